"""``make bench-capacity``: how many SDK sessions a second the whole loop sustains on this machine,
and where its CPU goes.

1. **In the loop.** The demo's whole loop runs (:func:`flywheel.demo.run_demo`: the stack with two
   vLLM replicas and the gate's, ingest, rewarding, the Celery trainer worker and beat, the router,
   the admin API, the canary controller, and the calculator agent's traffic through the router),
   with targets it never reaches. After ``--warmup-s`` a second SDK client in its own process
   (``make bench-reliability``'s soak client: sessions of start, a ~850-character user turn, an
   outcome, end, through Kafka) adds ended sessions in steps of rising rate, from
   ``--start-rate`` sessions/s, times ``--factor`` each step. Each step holds ``--step-s`` seconds
   on a project of its own and samples two end-to-end backlogs every 2 s: events sent and not yet
   in Postgres (ingest) and sessions sent without a reward yet (rewarding; its feedback window is
   part of it). A step is **sustained** when neither backlog grows over its second half (their
   least-squares slopes under :data:`GROWTH_TOLERANCE` of the step's rate, and at most 0.5
   sessions/s) and the client sent at least 90 % of the asked rate. The first step that is not
   ends the ramp; the rate that the rewarding workers scored in its second half is
   ``rewarding_in_loop_sessions_per_s`` (saturated: the most they scored with the loop beside
   them). Between steps the backlog drains. Over the ramp every service's process tree, every
   stack component (vLLM replicas, broker, Postgres, Redis), the soak client and this process
   (the agent) are metered for CPU seconds: ``cpu_share`` is each one's share of the machine
   (CPU seconds / wall seconds / cores).
2. **Alone.** The stack again without vLLM and without the rest of the loop: the broker,
   Postgres, Redis, the ingest consumer and the rewarding worker only, the same client and the
   same steps from the in-loop sustained rate up, times ``--alone-factor`` each (a coarser
   baseline, in half the steps): ``rewarding_alone_sessions_per_s``.
   ``in_loop_vs_alone`` is the in-loop rate over it.
3. **Scale-out** (``--alone-layouts 1x1,2x1,1x2``): the alone phase once per layout, INGESTxREWARDING
   processes (the processes of a service share its consumer group),
   each layout on a fresh stack; ``alone_layouts`` gives each one's sustained and saturated rates and
   their ratios to the first layout's. ``--skip-loop`` with ``--alone-start-rate`` measures only this.

``--vllm-nice N`` runs the loop's vLLM replicas at niceness N (``vllm.nice``), so that the
pipeline's services get the CPU first and the agent's generation what is left.

Last line: one JSON object (``sustained_sessions_per_s``, ``sustained_events_per_s``,
``rewarding_in_loop_sessions_per_s``, ``rewarding_alone_sessions_per_s``,
``alone_sustained_sessions_per_s``, ``in_loop_vs_alone``, ``cpu_share``, ``cpu_busy_share``,
each step's figures).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import reliability  # noqa: E402 - bench/reliability.py: its soak client is this benchmark's load

GROWTH_TOLERANCE = 0.05
"""A backlog grows when its slope over a step's second half exceeds this share of the step's session rate."""
SENT_SHARE = 0.9
"""A step whose client sent less than this share of the asked rate measured the client, not the loop."""
SAMPLE_S = 2.0
"""Backlog sampling interval."""
SERVICE_SETTINGS = {"rewarding": {"state_retention_s": reliability.SOAK_RETENTION_S}}
"""The soak's: scored states kept 120 s instead of 7 days, so that the workers' memory stays in its steady state."""


# --------------------------------------------------------------------------- pure figures


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, y)`` points (0 with fewer than two distinct times)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in points) / var


def step_figures(rate: float, seconds: float, samples: list[dict[str, float]]) -> dict[str, Any]:
    """One step's verdict from its backlog samples (``t``, ``sessions_sent``, ``events_sent``, ``stored``,
    ``scored``): sustained or not, the backlogs' slopes and the rates sent and scored in its second half."""
    half = [s for s in samples if s["t"] >= seconds / 2]
    if len(half) < 3:
        raise ValueError(f"a step of {seconds:g} s with {len(samples)} samples cannot be judged: lengthen --step-s")
    rewarding = slope([(s["t"], s["sessions_sent"] - s["scored"]) for s in half])
    ingest = slope([(s["t"], s["events_sent"] - s["stored"]) for s in half])
    span = half[-1]["t"] - half[0]["t"]
    sent_rate = (half[-1]["sessions_sent"] - half[0]["sessions_sent"]) / span
    scored_rate = (half[-1]["scored"] - half[0]["scored"]) / span
    tolerance = max(GROWTH_TOLERANCE * rate, 0.5)
    client_bound = sent_rate < SENT_SHARE * rate
    return {
        "rate": round(rate, 1),
        "sent_sessions_per_s": round(sent_rate, 1),
        "scored_sessions_per_s": round(scored_rate, 1),
        "rewarding_backlog_slope": round(rewarding, 2),
        "ingest_backlog_slope": round(ingest, 2),
        "rewarding_backlog_end": int(samples[-1]["sessions_sent"] - samples[-1]["scored"]),
        "ingest_backlog_end": int(samples[-1]["events_sent"] - samples[-1]["stored"]),
        "client_bound": client_bound,
        "sustained": not client_bound
        and rewarding <= tolerance
        and ingest <= tolerance * reliability.SOAK_EVENTS_PER_SESSION,
    }


def rates(start: float, factor: float, ceiling: float) -> list[float]:
    """The ramp's session rates: ``start``, times ``factor`` each step, up to ``ceiling``."""
    if start <= 0 or factor <= 1 or ceiling < start:
        raise ValueError(f"need 0 < start <= ceiling and factor > 1 (start {start}, factor {factor}, max {ceiling})")
    out = [start]
    while out[-1] * factor <= ceiling:
        out.append(out[-1] * factor)
    return out


class CpuMeter:
    """CPU seconds per named process tree, from the first sample on; a process that appears later counts
    from its start, one that exits keeps what it had at its last sample."""

    def __init__(self, roots: Callable[[], dict[str, list[tuple[int, bool]]]]):
        """``roots``: name -> (pid, whether its children count too), called at every sample."""
        self.roots = roots
        self.first: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], tuple[str, float]] = {}
        self.started: float | None = None
        self.machine_first: Any = None
        self.machine_last: Any = None
        self.wall = 0.0

    def sample(self) -> None:
        import psutil

        now = time.monotonic()
        first = self.started is None
        if first:
            self.started = now
            self.machine_first = psutil.cpu_times()
        for name, pids in self.roots().items():
            for pid, with_children in pids:
                try:
                    root = psutil.Process(pid)
                    tree = [root, *root.children(recursive=True)] if with_children else [root]
                except psutil.Error:
                    continue
                for proc in tree:
                    try:
                        key = (proc.pid, proc.create_time())
                        times = proc.cpu_times()
                    except psutil.Error:
                        continue
                    used = times.user + times.system
                    if key not in self.first:
                        self.first[key] = used if first else 0.0
                    self.last[key] = (name, used)
        self.machine_last = psutil.cpu_times()
        self.wall = now - self.started

    def shares(self) -> dict[str, Any]:
        import psutil

        cores = psutil.cpu_count() or 1
        seconds: dict[str, float] = {}
        for key, (name, used) in self.last.items():
            seconds[name] = seconds.get(name, 0.0) + max(0.0, used - self.first[key])
        capacity = max(self.wall * cores, 1e-9)
        busy = None
        if self.machine_first is not None:
            a, b = self.machine_first, self.machine_last
            idle = (b.idle - a.idle) + (getattr(b, "iowait", 0.0) - getattr(a, "iowait", 0.0))
            total = sum(b) - sum(a)
            busy = round(1 - idle / total, 3) if total > 0 else None
        return {
            "cpu_cores": cores,
            "cpu_metered_s": round(self.wall, 1),
            "cpu_share": {k: round(v / capacity, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
            "cpu_busy_share": busy,
        }


# --------------------------------------------------------------------------- the ramp


class Ramp:
    """Steps of rising rate from the soak client, judged on the backlogs in Postgres."""

    def __init__(self, label: str, work: Path, step_rates: Iterable[float], step_s: float, drain_s: float):
        self.label, self.work, self.step_s, self.drain_s = label, work, step_s, drain_s
        self.step_rates = list(step_rates)
        self.steps: list[dict[str, Any]] = []
        self.error: str | None = None
        self.client_pid: int | None = None
        """The running step's soak client (metered with the rest)."""

    def run(self, engine: Any, bootstrap: str, prefix: str, spool_root: Path, meter: CpuMeter | None) -> None:
        try:
            for i, rate in enumerate(self.step_rates):
                step = self._step(i, rate, engine, bootstrap, prefix, spool_root, meter)
                self.steps.append(step)
                print(f"{self.label} step {i}: {json.dumps(step)}", file=sys.stderr, flush=True)
                if not step["sustained"]:
                    break
        except Exception as err:  # noqa: BLE001 - in the JSON line; the figures so far stay
            self.error = f"{type(err).__name__}: {err}"

    def _step(self, i: int, rate: float, engine: Any, bootstrap: str, prefix: str, spool_root: Path,
              meter: CpuMeter | None) -> dict[str, Any]:  # fmt: skip
        folder = self.work / f"{self.label}-step-{i}"
        folder.mkdir(parents=True)
        project = f"capacity-{uuid.uuid4().hex[:6]}-{i}"
        events_rate = rate * reliability.SOAK_EVENTS_PER_SESSION
        args = [
            bootstrap,
            prefix,
            project,
            str(events_rate),
            str(folder / "client.json"),
            str(spool_root / folder.name),
        ]
        with open(folder / "client.log", "ab") as log:
            client = subprocess.Popen([sys.executable, reliability.__file__, "--soak-client", *args], cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self.client_pid = client.pid
        samples: list[dict[str, float]] = []
        started = time.monotonic()
        try:
            while (t := time.monotonic() - started) < self.step_s:
                counts = _counts(engine, project, folder)
                if counts is not None:
                    samples.append({"t": round(t, 2), **counts})
                if meter is not None:
                    meter.sample()
                time.sleep(max(0.0, SAMPLE_S - (time.monotonic() - started - t)))
        finally:
            client.terminate()
            client.wait(300)
        figures = step_figures(rate, self.step_s, samples)
        sent = json.loads((folder / "client.json").read_text())
        deadline = time.monotonic() + self.drain_s
        drained = False
        while time.monotonic() < deadline:
            counts = _counts(engine, project, folder)
            if counts and counts["stored"] >= sent["sent"] - sent["dropped"] and counts["scored"] >= sent["sessions"]:
                drained = True
                break
            if meter is not None:
                meter.sample()
            time.sleep(SAMPLE_S)
        figures.update(drained=drained, drain_s=round(time.monotonic() - (deadline - self.drain_s), 1),
                       sdk_dropped=sent["dropped"])  # fmt: skip
        return figures

    def figures(self) -> dict[str, Any]:
        sustained = [s["rate"] for s in self.steps if s["sustained"]]
        saturated = next((s for s in self.steps if not s["sustained"] and not s["client_bound"]), None)
        return {
            "sustained_sessions_per_s": max(sustained, default=0.0),
            # the most the rewarding workers scored with everything else beside them: the saturated step's
            "rewarding_sessions_per_s": saturated["scored_sessions_per_s"] if saturated else None,
            "saturated": saturated is not None,
            "steps": self.steps,
            "error": self.error,
        }


def _counts(engine: Any, project: str, folder: Path) -> dict[str, float] | None:
    from sqlalchemy import text

    try:
        progress = json.loads((folder / "soak-progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM raw_events WHERE project = :p"), {"p": project}).scalar_one()
        scored = conn.execute(
            text("SELECT count(DISTINCT session_id) FROM rewards WHERE project = :p"), {"p": project}
        ).scalar_one()
    return {"sessions_sent": progress["sessions"], "events_sent": progress["sent"], "stored": stored, "scored": scored}


def _roots(settings: Any, group: Any, ramp: Ramp) -> Callable[[], dict[str, list[tuple[int, bool]]]]:
    """The metered processes: each service's tree, each stack component's, the soak client, this process alone."""
    import os

    from flywheel.stack.base import load_state

    def roots() -> dict[str, list[tuple[int, bool]]]:
        out: dict[str, list[tuple[int, bool]]] = {"bench (agent, sampler)": [(os.getpid(), False)]}
        for service in group:
            if service.pid:
                out[service.name] = [(service.pid, True)]
        for name, record in load_state(settings).components.items():
            if record.pid and record.kind != "service":
                out.setdefault("vllm" if record.kind == "vllm" else name, []).append((record.pid, True))
        if ramp.client_pid:
            out["soak client"] = [(ramp.client_pid, True)]
        return out

    return roots


# --------------------------------------------------------------------------- the two phases


def in_loop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from flywheel.core.settings import Settings
    from flywheel.demo import DemoConfig, run_demo
    from flywheel.stack.endpoints import kafka_bootstrap

    ramp = Ramp("loop", work, rates(args.start_rate, args.factor, args.max_rate), args.step_s, args.drain_s)
    meter: dict[str, CpuMeter] = {}
    done = threading.Event()

    def on_start(engine: Any, settings: Any, group: Any) -> None:
        def go() -> None:
            try:
                time.sleep(args.warmup_s)  # the loop in its steady state: replicas serving, the trainer cycling
                meter["m"] = CpuMeter(_roots(settings, group, ramp))
                ramp.run(engine, kafka_bootstrap(settings), settings.kafka.topic_prefix, work / "spool", meter["m"])
            finally:
                done.set()

        threading.Thread(target=go, name="capacity-ramp", daemon=True).start()

    base = random.Random().randrange(21000, 30000, 100)
    settings = Settings(
        run_dir=work / "run", kafka={"local_port": base},
        vllm={"base_port": base + 10, "replicas": 2, "nice": args.vllm_nice},
        serving={"router_port": base + 20, "admin_port": base + 21},
    )  # fmt: skip
    config = DemoConfig(budget_minutes=args.budget_minutes, target_gain_points=1000.0, target_promotions=1000,
                        live=False, report_dir=work / "report", on_start=on_start,
                        until=lambda engine, snap: done.is_set(), service_settings=SERVICE_SETTINGS,
                        service_counts={"rewarding": args.rewarding_workers})  # fmt: skip
    summary = run_demo(config, settings)
    figures = ramp.figures()
    out = {
        "sustained_sessions_per_s": figures["sustained_sessions_per_s"],
        "sustained_events_per_s": round(figures["sustained_sessions_per_s"] * reliability.SOAK_EVENTS_PER_SESSION, 1),
        "rewarding_in_loop_sessions_per_s": figures["rewarding_sessions_per_s"],
        "in_loop_saturated": figures["saturated"],
        "steps_in_loop": figures["steps"],
        "in_loop_error": figures["error"],
        "loop_promotions": summary["promotions"],
        "loop_failed_requests": summary["failed_requests"],
        "loop_agent_sessions": summary["sessions"],
    }
    if "m" in meter:
        out.update(meter["m"].shares())
    return out


def layout(text: str) -> tuple[int, int]:
    """``"2x1"``: two ingest consumers and one rewarding worker (one consumer group each)."""
    try:
        ingest, rewarding = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a layout is INGESTxREWARDING, e.g. 2x1, not {text!r}") from None
    if not (1 <= ingest <= 8 and 1 <= rewarding <= 8):
        raise ValueError(f"a layout runs 1 to 8 of each, not {text!r}")
    return ingest, rewarding


def layout_specs(settings: Any, counts: tuple[int, int]) -> list[Any]:
    """The ingest and rewarding specs, each repeated (``ingest``, ``ingest-2``, ...: one group, one log each)."""
    from flywheel.stack.services import pipeline_specs, scaled

    return scaled(pipeline_specs(settings, ["ingest", "rewarding"]), dict(zip(("ingest", "rewarding"), counts)))


def alone(args: argparse.Namespace, work: Path, start_rate: float, counts: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    from sqlalchemy import create_engine

    from flywheel.core.db import migrate
    from flywheel.core.settings import Settings
    from flywheel.stack import down, up
    from flywheel.stack.endpoints import drop_database, ensure_database, kafka_bootstrap, postgres_url
    from flywheel.stack.services import ServiceGroup, settings_env

    name = f"alone-{counts[0]}x{counts[1]}"
    base = random.Random().randrange(21000, 30000, 100)
    settings = Settings(run_dir=work / f"run-{name}", kafka={"local_port": base})
    ramp = Ramp(name, work, rates(start_rate, args.alone_factor, args.max_rate * 4), args.step_s, args.drain_s)
    group = None
    up(settings, ["broker", "postgres", "redis"])
    db_url = postgres_url(settings, f"flywheel_capacity_{uuid.uuid4().hex[:6]}")
    try:
        drop_database(db_url)
        ensure_database(db_url)
        migrate.upgrade(db_url)
        engine = create_engine(db_url, pool_pre_ping=True)
        overrides = {"postgres": {"url": db_url},
                     "rewarding": {"feedback_window_s": 3.0, "rescore_delay_s": 2.0, "session_timeout_s": 120.0,
                                   **SERVICE_SETTINGS["rewarding"]}}  # fmt: skip
        group = ServiceGroup(layout_specs(settings, counts), settings_env(settings, overrides),
                             Path(settings.run_dir) / "logs")  # fmt: skip
        group.start()
        meter = CpuMeter(_roots(settings, group, ramp))
        ramp.run(engine, kafka_bootstrap(settings), settings.kafka.topic_prefix, work / "spool", meter)
        engine.dispose()
    finally:
        if group is not None:
            group.stop()
        drop_database(db_url)
        down(settings)
    figures = ramp.figures()
    return {
        "rewarding_sessions_per_s": figures["rewarding_sessions_per_s"],
        "sustained_sessions_per_s": figures["sustained_sessions_per_s"],
        "saturated": figures["saturated"],
        "steps": figures["steps"],
        "error": figures["error"],
        "cpu_share": meter.shares()["cpu_share"],
        "cpu_busy_share": meter.shares()["cpu_busy_share"],
    }


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The loop's layout options, shared with ``make bench-reliability`` (its capacity ramp and soak)."""
    parser.add_argument(
        "--vllm-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="0-19",
        help="niceness of the loop's vLLM replicas (vllm.nice; the gate's replica inherits it)",
    )
    parser.add_argument("--rewarding-workers", type=int, default=1, choices=range(1, 9), metavar="1-8",
                        help="rewarding worker processes in the loop (one consumer group)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``[]``: the defaults, as ``make bench-reliability --rate capacity`` uses them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-rate", type=float, default=10.0, help="first step's SDK sessions per second")
    parser.add_argument("--factor", type=float, default=1.5, help="each step's rate over the one before")
    parser.add_argument("--alone-factor", type=float, default=2.0, help="the same, alone (a coarser baseline)")
    parser.add_argument("--max-rate", type=float, default=2000.0, help="highest in-loop step (alone: four times it)")
    parser.add_argument("--step-s", type=float, default=60.0, help="seconds each step holds its rate")
    parser.add_argument("--drain-s", type=float, default=120.0, help="longest wait for a step's backlog to drain")
    parser.add_argument("--warmup-s", type=float, default=90.0, help="the loop's run before the first step")
    parser.add_argument("--budget-minutes", type=float, default=45.0, help="longest the in-loop phase may run")
    parser.add_argument("--skip-alone", action="store_true", help="measure the loop only")
    parser.add_argument("--skip-loop", action="store_true", help="measure alone only (from --alone-start-rate)")
    parser.add_argument(
        "--alone-start-rate", type=float, default=None, help="alone's first step (default: the in-loop sustained rate)"
    )
    parser.add_argument(
        "--alone-layouts",
        default="1x1",
        help="INGESTxREWARDING processes of each alone run, comma-separated (scale-out: 1x1,2x1,1x2)",
    )
    add_loop_arguments(parser)
    args = parser.parse_args(argv)
    try:
        rates(args.start_rate, args.factor, args.max_rate)
        rates(args.alone_start_rate or args.start_rate, args.alone_factor, args.max_rate * 4)
        args.alone_layouts = [layout(x) for x in args.alone_layouts.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if args.alone_start_rate is not None and args.alone_start_rate <= 0:
        parser.error(f"--alone-start-rate must be above 0, not {args.alone_start_rate:g}")
    if args.skip_loop and args.skip_alone:
        parser.error("--skip-loop and --skip-alone together measure nothing")
    if args.step_s < 4 * SAMPLE_S:
        parser.error(f"--step-s must be at least {4 * SAMPLE_S:g} (a step is judged on its second half's samples)")
    return args


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="flywheel-capacity-"))
    figures: dict[str, Any] = {"step_s": args.step_s, "vllm_nice": args.vllm_nice,
                               "rewarding_workers": args.rewarding_workers, "work": str(work)}  # fmt: skip
    if not args.skip_loop:
        figures |= in_loop(args, work)
    if not args.skip_alone:
        start = args.alone_start_rate or max(figures.get("sustained_sessions_per_s") or 0.0, args.start_rate)
        runs = {f"{i}x{r}": alone(args, work, start, (i, r)) for i, r in args.alone_layouts}
        first = next(iter(runs.values()))
        figures |= {
            "rewarding_alone_sessions_per_s": first["rewarding_sessions_per_s"],
            "alone_sustained_sessions_per_s": first["sustained_sessions_per_s"],
            "alone_saturated": first["saturated"],
            "alone_error": first["error"],
            "alone_cpu_share": first["cpu_share"],
        }
        if len(runs) > 1:  # scale-out: each layout's figures against the first one's
            figures["alone_layouts"] = {
                name: {k: run[k] for k in ("sustained_sessions_per_s", "rewarding_sessions_per_s", "saturated",
                                           "error", "cpu_busy_share")}  # fmt: skip
                | {"sustained_vs_first": _ratio(run["sustained_sessions_per_s"], first["sustained_sessions_per_s"]),
                   "saturated_vs_first": _ratio(run["rewarding_sessions_per_s"], first["rewarding_sessions_per_s"])}
                for name, run in runs.items()
            }  # fmt: skip
        figures["steps_alone"] = {name: run["steps"] for name, run in runs.items()}
        figures["in_loop_vs_alone"] = _ratio(figures.get("rewarding_in_loop_sessions_per_s"),
                                             figures["rewarding_alone_sessions_per_s"])  # fmt: skip
    print(json.dumps(figures))
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    sys.exit(main())
