"""Settings: the trainer.

One section per concern; every field is ``FLYWHEEL_TRAINER__<SECTION>__<FIELD>``
(``FLYWHEEL_TRAINER__SCHEDULE__INTERVAL_S=30``, ``FLYWHEEL_TRAINER__LORA__RANK=16``), and the
two top-level choices ``FLYWHEEL_TRAINER__MODE`` and ``FLYWHEEL_TRAINER__PARENT``. The trainer
reads these models directly (``trainer.step`` takes ``step`` and ``loss``, ``trainer.ckpt``
takes ``lora``, ...). An unknown field is refused, so a misspelt variable (or one of the flat
names used before the sections, such as ``FLYWHEEL_TRAINER__GATE_MARGIN``) fails loudly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

STRICT = ConfigDict(extra="forbid")


class ScheduleSettings(BaseModel):
    """When cycles run: the beat interval, the time limit and the Celery queue."""

    model_config = STRICT

    interval_s: float = Field(3600.0, ge=1.0, le=7 * 86400.0)
    """Interval of the beat schedule between training cycles."""
    time_limit_s: float = Field(1800.0, ge=10.0, le=86400.0)
    """Longest one cycle may run; beyond it the cycle is ``failed: time limit``."""
    queue: str = Field("trainer", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Celery queue of the training task."""


class DataSettings(BaseModel):
    """Which scored samples a cycle trains on (``trainer.select``)."""

    model_config = STRICT

    min_samples: int = Field(64, ge=1, le=1_000_000)
    """Fewest trainable samples a cycle trains on; below it the cycle is skipped with the counts."""
    max_samples: int = Field(1024, ge=1, le=1_000_000)
    """Most samples a cycle trains on (the newest are kept)."""
    max_policy_lag: int = Field(1, ge=0, le=1000)
    """Staleness bound: samples from serving versions or up to this many ancestors of them."""
    window_settle_s: float = Field(2.0, ge=0.0, le=3600.0)
    """The data window ends this long before the cycle starts, so rows still being committed are not skipped."""
    trainable_roles: list[str] = Field(default_factory=lambda: ["agent", "orchestrator"], min_length=1)
    """Agent roles whose tokens are trained; other roles (frozen sub-agents) carry no gradient."""

    @model_validator(mode="after")
    def _sample_bounds(self) -> DataSettings:
        if self.min_samples > self.max_samples:
            raise ValueError("trainer.data.min_samples must not exceed trainer.data.max_samples")
        return self


class AdvantageSettings(BaseModel):
    """How advantages are estimated (``trainer.advantages``)."""

    model_config = STRICT

    group: Literal["rloo", "grpo"] = "rloo"
    """Group-relative estimator where a group key has several episodes."""
    baseline: Literal["running_mean", "value"] = "running_mean"
    """Baseline elsewhere: a running mean per task kind, or a learned (ridge, leave-one-out) value."""
    norm: Literal["none", "batch"] = "batch"
    """Scale the advantages by their batch standard deviation."""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of the running-mean baseline across cycles."""
    value_l2: float = Field(1.0, gt=0.0, le=1e6)
    """Ridge penalty of the learned value baseline."""


class LossSettings(BaseModel):
    """The per-token policy-gradient loss (``trainer.loss``)."""

    model_config = STRICT

    kind: Literal["cispo", "ppo"] = "cispo"
    """CISPO (truncated, stop-gradient importance weight on log-prob) or PPO-clip."""
    is_ratio_min: float = Field(0.0, ge=0.0, le=1.0)
    """CISPO: lower truncation of the importance ratio (0 = none)."""
    is_ratio_max: float = Field(2.0, gt=1.0, le=100.0)
    """CISPO: upper truncation of the importance ratio."""
    ppo_clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO: the ratio is clipped below at 1 - ppo_clip_low."""
    ppo_clip_high: float = Field(0.28, gt=0.0, le=10.0)
    """PPO: the ratio is clipped above at 1 + ppo_clip_high."""
    kl_coef: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the k3 KL estimate to the parent checkpoint; 0 disables it."""


class StepSettings(BaseModel):
    """The update of one cycle (``trainer.step``): AdamW, batches, packing, seed, log-prob temperature."""

    model_config = STRICT

    learning_rate: float = Field(2e-4, gt=0.0, le=1.0)
    """AdamW learning rate (constant within a cycle)."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over the cycle's batch."""
    mini_batch_samples: int = Field(64, ge=1, le=100_000)
    """Samples per optimizer step."""
    micro_batch_tokens: int = Field(8192, ge=64, le=10_000_000)
    """Most tokens in one forward/backward; an optimizer step accumulates gradients over micro-batches."""
    pack_row_tokens: int = Field(256, ge=16, le=1_000_000)
    """Sequences are packed (no padding between them) into rows of at most this many tokens."""
    grad_clip: float = Field(1.0, gt=0.0, le=1e6)
    """Gradient norm clipping."""
    seed: int = Field(0, ge=0)
    """Seed of the sample order, LoRA initialisation and dropout."""
    sampling_temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Temperature assumed for samples that recorded none (each sample's own recorded temperature, top-k,
    top-p and min-p define the distribution its log-probs are under; see docs/trainer.md). The gate samples with it."""
    torch_threads: int | None = Field(None, ge=1, le=512)
    """torch intra-op threads; None keeps torch's default."""
    show_progress: bool = True
    """Show a progress bar over the optimizer steps."""


class LoraSettings(BaseModel):
    """The LoRA adapter trained in ``mode="lora"`` (peft)."""

    model_config = STRICT

    rank: int = Field(8, ge=1, le=256)
    """LoRA rank."""
    alpha: float = Field(16.0, gt=0.0, le=1024.0)
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA path."""
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1)
    """Module names that get LoRA adapters; ``["all-linear"]`` (peft's shorthand): every linear (and GPT-2
    ``Conv1D``) layer except the output head, whatever the architecture."""

    @model_validator(mode="after")
    def _all_linear_alone(self) -> LoraSettings:
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError("trainer.lora.target_modules: 'all-linear' cannot be combined with module names")
        return self


class DistributedSettings(BaseModel):
    """The step under torchrun (``trainer.distributed``)."""

    model_config = STRICT

    nproc_per_node: int = Field(1, ge=1, le=64)
    """Processes of the training step; above 1 the step runs under torchrun."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the step is parallelised under torchrun."""


class HardwareSettings(BaseModel):
    """Where and in which precision the policy trains (``trainer.parallel``).

    ``device`` and ``gradient_checkpointing`` are operational (left out of the config hash: they change
    speed and memory, not the update); ``dtype`` shapes the update (bf16 compute rounds differently) and is
    hashed as written, so ``auto`` hashes as ``auto`` whatever it resolved to.
    """

    model_config = STRICT

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when torch sees a GPU, else the CPU. ``cuda`` without a GPU is refused at load."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision. ``auto``: bfloat16 on CUDA, float32 on the CPU. Trained weights and their AdamW
    state stay float32 either way; with bfloat16 the forward runs under autocast (one process) or FSDP2
    gathers bfloat16 copies (torchrun), and a LoRA adapter's frozen base is stored in bfloat16."""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Recompute each decoder layer's activations in the backward (non-reentrant). ``auto``: on for CUDA."""


class GateSettings(BaseModel):
    """The eval gate: the eval suites that measure a candidate against its parent, each with its tolerated
    regression, and the inference engine (a vLLM replica of the gate's own) they run through."""

    model_config = STRICT

    run: list[str] = Field(default_factory=lambda: ["arith", "replay"], min_length=1, max_length=32)
    """Eval suites the gate runs, in order (``FLYWHEEL_TRAINER__GATE__RUN='["arith","replay"]'``), each a
    plug-in of the ``flywheel.eval_suites`` entry-point group; a candidate passes only if none regresses
    beyond its margin. The first one is the checkpoint's headline held-out success."""
    margin: float = Field(0.05, ge=0.0, le=1.0)
    """A suite's margin unless its section sets one: a candidate may score at most this much below its parent."""
    suites: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Settings of each eval suite by name (``FLYWHEEL_TRAINER__GATE__SUITES__ARITH__N=100``), validated
    against the suite's own ``Settings`` model when the gate runs; a suite left out runs with its defaults.
    The key ``margin`` (``FLYWHEEL_TRAINER__GATE__SUITES__REPLAY__MARGIN=0.08``) is that suite's margin."""
    holdout_per_mille: int = Field(50, ge=0, le=1000)
    """Production sessions held out of training for the replay suite: those whose
    ``sha256(project/session_id)`` falls in the first this-many of 1000 buckets (0 holds none out)."""
    engine_url: str | None = None
    """Base URL (``http://host:port``, no ``/v1``) of the gate's vLLM replica, started with development mode
    (``VLLM_SERVER_DEV_MODE=1``) and runtime LoRA loading; the gate loads each policy it evaluates into it.
    The local stack starts one and passes it (``FLYWHEEL_TRAINER__GATE__ENGINE_URL``)."""
    local_port: int = Field(18190, ge=1024, le=65000)
    """Port of the local stack's gate replica (loopback only)."""
    concurrency: int = Field(16, ge=1, le=1024)
    """Requests the gate keeps in flight against its replica."""
    request_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """Longest one generation request of the gate may take."""

    @model_validator(mode="after")
    def _suites_named_once(self) -> GateSettings:
        twice = sorted({name for name in self.run if self.run.count(name) > 1})
        if twice:
            raise ValueError(f"trainer.gate.run names {twice} more than once")
        return self


class CheckpointSettings(BaseModel):
    """Where checkpoints are written and how many are kept (``trainer.ckpt``, retention)."""

    model_config = STRICT

    dir: Path = Path(".flywheel/checkpoints")
    """Where checkpoints are written, one folder per checkpoint id (owned by one registry)."""
    keep_latest: int = Field(3, ge=1, le=1000)
    """Retention keeps this many newest checkpoints."""
    keep_deployed_days: float = Field(7.0, ge=0.0, le=3650.0)
    """Retention keeps every checkpoint deployed now or within this many days."""


class MetricsSettings(BaseModel):
    """The trainer's Prometheus metrics (``trainer.metrics``)."""

    model_config = STRICT

    port: int | None = Field(None, ge=1, le=65535)
    """Port of the worker's Prometheus endpoint; None disables it."""
    textfile: Path = Path(".flywheel/run/trainer.prom")
    """Prometheus text file rewritten after every step and cycle (node-exporter textfile format)."""


class TrainerSettings(BaseModel):
    """The trainer: schedule, data selection, the update, checkpoints and the eval gate."""

    model_config = STRICT

    mode: Literal["full", "lora"] = "full"
    """Train every weight, or a LoRA adapter (peft) over the parent's base."""
    parent: Literal["stable", "latest", "lineage"] = "stable"
    """What a cycle trains from: the stable deployment's checkpoint (else the base); the newest candidate;
    or ``lineage``: the newest checkpoint descending from the stable through checkpoints still on trial
    (gated candidates never deployed, and the active canary), so training goes on while a canary is judged
    and a rolled-back lineage is dropped (``trainer.registry.pending_lineage_tip``)."""
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    """Beat interval, time limit, queue."""
    data: DataSettings = Field(default_factory=DataSettings)
    """Data selection and staleness."""
    advantages: AdvantageSettings = Field(default_factory=AdvantageSettings)
    """Advantage estimation."""
    loss: LossSettings = Field(default_factory=LossSettings)
    """The policy-gradient loss."""
    step: StepSettings = Field(default_factory=StepSettings)
    """The update: optimizer, batches, packing."""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """LoRA hyper-parameters (``mode="lora"``)."""
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    """torchrun processes and strategy."""
    hardware: HardwareSettings = Field(default_factory=HardwareSettings)
    """Device, precision and gradient checkpointing."""
    gate: GateSettings = Field(default_factory=GateSettings)
    """The eval gate and its suite."""
    checkpoints: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Checkpoint folder and retention."""
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """Prometheus endpoint and text file."""
