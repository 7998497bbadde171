"""The training step under torchrun: DDP or FSDP2, one process per device (or CPU core).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m trainer.distributed \\
        --batch BATCH.pt --out DIR

``BATCH.pt`` (:func:`write_batch`) holds the parent checkpoint's location, the samples
with their advantages and the trainer settings; every rank loads the parent the same way
(same seed), runs :func:`trainer.step.train_on_batch` on its shard and writes
``DIR/rank<r>.json`` with digests of its first and final weights and the parameter bytes
it holds. Rank 0 also writes the trained model (full weights or the LoRA adapter) to
``DIR/model`` and the step metrics to ``DIR/result.json``. The cycle runs this through :func:`launch` when
``trainer.distributed.nproc_per_node > 1``.

Device and precision come from ``trainer.hardware`` (:func:`trainer.parallel.resolve`):
NCCL on GPUs, gloo on CPU. DDP loads the whole policy in every rank
(:func:`trainer.ckpt.load_trainable`); FSDP2 builds it without storage and reads each rank's
shard from the safetensors files (:func:`trainer.parallel.load_sharded`), and saves by
gathering one tensor at a time (:func:`trainer.parallel.save_trained`), so no rank holds the
whole model. The tests run both with world size 2 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flywheel.core.settings.trainer import TrainerSettings
from trainer.ckpt import PolicyRef, load_trainable
from trainer.parallel import load_sharded, resident_parameter_bytes, resolve, save_trained
from trainer.step import DistInfo, StepSample, TrainResult, train_on_batch, weights_digest

# torch is imported inside the functions that use it: trainer.cycle imports this module (for
# launch) in processes that never train (``flywheel-trainer check``).


class DistributedFailed(RuntimeError):
    """torchrun exited with an error."""


def write_batch(path: Path, parent: PolicyRef, samples: list[StepSample], settings: TrainerSettings) -> None:
    """Everything a rank needs, in one file."""
    import torch

    payload = {
        "schema_version": 1,
        "parent": asdict(parent),
        "samples": [asdict(s) for s in samples],
        "settings": settings.model_dump(mode="json"),
    }
    torch.save(payload, path)


def launch(
    parent: PolicyRef, samples: list[StepSample], settings: TrainerSettings, root: Path, timeout_s: float
) -> tuple[TrainResult, Path]:
    """Run the step under torchrun; returns its result and the folder of the trained model.

    The work folder is a ``.tmp-`` folder under ``root`` (removed by the caller, or swept
    by the next cycle if this process dies).
    """
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-dist-", dir=root))
    write_batch(work / "batch.pt", parent, samples, settings)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(settings.distributed.nproc_per_node),
        "-m",
        "trainer.distributed",
        "--batch",
        str(work / "batch.pt"),
        "--out",
        str(work),
    ]
    done = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    if done.returncode != 0:
        raise DistributedFailed(f"torchrun exited {done.returncode}: {done.stderr[-2000:]}")
    result = TrainResult(**json.loads((work / "result.json").read_text()))
    return result, work / "model"


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (started by torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--strategy", choices=["ddp", "fsdp"], default=None, help="override trainer.distributed.strategy"
    )
    parser.add_argument("--no-save", action="store_true", help="write digests and metrics only")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as tdist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    payload = torch.load(args.batch, weights_only=False)
    settings = TrainerSettings.model_validate(payload["settings"])
    placement = resolve(settings.hardware)
    if placement.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    tdist.init_process_group("nccl" if placement.device == "cuda" else "gloo")
    try:
        strategy = args.strategy or settings.distributed.strategy
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        parent = PolicyRef(**payload["parent"])
        if strategy == "fsdp":
            model, tokenizer, _ = load_sharded(parent, settings.mode, settings.lora, settings.step.seed, placement)
        else:
            model, tokenizer, _ = load_trainable(parent, settings.mode, settings.lora, settings.step.seed, placement)
        param_bytes, model_bytes = resident_parameter_bytes(model)
        initial = weights_digest(model)
        samples = [StepSample(**s) for s in payload["samples"]]
        result = train_on_batch(
            model,
            samples,
            settings.step,
            settings.loss,
            tokenizer.pad_token_id or 0,
            DistInfo(rank, world, strategy),  # type: ignore[arg-type]
        )
        final = weights_digest(model)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "world": world,
                    "strategy": strategy,
                    "placement": asdict(placement),
                    "param_bytes": param_bytes,
                    "model_bytes": model_bytes,
                    "initial": initial,
                    "final": final,
                    "loss_before": result.loss_before,
                    "loss_after": result.loss_after,
                }
            )
        )
        if not args.no_save:
            save(model, tokenizer, args.out / "model", rank, strategy)
        if rank == 0:
            (args.out / "result.json").write_text(json.dumps(asdict(result)))
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    return 0


def save(model: Any, tokenizer: Any, folder: Path, rank: int, strategy: str) -> None:
    """Rank 0 writes the trained model: DDP from its full copy; FSDP streamed one gathered tensor at a time."""
    if strategy == "fsdp":
        save_trained(model, tokenizer, folder, rank)
    elif rank == 0:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    raise SystemExit(main())
