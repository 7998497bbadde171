"""Selection rules on in-memory rows: newest reward version, staleness, roles, cap, minimum; retention; gate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from trainer.registry import RetentionInfo, retained
from trainer.select import DataWindow, SampleMeta, SelectionRules, allowed_versions, choose

T0 = datetime(2026, 12, 2, tzinfo=UTC)


def row(
    i: int, completion: str, version: int = 1, policy: str = "p2", role: str = "agent", minute: int = 0
) -> SampleMeta:
    return SampleMeta(i, completion, version, policy, role, T0 + timedelta(minutes=minute or i))


def rules(**kw) -> SelectionRules:
    base = dict(
        allowed_versions=frozenset({"p2"}), trainable_roles=frozenset({"agent"}), min_samples=1, max_samples=100
    )
    return SelectionRules(**(base | kw))


LINEAGE = {"c1": (None, "p0"), "c2": ("c1", "p1"), "c3": ("c2", "p2"), "c4": ("c3", "p3")}


def test_allowed_versions_walk_the_lineage_up_to_the_lag():
    assert allowed_versions(["c3"], LINEAGE, 0) == {"p2"}
    assert allowed_versions(["c3"], LINEAGE, 1) == {"p2", "p1"}
    assert allowed_versions(["c3", "c4"], LINEAGE, 1) == {"p3", "p2", "p1"}
    assert allowed_versions(["c3"], LINEAGE, 10) == {"p2", "p1", "p0"}
    assert allowed_versions(["unknown"], LINEAGE, 3) == frozenset()


def test_newest_reward_version_wins():
    sel = choose([row(1, "x", 1), row(2, "x", 2), row(3, "y", 1)], rules())
    assert sorted(sel.ids) == [2, 3]
    assert sel.counts["superseded"] == 1


def test_off_policy_and_frozen_roles_are_dropped():
    rows = [row(1, "a", policy="p0"), row(2, "b", role="subagent"), row(3, "c")]
    sel = choose(rows, rules())
    assert sel.ids == [3]
    assert sel.counts["off_policy"] == 1 and sel.counts["frozen_role"] == 1


def test_cap_keeps_the_newest():
    sel = choose([row(i, f"c{i}") for i in range(1, 6)], rules(max_samples=2))
    assert sel.ids == [5, 4]
    assert sel.counts["over_max"] == 3


def test_too_few_samples_skips_with_the_counts():
    sel = choose([row(1, "a"), row(2, "b", policy="old")], rules(min_samples=5))
    assert sel.ids == []
    assert sel.skip_reason is not None
    assert "1 < min_samples 5" in sel.skip_reason and "off_policy=1" in sel.skip_reason


def test_window_is_open_at_start_closed_at_end():
    w = DataWindow(start=T0, end=T0 + timedelta(hours=1))
    assert not w.contains(T0)
    assert w.contains(T0 + timedelta(hours=1))
    assert DataWindow(None, T0).contains(T0 - timedelta(days=9))


def info(
    i: str,
    minute: int,
    status: str = "candidate",
    score: float | None = None,
    fmt: str = "full",
    base: str = "/base",
    root: bool = False,
) -> RetentionInfo:
    return RetentionInfo(i, T0 + timedelta(minutes=minute), status, fmt, f"/ck/{i}", base, root, score)


def test_retention_keeps_latest_best_deployed_roots_and_lora_bases():
    rows = [
        info("base", 0, "deployed", root=True),
        info("a", 1, score=0.9),  # best
        info("b", 2, score=0.1),  # deployed recently
        info("c", 3, score=0.2),  # dropped
        info("d", 4, "rejected", score=0.95),  # rejected never counts as best
        info("e", 5, score=0.3, fmt="lora", base="/ck/c"),  # latest, keeps its base c
    ]
    assert retained(rows, {"b"}, keep_latest=1) == {"base", "a", "b", "e", "c"}
    assert retained(rows, set(), keep_latest=2) == {"base", "a", "d", "e", "c"}


def test_lineage_tip_follows_checkpoints_on_trial_and_drops_a_rolled_back_branch():
    from trainer.registry import pending_lineage_tip

    S = "stable"
    # c1 is the active canary; c2 (from c1) and c3 (from c2) passed the gate; r (from S) was rejected
    rows = [(S, None, "deployed"), ("c1", S, "deployed"), ("r", S, "rejected"), ("c2", "c1", "candidate"),
            ("c3", "c2", "candidate")]  # fmt: skip
    assert pending_lineage_tip(S, rows, active_canaries={"c1"}) == "c3"
    # c1 rolled back (no longer an active canary, status stays "deployed"): c2 and c3 are abandoned
    assert pending_lineage_tip(S, rows, active_canaries=set()) == S
    # as the fleet leaves it: a canary keeps "candidate" until promoted, and a rolled-back one was tried
    as_left = [(cid, parent, "candidate" if cid == "c1" else status) for cid, parent, status in rows]
    assert pending_lineage_tip(S, as_left, active_canaries={"c1"}, tried={"c1"}) == "c3"
    assert pending_lineage_tip(S, as_left, active_canaries=set(), tried={"c1"}) == S
    # without the tried set the rolled-back canary would still look on trial (the stall this guards)
    assert pending_lineage_tip(S, as_left, active_canaries=set()) == "c3"
    # a candidate that failed its swap (tried, never active) is not on trial either
    assert pending_lineage_tip(S, [*as_left, ("c5", S, "candidate")], set(), tried={"c1", "c5"}) == S
    # a newer sibling trained from the stable wins over an older branch
    assert pending_lineage_tip(S, [*rows, ("c4", S, "candidate")], active_canaries={"c1"}) == "c4"
    # only the stable: train from it; a rejected tip is skipped for its on-trial parent
    assert pending_lineage_tip(S, [(S, None, "deployed")], set()) == S
    assert pending_lineage_tip(S, [*rows, ("bad", "c3", "rejected")], {"c1"}) == "c3"
    # a checkpoint trained from an older stable is not on this lineage
    assert (
        pending_lineage_tip(S, [("old", None, "deployed"), ("x", "old", "candidate"), (S, "old", "deployed")], set())
        == S
    )
