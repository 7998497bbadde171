"""``flywheel contracts``: export and check the event JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "schema" / "events.schema.json"


def render_schema() -> str:
    """The JSON Schema of every event, as committed under docs/schema/."""
    from flywheel.core.contracts import event_json_schema

    return json.dumps(event_json_schema(), indent=2, sort_keys=True) + "\n"


@app.command("export")
def export(path: Path = typer.Option(SCHEMA_PATH, help="Where to write the schema.")) -> None:
    """Write the event JSON Schema (docs/schema/events.schema.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_schema())
    typer.echo(f"wrote {path}")


@app.command("validate")
def validate(file: Path = typer.Argument(..., help="A JSON file with one event, or a JSON-lines file.")) -> None:
    """Validate events from a file; exit 1 naming the field of the first bad one.

    A field the contract does not declare is accepted, as every reader accepts it, and named
    on stderr (a typo in a producer shows here).
    """
    from flywheel.core.contracts import ContractError, parse_event, unknown_fields

    bad = 0
    for n, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            event = parse_event(line)
        except ContractError as exc:
            bad += 1
            typer.echo(f"{file}:{n}: {exc}", err=True)
            continue
        unknown = unknown_fields(event)
        if unknown:
            typer.echo(f"{file}:{n}: fields not in the contract (accepted, kept): {', '.join(unknown)}", err=True)
    if bad:
        raise typer.Exit(1)
    typer.echo("all events valid")
