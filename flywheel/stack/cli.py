"""``flywheel up``, ``flywheel down``, ``flywheel status``.

Heavy modules (the stack, kafka-python, psycopg, rich) are imported inside the
commands, so ``flywheel --help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from flywheel.stack.base import ComponentStatus


def register(app: typer.Typer) -> None:
    """Add the stack commands to the ``flywheel`` app."""
    app.command("up")(up_command)
    app.command("down")(down_command)
    app.command("status")(status_command)


def up_command(
    only: str | None = typer.Option(
        None, "--only", help="Comma-separated subset of broker,postgres,redis,vllm,gate (default: all)."
    ),
    replicas: int | None = typer.Option(
        None, "--replicas", min=0, max=8, help="Number of local vLLM replicas (default: settings)."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Model folder the local vLLM replicas serve (default: the project's built base model)."
    ),
) -> None:
    """Start (or find) the stack's services and wait until they are healthy."""
    from flywheel.core.settings import get_settings
    from flywheel.stack.base import ComponentFailed
    from flywheel.stack.stack import parse_components, status, up

    settings = get_settings()
    if replicas is not None:
        settings = settings.model_copy(update={"vllm": settings.vllm.model_copy(update={"replicas": replicas})})
    try:
        kinds = parse_components(only)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--only") from err
    try:
        up(settings, kinds, model_dir=model)
    except ComponentFailed as err:
        _fail(err.component, err.reason, err.log_path, err.log_tail)
    rows = [r for r in status(settings) if r.name.split("-")[0] in kinds]
    _print_table(rows, title=f"flywheel stack ({settings.run_dir})")
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


def down_command(
    only: str | None = typer.Option(
        None,
        "--only",
        help="Comma-separated subset of service,broker,postgres,redis,vllm,gate (default: all); "
        "service: the pipeline's services left running by `flywheel demo --keep-up`.",
    ),
) -> None:
    """Stop what the stack started, and the services a `flywheel demo --keep-up` left (external ones keep running)."""
    from rich.console import Console

    from flywheel.core.settings import get_settings
    from flywheel.stack.stack import DOWN_KINDS, down, parse_components

    try:
        kinds = parse_components(only, DOWN_KINDS)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--only") from err
    stopped = down(get_settings(), kinds)
    Console().print(f"stopped: {', '.join(stopped)}" if stopped else "nothing of ours was running")


def status_command() -> None:
    """Show what runs where and whether it is healthy (exit code 1 if anything is not).

    The pipeline's services are listed too while a `flywheel demo --keep-up` left them running.
    """
    from flywheel.core.settings import get_settings
    from flywheel.stack.stack import status

    settings = get_settings()
    rows = status(settings)
    _print_table(rows, title=f"flywheel stack ({settings.run_dir})")
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


def _print_table(rows: list[ComponentStatus], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("component", no_wrap=True)
    table.add_column("where", overflow="fold")
    table.add_column("by", no_wrap=True)
    table.add_column("pid", no_wrap=True)
    table.add_column("healthy", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for row in rows:
        table.add_row(
            row.name,
            row.where,
            "us" if row.started_by_us else ("external" if row.where != "-" else "-"),
            str(row.pid) if row.pid else "-",
            "[green]yes[/green]" if row.healthy else "[red]no[/red]",
            row.detail,
        )
    Console().print(table)


def _fail(component: str, reason: str, log_path: Path | None, tail: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    console.print(f"[bold red]{escape(component)} failed:[/bold red] {escape(reason)}")
    if log_path is not None:
        console.print(f"[dim]--- last lines of {escape(str(log_path))} ---[/dim]")
        console.print(escape(tail or "(empty)"), highlight=False)
    raise typer.Exit(1)
