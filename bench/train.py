"""``make bench-train``: our training step against TRL's GRPO loss, same model, same batch, one run.

Two kinds of batch (``--shape``):

- ``project`` (default): the project's base model and a real batch: episodes of the
  calculator task sampled from it (token-level sampling logprobs recorded, tool tokens masked
  out), rewarded by the task's outcome, advantages by RLOO over each problem's group;
- any other shape in ``SHAPES`` (``qwen3-0.6b``: Qwen3-0.6B's shape; ``tiny``: the same
  architecture, small enough for a CPU): a randomly initialised model built from its config
  (no hub on any machine) and a synthetic batch: random token ids with realistic prompt and
  completion lengths (``--prompt-len``, ``--completion-len`` ranges), random behaviour
  logprobs, advantages and loss masks.

For each ``--modes`` entry (``full``, ``lora``) each side trains on the whole batch for
``--steps`` optimizer steps (forward, backward, clipping, AdamW), after one untimed warm-up
step, in its own fresh process so that peak memory is its own. Both sides load the policy the
way the trainer does (``trainer.ckpt.load_trainable`` with ``trainer.hardware`` resolved for
``--device``: on CUDA bf16 compute over float32 trained weights, a bf16 frozen base under LoRA,
gradient checkpointing), so they differ only in the step:

- **ours**: ``trainer.step.optimizer_step`` (sequences packed without padding, log-probs only
  at trained tokens, CISPO with the ratio to the behaviour logprobs);
- **trl**: ``GRPOTrainer._compute_loss`` of TRL (``loss_type="cispo"``, the same ratio cap,
  ``beta=0``; the batch padded the way TRL pads it: prompts left, completions right, tool
  tokens masked with ``tool_mask``), then the same backward, clipping and AdamW.

Figures (the medians of ``--rounds`` interleaved runs per side):

- tokens/s: the real tokens of the batch (prompt + completion, no padding), the same for both;
- model FLOP utilisation (``mfu``): ``tokens/s x flops_per_token / peak``, with
  ``flops_per_token = k * N + 12 * L * d_attn * s_mean`` (PaLM, appendix B): ``N`` the
  parameters doing matmuls (all but the input embedding; a tied head counted once), ``k = 6``
  for full fine-tuning (forward 2N, backward 4N) and ``k = 4`` for LoRA (no weight gradients of
  the frozen base; the adapter's own FLOPs are neglected), ``L`` layers, ``d_attn`` = heads x
  head_dim, ``s_mean`` the mean sample length. Recomputation by gradient checkpointing is not
  counted (model FLOPs, not hardware FLOPs). ``peak``: ``--peak-tflops``, else the dense bf16
  tensor-core peak of a known GPU (``PEAK_BF16_TFLOPS``, e.g. 989 for H100/H200 SXM); none on
  the CPU (mfu null);
- peak memory: the rise of the process's peak resident set (Linux ``VmHWM``, reset after
  setup) over the resident set at setup on CPU; on a GPU the rise of
  ``torch.cuda.max_memory_allocated`` over the allocation after setup (``peak_mb``, AdamW's
  state included: it is created in the warm-up step) and the peak itself (``peak_total_mb``).

The last line is one JSON object.
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

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architecture": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "architecture": "qwen3",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
}
"""Model shapes built from a config with random weights (Qwen3-0.6B's is its published config.json)."""

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the CUDA device name."""


def main() -> int:
    parser = argparse.ArgumentParser(description="trainer step vs TRL GRPO loss")
    parser.add_argument("--side", choices=["ours", "trl"], help="internal: run one side on --batch")
    parser.add_argument("--batch", type=Path, help="internal: the batch file")
    parser.add_argument("--mode", choices=["full", "lora"], default="full", help="internal: the side's mode")
    parser.add_argument("--shape", default="project", choices=["project", *SHAPES], help="model and batch")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="trainer.hardware.device")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="trainer.hardware.dtype"
    )
    parser.add_argument(
        "--checkpointing", choices=["auto", "on", "off"], default="auto", help="trainer.hardware.gradient_checkpointing"
    )
    parser.add_argument("--modes", default="full", help="comma-separated: full, lora")
    parser.add_argument("--problems", type=int, default=32, help="project shape: problems in the batch")
    parser.add_argument("--group", type=int, default=4, help="project shape: episodes per problem")
    parser.add_argument("--samples", type=int, default=32, help="synthetic batch: samples")
    parser.add_argument("--prompt-len", default="128,768", help="synthetic batch: prompt length range MIN,MAX")
    parser.add_argument("--completion-len", default="64,512", help="synthetic batch: completion length range")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak FLOP/s for the MFU (0: by GPU name)")
    parser.add_argument("--sides", default="ours,trl", help="comma-separated sides to run")
    args = parser.parse_args()
    if args.side:
        hardware = {"device": args.device, "dtype": args.dtype, "gradient_checkpointing": args.checkpointing}
        print(json.dumps(run_side(args.side, args.batch, args.mode, hardware, args.steps, args.threads)))
        return 0
    return orchestrate(args)


# --------------------------------------------------------------------------- orchestration


def orchestrate(args: argparse.Namespace) -> int:
    """Build the batch once, run both sides interleaved per mode, print the comparison."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not modes or set(modes) - {"full", "lora"} or not sides or set(sides) - {"ours", "trl"}:
        raise SystemExit(
            f"--modes takes full and/or lora, --sides ours and/or trl (got {args.modes!r}, {args.sides!r})"
        )
    if "trl" in sides:
        import trl  # noqa: F401  (fail early with a clear message if the bench extras are missing)

    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        started = time.perf_counter()
        batch = project_batch(args) if args.shape == "project" else synthetic_batch(args, Path(tmp))
        lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in batch["samples"]]
        print(
            f"batch ({args.shape}): {len(lengths)} samples, {sum(lengths)} tokens "
            f"(mean {statistics.mean(lengths):.1f}, max {max(lengths)}), prepared in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
        path = Path(tmp) / "batch.json"
        path.write_text(json.dumps(batch))
        results: dict[str, dict[str, list[dict[str, Any]]]] = {m: {s: [] for s in sides} for m in modes}
        for mode in modes:
            for round_ in range(args.rounds):
                for side in sides:
                    result = run_subprocess(side, mode, path, args)
                    results[mode][side].append(result)
                    print(
                        f"{mode} round {round_ + 1} {side:4s}: {result['tokens_per_s']:9.0f} tokens/s, "
                        f"peak {result['peak_mb']:8.1f} MB, "
                        f"loss {result['first_loss']:+.4f} -> {result['last_loss']:+.4f}",
                        flush=True,
                    )
    first = next(iter(results.values()))[sides[0]][0]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(first)
    summary: dict[str, Any] = {
        "shape": args.shape,
        "device": first["device"],
        "device_name": first["device_name"],
        "dtype": first["placement"]["dtype"],
        "gradient_checkpointing": first["placement"]["gradient_checkpointing"],
        "threads": first["threads"],
        "samples": len(lengths),
        "tokens_per_step": sum(lengths),
        "steps": args.steps,
        "rounds": args.rounds,
        "peak_tflops": peak / 1e12 if peak else None,
        "flops_formula": "k*N + 12*L*d_attn*s_mean per token; k=6 full, 4 LoRA; N = matmul parameters",
        "modes": {mode: mode_summary(results[mode], first, mode, sum(lengths) / len(lengths), peak) for mode in modes},
    }
    if "trl" in sides:
        summary["trl_version"] = next(iter(results.values()))["trl"][0]["trl_version"]
    print(json.dumps(summary))
    return 0


def mode_summary(
    runs: dict[str, list[dict[str, Any]]], first: dict[str, Any], mode: str, mean_len: float, peak: float
) -> dict[str, Any]:
    """Medians per side, their ratios, FLOPs per token and MFU."""
    flops = flops_per_token(first["model_stats"], mode, mean_len)
    out: dict[str, Any] = {"flops_per_token": flops}
    for side, rows in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        out[f"{side}_tokens_per_s"] = round(tps, 1)
        out[f"{side}_mfu"] = round(tps * flops / peak, 4) if peak else None
        out[f"{side}_peak_mb"] = round(statistics.median(r["peak_mb"] for r in rows), 1)
        if rows[0].get("peak_total_mb") is not None:
            out[f"{side}_peak_total_mb"] = round(statistics.median(r["peak_total_mb"] for r in rows), 1)
    if "ours" in runs and "trl" in runs:
        out["speed_ratio"] = round(out["ours_tokens_per_s"] / out["trl_tokens_per_s"], 3)
        out["memory_ratio"] = round(out["ours_peak_mb"] / out["trl_peak_mb"], 3) if out["trl_peak_mb"] > 0 else None
        out["target_met"] = out["speed_ratio"] >= 1 and out["ours_peak_mb"] <= out["trl_peak_mb"]
    return out


def flops_per_token(stats: dict[str, int], mode: str, mean_len: float) -> float:
    """Training FLOPs per token (see the module docstring)."""
    k = 6 if mode == "full" else 4
    return k * stats["matmul_params"] + 12 * stats["layers"] * stats["d_attn"] * mean_len


def peak_flops(result: dict[str, Any]) -> float:
    """The dense bf16 peak of the GPU the sides ran on (0 when unknown, on the CPU, or not computing in bf16)."""
    if result["device"] != "cuda" or result["placement"]["dtype"] != "bfloat16":
        return 0.0
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in result["device_name"]:
            return tflops * 1e12
    return 0.0


def project_batch(args: argparse.Namespace) -> dict[str, Any]:
    """The project's base model and real episodes of it, RLOO advantages."""
    from flywheel.core.settings.trainer import AdvantageSettings
    from flywheel.model.build import build_model
    from trainer.advantages import AdvInput, compute_advantages

    model_dir = build_model()
    rows = load_rollouts_module().sample_rows(model_dir, n_problems=args.problems, group_size=args.group, seed=0)
    adv = compute_advantages(
        [AdvInput(r["session_id"], r["group_key"], r["task"], r["reward"]) for r in rows],
        AdvantageSettings(group="rloo", norm="batch"),
    )
    return {
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


def synthetic_batch(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A randomly initialised model of ``args.shape`` saved under ``tmp``, and a random batch for it."""
    import random

    shape = SHAPES[args.shape]
    model_dir = build_random_model(shape, tmp / "model")
    rng = random.Random(0)
    p_lo, p_hi = (int(x) for x in args.prompt_len.split(","))
    c_lo, c_hi = (int(x) for x in args.completion_len.split(","))
    vocab = shape["vocab_size"]
    samples = []
    for _ in range(args.samples):
        n_prompt, n_completion = rng.randint(p_lo, p_hi), rng.randint(c_lo, c_hi)
        samples.append(
            {
                "prompt_ids": [rng.randrange(1, vocab) for _ in range(n_prompt)],
                "completion_ids": [rng.randrange(1, vocab) for _ in range(n_completion)],
                # Mostly model tokens, a few masked spans (tool output inside a turn).
                "mask": [0 if rng.random() < 0.1 else 1 for _ in range(n_completion)],
                "behaviour": [-rng.expovariate(1.0) for _ in range(n_completion)],
                "advantage": rng.gauss(0.0, 1.0),
                "reward": rng.random(),
            }
        )
    return {"model_dir": str(model_dir), "samples": samples}


def build_random_model(shape: dict[str, Any], folder: Path) -> Path:
    """Save a seeded random model of ``shape`` and a minimal tokenizer (a pad token) into ``folder``."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    fields = {k: v for k, v in shape.items() if k != "architecture"}
    config = AutoConfig.for_model(shape["architecture"], **fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2}, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tokenizer.save_pretrained(folder)
    return folder


def load_rollouts_module() -> Any:
    """The rollout sampler shared with the trainer's tests."""
    spec = importlib.util.spec_from_file_location("trainer_rollouts", ROLLOUTS)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def run_subprocess(side: str, mode: str, batch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh interpreter; its last stdout line is its JSON result."""
    command = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--mode",
        mode,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--checkpointing",
        args.checkpointing,
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{side} side ({mode}) failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- one side


def run_side(
    side: str, batch_path: Path, mode: str, hardware: dict[str, str], steps: int, threads: int
) -> dict[str, Any]:
    """Load the policy as the trainer does, reset the memory peak, warm up once, time ``steps`` steps."""
    from dataclasses import asdict

    import torch

    from flywheel.core.settings.trainer import HardwareSettings, LoraSettings
    from trainer.ckpt import PolicyRef, load_trainable
    from trainer.parallel import resolve

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch = json.loads(batch_path.read_text())
    placement = resolve(HardwareSettings(**hardware))
    parent = PolicyRef("bench", "bench", batch["model_dir"], "full", batch["model_dir"])
    model, tokenizer, _ = load_trainable(parent, mode, LoraSettings(), 0, placement)  # type: ignore[arg-type]
    device = placement.torch_device()
    samples = batch["samples"]
    tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    step = (
        make_ours(model, tokenizer, samples)
        if side == "ours"
        else make_trl(model, tokenizer, samples, device, placement.gradient_checkpointing)
    )
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
        "mode": mode,
        "tokens_per_s": tokens * steps / seconds,
        "peak_mb": peak_mb(device, baseline),
        "peak_total_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "device": device.type,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "placement": asdict(placement),
        "threads": torch.get_num_threads(),
        "model_stats": model_stats(model),
    }
    if side == "trl":
        import trl

        out["trl_version"] = trl.__version__
    return out


def model_stats(model: Any) -> dict[str, int]:
    """Parameters doing matmuls (all but the input embedding; a tied head once), layers, heads x head_dim."""
    from trainer.parallel import causal_lm

    lm = causal_lm(model)
    config = lm.config
    embedding = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    for name, param in lm.named_parameters():
        if id(param) in seen or ".lora_" in name:
            continue
        seen.add(id(param))
        total += param.numel()
    if head is not embedding:
        total -= embedding.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "matmul_params": total,
        "layers": config.num_hidden_layers,
        "d_attn": config.num_attention_heads * head_dim,
    }


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
    # The whole batch in one micro-batch: the largest token budget the settings allow; rows as long
    # as the longest sample.
    longest = max(s.length for s in step_samples)
    step = StepSettings(
        learning_rate=1e-4,
        mini_batch_samples=len(samples),
        micro_batch_tokens=10_000_000,
        pack_row_tokens=max(256, longest),
    )
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


def make_trl(model: Any, tokenizer: Any, samples: list[dict[str, Any]], device: Any, checkpointing: bool) -> Any:
    """One call = TRL's GRPO (CISPO) loss on the padded batch, backward, clipping, AdamW.

    The model arrives placed as ours (device, autocast, gradient checkpointing); TRL is told the
    same checkpointing and no mixed precision of its own.
    """
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
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
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
