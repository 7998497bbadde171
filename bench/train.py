"""``make bench-train``: our training step against TRL's GRPO loss, same model, same batch, one run.

The batch is real: episodes of the calculator task sampled from the project's base model
(token-level sampling logprobs recorded, tool tokens masked out), rewarded by the task's
outcome, advantages by RLOO over each problem's group. Each side then trains on the whole
batch for ``--steps`` optimizer steps (forward, backward, clipping, AdamW), after one
untimed warm-up step, in its own fresh process so that peak memory is its own:

- **ours**: ``trainer.step.train_on_batch`` (sequences packed without padding, log-probs
  only at trained tokens, CISPO with the ratio to the behaviour logprobs);
- **trl**: ``GRPOTrainer._compute_loss`` of TRL (``loss_type="cispo"``, the same ratio
  cap, ``beta=0``; the batch padded the way TRL pads it: prompts left, completions
  right, tool tokens masked with ``tool_mask``), then the same backward and AdamW.

Training tokens per second count the real tokens of the batch (prompt + completion, no
padding), the same number for both. Peak memory is the rise of the process's peak
resident set (Linux ``VmHWM``, reset after setup) over the resident set at setup on CPU,
``torch.cuda.max_memory_allocated`` on a GPU. The sides run interleaved, ``--rounds``
times each; the figures are the medians. The last line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself, whose flywheel.py would shadow the package
ROLLOUTS = ROOT / "tests" / "integration" / "test_trainer_rollouts.py"


def main() -> int:
    parser = argparse.ArgumentParser(description="trainer step vs TRL GRPO loss")
    parser.add_argument("--side", choices=["ours", "trl"], help="internal: run one side on --batch")
    parser.add_argument("--batch", type=Path, help="internal: the batch file")
    parser.add_argument("--problems", type=int, default=32, help="problems in the batch")
    parser.add_argument("--group", type=int, default=4, help="episodes per problem")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.batch, args.steps, args.threads)))
        return 0
    return orchestrate(args)


# --------------------------------------------------------------------------- orchestration


def orchestrate(args: argparse.Namespace) -> int:
    """Build the batch once, run both sides interleaved, print the comparison."""
    import trl  # noqa: F401  (fail early with a clear message if the bench extras are missing)

    from flywheel.core.settings.trainer import AdvantageSettings
    from flywheel.model.build import build_model
    from trainer.advantages import AdvInput, compute_advantages

    model_dir = build_model()
    rollouts = load_rollouts_module()
    started = time.perf_counter()
    rows = rollouts.sample_rows(model_dir, n_problems=args.problems, group_size=args.group, seed=0)
    adv = compute_advantages(
        [AdvInput(r["session_id"], r["group_key"], r["task"], r["reward"]) for r in rows],
        AdvantageSettings(group="rloo", norm="batch"),
    )
    batch = {
        "model_dir": str(model_dir),
        "samples": [
            {
                "prompt_ids": r["prompt_token_ids"],
                "completion_ids": r["completion_token_ids"],
                "mask": r["loss_mask"],
                "behaviour": r["behaviour_logprobs"],
                "advantage": a,
                "reward": r["reward"],
            }
            for r, a in zip(rows, adv.advantages)
        ],
    }
    lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in batch["samples"]]
    print(
        f"batch: {len(rows)} samples, {sum(lengths)} tokens (mean {statistics.mean(lengths):.1f}, max {max(lengths)}), "
        f"mean reward {statistics.mean(r['reward'] for r in rows):.3f}, "
        f"sampled in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        path = Path(tmp) / "batch.json"
        path.write_text(json.dumps(batch))
        for round_ in range(args.rounds):
            for side in ("ours", "trl"):
                result = run_subprocess(side, path, args)
                results[side].append(result)
                print(
                    f"round {round_ + 1} {side:4s}: {result['tokens_per_s']:8.0f} tokens/s, "
                    f"peak {result['peak_mb']:7.1f} MB, "
                    f"loss {result['first_loss']:+.4f} -> {result['last_loss']:+.4f}",
                    flush=True,
                )
    ours_tps = statistics.median(r["tokens_per_s"] for r in results["ours"])
    trl_tps = statistics.median(r["tokens_per_s"] for r in results["trl"])
    ours_mb = statistics.median(r["peak_mb"] for r in results["ours"])
    trl_mb = statistics.median(r["peak_mb"] for r in results["trl"])
    summary = {
        "ours_tokens_per_s": round(ours_tps, 1),
        "trl_tokens_per_s": round(trl_tps, 1),
        "speed_ratio": round(ours_tps / trl_tps, 3),
        "ours_peak_mb": round(ours_mb, 1),
        "trl_peak_mb": round(trl_mb, 1),
        "memory_ratio": round(ours_mb / trl_mb, 3) if trl_mb > 0 else None,
        "samples": len(rows),
        "tokens_per_step": sum(lengths),
        "steps": args.steps,
        "rounds": args.rounds,
        "device": results["ours"][0]["device"],
        "threads": results["ours"][0]["threads"],
        "trl_version": results["trl"][0]["trl_version"],
        "target_met": ours_tps >= trl_tps and ours_mb <= trl_mb,
    }
    print(json.dumps(summary))
    return 0


def load_rollouts_module() -> Any:
    """The rollout sampler shared with the trainer's tests."""
    spec = importlib.util.spec_from_file_location("trainer_rollouts", ROLLOUTS)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def run_subprocess(side: str, batch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh interpreter; its last stdout line is its JSON result."""
    command = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{side} side failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- one side


def run_side(side: str, batch_path: Path, steps: int, threads: int) -> dict[str, Any]:
    """Load the model and batch, reset the memory peak, warm up once, time ``steps`` steps."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch = json.loads(batch_path.read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from flywheel.model.eval import load_policy

    model, tokenizer = load_policy(batch["model_dir"])
    model.to(device)
    samples = batch["samples"]
    tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    step = make_ours(model, tokenizer, samples) if side == "ours" else make_trl(model, tokenizer, samples, device)
    baseline = reset_peak(device)
    losses = [step()]  # warm-up, untimed
    started = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    out = {
        "side": side,
        "tokens_per_s": tokens * steps / seconds,
        "peak_mb": peak_mb(device, baseline),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "device": device.type,
        "threads": torch.get_num_threads(),
    }
    if side == "trl":
        import trl

        out["trl_version"] = trl.__version__
    return out


def make_ours(model: Any, tokenizer: Any, samples: list[dict[str, Any]]) -> Any:
    """One call = one ``trainer.step.optimizer_step`` on the whole batch (packed, CISPO), as a cycle runs it."""
    import torch

    from flywheel.core.settings.trainer import LossSettings, StepSettings
    from trainer.step import DistInfo, StepSample, make_logprob_module, optimizer_step

    step_samples = [
        StepSample(i, s["prompt_ids"], s["completion_ids"], s["mask"], s["behaviour"], s["advantage"], s["reward"])
        for i, s in enumerate(samples)
    ]
    loss = LossSettings(kind="cispo", is_ratio_max=2.0)
    # The whole batch in one micro-batch: the largest token budget the settings allow.
    step = StepSettings(learning_rate=1e-4, mini_batch_samples=len(samples), micro_batch_tokens=10_000_000)
    module = make_logprob_module(model, step.sampling_temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=step.learning_rate)
    device = next(model.parameters()).device
    model.train()

    def run() -> float:
        metrics = optimizer_step(
            module, optimizer, params, step_samples, step, loss, tokenizer.pad_token_id, DistInfo(), device
        )
        return metrics["loss"]

    return run


def make_trl(model: Any, tokenizer: Any, samples: list[dict[str, Any]], device: Any) -> Any:
    """One call = TRL's GRPO (CISPO) loss on the padded batch, backward, clipping, AdamW."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    max_completion = max(len(s["completion_ids"]) for s in samples)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=len(samples),
        num_generations=4,
        max_completion_length=max_completion,
        loss_type="cispo",
        epsilon_high=2.0,
        beta=0.0,
        learning_rate=1e-4,
        report_to=[],
        use_cpu=device.type == "cpu",
        bf16=False,
        fp16=False,
        logging_steps=10**6,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * len(samples)}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    policy = trainer.model
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    pad = tokenizer.pad_token_id

    def collate() -> dict[str, torch.Tensor]:
        width_p = max(len(s["prompt_ids"]) for s in samples)
        width_c = max_completion
        n = len(samples)
        prompt_ids = torch.full((n, width_p), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
        completion_ids = torch.full((n, width_c), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, width_c), dtype=torch.long)
        tool_mask = torch.zeros((n, width_c), dtype=torch.long)
        old = torch.zeros((n, width_c), dtype=torch.float32)
        for i, s in enumerate(samples):
            p, c = s["prompt_ids"], s["completion_ids"]
            prompt_ids[i, width_p - len(p) :] = torch.tensor(p)
            prompt_mask[i, width_p - len(p) :] = 1
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
            tool_mask[i, : len(c)] = torch.tensor(s["mask"])
            old[i, : len(c)] = torch.tensor(s["behaviour"])
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "old_per_token_logps": old,
            "advantages": torch.tensor([s["advantage"] for s in samples], dtype=torch.float32),
            "num_items_in_batch": (completion_mask * tool_mask).sum(),
        }
        return {k: v.to(device) for k, v in inputs.items()}

    def run() -> float:
        inputs = collate()
        loss = trainer._compute_loss(policy, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return run


# --------------------------------------------------------------------------- memory


def reset_peak(device: Any) -> float:
    """Reset the peak-memory counter; returns the current resident (or allocated) MB."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_mb("VmRSS")


def peak_mb(device: Any, baseline: float) -> float:
    """Peak memory since :func:`reset_peak`, above the baseline, in MB."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20 - baseline
    return _status_mb("VmHWM") - baseline


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


if __name__ == "__main__":
    raise SystemExit(main())
