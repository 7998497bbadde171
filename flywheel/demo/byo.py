"""Bring your own model: the flywheel's real loop on any causal-LM folder, and the checks of its truth.

``make bench-byo MODEL=PATH`` (``bench/byo.py``) and the architecture tests use this. The loop is
the demo's (:func:`flywheel.demo.loop.run_demo`: the local stack, the services, the canary
controller), with three changes made through its hooks and settings:

- the base model is the given folder (``model.path``), served by vLLM with its own tokenizer and
  chat template, trained in ``full`` or ``lora`` mode (LoRA: the fleet's swap strategy is
  ``lora`` and the replicas load adapters at runtime);
- the agent product is :class:`flywheel.demo.chat_agent.ChatAgent` (plain-text arithmetic at
  T=0.7 / top_p=0.9 / top_k=50, partial credit as the ``task_score`` outcome, the reward), so a
  model that solves nothing yet still trains;
- the loop ends when :func:`counted_cycles` holds ``cycles`` cycles that each ran optimizer
  steps and produced a gated checkpoint that was then swapped into serving (a canary
  deployment that became active), and every such checkpoint has served samples.

The figures come from the tables the services wrote: :func:`counted_cycles`, the swaps of the
audit log, :func:`step0_truth` (the trainer's log-probs under the parent's weights against
the behaviour logprobs of the base policy's samples, :mod:`trainer.truth`) and
:func:`version_truth` (each swapped checkpoint's logged logprobs against a plain transformers
recomputation under the weights of the checkpoint its policy version names).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import text

from flywheel.core.contracts.checkpoint import CheckpointEval
from flywheel.core.settings import Settings
from flywheel.demo.chat_agent import REWARD_RULES, ChatAgent, Sampling
from flywheel.demo.loop import DemoConfig

if TYPE_CHECKING:
    import torch
    from sqlalchemy.engine import Engine

    from flywheel.core.settings.trainer import TrainerSettings

log = logging.getLogger("flywheel.demo.byo")

TRUTH_TOLERANCE = 1e-3
"""Largest |log-prob difference| the issue accepts for both figures."""
SWAPPED_STATUSES = ("active", "promoted", "rolled_back", "superseded")
"""Deployment statuses that a canary reaches only after its replicas were swapped and verified."""


@dataclass
class ByoConfig:
    """The knobs of one run on a model folder (the defaults are ``make bench-byo``'s)."""

    model: Path
    """The causal-LM folder (config, safetensors weights, tokenizer with a chat template)."""
    mode: Literal["full", "lora"] = "full"
    """Training mode; ``lora`` also makes the fleet swap adapters."""
    cycles: int = 3
    """Counted cycles to reach (see :func:`counted_cycles`)."""
    budget_minutes: float = 45.0
    """Longest the loop runs."""
    concurrency: int = 4
    """Concurrent agent sessions."""
    sampling: Sampling = field(default_factory=Sampling)
    """How the agent samples."""
    min_samples: int = 48
    """Fewest samples a cycle trains on."""
    max_samples: int = 192
    """Most samples a cycle trains on."""
    mini_batch_samples: int = 32
    """Samples per optimizer step."""
    cycle_s: float = 15.0
    """Celery beat's training schedule."""
    canary_min_samples: int = 24
    """Scored canary sessions per traffic step."""
    canary_max_s: float = 120.0
    """An inconclusive canary is rolled back after this long (it has served by then: it still counts)."""
    truth_samples: int = 64
    """Most samples per policy version recomputed for each truth figure."""
    seed: int = 0
    report_dir: Path = Path(".flywheel/report-byo")


def run_settings(config: ByoConfig, settings: Settings) -> Settings:
    """``settings`` with the model folder as base model, and LoRA serving in ``lora`` mode."""
    lora = config.mode == "lora"
    vllm = settings.vllm.model_copy(update={"replicas": replicas(config), "enable_lora": lora})
    model = settings.model.model_copy(update={"path": Path(config.model).resolve()})
    serving = settings.serving.model_copy(update={"strategy": "lora" if lora else "full"})
    return settings.model_copy(update={"vllm": vllm, "model": model, "serving": serving})


def replicas(config: ByoConfig) -> int:
    """Two replicas for full weights (a full-weight canary owns one, never all); one holds every adapter."""
    return 1 if config.mode == "lora" else 2


def service_settings(config: ByoConfig) -> dict[str, dict[str, Any]]:
    """What the services get on top of the demo's own settings."""
    lora = config.mode == "lora"
    return {
        "model": {"path": str(Path(config.model).resolve())},
        "trainer": {
            "mode": config.mode,
            "data": {"min_samples": config.min_samples, "max_samples": config.max_samples},
            "step": {"mini_batch_samples": config.mini_batch_samples},
            "schedule": {"time_limit_s": 900.0},
        },
        "rewarding": {"scoring": {"extractors": {"outcome": {"rules": REWARD_RULES}}}},
        "vllm": {"enable_lora": lora},
        "serving": {
            "strategy": "lora" if lora else "full",
            "canary": {
                "metric": "reward",
                "variance": "empirical",
                "max_duration_s": config.canary_max_s,
                "max_canary_sessions": 20 * config.canary_min_samples,
            },
        },
    }


def demo_config(config: ByoConfig, on_finish: Any = None) -> DemoConfig:
    """The demo loop configured for ``config`` (its hooks: the chat agent and :func:`reached`)."""

    def agent(fw: Any, router: str, api_key: str) -> ChatAgent:
        return ChatAgent(
            fw, router, api_key=api_key, concurrency=config.concurrency, sampling=config.sampling, seed=config.seed
        )

    return DemoConfig(
        budget_minutes=config.budget_minutes,
        replicas=replicas(config),
        concurrency=config.concurrency,
        cycle_s=config.cycle_s,
        min_samples=config.min_samples,
        max_samples=config.max_samples,
        canary_steps=[0.5, 1.0],
        canary_min_samples=config.canary_min_samples,
        canary_margin=0.1,
        report_dir=Path(config.report_dir),
        live=False,
        seed=config.seed,
        database=f"flywheel_byo_{config.mode}",
        service_settings=service_settings(config),
        agent_factory=agent,
        until=lambda engine, _snap: reached(engine, config.cycles),
        on_finish=on_finish,
    )


# --------------------------------------------------------------------------- what counts


@dataclass
class CountedCycle:
    """A training cycle and what became of its checkpoint."""

    cycle_id: int
    checkpoint_id: str
    policy_version: str
    parent_id: str | None
    path: str
    format: str
    base_model: str | None
    optimizer_steps: int
    gate: dict[str, Any]
    """The checkpoint's gate record (``checkpoints.eval.gate``)."""
    deployment: str | None
    """Status of its canary deployment once swapped in (None: never swapped in)."""
    swaps_ok: int
    """Successful replica swaps to it (audit log ``replica.swap``)."""
    samples: int
    """Training samples logged under its policy version."""

    @property
    def gated(self) -> bool:
        return bool(self.gate.get("passed"))

    @property
    def counts(self) -> bool:
        """Optimizer steps ran, the gate passed, and it was then swapped into serving."""
        return self.optimizer_steps > 0 and self.gated and self.deployment is not None and self.swaps_ok > 0


CYCLES_SQL = """
SELECT t.id AS cycle_id, t.metrics, k.id AS checkpoint_id, k.policy_version, k.parent_id, k.path, k.format,
       k.base_model, k.eval,
       (SELECT d.status FROM deployments d WHERE d.checkpoint_id = k.id AND d.status IN :swapped
        ORDER BY d.id DESC LIMIT 1) AS deployment,
       (SELECT count(*) FROM audit_log a WHERE a.action = 'replica.swap' AND a.success
        AND a.details->>'checkpoint_id' = k.id) AS swaps_ok,
       (SELECT count(*) FROM training_samples s WHERE s.policy_version = k.policy_version) AS samples
FROM training_cycles t JOIN checkpoints k ON k.id = t.checkpoint_id
ORDER BY t.id
"""


def trained_cycles(engine: Engine) -> list[CountedCycle]:
    """Every cycle that wrote a checkpoint, oldest first, with what became of it."""
    from sqlalchemy import bindparam

    statement = text(CYCLES_SQL).bindparams(bindparam("swapped", expanding=True))
    with engine.connect() as conn:
        rows = conn.execute(statement, {"swapped": list(SWAPPED_STATUSES)}).mappings().all()
    out = []
    for r in rows:
        gate = CheckpointEval.parse(r["eval"]).gate
        out.append(
            CountedCycle(
                cycle_id=int(r["cycle_id"]),
                checkpoint_id=r["checkpoint_id"],
                policy_version=r["policy_version"],
                parent_id=r["parent_id"],
                path=r["path"],
                format=r["format"],
                base_model=r["base_model"],
                optimizer_steps=int((r["metrics"] or {}).get("optimizer_steps") or 0),
                gate=gate.model_dump(mode="json") if gate is not None else {},
                deployment=r["deployment"],
                swaps_ok=int(r["swaps_ok"]),
                samples=int(r["samples"]),
            )
        )
    return out


def counted_cycles(engine: Engine) -> list[CountedCycle]:
    """The cycles that count (:attr:`CountedCycle.counts`)."""
    return [c for c in trained_cycles(engine) if c.counts]


def reached(engine: Engine, cycles: int) -> bool:
    """``cycles`` counted cycles, each of whose checkpoints has served samples."""
    counted = counted_cycles(engine)
    return len(counted) >= cycles and all(c.samples > 0 for c in counted)


def swaps(engine: Engine) -> int:
    """Successful replica swaps of the run (the audit log's ``replica.swap`` rows)."""
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM audit_log WHERE action = 'replica.swap' AND success")).scalar_one()
        )


def gate_suites(cycles: Iterable[CountedCycle]) -> dict[str, dict[str, Any]]:
    """Per checkpoint, the suites its gate ran and each verdict (``passed`` and the numbers compared)."""
    out: dict[str, dict[str, Any]] = {}
    for c in cycles:
        gate = c.gate
        suites = gate.get("suites")
        if isinstance(suites, list) and suites:
            out[c.checkpoint_id] = {str(v.get("suite")): _verdict(v) for v in suites if isinstance(v, dict)}
        elif gate:
            name = str(gate.get("key") or "gate").split("/", 1)[0]
            out[c.checkpoint_id] = {name: _verdict(gate)}
    return out


def _verdict(record: Any) -> Any:
    if not isinstance(record, dict):
        return record
    keep = ("passed", "delta", "margin", "note")
    verdict = {k: record[k] for k in keep if record.get(k) is not None}
    for side in ("candidate", "parent"):
        value = record.get(side)
        if isinstance(value, dict) and "success_rate" in value:
            verdict[f"{side}_success"] = value["success_rate"]
            verdict[f"{side}_n"] = value.get("n")
    return verdict or record


# --------------------------------------------------------------------------- truth


@dataclass
class LoggedSample:
    """A training sample as the truth checks need it."""

    id: int
    policy_version: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    sampling: dict[str, Any]


def logged_samples(engine: Engine, policy_version: str, limit: int, ids: list[int] | None = None) -> list[LoggedSample]:
    """Up to ``limit`` training samples logged under ``policy_version`` (of ``ids`` when given), oldest first."""
    where = "policy_version = :version" + (" AND id = ANY(:ids)" if ids is not None else "")
    sql = text(
        "SELECT id, policy_version, prompt_token_ids, completion_token_ids, loss_mask, behaviour_logprobs, sampling "
        f"FROM training_samples WHERE {where} ORDER BY id LIMIT :limit"
    )
    params: dict[str, Any] = {"version": policy_version, "limit": limit}
    if ids is not None:
        params["ids"] = list(ids)
    with engine.connect() as conn:
        return [LoggedSample(**dict(r)) for r in conn.execute(sql, params).mappings()]


def processed_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Log-probs of the distribution vLLM samples from: logits / temperature, then top-k, then top-p.

    Written from vLLM's sampler (``apply_top_k_top_p_pytorch``): top-k keeps the logits at least
    the k-th largest; top-p sorts ascending and masks the tokens whose cumulative probability is
    at most ``1 - top_p`` (the largest always kept). Float32 throughout, one row per position.
    """
    import torch

    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        ordered, index = x.sort(dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        ordered = ordered.masked_fill(drop, -math.inf)
        x = torch.empty_like(x).scatter_(-1, index, ordered)
    return x.log_softmax(dim=-1)


def load_plain(path: str, fmt: str, base_model: str | None) -> Any:
    """A checkpoint with plain transformers (float32, eval): its folder, or a LoRA adapter merged over its base."""
    import torch
    from transformers import AutoModelForCausalLM

    if fmt == "lora":
        from peft import PeftModel

        if not base_model:
            raise ValueError(f"LoRA checkpoint {path} names no base model")
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def sample_diffs(model: Any, sample: LoggedSample, default: Sampling) -> list[float]:
    """|recomputed - logged| for every model-generated token of ``sample`` (loss mask 1)."""
    import torch

    s = sample.sampling or {}
    temperature = float(s["temperature"]) if s.get("temperature") is not None else default.temperature
    top_k = int(s["top_k"]) if s.get("top_k") is not None else default.top_k
    top_p = float(s["top_p"]) if s.get("top_p") is not None else default.top_p
    ids = torch.tensor([list(sample.prompt_token_ids) + list(sample.completion_token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    start = len(sample.prompt_token_ids) - 1
    rows = logits[start : start + len(sample.completion_token_ids)]
    logp = processed_logprobs(rows, temperature, top_k, top_p)
    target = torch.tensor(sample.completion_token_ids).unsqueeze(-1)
    recomputed = logp.gather(-1, target).squeeze(-1).tolist()
    return [
        abs(r - b) for r, b, m in zip(recomputed, sample.behaviour_logprobs, sample.loss_mask) if m and b is not None
    ]


def version_truth(
    engine: Engine, cycles: Iterable[CountedCycle], per_version: int, default: Sampling | None = None
) -> dict[str, Any]:
    """Each checkpoint's logged logprobs against a plain transformers recomputation under its own weights.

    The samples are those whose recorded policy version is the checkpoint's; the weights are
    loaded from the checkpoint folder its registry row names (a LoRA adapter merged over its
    base). Returns the largest difference over all of them, per checkpoint and overall, and
    ``outside_support``: tokens that serving sampled but the recomputed top-k / top-p leaves out
    (an infinite difference, counted apart so the figure stays a number).
    """
    default = default or Sampling()
    per: dict[str, Any] = {}
    worst = 0.0
    tokens = 0
    outside = 0
    for c in cycles:
        samples = logged_samples(engine, c.policy_version, per_version)
        if not samples:
            per[c.checkpoint_id] = {"samples": 0, "tokens": 0, "max_abs_diff": None, "outside_support": 0}
            continue
        model = load_plain(c.path, c.format, c.base_model)
        diffs = [d for s in samples for d in sample_diffs(model, s, default)]
        del model
        finite = [d for d in diffs if math.isfinite(d)]
        top = max(finite, default=0.0)
        per[c.checkpoint_id] = {"samples": len(samples), "tokens": len(diffs), "max_abs_diff": top,
                                "outside_support": len(diffs) - len(finite)}  # fmt: skip
        worst, tokens, outside = max(worst, top), tokens + len(diffs), outside + len(diffs) - len(finite)
    checked = [v for v in per.values() if v["samples"]]
    return {
        "max_abs_diff": worst if checked else None,
        "outside_support": outside,
        "tokens": tokens,
        "checkpoints": per,
        "sampling_recorded": _sampling_recorded(engine),
    }


def _sampling_recorded(engine: Engine) -> bool:
    """Whether the samples carry their sampling parameters (else the agent's known ones were assumed)."""
    with engine.connect() as conn:
        try:
            return bool(
                conn.execute(text("SELECT bool_and(sampling <> '{}'::jsonb) FROM training_samples")).scalar_one()
            )
        except Exception:  # noqa: BLE001 - a database without the column (before migration 0006)
            return False


def step0_truth(
    engine: Engine, cycles: Iterable[CountedCycle], per_version: int, trainer: TrainerSettings | None = None
) -> dict[str, Any]:
    """The trainer's log-probs at step 0 against the behaviour logprobs serving recorded.

    For each cycle: the samples of its batch that its parent policy produced (their recorded
    policy version is the parent's), and the parent loaded as that cycle's trainer loads it
    before its first optimizer step (``trainer.ckpt.load_trainable`` in ``trainer.mode``: full
    weights, or a fresh LoRA adapter over them), through :func:`trainer.truth.check_logprobs`
    (the training step's packing, log-prob module and each sample's temperature / top-k /
    top-p). Returns the largest ``|log ratio|`` over every token checked.
    """
    from flywheel.core.settings.trainer import TrainerSettings
    from trainer import ckpt, truth

    t = trainer or TrainerSettings()
    worst = 0.0
    tokens = 0
    checked = 0
    excluded: dict[str, int] = {}
    for c in cycles:
        ids = _cycle_sample_ids(engine, c.cycle_id)
        parent = _checkpoint_row(engine, c.parent_id) if c.parent_id else None
        if parent is None or not ids:
            continue
        samples = logged_samples(engine, parent["policy_version"], per_version, ids=ids)
        if not samples:
            continue
        ref = ckpt.PolicyRef(parent["id"], parent["policy_version"], parent["path"], parent["format"],
                             parent["base_model"] or parent["path"])  # fmt: skip
        model, tokenizer, _ = ckpt.load_trainable(ref, t.mode, t.lora, t.step.seed)
        report = truth.check_logprobs(
            model,
            [
                truth.TruthSample(s.prompt_token_ids, s.completion_token_ids, s.behaviour_logprobs, s.sampling or None)
                for s in samples
            ],  # fmt: skip
            default_temperature=t.step.sampling_temperature,
            pad_id=tokenizer.pad_token_id or 0,
        )
        del model
        for reason, n in report.excluded.items():
            excluded[reason] = excluded.get(reason, 0) + n
        worst = max(worst, report.max_abs_log_ratio)
        tokens += report.tokens
        checked += 1
    return {"max_abs_log_ratio": worst if tokens else None, "tokens": tokens, "cycles": checked, "excluded": excluded}


def _checkpoint_row(engine: Engine, checkpoint_id: str) -> dict[str, Any] | None:
    with engine.connect() as conn:
        row = (
            conn.execute(
                text("SELECT id, policy_version, path, format, base_model FROM checkpoints WHERE id = :id"),
                {"id": checkpoint_id},
            )
            .mappings()
            .first()
        )
    return dict(row) if row else None


def _cycle_sample_ids(engine: Engine, cycle_id: int) -> list[int]:
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT sample_ids FROM training_cycles WHERE id = :id"), {"id": cycle_id}).scalar()
    return list(ids or [])


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 1.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(interval_s)
