"""The figures ``make bench-capacity`` judges its steps by (bench/capacity.py): backlog slopes, a step's
verdict, the ramp's rates and the CPU meter."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def capacity():
    spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_capacity"] = module
    spec.loader.exec_module(module)
    return module


def samples(rate: float, scored_rate: float, seconds: float = 60.0, every: float = 2.0, window: float = 5.0):
    """Backlog samples of a client sending ``rate`` sessions/s (4 events each, all stored at once) while the
    workers score ``scored_rate`` (after a feedback window of ``window`` s)."""
    out, t = [], 0.0
    while t < seconds:
        sent = rate * t
        out.append({"t": t, "sessions_sent": sent, "events_sent": 4 * sent, "stored": 4 * sent,
                    "scored": min(sent, max(0.0, scored_rate * (t - window)))})  # fmt: skip
        t += every
    return out


def test_slope_is_the_least_squares_slope(capacity) -> None:
    assert capacity.slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert capacity.slope([(0, 4), (1, 4), (2, 4)]) == 0.0
    assert capacity.slope([(1, 4)]) == 0.0 and capacity.slope([(1, 4), (1, 5)]) == 0.0


def test_a_step_whose_backlog_holds_is_sustained(capacity) -> None:
    step = capacity.step_figures(20.0, 60.0, samples(20.0, 40.0))
    assert step["sustained"] and not step["client_bound"], step
    assert step["rewarding_backlog_slope"] <= 0.5 and step["scored_sessions_per_s"] == pytest.approx(20.0, rel=0.01)


def test_a_step_whose_backlog_grows_is_not_and_says_what_the_workers_scored(capacity) -> None:
    step = capacity.step_figures(80.0, 60.0, samples(80.0, 50.0))
    assert not step["sustained"] and not step["client_bound"], step
    assert step["rewarding_backlog_slope"] == pytest.approx(30.0, rel=0.01)
    assert step["scored_sessions_per_s"] == pytest.approx(50.0, rel=0.01)


def test_a_step_whose_client_fell_short_measured_the_client(capacity) -> None:
    step = capacity.step_figures(100.0, 60.0, samples(70.0, 500.0))
    assert step["client_bound"] and not step["sustained"], step


def test_ingest_growth_alone_fails_a_step(capacity) -> None:
    rows = samples(20.0, 40.0)
    for row in rows:
        row["stored"] = row["events_sent"] * 0.5  # ingest keeps half: its backlog grows at 40 events/s
    assert not capacity.step_figures(20.0, 60.0, rows)["sustained"]


def test_a_step_too_short_to_judge_is_refused_by_name(capacity) -> None:
    with pytest.raises(ValueError, match="--step-s"):
        capacity.step_figures(20.0, 4.0, samples(20.0, 40.0, seconds=4.0))


def test_rates_rise_by_the_factor_up_to_the_ceiling(capacity) -> None:
    assert capacity.rates(10.0, 1.5, 50.0) == pytest.approx([10.0, 15.0, 22.5, 33.75])
    assert capacity.rates(10.0, 2.0, 10.0) == [10.0]
    for bad in ((0.0, 1.5, 50.0), (10.0, 1.0, 50.0), (10.0, 1.5, 5.0)):
        with pytest.raises(ValueError):
            capacity.rates(*bad)


def test_the_cpu_meter_counts_a_busy_process_from_its_first_sample(capacity) -> None:
    meter = capacity.CpuMeter(lambda: {"me": [(os.getpid(), False)], "gone": [(2**22 + 7, True)]})
    meter.sample()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of CPU in this process
        pass
    meter.sample()
    shares = meter.shares()
    seconds = shares["cpu_share"]["me"] * shares["cpu_cores"] * shares["cpu_metered_s"]
    assert 0.2 <= seconds <= 1.0, shares
    assert "gone" not in shares["cpu_share"]  # a pid that does not exist is skipped, not an error


def test_a_layout_names_each_services_count(capacity) -> None:
    assert capacity.layout("2x1") == (2, 1)
    assert capacity.layout("1X3") == (1, 3)
    for bad in ("2", "ax1", "0x1", "1x9", "1x1x1"):
        with pytest.raises(ValueError, match="layout"):
            capacity.layout(bad)


def test_layout_specs_repeat_each_service_under_its_own_name(capacity) -> None:
    from flywheel.core.settings import Settings

    specs = capacity.layout_specs(Settings(environment="test"), (2, 3))
    assert [s.name for s in specs] == ["ingest", "ingest-2", "rewarding", "rewarding-2", "rewarding-3"]
    assert len({s.argv for s in specs}) == 2  # one command per service, the same group


def test_bad_arguments_are_refused_by_name(capacity, capsys) -> None:
    refused = [
        (["--alone-layouts", "1x1,two"], "layout"),
        (["--skip-loop", "--skip-alone"], "measure"),
        (["--vllm-nice", "20"], "vllm-nice"),
        (["--alone-start-rate", "0"], "alone-start-rate"),
    ]
    for argv, named in refused:
        with pytest.raises(SystemExit) as exit_:
            capacity.parse_args(argv)
        assert exit_.value.code == 2
        assert named in capsys.readouterr().err
    args = capacity.parse_args(["--alone-layouts", "1x1,2x1,1x2", "--vllm-nice", "19"])
    assert args.alone_layouts == [(1, 1), (2, 1), (1, 2)] and args.vllm_nice == 19
