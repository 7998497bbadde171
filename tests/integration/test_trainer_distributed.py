"""The training step under torchrun, world size 2 on CPU (gloo): DDP and FSDP2.

Both ranks must end with identical weights that differ from the start, and the
data-parallel update must equal the single-process update on the same batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_rollouts import sample_rows

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def batch(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A batch file (parent = the base model, 24 real samples with RLOO advantages) for torchrun."""
    from flywheel.core.settings import TrainerSettings
    from flywheel.core.settings.trainer import AdvantageSettings
    from flywheel.model.build import read_sidecar
    from trainer.advantages import AdvInput, compute_advantages
    from trainer.ckpt import PolicyRef
    from trainer.distributed import write_batch
    from trainer.step import StepSample

    rows = sample_rows(base_model_dir, n_problems=6, group_size=4, seed=5)
    adv = compute_advantages(
        [AdvInput(r["session_id"], r["group_key"], r["task"], r["reward"]) for r in rows], AdvantageSettings()
    )
    samples = [
        StepSample(
            i, r["prompt_token_ids"], r["completion_token_ids"], r["loss_mask"], r["behaviour_logprobs"], a, r["reward"]
        )
        for i, (r, a) in enumerate(zip(rows, adv.advantages))
    ]
    version = read_sidecar(base_model_dir).policy_version
    parent = PolicyRef(version, version, str(base_model_dir), "full", str(base_model_dir))
    settings = TrainerSettings(
        step={
            "learning_rate": 1e-3,
            "mini_batch_samples": 8,
            "epochs": 1,
            "show_progress": False,
            "micro_batch_tokens": 400,
        }
    )
    path = tmp_path_factory.mktemp("dist") / "batch.pt"
    write_batch(path, parent, samples, settings)
    return path, samples


def torchrun(batch_path: Path, out: Path, strategy: str) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "trainer.distributed",
        "--batch",
        str(batch_path),
        "--out",
        str(out),
        "--strategy",
        strategy,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def single_process(batch_path: Path) -> tuple[dict, float]:
    """The same update in one process: final weights and loss after."""
    import torch

    from flywheel.core.settings import TrainerSettings
    from trainer.ckpt import PolicyRef, load_trainable
    from trainer.step import StepSample, train_on_batch

    payload = torch.load(batch_path, weights_only=False)
    settings = TrainerSettings.model_validate(payload["settings"])
    model, tokenizer, _ = load_trainable(PolicyRef(**payload["parent"]), "full", settings.lora, settings.step.seed)
    result = train_on_batch(
        model, [StepSample(**s) for s in payload["samples"]], settings.step, settings.loss, tokenizer.pad_token_id
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result.loss_after


@pytest.fixture(scope="module")
def single(batch) -> tuple[dict, float]:
    return single_process(batch[0])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_both_ranks_end_with_identical_changed_weights_equal_to_one_process(batch, single, tmp_path, strategy):
    import torch
    from safetensors.torch import load_file

    ranks = torchrun(batch[0], tmp_path / strategy, strategy)
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["initial"] == ranks[1]["initial"]
    assert ranks[0]["final"] != ranks[0]["initial"]
    assert ranks[0]["loss_after"] < ranks[0]["loss_before"]
    # The data-parallel update is the single-process one (up to summation order).
    weights, loss_after = single
    assert ranks[0]["loss_after"] == pytest.approx(loss_after, rel=1e-3, abs=1e-4)
    saved = load_file(str(tmp_path / strategy / "model" / "model.safetensors"))
    assert saved.keys() == {k for k in weights if k in saved}
    for name, tensor in saved.items():
        assert torch.allclose(tensor, weights[name], atol=1e-4), name
