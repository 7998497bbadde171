"""``flywheel-rewarding``: the rewarding worker and its maintenance commands.

``worker`` runs the faust stream processor; ``recompute`` replays raw events into new
reward versions; ``detectors`` prints the reward-hacking metrics per policy version;
``check`` validates the configuration and prints its hash. Heavy imports (the settings
and pydantic, faust, SQLAlchemy) happen inside the commands, so ``--help`` is instant.
A reward extractor that is unknown or misconfigured stops every command that scores, with
an error naming it (exit code 2).
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta

import typer

from flywheel.core.entrypoint import run

app = typer.Typer(
    name="flywheel-rewarding",
    help="Rewarding: sessions and late feedback -> versioned rewards and training samples.",
    no_args_is_help=True,
    add_completion=False,
)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """An ISO time (``2026-12-01T00:00:00Z``) or a look-back (``90s``, ``30m``, ``2h``, ``7d``)."""
    now = now or datetime.now(UTC)
    match = _DURATION.match(value.strip())
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as err:
        raise typer.BadParameter(f"{value!r} is neither an ISO time nor a duration like 2h or 7d") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _judge_url(settings):
    from flywheel.core.endpoints import vllm_urls

    return lambda: vllm_urls(settings)[0]


def _db_url(settings) -> str:
    from flywheel.core.endpoints import postgres_url

    return postgres_url(settings)


def _refused(err: Exception) -> typer.Exit:
    """A configuration error (a :class:`~flywheel.core.plugins.PluginError`) said plainly: exit code 2."""
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(2)


def build_worker(settings=None):
    """The configured :class:`~rewarding.app.RewardingApp` (extractors built, then topics created)."""
    from flywheel.core.endpoints import kafka_bootstrap
    from flywheel.core.settings import get_settings
    from rewarding.app import RewardingApp
    from rewarding.scorer import Scorer
    from rewarding.topics import ensure_topics

    settings = settings or get_settings()
    scorer = Scorer.from_settings(settings.rewarding, _judge_url(settings))  # a bad extractor fails first
    bootstrap = kafka_bootstrap(settings)
    topics = ensure_topics(settings, bootstrap)
    return RewardingApp(settings, bootstrap, _db_url(settings), scorer, topics)


@app.command()
def worker(
    loglevel: str = typer.Option("info", help="Log level of the worker (debug, info, warning, error)."),
) -> None:
    """Run one rewarding worker (start more with the same group id to scale out)."""
    import mode.loop

    mode.loop.use("uvloop")  # before faust creates its loop: faster than asyncio's default
    import faust

    from flywheel.core.plugins import PluginError
    from flywheel.core.settings import get_settings

    settings = get_settings()
    try:
        rewarding = build_worker(settings)
    except PluginError as err:
        raise _refused(err) from err
    if settings.rewarding.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.rewarding.metrics_port, addr="127.0.0.1")
    faust.Worker(rewarding.app, loglevel=loglevel, quiet=True).execute_from_commandline()


@app.command()
def recompute(
    since: str = typer.Option(..., help="Sessions with an event since: ISO time or a look-back like 2h, 7d."),
    project: str | None = typer.Option(None, help="Only this project."),
    force: bool = typer.Option(False, help="Write a new version even where input and configuration are unchanged."),
    dry_run: bool = typer.Option(False, help="Only compare with the stored rewards; write nothing."),
) -> None:
    """Replay raw events from Postgres through the current extractors into new reward versions."""
    from flywheel.core.plugins import PluginError
    from flywheel.core.settings import get_settings
    from rewarding.recompute import recompute as run
    from rewarding.scorer import Scorer

    settings = get_settings()
    try:
        scorer = Scorer.from_settings(settings.rewarding, _judge_url(settings))
    except PluginError as err:
        raise _refused(err) from err

    async def go():
        try:
            return await run(
                scorer, _db_url(settings), parse_since(since), project=project, force=force, dry_run=dry_run
            )
        finally:
            await scorer.aclose()

    report = asyncio.run(go())
    typer.echo(json.dumps(report.to_json(), indent=2))


@app.command()
def detectors(
    since: str = typer.Option("1d", help="Rewards created since: ISO time or a look-back like 2h, 7d."),
    baseline: str | None = typer.Option(None, help="Policy version to compare against (default: the previous)."),
) -> None:
    """Reward-hacking metrics per policy version, and the shifts beyond their bounds."""
    from flywheel.core.settings import get_settings
    from rewarding.detectors import detector_report

    settings = get_settings()
    report = detector_report(_db_url(settings), parse_since(since), settings.rewarding.detectors, baseline)
    typer.echo(json.dumps(report.to_json(), indent=2, default=str))
    if report.shifts:
        raise typer.Exit(3)


@app.command()
def check() -> None:
    """Validate the scoring configuration; print the config hash, extractors and weights."""
    from flywheel.core.plugins import PluginError
    from flywheel.core.settings import get_settings
    from rewarding.composite import config_hash
    from rewarding.extractors import needed
    from rewarding.extractors import versions as registered_versions

    settings = get_settings()
    scoring = settings.rewarding.scoring
    try:
        known = registered_versions()
        versions = {n: known[n] for n in needed(settings.rewarding)}
    except PluginError as err:
        raise _refused(err) from err
    typer.echo(
        json.dumps(
            {
                "config_hash": config_hash(scoring, versions),
                "extractors": versions,
                "weights": scoring.weights,
                "task_weights": scoring.task_weights,
                "feedback_window_s": settings.rewarding.feedback_window_s,
                "session_timeout_s": settings.rewarding.session_timeout_s,
            },
            indent=2,
        )
    )


def main() -> None:
    """Console-script entry point."""
    run(app)


if __name__ == "__main__":
    main()
