"""``make demo`` / ``flywheel demo``: the whole flywheel, for real, on this machine.

1. The base model is built (or reused), the local stack starts (broker, Postgres, Redis,
   two vLLM replicas), a fresh database is migrated and the fleet registered: both
   replicas serve the base model as the stable deployment.
2. The pipeline's services start as separate processes, configured only through the
   environment like deployed services: the ingest consumer, the faust rewarding worker,
   a Celery trainer worker and Celery beat (a short demo schedule), the router, the admin
   API and the canary controller (which deploys each gated candidate as a canary by hot
   swap, steps its traffic up, and promotes or rolls it back on the live rewards).
3. The demo's agent product (:mod:`flywheel.demo.agent`) plays calculator sessions
   through the router with the official ``openai`` client and the SDK, reports outcomes
   and simulated user feedback.
4. A live view shows the loop; at the end a summary table and a report folder (plot,
   canary decisions, JSON summary). With ``inject_regression`` a deliberately damaged
   checkpoint is deployed as canary through the admin API and must be rolled back
   (:mod:`flywheel.demo.regression`).
5. Everything stops, unless ``keep_up``: then the stack and the services stay up (the
   services recorded in ``stack.json``) until ``flywheel down``, and the demo prints where
   the dashboard is and a viewer token to log in with.

Nothing is skipped or faked: every number comes from the tables the services write.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from flywheel.core.settings import Settings, get_settings
from flywheel.core.settings.vllm import VllmSettings

console = Console(width=130)
log = logging.getLogger("flywheel.demo")

DEMO_DATABASE = "flywheel_demo"
"""The demo migrates a fresh database of this name on every run (its numbers are its own)."""


@dataclass
class DemoConfig:
    """The demo's knobs; the defaults are what ``make demo`` runs."""

    scenario: str = "arith"
    """Which scenario runs (:mod:`flywheel.demo.scenarios`): ``arith`` (the calculator assistant) or ``parl``
    (an orchestrator with frozen sub-agents, Kimi K2.5's PARL); it picks the base model's task, the agent
    product, the reward, the gate's suite and the role pins."""
    budget_minutes: float = 20.0
    """Longest the learning phase runs."""
    target_gain_points: float = 25.0
    """Stop early once the stable checkpoint's held-out success is this many points above the base's ..."""
    target_promotions: int = 2
    """... and at least this many checkpoints were promoted."""
    replicas: int = 2
    """vLLM replicas (the canary takes one of them)."""
    concurrency: int = 6
    """Concurrent agent sessions."""
    cycle_s: float = 20.0
    """Celery beat's training schedule."""
    trainer_parent: str = "lineage"
    """What a cycle trains from (``trainer.parent``): the demo trains the next checkpoint while the
    canary of the last one is judged, instead of once more from the stable it may replace."""
    trainer_threads: int = 1
    """torch threads of the training cycle. The trainer shares two cores with two busy vLLM
    replicas: with two threads each OpenMP barrier waits for a thread the scheduler has
    preempted, and a cycle measured ~160 tokens/s where the idle machine does ~24,000."""
    min_samples: int = 192
    """Fewest samples a cycle trains on."""
    max_samples: int = 768
    """Most samples a cycle trains on."""
    canary_steps: list[float] = field(default_factory=lambda: [0.5, 1.0])
    """Canary traffic steps of the demo (two replicas: one serves the canary)."""
    canary_min_samples: int = 60
    """Scored canary sessions per step."""
    canary_margin: float = 0.05
    """Non-inferiority margin of the demo's canary (success rate)."""
    inject_regression: bool = False
    """After learning, deploy a damaged checkpoint as canary and show it rolled back."""
    regression_budget_minutes: float = 6.0
    """Longest the regression phase runs (making room, deploying, waiting for the rollback)."""
    regression_settle_minutes: float = 1.0
    """Longest a canary already on trial gets to reach its own decision before ops roll it back to make room."""
    report_dir: Path = Path(".flywheel/report")
    """Where the report is written."""
    keep_up: bool = False
    """Leave the whole system running at the end (the stack and the services, dashboard included) until
    ``flywheel down``."""
    live: bool = True
    """Show the live view (off for the benchmark and CI)."""
    seed: int = 0
    """Seed of the agent's problem choice and users."""
    database: str = DEMO_DATABASE
    """Database the demo migrates afresh (dropped first, kept afterwards for inspection)."""
    service_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Settings the services get on top of the demo's own, by section, e.g.
    ``{"rewarding": {"state_retention_s": 120}}`` (the soak's)."""
    service_counts: dict[str, int] = field(default_factory=dict)
    """Processes of a service, e.g. ``{"rewarding": 2}`` (one consumer group); one of each by default."""
    on_start: Callable[[Any, Settings, Any], None] | None = None
    """Called with (engine, settings, service group) once the services and the agent run."""
    on_finish: Callable[[Any, Settings, dict[str, Any]], None] | None = None
    """Called with (engine, settings, summary) after the summary, while every service still runs."""
    agent_factory: Callable[[Any, str, str], Any] | None = None
    """Builds the agent product from (the SDK client, the router URL, a product key for the router) instead of
    the calculator agent: any
    object with ``start()``, ``stop(timeout_s)`` and ``stats.snapshot()`` (``make bench-byo``'s chat agent)."""
    until: Callable[[Any, Any], bool] | None = None
    """Ends the learning phase when it returns True, called with (engine, snapshot) every 2 s, instead of the
    held-out target (which needs the base model's held-out evaluation); the budget still applies."""


def service_overrides(
    config: DemoConfig, settings: Settings, db_url: str, started_at: datetime | None = None
) -> dict[str, dict[str, Any]]:
    """The settings every service of the demo gets through its environment (the scenario's included; its
    anneal, if any, starts at ``started_at``, default now)."""
    from flywheel.demo.scenarios import scenario

    own = _own_overrides(config, settings, db_url)
    for section, values in scenario(config.scenario).overrides(config, started_at or datetime.now(UTC)).items():
        own[section] = _merged(own.get(section, {}), values)
    for section, values in config.service_settings.items():
        own[section] = _merged(own.get(section, {}), values)
    return own


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _own_overrides(config: DemoConfig, settings: Settings, db_url: str) -> dict[str, dict[str, Any]]:
    return {
        "postgres": {"url": db_url},
        "trainer": {  # sections travel as JSON: paths as absolute strings
            "parent": config.trainer_parent,
            "schedule": {"interval_s": config.cycle_s},
            "data": {"min_samples": config.min_samples, "max_samples": config.max_samples},
            "step": {"torch_threads": config.trainer_threads, "show_progress": False},
            "checkpoints": {"dir": str((Path(settings.run_dir) / "demo-checkpoints").resolve()), "keep_latest": 50},
            "metrics": {"textfile": str((Path(settings.run_dir) / "trainer.prom").resolve())},
        },
        "rewarding": {"feedback_window_s": 3.0, "rescore_delay_s": 2.0, "session_timeout_s": 120.0},
        "serving": {
            "fleet": settings.serving.fleet,
            "router_host": settings.serving.router_host,
            "router_port": settings.serving.router_port,
            "admin_host": settings.serving.admin_host,
            "admin_port": settings.serving.admin_port,
            "canary": {
                "steps": config.canary_steps,
                "min_samples_per_step": config.canary_min_samples,
                "non_inferiority_margin": config.canary_margin,
                "interval_s": 2.0,
                "auto_deploy": True,
            },
        },
    }


def run_demo(config: DemoConfig | None = None, settings: Settings | None = None) -> dict[str, Any]:
    """Run the loop; returns the summary (also written to the report folder)."""
    from sqlalchemy import create_engine

    from flywheel.core.db import migrate
    from flywheel.demo.report import write_report
    from flywheel.demo.scenarios import scenario
    from flywheel.demo.view import render
    from flywheel.model.base import base_model_dir
    from flywheel.sdk import Flywheel
    from flywheel.stack import down, up
    from flywheel.stack.endpoints import drop_database, ensure_database, kafka_bootstrap, postgres_url, vllm_urls
    from flywheel.stack.services import SERVICE_KIND, ServiceGroup, pipeline_specs, scaled, settings_env
    from flywheel.stack.stack import keep_services
    from serving.overview import snapshot

    config = config or DemoConfig()
    settings = settings or get_settings()
    plan = scenario(config.scenario)
    replicas = max(config.replicas, plan.replicas)
    if settings.model.task != plan.model_task:
        settings = settings.model_copy(update={"model": settings.model.model_copy(update={"task": plan.model_task})})
    _exit_on_sigterm()
    for noisy in ("kafka", "faust", "aiokafka"):  # the agent's SDK producer: its warnings go to the log, not the view
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if not settings.vllm.urls:
        settings = settings.model_copy(update={"vllm": _local_vllm(settings.vllm, replicas)})
    console.rule(f"[bold]Flywheel demo ({plan.name}): the model learns from its own traffic")
    console.print("resolving the base model (building the project's model if it is the one and not built) ...")
    model_dir = base_model_dir(settings.model, build=True)
    if stopped := down(settings, [SERVICE_KIND]):
        console.print(f"stopped the services an earlier `--keep-up` run left running: {', '.join(stopped)}")
    console.print(f"starting the stack (broker, Postgres, Redis, vLLM x{settings.vllm.replicas}) ...")
    up(settings, model_dir=model_dir)
    group: ServiceGroup | None = None
    agent: Any = None
    fw: Flywheel | None = None
    viewer_token: str | None = None
    api_key: str | None = None
    started = time.monotonic()
    try:
        db_url = postgres_url(settings, config.database)
        drop_database(db_url)
        ensure_database(db_url)
        migrate.upgrade(db_url)
        engine = create_engine(db_url, pool_pre_ping=True)
        scenario_started = datetime.now(UTC)
        overrides = service_overrides(config, settings, db_url, scenario_started)
        child_settings = _with_overrides(settings, overrides)
        from serving.fleet.registry import ensure_fleet

        ensure_fleet(engine, child_settings, urls=vllm_urls(settings))
        if plan.pinned_roles:  # frozen roles stay on the base model's policy version (the canary controller pins them)
            base_version = snapshot(engine, settings.serving.fleet).stable["policy_version"]
            pins = {role: base_version for role in plan.pinned_roles}
            overrides["serving"] = _merged(overrides["serving"], {"role_pins": pins})
            child_settings = _with_overrides(settings, overrides)
        env = settings_env(settings, overrides)
        group = ServiceGroup(scaled(pipeline_specs(settings), config.service_counts), env,
                             Path(settings.run_dir) / "logs")  # fmt: skip
        console.print("starting the services (ingest, rewarding, trainer worker + beat, router, admin API, canary) ...")
        group.start()
        if config.keep_up:
            from flywheel.demo.damage import ops_token

            viewer_token = ops_token(engine, "demo-viewer", role="viewer")
        router = f"http://{settings.serving.router_host}:{settings.serving.router_port}"
        project = f"demo-{uuid.uuid4().hex[:6]}"
        api_key = product_key(engine, project)
        fw = Flywheel(project=project, transport="kafka", kafka_bootstrap=kafka_bootstrap(settings),
                      spool_dir=Path(settings.run_dir) / "demo-spool")  # fmt: skip
        if config.agent_factory is not None:
            agent = config.agent_factory(fw, router, api_key)
        else:
            agent = plan.agent(fw, router, api_key, config)
        agent.start()
        if config.on_start is not None:
            config.on_start(engine, child_settings, group)
        learn_started = time.monotonic()
        base = snapshot(engine, settings.serving.fleet)
        # the calculator's build registers its held-out figure; another task's base is measured by the first gate
        base_success = _base_success(base, required=config.until is None and plan.model_task == "arith")
        anneal_ends = plan.anneal_ends_at(config, scenario_started)
        budget_s = config.budget_minutes * 60
        with Live(console=console, refresh_per_second=1, transient=False) if config.live else _NoLive() as live:
            while True:
                snap = snapshot(engine, settings.serving.fleet)
                elapsed = time.monotonic() - learn_started
                live.update(render(snap, agent.stats.snapshot(), elapsed, budget_s))
                if base_success is None:
                    base_success = _base_success(snap, required=False)
                if config.until is not None:
                    done = config.until(engine, snap)
                else:  # the scenario's anneal, if any, must have reached 0 first
                    annealed = anneal_ends is None or datetime.now(UTC) >= anneal_ends
                    done = annealed and base_success is not None and _reached(snap, base_success, config)
                if done or elapsed > budget_s:
                    break
                if revived := group.revive():  # like compose's restart policy; a crash loop raises
                    console.print(f"[yellow]restarted {', '.join(revived)}: it died (see its log)[/]")
                time.sleep(2.0)
        learn_minutes = (time.monotonic() - learn_started) / 60
        regression: dict[str, Any] = {}
        if config.inject_regression:
            from flywheel.demo.regression import inject_regression

            regression = inject_regression(engine, child_settings, config, group)
        agent.stop()
        fw.flush(60)
        final = snapshot(engine, settings.serving.fleet, with_decisions=True)
        if base_success is None:  # a base model without a build-time figure: the gate's first measurement of it
            base_success = _base_success(final, required=False)
        summary = _summary(final, base_success, learn_minutes, agent.stats.snapshot(), regression, config)
        summary["scenario"] = plan.name
        if plan.metric is not None:
            summary["metric"] = plan.metric
            summary.update(_metric_before_after(final, plan.metric))
        if anneal_ends is not None:
            summary["anneal_reached_zero"] = datetime.now(UTC) >= anneal_ends
            summary["anneal_minutes"] = round((anneal_ends - scenario_started).total_seconds() / 60, 2)
        summary["service_restarts"] = {s.name: s.restarts for s in group if s.restarts}
        paths = write_report(Path(config.report_dir), final, summary)
        summary["report"] = {k: str(v) for k, v in paths.items()}
        console.print(_summary_table(final, summary))
        console.print(f"report: {Path(config.report_dir).resolve()}")
        if config.on_finish is not None:
            config.on_finish(engine, child_settings, summary)
        return summary
    finally:
        if agent is not None:
            agent.stop(10)
        if fw is not None:
            fw.close(10)
        if config.keep_up:
            if group is not None:
                keep_services(settings, group.records(source="demo"))
            _print_kept_up(settings, viewer_token, api_key)
        else:
            if group is not None:
                group.stop()
            down(settings)
        log.info("demo finished in %.1f min", (time.monotonic() - started) / 60)


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so the ``finally`` below stops the services and the stack."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


DEMO_KEY_RATE_PER_S = 1000.0
"""The demo agent's key rate (and burst): it is the whole product's traffic, which a fast replica
answers faster than the router's per-key default; the demo and the benches measure the loop, not
the limiter."""


def product_key(engine: Any, project: str) -> str:
    """A product key of ``project`` for the router (what the agent product gives its ``openai`` client)."""
    from sqlalchemy.orm import Session

    from flywheel.core.auth import create_key

    with Session(engine) as session:
        _, token = create_key(
            session, name=f"{project}-agent", role="product", project=project, created_by="demo",
            rate_per_s=DEMO_KEY_RATE_PER_S, burst=int(DEMO_KEY_RATE_PER_S),
        )  # fmt: skip
        session.commit()
    return token


def _print_kept_up(settings: Settings, viewer_token: str | None, api_key: str | None) -> None:
    """Where the running system is, and how to stop it."""
    from flywheel.stack.stack import status

    rows = status(settings)
    down_rows = [r.name for r in rows if not r.healthy]
    s = settings.serving
    console.rule("[bold]left running until `flywheel down`")
    console.print(f"running: {', '.join(r.name for r in rows if r.healthy) or 'nothing'}")
    if down_rows:
        console.print(f"[yellow]not running: {', '.join(down_rows)} (see `flywheel status` and the logs)[/]")
    console.print(f"dashboard: http://{s.admin_host}:{s.admin_port}/dashboard")
    if viewer_token is not None:
        console.print(f"  log in with this viewer token: {viewer_token}")
        console.print(f"  the CLI reads it too: export FLYWHEEL_TOKEN={viewer_token}; flywheel status")
    console.print(f"router (OpenAI-compatible): http://{s.router_host}:{s.router_port}/v1")
    if api_key is not None:
        console.print(f"  its product key (the openai client's api_key): {api_key}")
    console.print("`flywheel status` lists every part; `flywheel down` stops everything (the services and the stack)")


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_: Any) -> None:
        return None


def _with_overrides(settings: Settings, overrides: dict[str, dict[str, Any]]) -> Settings:
    """``settings`` with the services' overrides applied (for the calls the demo makes itself)."""
    data = settings.model_dump()
    for section, values in overrides.items():
        data[section] = _merged(data.get(section, {}), values)
    return Settings.model_validate(data)


def _base_success(snap: Any, required: bool = True) -> float | None:
    """The base checkpoint's held-out success; None when it has none and it is not ``required``."""
    roots = [c for c in snap.checkpoints if c.parent_id is None and c.heldout is not None]
    if not roots:
        if not required:
            return None
        raise RuntimeError("the base checkpoint has no held-out evaluation (rebuild the model)")
    return roots[0].heldout


def _local_vllm(vs: VllmSettings, replicas: int) -> VllmSettings:
    """The local replicas' settings for a scenario: ``replicas`` of them and a start timeout that
    grows with the servers starting at once on these cores (the replicas and the gate's engine; the
    settings' timeout fits the calculator's). The stack gives them the task's context
    (:func:`flywheel.stack.vllm.served_vllm`)."""
    from flywheel.demo.scenarios import SCENARIOS

    update: dict[str, Any] = {"replicas": replicas}
    calculator = SCENARIOS["arith"].replicas
    if replicas > calculator:
        update["startup_timeout_s"] = vs.startup_timeout_s * (replicas + 1) / (calculator + 1)
    return vs.model_copy(update=update)


def _metric_before_after(snap: Any, metric: str) -> dict[str, float | None]:
    """``<metric>_before`` (the base's held-out figure) and ``<metric>_after`` (the stable's)."""
    roots = [c for c in snap.checkpoints if c.parent_id is None and metric in c.heldout_metrics]
    before = roots[0].heldout_metrics[metric] if roots else None
    after = before
    if snap.stable:
        for c in snap.checkpoints:
            if c.id == snap.stable["checkpoint_id"] and metric in c.heldout_metrics:
                after = c.heldout_metrics[metric]
    return {f"{metric}_before": before, f"{metric}_after": after}


def _stable_success(snap: Any) -> float | None:
    if not snap.stable:
        return None
    for c in snap.checkpoints:
        if c.id == snap.stable["checkpoint_id"]:
            return c.heldout
    return None


def _reached(snap: Any, base_success: float, config: DemoConfig) -> bool:
    stable = _stable_success(snap)
    if stable is None or snap.canary is not None:
        return False
    gain = (stable - base_success) * 100
    return snap.promotions >= config.target_promotions and gain >= config.target_gain_points


def config_json(config: DemoConfig) -> dict[str, Any]:
    """The knobs of ``config`` as JSON values (the hooks left out: they are code, and may hold locks)."""
    out = {}
    for f in fields(config):
        if f.name in ("on_start", "on_finish", "agent_factory", "until"):
            continue
        value = getattr(config, f.name)
        out[f.name] = str(value) if isinstance(value, Path) else value
    return out


def _summary(snap: Any, base_success: float | None, minutes: float, agent: dict[str, Any], regression: dict[str, Any],
             config: DemoConfig) -> dict[str, Any]:  # fmt: skip
    final = _stable_success(snap) or base_success
    known = base_success is not None and final is not None
    return {
        "base_success": round(base_success, 4) if base_success is not None else None,
        "final_success": round(final, 4) if final is not None else None,
        "gain_points": round((final - base_success) * 100, 1) if known else None,
        "cycles": sum(snap.cycles.values()),
        "cycles_by_status": snap.cycles,
        "minutes": round(minutes, 2),
        "promotions": snap.promotions,
        "rollbacks": snap.rollbacks,
        "failed_requests": agent.get("failed_requests", 0),
        "sessions": agent.get("sessions", 0),
        "events": snap.raw_events,
        "rewards": snap.rewards,
        "samples": snap.samples,
        "stable": snap.stable["policy_version"] if snap.stable else None,
        "config": config_json(config),
        **regression,
    }


def _summary_table(snap: Any, summary: dict[str, Any]) -> Table:
    table = Table(title="Flywheel demo: summary")
    table.add_column("checkpoint")
    table.add_column("status")
    table.add_column("held-out")
    table.add_column("live success")
    table.add_column("sessions")
    for c in snap.checkpoints:
        table.add_row(c.policy_version, c.status + (f" ({c.deployed_as})" if c.deployed_as else ""),
                      "-" if c.heldout is None else f"{c.heldout:.1%}",
                      "-" if c.live_success is None else f"{c.live_success:.1%}", str(c.live_sessions))  # fmt: skip
    regression = {k: v for k, v in summary.items() if k.startswith("regression_")}
    heldout = (
        f"held-out {summary['base_success']:.1%} → {summary['final_success']:.1%} "
        f"({summary['gain_points']:+.1f} points)"
        if summary["gain_points"] is not None
        else "no held-out figure for the base model"
    )
    table.caption = (
        f"{heldout} in {summary['minutes']:.1f} min; "
        f"{summary['promotions']} promoted, {summary['rollbacks']} rolled back, "
        f"{summary['failed_requests']} failed requests" + (f"; {json.dumps(regression)}" if regression else "")
    )
    return table
