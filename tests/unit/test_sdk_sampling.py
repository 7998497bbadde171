"""Sampling by session: decided once from the session id, the same in every process."""

from __future__ import annotations

import subprocess
import sys

from flywheel.sdk import Flywheel, is_sampled
from flywheel.sdk.transports.memory import MemoryTransport

IDS = [f"session-{i}" for i in range(20_000)]


def test_rate_is_respected_and_edges_are_exact() -> None:
    share = sum(is_sampled(sid, 0.3) for sid in IDS) / len(IDS)
    assert 0.28 < share < 0.32
    assert all(is_sampled(sid, 1.0) for sid in IDS[:100])
    assert not any(is_sampled(sid, 0.0) for sid in IDS[:100])


def test_decision_is_deterministic_and_nested_across_rates() -> None:
    first = [is_sampled(sid, 0.5) for sid in IDS]
    assert first == [is_sampled(sid, 0.5) for sid in IDS]
    # a session kept at a low rate is kept at every higher rate (raising the rate only adds sessions)
    assert all(is_sampled(sid, 0.7) for sid in IDS if is_sampled(sid, 0.2))


def test_another_process_takes_the_same_decision() -> None:
    code = (
        "from flywheel.sdk import is_sampled; "
        "print(''.join('1' if is_sampled(f'session-{i}', 0.5) else '0' for i in range(500)))"
    )
    other = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert other == "".join("1" if is_sampled(f"session-{i}", 0.5) else "0" for i in range(500))


def test_unsampled_sessions_log_nothing_also_late_feedback(tmp_path) -> None:
    transport = MemoryTransport()
    fw = Flywheel(project="sampling", transport=transport, spool_dir=tmp_path, sample_rate=0.5)
    kept = next(sid for sid in IDS if is_sampled(sid, 0.5))
    skipped = next(sid for sid in IDS if not is_sampled(sid, 0.5))
    with fw.session(kept) as s:
        s.tool_call("t")
    with fw.session(skipped) as u:
        assert not u.sampled
        assert u.tool_call("t", id="c1") == "c1"  # ids still work for the product
        assert u.tool_result("c1", "x") is None
        assert u.completion(model="m") is None
        with u.span("subagent") as sub:
            sub.message("user", "hi")
    assert fw.feedback(skipped, "accept") is None
    assert fw.outcome(skipped, "solved", True) is None
    fw.feedback(kept, "accept")
    assert fw.flush(10)
    fw.close()
    assert {e.session_id for e in transport.events()} == {kept}
    assert fw.stats.enqueued == 4  # start, tool call, end, feedback of the kept session only
