"""One training cycle, as a plain function: lock, select, train, checkpoint, gate, registry.

``run_cycle(key, trigger)`` is what the Celery task, ``flywheel-trainer now --inline``
and tests call. Its states in ``training_cycles``:

- ``running`` while it works (``metrics.phase`` says where: select, load, train, gate, publish);
- ``skipped`` with the reason: paused, too few samples (with the counts), or another
  cycle holding the lock;
- ``failed`` with the reason: ``worker lost`` (set by the next cycle for a row whose
  worker died), ``time limit``, or the error;
- ``candidate`` / ``rejected``: a checkpoint was written; the gate's verdict and numbers
  are in the reason, the checkpoint row and its sidecar.

Idempotent per key: a key whose cycle finished returns that outcome again; a redelivered
task whose first attempt died finds its row ``running`` while the lock is free, marks it
``failed: worker lost`` and returns that (the next trigger trains). The registry row of
a checkpoint is written in the same transaction as its cycle's final state, and only
after the checkpoint folder is complete on disk.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.core.contracts.checkpoint import CheckpointEval, HeldoutResult
from flywheel.core.contracts.samples import StoredSample
from flywheel.core.db.engine import get_engine, session_factory
from flywheel.core.db.models import TrainingCycle
from flywheel.core.endpoints import postgres_url
from flywheel.core.settings import Settings, get_settings
from flywheel.core.settings.trainer import TrainerSettings
from flywheel.model.register import register_base_model
from trainer import ckpt, distributed, gate, registry, select
from trainer.advantages import AdvantageResult, AdvInput, BaselineState, compute_advantages
from trainer.ckpt import PolicyRef
from trainer.engine import VllmEngine
from trainer.evals.base import EvalContext
from trainer.metrics import TrainerMetrics
from trainer.parallel import resolve as resolve_placement
from trainer.select import DataWindow, SelectionRules
from trainer.step import CycleTimeout, StepSample, TokenSampling, TrainResult, prompt_features, train_on_batch

# torch, transformers and peft are imported where they are used: the Celery worker's main
# process and ``flywheel-trainer check`` import this module without training.

if TYPE_CHECKING:
    from sqlalchemy.orm import Session
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

OPERATIONAL_FIELDS: dict[str, Any] = {
    "schedule": True,
    "checkpoints": True,
    "metrics": True,
    "data": {"window_settle_s"},
    "step": {"show_progress", "torch_threads"},
    "gate": {"engine_url", "local_port", "concurrency", "request_timeout_s"},
    "hardware": {"device", "gradient_checkpointing"},
}
"""TrainerSettings sections and fields that do not shape the update (left out of the config hash)."""


class SkipCycle(Exception):
    """The cycle has nothing to do (an answer, not an error)."""

    def __init__(self, reason: str, metrics: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.metrics = metrics or {}


@dataclass
class CycleOutcome:
    """What a cycle ended as."""

    cycle_id: int | None
    status: str
    reason: str | None = None
    checkpoint_id: str | None = None
    policy_version: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    replayed: bool = False
    """True when the key had already run and this is its recorded outcome."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the Celery result)."""
        return asdict(self)


def run_cycle(key: str, trigger: str = "manual", settings: Settings | None = None) -> CycleOutcome:
    """Run one training cycle for idempotency ``key`` (see the module docstring)."""
    settings = settings or get_settings()
    url = postgres_url(settings)
    with session_factory(url)() as session:
        existing = registry.cycle_by_key(session, key)
        if existing is not None and existing.status != "running":
            return _outcome_of(existing, replayed=True)
        with registry.cycle_lock(get_engine(url)) as held:
            if not held:
                reason = "another cycle is running"
                cycle_id = registry.insert_cycle(session, None, trigger, "skipped", reason, {"requested_key": key})
                return CycleOutcome(cycle_id, "skipped", reason)
            stale = registry.fail_stale_cycles(session)
            if stale:
                log.warning("marked cycles %s failed: %s", stale, registry.WORKER_LOST)
            existing = registry.cycle_by_key(session, key)
            if existing is not None:
                session.refresh(existing)
                return _outcome_of(existing, replayed=True)
            return _run_locked(session, key, trigger, settings)


def _run_locked(session: Session, key: str, trigger: str, settings: Settings) -> CycleOutcome:
    """The cycle proper, with the lock held."""
    t = settings.trainer
    deadline = time.monotonic() + t.schedule.time_limit_s
    metrics = TrainerMetrics(t.metrics.textfile)
    pause = registry.pause_state(session)
    if pause.paused:
        reason = f"paused by {pause.actor} at {pause.at:%Y-%m-%d %H:%M:%S%z}" + (
            f": {pause.reason}" if pause.reason else ""
        )
        cycle_id = registry.insert_cycle(session, key, trigger, "skipped", reason)
        _export(session, metrics, "skipped", {})
        return CycleOutcome(cycle_id, "skipped", reason)
    cycle_id = registry.insert_cycle(session, key, trigger, "running", metrics={"phase": "select"})
    try:
        base_id = register_base_model(session, settings.model)
        removed = ckpt.sweep(Path(t.checkpoints.dir), set(registry.lineage(session)))
        if removed:
            log.warning("removed incomplete or unregistered checkpoint folders: %s", [p.name for p in removed])
        outcome = _train(session, cycle_id, settings, base_id, deadline, metrics)
    except SkipCycle as skip:
        session.rollback()
        registry.update_cycle(session, cycle_id, status="skipped", reason=skip.reason, metrics=skip.metrics)
        _export(session, metrics, "skipped", {})
        return CycleOutcome(cycle_id, "skipped", skip.reason, metrics=skip.metrics)
    except BaseException as exc:
        session.rollback()
        reason = failure_reason(exc, t)
        registry.update_cycle(session, cycle_id, status="failed", reason=reason)
        _export(session, metrics, "failed", {})
        if reason.startswith("time limit"):
            return CycleOutcome(cycle_id, "failed", reason)
        raise
    deleted = registry.apply_retention(
        session, Path(t.checkpoints.dir), t.checkpoints.keep_latest, t.checkpoints.keep_deployed_days
    )
    if deleted:
        log.info("retention deleted %s", deleted)
    _export(session, metrics, outcome.status, outcome.metrics)
    return outcome


def _train(
    session: Session, cycle_id: int, settings: Settings, base_id: str, deadline: float, metrics: TrainerMetrics
) -> CycleOutcome:
    """Select, train, stage, gate, publish; returns the candidate/rejected outcome."""
    t = settings.trainer
    root = Path(t.checkpoints.dir)
    parent = registry.get_checkpoint(session, parent_checkpoint_id(session, t, base_id))
    parent_ref = PolicyRef(parent.id, parent.policy_version, parent.path, parent.format, parent.base_model)  # type: ignore[arg-type]

    # Selection.
    serving = registry.serving_checkpoint_ids(session) or [base_id]
    allowed = select.allowed_versions(serving, registry.lineage(session), t.data.max_policy_lag)
    window = DataWindow(
        start=registry.last_window_end(session),
        end=registry.db_now(session) - timedelta(seconds=t.data.window_settle_s),
    )
    selection = select.choose(
        select.fetch_window(session, window),
        SelectionRules(
            allowed,
            frozenset(t.data.trainable_roles),
            t.data.min_samples,
            t.data.max_samples,
            holdout_per_mille=t.gate.holdout_per_mille,
        ),
    )
    info: dict[str, Any] = {
        "selection": selection.counts,
        "serving": serving,
        "allowed_versions": sorted(allowed),
        "window": {"start": _iso(window.start), "end": _iso(window.end)},
        "parent": parent.id,
    }
    if selection.skip_reason:
        raise SkipCycle(selection.skip_reason, info)
    samples = select.fetch_samples(session, selection.ids)
    registry.update_cycle(
        session, cycle_id, parent_checkpoint_id=parent.id, sample_ids=selection.ids, metrics=info | {"phase": "load"}
    )

    # The gate's suites prepared (problems and held-out slice fixed) and the parent's results,
    # each cached per suite key, evaluated through the gate's engine where not cached.
    engine = VllmEngine.from_settings(settings)
    context = gate.context_of(settings, session, engine.kind)
    suites = gate.prepare(settings, context)
    parent_evals = evaluate_parent(session, cycle_id, engine, parent, parent_ref, suites, context)
    info["gate_keys"] = {p.name: p.key for p in suites}
    _check_deadline(deadline, "evaluating the parent")

    # The parent as a trainable policy.
    _torch_threads(t)
    placement = resolve_placement(t.hardware)
    model, tokenizer, base_model = ckpt.load_trainable(parent_ref, t.mode, t.lora, t.step.seed, placement)

    # Advantages and the update.
    registry.merge_cycle_metrics(session, cycle_id, {"phase": "train"})
    step_samples, adv = prepare_batch(samples, model, tokenizer, t, registry.latest_baseline_state(session))
    info |= {"advantages": adv.stats, "too_long": len(samples) - len(step_samples)}
    if not step_samples:
        raise SkipCycle("no sample fits the model's context", info)

    def on_step(step_metrics: dict[str, float]) -> None:
        metrics.on_step(step_metrics)
        registry.merge_cycle_metrics(session, cycle_id, {"step": int(step_metrics["step"]) + 1})

    result, model = train(model, tokenizer, step_samples, parent_ref, base_model, t, deadline, on_step, root)
    _check_deadline(deadline, "after training")

    # Stage the files, gate what was written, publish, register.
    registry.merge_cycle_metrics(session, cycle_id, {"phase": "gate"})
    sample_hash = ckpt.sample_ids_hash(selection.ids)
    config = training_config(t)
    cfg_hash = ckpt.config_hash(config)
    digest = hashlib.sha256(f"{parent.policy_version}:{sample_hash}:{cfg_hash}".encode()).hexdigest()[:8]
    checkpoint_id = f"c{cycle_id:06d}-{digest}"
    tmp = ckpt.stage(model, tokenizer, root, checkpoint_id)
    del model
    try:
        # The gate's replica reads the staged folder (full weights are reloaded from it, a LoRA
        # adapter is loaded from it and unloaded again) before publish renames it.
        staged = PolicyRef(checkpoint_id, checkpoint_id, str(tmp), t.mode, base_model)
        with engine.serve(staged) as served:
            candidate_evals = gate.evaluate_all(served, suites, context)
        decision = gate.decide_suites(suites, candidate_evals, parent_evals)
        _check_deadline(deadline, "gating")
        status = "candidate" if decision.passed else "rejected"
        summary = {
            **info,
            **result.summary(),
            "samples": len(step_samples),
            "gate_candidate_success": decision.candidate.success_rate,
            "gate_parent_success": decision.parent.success_rate if decision.parent is not None else None,
            "gate_suites": {
                v.suite: {"candidate": v.candidate.success_rate, "parent": v.parent.success_rate, "passed": v.passed}
                for v in decision.suites or []
            },
        }
        sidecar = ckpt.CheckpointSidecar(
            checkpoint_id=checkpoint_id,
            policy_version=checkpoint_id,
            parent_id=parent.id,
            parent_policy_version=parent.policy_version,
            format=t.mode,
            base_model=base_model,
            cycle_id=cycle_id,
            data_window_start=window.start,
            data_window_end=window.end,
            n_samples=len(step_samples),
            sample_ids=[s.sample_id for s in step_samples],
            sample_ids_hash=ckpt.sample_ids_hash(s.sample_id for s in step_samples),
            config_hash=cfg_hash,
            config=config,
            metrics=summary,
            steps=result.steps,
            baseline_state=adv.state.to_dict(),
            gate=decision,
            status=status,
            versions=_versions(),
        )
        registry.merge_cycle_metrics(session, cycle_id, {"phase": "publish"})
        path = ckpt.publish(tmp, sidecar, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    registry.add_checkpoint(
        session,
        sidecar,
        path,
        decision.reason,
        CheckpointEval(heldout={p.key: candidate_evals[p.name] for p in suites}, gate=decision),
    )
    registry.update_cycle(
        session,
        cycle_id,
        commit=False,
        status=status,
        reason=decision.reason,
        checkpoint_id=checkpoint_id,
        sample_ids=sidecar.sample_ids,
        metrics=summary | {"phase": "done"},
    )
    session.commit()
    log.info("cycle %d: %s %s (%s)", cycle_id, status, checkpoint_id, decision.reason)
    return CycleOutcome(cycle_id, status, decision.reason, checkpoint_id, checkpoint_id, summary)


# --------------------------------------------------------------------------- pieces


def evaluate_parent(
    session: Session,
    cycle_id: int,
    engine: VllmEngine,
    parent: Any,
    parent_ref: PolicyRef,
    suites: list[gate.PreparedSuite],
    context: EvalContext,
) -> dict[str, HeldoutResult]:
    """The parent's result of every prepared suite: cached in its registry row under the suite's key, else
    evaluated through ``engine`` (loading the parent once) and cached."""
    results: dict[str, HeldoutResult] = {}
    missing = []
    for p in suites:
        cached = registry.cached_eval(parent, p.key)
        if cached is not None:
            results[p.name] = cached
        else:
            missing.append(p)
    if missing:
        registry.merge_cycle_metrics(session, cycle_id, {"phase": "gate-parent"})

        def cache(p: gate.PreparedSuite, result: HeldoutResult) -> None:
            registry.cache_eval(session, parent.id, p.key, result)

        with engine.serve(parent_ref) as served:
            results |= gate.evaluate_all(served, missing, context, on_result=cache)
    return results


def parent_checkpoint_id(session: Session, t: TrainerSettings, base_id: str) -> str:
    """What this cycle trains from (``trainer.parent``)."""
    if t.parent == "latest":
        return registry.latest_trained_id(session) or registry.stable_checkpoint_id(session) or base_id
    stable = registry.stable_checkpoint_id(session) or base_id
    if t.parent == "lineage":
        return registry.lineage_tip_id(session, stable)
    return stable


def prepare_batch(
    samples: list[StoredSample],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    t: TrainerSettings,
    baseline_state: dict[str, Any],
) -> tuple[list[StepSample], AdvantageResult]:
    """Advantages for ``samples`` and the step's view of them (samples beyond the context are dropped)."""
    limit = int(getattr(model.config, "max_position_embeddings", 10**9))
    fitting = [s for s in samples if len(s.prompt_token_ids) + len(s.completion_token_ids) <= limit]
    provisional = [_step_sample(s, 0.0) for s in fitting]
    features = None
    if t.advantages.baseline == "value":
        features = prompt_features(model, provisional, t.step, tokenizer.pad_token_id or 0)
    adv = compute_advantages(
        [AdvInput(s.episode, s.group_key, s.task, s.reward) for s in fitting],
        t.advantages,
        BaselineState.from_dict(baseline_state),
        features,
    )
    return [_step_sample(s, a) for s, a in zip(fitting, adv.advantages)], adv


def _step_sample(s: StoredSample, advantage: float) -> StepSample:
    """The step's view of a stored sample, with the distribution it was sampled from (selection has
    already dropped the samples whose sampling the trainer cannot reproduce)."""
    return StepSample(
        s.id,
        s.prompt_token_ids,
        s.completion_token_ids,
        s.loss_mask,
        s.behaviour_logprobs,
        advantage,
        s.reward,
        TokenSampling.from_params(s.sampling),
    )


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    samples: list[StepSample],
    parent: PolicyRef,
    base_model: str,
    t: TrainerSettings,
    deadline: float,
    on_step: Callable[[dict[str, float]], None],
    root: Path,
) -> tuple[TrainResult, PreTrainedModel]:
    """The update, in this process or under torchrun; returns the result and the trained model."""
    pad_id = tokenizer.pad_token_id or 0
    if t.distributed.nproc_per_node == 1:
        result = train_on_batch(model, samples, t.step, t.loss, pad_id, deadline=deadline, on_step=on_step)
        return result, model
    # The workers load the parent themselves: release this process's copy (in place, so the
    # caller's reference holds no storage either; on a GPU it would sit beside the workers).
    model.to("meta")
    del model
    _release_device_memory()
    remaining = max(deadline - time.monotonic(), 1.0)
    result, trained_dir = distributed.launch(parent, samples, t, root, timeout_s=remaining)
    try:
        trained, _ = ckpt.load_policy(trained_dir, t.mode, base_model, trainable=False)
    finally:
        shutil.rmtree(trained_dir.parent, ignore_errors=True)
    for step_metrics in result.steps:
        on_step(step_metrics)
    return result, trained


def _release_device_memory() -> None:
    """Return cached CUDA blocks to the device (nothing without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def training_config(t: TrainerSettings) -> dict[str, Any]:
    """The settings that shape the update (hashed into the checkpoint)."""
    return t.model_dump(mode="json", exclude=OPERATIONAL_FIELDS)


def failure_reason(exc: BaseException, t: TrainerSettings) -> str:
    """A one-line reason for a failed cycle."""
    if isinstance(exc, CycleTimeout) or type(exc).__name__ in ("SoftTimeLimitExceeded", "TimeLimitExceeded"):
        return f"time limit ({t.schedule.time_limit_s:g} s): {exc}"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return f"interrupted ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"[:2000]


def _check_deadline(deadline: float, where: str) -> None:
    if time.monotonic() > deadline:
        raise CycleTimeout(f"time limit reached {where}")


def _torch_threads(t: TrainerSettings) -> None:
    if t.step.torch_threads is not None:
        import torch

        torch.set_num_threads(t.step.torch_threads)


def _export(session: Session, metrics: TrainerMetrics, status: str, summary: dict[str, Any]) -> None:
    """Write the Prometheus text file: this cycle's summary and the registry's cycle counts."""
    metrics.on_cycle(status, summary, registry.cycle_counts(session), time.time())


def _outcome_of(row: TrainingCycle, replayed: bool) -> CycleOutcome:
    return CycleOutcome(
        row.id, row.status, row.reason, row.checkpoint_id, row.checkpoint_id, dict(row.metrics or {}), replayed
    )


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _versions() -> dict[str, str]:
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
