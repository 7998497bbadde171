"""The ``flywheel`` command-line tool: the composition root.

Each command group lives beside the code it drives and is imported lazily, so
``flywheel --help`` stays instant (no torch, no vLLM, no SQLAlchemy at import).

The roles read every endpoint from their settings alone. When the local development
stack runs (``flywheel up``), :func:`main` passes its endpoints to the commands through
the environment, as a deployment would (variables already set win); ``flywheel env``
prints the same variables for a service started by hand.
"""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.contracts import app as contracts_app
from flywheel.cli.db import app as db_app
from flywheel.core.entrypoint import run
from flywheel.model.cli import app as model_app
from flywheel.stack.cli import down_command, up_command
from flywheel.stack.cli import status_command as stack_status
from ingest.cli import app as ingest_app
from ingest.cli import keys_app
from rewarding.main import app as rewards_app
from serving.admin_cli import TOKEN_OPTION, URL_OPTION, fleet_status
from serving.admin_cli import register as register_serving
from serving.fleet.cli import app as fleet_app
from trainer.main import app as trainer_app

app = typer.Typer(
    name="flywheel",
    help="Flywheel: continual learning from production agent traffic.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("up")(up_command)
app.command("down")(down_command)
# checkpoints, deploy, promote, rollback, canary, audit, tokens (through the admin API).
register_serving(app)
app.add_typer(model_app, name="model", help="The base model: check or register a Hugging Face folder, build our own.")
app.add_typer(db_app, name="db", help="Database migrations.")
app.add_typer(fleet_app, name="fleet", help="The vLLM fleet in Postgres: register its replicas.")
app.add_typer(ingest_app, name="ingest", help="Topics, the Kafka-to-Postgres consumer, the HTTP gateway.")
app.add_typer(keys_app, name="keys", help="Project keys: gateway write keys and router product keys.")
app.add_typer(rewards_app, name="rewards", help="Rewards: worker, recompute, detectors, check.")
app.add_typer(trainer_app, name="train", help="The trainer: train now, pause/resume, status, worker, beat, check.")
app.add_typer(contracts_app, name="contracts", help="Event contracts: JSON Schema export and validation.")


@app.command()
def demo(
    inject_regression: bool = typer.Option(
        False,
        "--inject-regression",
        help="Also deploy a deliberately damaged checkpoint as canary and show it rolled back.",
    ),
    scenario: str = typer.Option(
        "arith", help="The scenario: arith (the calculator assistant) or parl (an orchestrator with frozen sub-agents)."
    ),
    minutes: float = typer.Option(20.0, min=1.0, help="Longest the learning phase runs."),
    target_gain: float | None = typer.Option(
        None, help="Stop early at this held-out gain (points) ... [default: the scenario's, 25 for arith, 10 for parl]"
    ),
    target_promotions: int = typer.Option(2, min=0, help="... and this many promotions."),
    concurrency: int = typer.Option(6, min=1, max=64, help="Concurrent agent sessions."),
    report_dir: str = typer.Option(".flywheel/report", help="Where the plot and the JSON summary go."),
    keep_up: bool = typer.Option(
        False, help="Leave everything running after the demo (stack, services, dashboard) until `flywheel down`."
    ),
    smoke: bool = typer.Option(False, help="Only the stack smoke run (every component answers), no learning loop."),
) -> None:
    """Run the main job: the flywheel learns from its own traffic, live, then a summary and a report."""
    if smoke:
        from flywheel.demo import run_smoke

        raise typer.Exit(run_smoke(keep_up=keep_up))
    from flywheel.demo import DemoConfig, run_demo
    from flywheel.demo.scenarios import SCENARIOS

    if scenario not in SCENARIOS:
        typer.echo(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}", err=True)
        raise typer.Exit(2)
    config = DemoConfig(
        scenario=scenario,
        budget_minutes=minutes,
        target_gain_points=target_gain if target_gain is not None else SCENARIOS[scenario].target_gain_points,
        target_promotions=target_promotions,
        concurrency=concurrency,
        inject_regression=inject_regression,
        report_dir=Path(report_dir),
        keep_up=keep_up,
    )
    try:
        summary = run_demo(config)
    except Exception as err:  # the demo's own failure, said plainly, with a non-zero exit
        typer.echo(f"demo failed: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(1) from err
    ok = summary["promotions"] >= 1 and summary["failed_requests"] == 0
    if inject_regression:
        ok = ok and bool(summary.get("regression_rolled_back"))
    raise typer.Exit(0 if ok else 1)


@app.command("status")
def status_command(
    stack: bool | None = typer.Option(
        None,
        "--stack/--no-stack",
        show_default=False,
        help="Show the local stack's components [default: only without an admin URL (--url, serving.admin_url)].",
    ),
    fleet: bool = typer.Option(True, "--fleet/--no-fleet", help="Show the fleet, trainer and canary (admin API)."),
    token: str | None = TOKEN_OPTION,
    url: str | None = URL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the fleet section as the API's JSON."),
) -> None:
    """The local stack (what runs where, healthy or not), then the fleet through the admin API.

    Against a remote admin API (``--url``, or ``serving.admin_url`` /
    ``FLYWHEEL_SERVING__ADMIN_URL``) only the admin API is asked: no local stack is read or
    probed, unless ``--stack`` asks for it. Exit 1: a stack component is unhealthy or the API
    refused; exit 2: the admin API is unreachable.
    """
    code = 0
    if stack is None:
        stack = not is_remote(url)
    if stack:
        try:
            stack_status()
        except typer.Exit as exit_:
            code = max(code, int(exit_.exit_code or 0))
    if fleet:
        fleet_code = fleet_status(token, url, as_json)
        if fleet_code:
            raise typer.Exit(max(code, fleet_code))
    if code:
        raise typer.Exit(code)


def is_remote(url: str | None) -> bool:
    """Whether ``flywheel status`` talks to an admin API named explicitly (``--url`` or ``serving.admin_url``)."""
    from flywheel.core.settings import get_settings

    return bool(url or get_settings().serving.admin_url)


@app.command("env")
def env_command() -> None:
    """Print ``export FLYWHEEL_...=...`` lines naming the running local stack's components.

    For a service started by hand against the local stack: ``eval "$(flywheel env)"``.
    """
    import shlex

    from flywheel.stack.endpoints import endpoint_env

    variables = endpoint_env()
    if not variables:
        typer.echo("no local stack is running and no endpoint is configured: run `flywheel up`", err=True)
        raise typer.Exit(1)
    for name, value in sorted(variables.items()):
        typer.echo(f"export {name}={shlex.quote(value)}")


# Commands that run a role's code against the infrastructure (not the stack's own commands,
# which must tell a component they started from one configured elsewhere).
ROLE_COMMANDS = frozenset({"ingest", "keys", "rewards", "train", "db", "fleet"})


def export_stack_endpoints(argv: list[str]) -> None:
    """For a role's command, put the local stack's endpoints into the environment, unless already set.

    Composition tells the roles where development services run, through the environment;
    the roles themselves read settings alone. Without a stack nothing is added.
    """
    import os

    if not argv or argv[0] not in ROLE_COMMANDS:
        return
    from flywheel.core.settings import get_settings
    from flywheel.stack.endpoints import endpoint_env

    if not (Path(get_settings().run_dir) / "stack.json").exists():
        return
    added = {k: v for k, v in endpoint_env().items() if k not in os.environ}
    if added:
        os.environ.update(added)
        get_settings.cache_clear()


def main() -> None:
    """Console-script entry point."""
    import sys

    export_stack_endpoints(sys.argv[1:])
    run(app)


if __name__ == "__main__":
    main()
