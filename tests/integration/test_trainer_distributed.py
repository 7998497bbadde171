"""The training step under torchrun, world size 2 on CPU (gloo): DDP and FSDP2.

Both ranks must end with identical weights that differ from the start, and the
data-parallel update must equal the single-process update on the same batch. FSDP2 loads
each rank's shard straight from the safetensors files: its first weights must be the plain
load's (digest) while each rank holds about half of the parameter bytes, and what it saves
(streamed, one gathered tensor at a time) must be the single-process result; in full and in
LoRA mode.
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


def make_samples(base_model_dir: Path) -> list:
    """24 real samples (6 problems x 4 episodes of the base model) with RLOO advantages."""
    from flywheel.core.settings.trainer import AdvantageSettings
    from trainer.advantages import AdvInput, compute_advantages
    from trainer.step import StepSample

    rows = sample_rows(base_model_dir, n_problems=6, group_size=4, seed=5)
    adv = compute_advantages(
        [AdvInput(r["session_id"], r["group_key"], r["task"], r["reward"]) for r in rows], AdvantageSettings()
    )
    return [
        StepSample(
            i, r["prompt_token_ids"], r["completion_token_ids"], r["loss_mask"], r["behaviour_logprobs"], a, r["reward"]
        )
        for i, (r, a) in enumerate(zip(rows, adv.advantages))
    ]


def write(path: Path, base_model_dir: Path, samples: list, mode: str) -> Path:
    """A batch file (parent = the base model) for torchrun, training in ``mode``."""
    from flywheel.core.settings import TrainerSettings
    from flywheel.model.build import read_sidecar
    from trainer.ckpt import PolicyRef
    from trainer.distributed import write_batch

    version = read_sidecar(base_model_dir).policy_version
    parent = PolicyRef(version, version, str(base_model_dir), "full", str(base_model_dir))
    settings = TrainerSettings(
        mode=mode,
        hardware={"device": "cpu", "dtype": "float32"},  # gloo on the CPU, as the single process here
        step={
            "learning_rate": 1e-3,
            "mini_batch_samples": 8,
            "epochs": 1,
            "show_progress": False,
            "micro_batch_tokens": 400,
        },
    )
    write_batch(path, parent, samples, settings)
    return path


@pytest.fixture(scope="module")
def batch(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A full-mode batch file and its samples."""
    samples = make_samples(base_model_dir)
    return write(tmp_path_factory.mktemp("dist") / "batch.pt", base_model_dir, samples, "full"), samples


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


def single_process(batch_path: Path) -> tuple[dict, float, str]:
    """The same update in one process: final weights (peft's saved names for LoRA), loss after, first digest."""
    import torch

    from flywheel.core.settings import TrainerSettings
    from trainer.ckpt import PolicyRef, load_trainable
    from trainer.parallel import resolve
    from trainer.step import StepSample, train_on_batch, weights_digest

    payload = torch.load(batch_path, weights_only=False)
    settings = TrainerSettings.model_validate(payload["settings"])
    placement = resolve(settings.hardware)
    model, tokenizer, _ = load_trainable(
        PolicyRef(**payload["parent"]), settings.mode, settings.lora, settings.step.seed, placement
    )
    initial = weights_digest(model)
    result = train_on_batch(
        model, [StepSample(**s) for s in payload["samples"]], settings.step, settings.loss, tokenizer.pad_token_id
    )
    weights = {k.replace(".default", ""): v.detach().clone() for k, v in model.state_dict().items()}
    return weights, result.loss_after, initial


@pytest.fixture(scope="module")
def single(batch) -> tuple[dict, float, str]:
    return single_process(batch[0])


def assert_same_update(ranks: list[dict], single: tuple[dict, float, str], saved_file: Path) -> None:
    """Identical, changed weights on both ranks, loss down, equal to the single-process update and its save."""
    import torch
    from safetensors.torch import load_file

    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["initial"] == ranks[1]["initial"]
    assert ranks[0]["final"] != ranks[0]["initial"]
    assert ranks[0]["loss_after"] < ranks[0]["loss_before"]
    weights, loss_after, initial = single
    assert ranks[0]["initial"] == initial  # the loaded parent is the plain load, bit for bit
    # The data-parallel update is the single-process one (up to summation order).
    assert ranks[0]["loss_after"] == pytest.approx(loss_after, rel=1e-3, abs=1e-4)
    saved = load_file(str(saved_file))
    assert saved and saved.keys() <= weights.keys()
    for name, tensor in saved.items():
        assert torch.allclose(tensor, weights[name], atol=1e-4), name


def assert_sharded(ranks: list[dict]) -> None:
    """Each rank holds about half of the parameter bytes: the whole model never sat in one rank."""
    total = ranks[0]["model_bytes"]
    assert sum(r["param_bytes"] for r in ranks) == total
    for r in ranks:
        assert r["param_bytes"] <= 0.55 * total, r


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_both_ranks_end_with_identical_changed_weights_equal_to_one_process(batch, single, tmp_path, strategy):
    ranks = torchrun(batch[0], tmp_path / strategy, strategy)
    assert_same_update(ranks, single, tmp_path / strategy / "model" / "model.safetensors")
    if strategy == "fsdp":
        assert_sharded(ranks)
    else:
        assert all(r["param_bytes"] == r["model_bytes"] for r in ranks)  # DDP: a full replica per rank


def test_fsdp_lora_adapter_loads_sharded_and_trains_as_one_process(batch, base_model_dir, tmp_path):
    path = write(tmp_path / "lora.pt", base_model_dir, batch[1], "lora")
    ranks = torchrun(path, tmp_path / "out", "fsdp")
    assert_same_update(ranks, single_process(path), tmp_path / "out" / "model" / "adapter_model.safetensors")
    assert_sharded(ranks)
    assert (tmp_path / "out" / "model" / "adapter_config.json").is_file()
