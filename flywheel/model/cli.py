"""``flywheel model``: build the offline base model and show what was built.

torch and transformers are imported inside the commands, so ``flywheel --help`` stays instant.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def build(
    force: bool = typer.Option(False, "--force", help="Rebuild even when a cached build exists."),
    output: Path | None = typer.Option(
        None, "--output", help="Also publish the built model at this folder (e.g. a volume vLLM serves from)."
    ),
) -> None:
    """Build (or reuse) the base model; print its folder, size and held-out success."""
    from flywheel.model.build import BuildError, build_model, read_sidecar

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        folder = build_model(force=force)
    except (BuildError, OSError, ValueError) as exc:
        typer.echo(f"model build failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    if output is not None:
        folder = _publish_copy(folder, output)
    sidecar = read_sidecar(folder)
    held = sidecar.heldout
    typer.echo(f"model: {folder}")
    typer.echo(f"policy_version: {sidecar.policy_version}")
    typer.echo(f"params: {sidecar.param_count:,}")
    typer.echo(f"held-out success: {held.success_rate:.1%} (n={held.n}, temperature={held.temperature})")
    typer.echo(f"build seconds: {sidecar.build_seconds}")


def _publish_copy(folder: Path, output: Path) -> Path:
    """Copy a built model to ``output`` atomically (temporary sibling, then rename); replaces an older copy."""
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp)
    if output.exists():
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)
    return output


@app.command()
def info(
    folder: Path | None = typer.Argument(None, help="A built model folder; default: the one the settings name."),
) -> None:
    """Print the sidecar (flywheel_model.json) of a built model."""
    from flywheel.core.settings import get_settings
    from flywheel.model.build import SIDECAR_NAME, build_key, is_complete

    if folder is None:
        settings = get_settings().model
        folder = Path(settings.cache_dir).resolve() / build_key(settings)
    if not is_complete(folder):
        typer.echo(f"no complete model build at {folder}; run `flywheel model build`", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(json.loads((folder / SIDECAR_NAME).read_text()), indent=2))
