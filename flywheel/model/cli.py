"""``flywheel model``: build the offline base model, check and register any base model, the zoo.

torch, transformers and vLLM are imported inside the commands, so ``flywheel --help`` stays instant.
Bad input (a folder that is not a usable causal LM) is a message naming what is wrong and exit 2.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from flywheel.model.check import ModelInfo

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
    typer.echo(f"policy_version: {sidecar.policy_version}")  # the content hash's, as `flywheel model check` says
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


def _checked(folder: Path, completion_only: bool) -> ModelInfo:
    from flywheel.model.check import ModelCheckError, check_model

    try:
        return check_model(folder, completion_only=completion_only)
    except ModelCheckError as exc:
        typer.echo(f"not a usable base model: {exc}", err=True)
        raise typer.Exit(2) from exc


def _echo_info(info: ModelInfo) -> None:
    typer.echo(f"model: {info.path}")
    typer.echo(f"policy_version: {info.policy_version}")
    typer.echo(f"content_hash: {info.content_hash}")
    typer.echo(f"architecture: {info.architecture} ({info.model_type}), {info.dtype}")
    typer.echo(f"parameters: {info.parameters:,}")
    typer.echo(f"vocab: {info.vocab_size}, max positions: {info.max_positions}")
    typer.echo(f"shards: {', '.join(info.shard_files)}")
    mode = "completion-only" if info.completion_only else "chat"
    typer.echo(f"mode: {mode} (chat template {'present' if info.chat_template else 'absent'})")
    typer.echo(
        f"vLLM: {'serves it (' + info.vllm_version + ')' if info.vllm_version else 'not installed here: unchecked'}"
    )


_COMPLETION_ONLY = typer.Option(
    False, "--completion-only", help="The model has no chat template: use it through completions only."
)


@app.command()
def check(
    folder: Path = typer.Argument(..., help="A Hugging Face causal-LM folder (config.json, safetensors, tokenizer)."),
    completion_only: bool = _COMPLETION_ONLY,
) -> None:
    """Check a model folder (architecture, vLLM support, tokenizer, dtype, shards, finite weights); no database."""
    _echo_info(_checked(folder, completion_only))


@app.command()
def register(
    folder: Path = typer.Argument(..., help="A Hugging Face causal-LM folder (config.json, safetensors, tokenizer)."),
    completion_only: bool = _COMPLETION_ONLY,
    url: str = typer.Option(None, help="Database URL (default: the settings' postgres)."),
) -> None:
    """Check a model folder and record it in the registry as a lineage root (idempotent)."""
    from sqlalchemy.orm import Session

    from flywheel.core.db.engine import default_url, get_engine
    from flywheel.model.register import build_heldout, register_model

    info = _checked(folder, completion_only)
    with Session(get_engine(url or default_url())) as session:
        register_model(session, info.path, completion_only=completion_only, heldout=build_heldout(info.path))
    _echo_info(info)
    typer.echo(f"registered: checkpoint {info.policy_version} (a lineage root)")
    typer.echo(f"select it as the base model with FLYWHEEL_MODEL__PATH={info.path}")


@app.command()
def zoo(
    name: str = typer.Argument(..., help="Architecture: qwen3, mistral, gpt2 or gemma."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when a cached one exists."),
) -> None:
    """Build (or reuse) a tiny random-weight model of another architecture, for tests; print its folder."""
    from flywheel.model.zoo import ZooError, zoo_model

    try:
        folder = zoo_model(name, force=force)
    except ZooError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    typer.echo(str(folder))
