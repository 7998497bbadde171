"""The ``flywheel`` command-line tool.

Each command group lives beside the code it drives and is imported lazily, so
``flywheel --help`` stays instant (no torch, no vLLM, no SQLAlchemy at import).
"""

from __future__ import annotations

import typer

from flywheel.contracts.cli import app as contracts_app
from flywheel.db.cli import app as db_app
from flywheel.model.cli import app as model_app
from flywheel.stack.cli import down_command, up_command
from ingest.cli import app as ingest_app
from ingest.cli import keys_app
from rewarding.main import app as rewards_app
from serving.admin_cli import register as register_serving
from trainer.main import app as trainer_app

app = typer.Typer(
    name="flywheel",
    help="Flywheel: continual learning from production agent traffic.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("up")(up_command)
app.command("down")(down_command)
# checkpoints, deploy, promote, rollback, canary, audit, tokens (through the admin API), and
# status: the stack's components (as `flywheel up` reports them), then the fleet.
register_serving(app)
app.add_typer(model_app, name="model", help="Build the project's small base model.")
app.add_typer(db_app, name="db", help="Database migrations.")
app.add_typer(ingest_app, name="ingest", help="Topics, the Kafka-to-Postgres consumer, the HTTP gateway.")
app.add_typer(keys_app, name="keys", help="Gateway write keys per project.")
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
    minutes: float = typer.Option(20.0, min=1.0, help="Longest the learning phase runs."),
    target_gain: float = typer.Option(25.0, help="Stop early at this held-out gain (points) ..."),
    target_promotions: int = typer.Option(2, min=0, help="... and this many promotions."),
    concurrency: int = typer.Option(6, min=1, max=64, help="Concurrent agent sessions."),
    report_dir: str = typer.Option(".flywheel/report", help="Where the plot and the JSON summary go."),
    keep_up: bool = typer.Option(False, help="Leave the stack running after the demo."),
    smoke: bool = typer.Option(False, help="Only the stack smoke run (every component answers), no learning loop."),
) -> None:
    """Run the main job: the flywheel learns from its own traffic, live, then a summary and a report."""
    from pathlib import Path

    if smoke:
        from flywheel.demo import run_smoke

        raise typer.Exit(run_smoke(keep_up=keep_up))
    from flywheel.demo import DemoConfig, run_demo

    config = DemoConfig(
        budget_minutes=minutes,
        target_gain_points=target_gain,
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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
