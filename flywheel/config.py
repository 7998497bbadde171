"""Typed settings for every Flywheel service.

Environment variables are read here and nowhere else. Every field can be set as
``FLYWHEEL_<SECTION>__<FIELD>`` (for example ``FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS``),
or in a ``.env`` file in the working directory.

A field left at ``None`` where an external service could be named means "the local
stack provides it": ``flywheel up`` starts (or finds) the component and records where
it lives in the run folder's ``stack.json``.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "password", "admin", ""}


class KafkaSettings(BaseModel):
    """The Kafka-protocol broker that carries session events."""

    bootstrap_servers: str | None = None
    """Existing broker(s), ``host:port[,host:port]``; ``None`` starts Tansu locally."""
    local_port: int = Field(19092, ge=1024, le=65535)
    """Port of the locally started Tansu broker (loopback only)."""
    topic_prefix: str = Field("flywheel", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Prefix of every topic name, so several deployments can share one broker."""


class PostgresSettings(BaseModel):
    """The Postgres database that holds events, rewards, samples and the registry."""

    url: str | None = None
    """SQLAlchemy URL of an existing database; ``None`` uses the machine's server or an embedded one."""
    host: str = "127.0.0.1"
    """Host of the machine's Postgres server, tried first when ``url`` is unset."""
    port: int = Field(5432, ge=1, le=65535)
    """Port of the machine's Postgres server."""
    user: str = "postgres"
    """Role used on the machine's (trust-auth) server or the embedded one."""
    database: str = Field("flywheel", pattern=r"^[a-z_][a-z0-9_]*$")
    """Database name; created if missing."""
    embedded_port: int = Field(15432, ge=1024, le=65535)
    """Port of the embedded server started when no server is reachable."""


class RedisSettings(BaseModel):
    """Redis, the Celery broker and result backend."""

    url: str | None = None
    """URL of an existing Redis; ``None`` uses the machine's at 127.0.0.1:6379 or starts one."""
    host: str = "127.0.0.1"
    """Host of the machine's Redis, tried first when ``url`` is unset."""
    port: int = Field(6379, ge=1, le=65535)
    """Port of the machine's Redis."""
    local_port: int = Field(16379, ge=1024, le=65535)
    """Port of the Redis that the stack starts when none is reachable."""


class VllmSettings(BaseModel):
    """The vLLM fleet that serves the policy."""

    urls: list[str] = Field(default_factory=list)
    """Existing replicas (``http://host:port``); empty starts ``replicas`` local servers."""
    replicas: int = Field(1, ge=0, le=8)
    """Number of local replicas to start when ``urls`` is empty."""
    base_port: int = Field(18100, ge=1024, le=65000)
    """Port of the first local replica; replica i listens on base_port + i (loopback only)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weight dtype passed to vLLM."""
    max_model_len: int = Field(256, ge=32, le=32768)
    """Context length passed to vLLM."""
    kv_cache_gib: int = Field(1, ge=1, le=64)
    """CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    startup_timeout_s: float = Field(240.0, gt=0, le=3600)
    """How long to wait for a replica's /health before declaring it failed."""
    enable_lora: bool = False
    """Start replicas with runtime LoRA adapter loading."""
    max_lora_rank: int = Field(16, ge=1, le=256)
    """Largest LoRA rank a replica accepts."""
    cpu_binding: Literal["spread", "auto", "nobind"] = "spread"
    """vllm-cpu worker pinning (VLLM_CPU_OMP_THREADS_BIND): ``spread`` pins local replica i to the
    i-th usable core (round robin); ``auto`` is vLLM's own choice, which pins every replica of a
    machine to the same first core (measured here: a second replica's worker then starved the
    first one for minutes); ``nobind`` leaves scheduling to the OS."""
    nice: int = Field(0, ge=0, le=19)
    """Niceness of local replicas (their engine and worker processes inherit it): above 0,
    serving yields the CPU to the trainer and the other services of a shared machine. Two
    demo runs here (two replicas, two cores) differed little: training cycles of 345/496 s
    at 0 and 320/457 s at 10; production gives replicas machines of their own."""


class ModelSettings(BaseModel):
    """The small Llama-architecture base model built offline by ``flywheel model build``."""

    cache_dir: Path = Path(".flywheel/models")
    """Where built models are cached, one folder per build key."""
    seed: int = Field(0, ge=0)
    """Seed of the corpus, tokenizer, initialisation and pre-training."""
    hidden_size: int = Field(128, ge=64, le=4096)
    """Model width."""
    num_layers: int = Field(2, ge=1, le=48)
    """Number of decoder layers."""
    num_heads: int = Field(2, ge=1, le=64)
    """Attention heads; hidden_size / num_heads must be >= 64 (vLLM CPU attention)."""
    num_kv_heads: int = Field(1, ge=1, le=64)
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = Field(512, ge=128, le=65536)
    """Byte-level BPE vocabulary size."""
    pretrain_steps: int = Field(1200, ge=0, le=100000)
    """Supervised pre-training steps on the synthetic task's corpus."""

    @model_validator(mode="after")
    def _head_dim(self) -> ModelSettings:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_heads")
        if self.hidden_size // self.num_heads < 64:
            raise ValueError(
                f"model head_dim {self.hidden_size // self.num_heads} < 64: vLLM's CPU attention rejects it"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be divisible by model.num_kv_heads")
        return self


class IngestSettings(BaseModel):
    """Topics, the Kafka-to-Postgres consumer and the HTTP gateway."""

    partitions: int = Field(4, ge=1, le=1024)
    """Partitions of the events topic (created at start if missing)."""
    replication_factor: int = Field(1, ge=1, le=7)
    """Replication factor of created topics."""
    retention_hours: int = Field(168, ge=1, le=87600)
    """Retention of the events topic."""
    group_id: str = Field("flywheel-ingest", min_length=1, max_length=128)
    """Consumer group of the Postgres writers; scale out by starting more consumers."""
    batch_max_events: int = Field(1000, ge=1, le=100000)
    """Most events written to Postgres in one transaction."""
    batch_max_wait_ms: int = Field(200, ge=1, le=60000)
    """Longest a partial batch waits before it is written."""
    max_poll_interval_ms: int = Field(30000, ge=1000, le=3600000)
    """Kafka max.poll.interval (Tansu's first join waits this long: keep it small in tests)."""
    gateway_host: str = "127.0.0.1"
    """Address the HTTP gateway binds."""
    gateway_port: int = Field(18080, ge=1, le=65535)
    """Port of the HTTP gateway."""
    max_body_bytes: int = Field(5_000_000, ge=1024, le=100_000_000)
    """Largest request body the gateway reads (413 beyond)."""
    max_event_bytes: int = Field(1_000_000, ge=256, le=50_000_000)
    """Largest single event, serialized (rejected beyond)."""
    max_batch_events: int = Field(1000, ge=1, le=100000)
    """Most events in one gateway request."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the consumer's Prometheus endpoint; None disables it."""
    metrics_host: str = "127.0.0.1"
    """Address the consumer's Prometheus endpoint binds."""
    check_crcs: bool = False
    """Verify Kafka record CRCs in the consumer. Off by default, as in librdkafka: kafka-python
    checks them in pure Python (~90 % of consume time without the crc32c extension), TCP and
    the broker already protect the bytes, and every record is validated against its contract."""
    key_cache_ttl_s: float = Field(10.0, ge=0, le=3600)
    """How long the gateway caches a write-key lookup (a revocation takes effect within it)."""
    feedback_retry_s: float = Field(5.0, ge=0.05, le=3600)
    """First wait before the consumer looks again for the completion of unattached feedback (feedback by
    completion id alone whose completion was not stored yet); it doubles per attempt up to feedback_retry_max_s."""
    feedback_retry_max_s: float = Field(300.0, ge=0.05, le=86400)
    """Longest wait between two lookups of a pending feedback's completion."""
    feedback_report_after_s: float = Field(3600.0, ge=0, le=30 * 86400)
    """How long unattached feedback may wait for its completion before it is reported as
    ``unknown_completion`` (logged, counted, listed by ``flywheel-ingest report``); it is kept and still retried."""
    completion_window_s: float = Field(86400.0, ge=1, le=365 * 86400)
    """A pending feedback's completion is searched among completions that occurred within this long of the
    time in its UUIDv7 completion id (the SDK mints the id when it logs the completion)."""
    feedback_sweep_max: int = Field(500, ge=1, le=100000)
    """Most pending feedback rows one lookup round handles."""


class TrainerSettings(BaseModel):
    """The trainer: schedule, data selection, the update, checkpoints and the eval gate."""

    schedule_seconds: float = Field(3600.0, ge=1.0, le=7 * 86400.0)
    """Interval of the beat schedule between training cycles."""
    time_limit_s: float = Field(1800.0, ge=10.0, le=86400.0)
    """Longest one cycle may run; beyond it the cycle is ``failed: time limit``."""
    queue: str = Field("trainer", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Celery queue of the training task."""
    checkpoint_dir: Path = Path(".flywheel/checkpoints")
    """Where checkpoints are written, one folder per checkpoint id (owned by one registry)."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the worker's Prometheus endpoint; None disables it."""
    metrics_textfile: Path = Path(".flywheel/run/trainer.prom")
    """Prometheus text file rewritten after every step and cycle (node-exporter textfile format)."""
    parent: Literal["stable", "latest", "lineage"] = "stable"
    """What a cycle trains from: the stable deployment's checkpoint (else the base); the newest candidate;
    or ``lineage``: the newest checkpoint descending from the stable through checkpoints still on trial
    (gated candidates and the active canary), so training goes on while a canary is judged and a rolled-back
    lineage is dropped (``trainer.registry.pending_lineage_tip``)."""
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
    mode: Literal["full", "lora"] = "full"
    """Train every weight, or a LoRA adapter (peft) over the parent's base."""
    lora_rank: int = Field(8, ge=1, le=256)
    """LoRA rank."""
    lora_alpha: float = Field(16.0, gt=0.0, le=1024.0)
    """LoRA scaling numerator (scale = alpha / rank)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA path."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Module names that get LoRA adapters."""
    loss: Literal["cispo", "ppo"] = "cispo"
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
    sampling_temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Temperature serving sampled with; logits are divided by it before log-probs."""
    advantage_group: Literal["rloo", "grpo"] = "rloo"
    """Group-relative estimator where a group key has several episodes."""
    advantage_baseline: Literal["running_mean", "value"] = "running_mean"
    """Baseline elsewhere: a running mean per task kind, or a learned (ridge, leave-one-out) value."""
    advantage_norm: Literal["none", "batch"] = "batch"
    """Scale the advantages by their batch standard deviation."""
    baseline_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of the running-mean baseline across cycles."""
    value_l2: float = Field(1.0, gt=0.0, le=1e6)
    """Ridge penalty of the learned value baseline."""
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
    torch_threads: int | None = Field(None, ge=1, le=512)
    """torch intra-op threads; None keeps torch's default."""
    nproc_per_node: int = Field(1, ge=1, le=64)
    """Processes of the training step; above 1 the step runs under torchrun."""
    distributed_strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the step is parallelised under torchrun."""
    show_progress: bool = True
    """Show a progress bar over the optimizer steps."""
    gate_n: int = Field(200, ge=1, le=100_000)
    """Held-out problems the eval gate runs (the same ones for candidate and parent)."""
    gate_seed: int = Field(1234, ge=0)
    """Seed of the gate's problems and sampling."""
    gate_margin: float = Field(0.05, ge=0.0, le=1.0)
    """A candidate may be at most this much worse (held-out success rate) than its parent."""
    gate_max_new_tokens: int = Field(24, ge=1, le=4096)
    """Longest turn the gate generates."""
    gate_batch_size: int = Field(200, ge=1, le=100_000)
    """Episodes the gate runs in lock step."""
    keep_latest: int = Field(3, ge=1, le=1000)
    """Retention keeps this many newest checkpoints."""
    keep_deployed_days: float = Field(7.0, ge=0.0, le=3650.0)
    """Retention keeps every checkpoint deployed now or within this many days."""

    @model_validator(mode="after")
    def _sample_bounds(self) -> TrainerSettings:
        if self.min_samples > self.max_samples:
            raise ValueError("trainer.min_samples must not exceed trainer.max_samples")
        return self


class OutcomeRule(BaseModel):
    """How one named Outcome event's value maps to a reward."""

    kind: Literal["bool", "linear", "threshold"] = "bool"
    """``bool``: true/false values; ``linear``: scale * value + offset; ``threshold``: above/below a bound."""
    true_value: float = Field(1.0, ge=-1e6, le=1e6)
    """``bool``: reward of a true (or non-zero) value."""
    false_value: float = Field(0.0, ge=-1e6, le=1e6)
    """``bool``: reward of a false (or zero) value."""
    scale: float = Field(1.0, ge=-1e6, le=1e6)
    """``linear``: multiplier of the value."""
    offset: float = Field(0.0, ge=-1e6, le=1e6)
    """``linear``: added after scaling."""
    threshold: float = Field(0.0, ge=-1e12, le=1e12)
    """``threshold``: values at or above it earn ``above_value``."""
    above_value: float = Field(1.0, ge=-1e6, le=1e6)
    """``threshold``: reward at or above the threshold."""
    below_value: float = Field(0.0, ge=-1e6, le=1e6)
    """``threshold``: reward below the threshold."""
    clip_min: float = Field(-1e6, ge=-1e6, le=1e6)
    """Lowest reward this rule gives."""
    clip_max: float = Field(1e6, ge=-1e6, le=1e6)
    """Highest reward this rule gives."""


def _default_outcome_rules() -> dict[str, OutcomeRule]:
    return {"task_solved": OutcomeRule(), "tests_passed": OutcomeRule()}


class OutcomeExtractorSettings(BaseModel):
    """Verifiable outcomes (tests passed, task solved, a metric) mapped to reward."""

    rules: dict[str, OutcomeRule] = Field(default_factory=_default_outcome_rules)
    """Outcome name -> rule; outcomes without a rule are ignored (and listed in the components)."""
    combine: Literal["mean", "min", "max", "sum"] = "mean"
    """How the rewards of several configured outcomes in one session are combined."""


class SignalRule(BaseModel):
    """One user signal: its weight and the window in which it counts."""

    weight: float = Field(0.0, ge=-100.0, le=100.0)
    """Reward per occurrence (``edit``: per unit of edit ratio; ``score``: per unit of score)."""
    window_s: float | None = Field(None, gt=0.0, le=365 * 86400.0)
    """The signal counts only if it occurred within this many seconds after the session end; None: any time."""


class UserSignalSettings(BaseModel):
    """What the user did with the agent's work; each kind counts once per target (its latest occurrence)."""

    accept: SignalRule = Field(default_factory=lambda: SignalRule(weight=1.0))
    """The user accepted the work."""
    reject: SignalRule = Field(default_factory=lambda: SignalRule(weight=-1.0))
    """The user rejected it."""
    revert: SignalRule = Field(default_factory=lambda: SignalRule(weight=-1.0, window_s=600.0))
    """The user reverted it ("reverted within 10 minutes")."""
    edit: SignalRule = Field(default_factory=lambda: SignalRule(weight=-0.5))
    """The user changed part of it; the term is weight * edit_ratio."""
    persisted: SignalRule = Field(default_factory=lambda: SignalRule(weight=0.5))
    """The work survived unchanged for at least ``persisted_min_minutes``."""
    persisted_min_minutes: float = Field(30.0, ge=0.0, le=525_600.0)
    """How long the work must survive to count as persisted ("persisted after 30 minutes")."""
    follow_up: SignalRule = Field(default_factory=lambda: SignalRule(weight=-0.5, window_s=3600.0))
    """A dissatisfied follow-up (the user asked again or said it was wrong)."""
    score: SignalRule = Field(default_factory=lambda: SignalRule(weight=0.0))
    """A free score given by the user; the term is weight * score."""
    clip: float = Field(2.0, gt=0.0, le=1e6)
    """The summed signal is clipped to [-clip, clip], so stacking signals cannot run away."""


class RubricSettings(BaseModel):
    """One judge rubric: a prompt and the strict answer format it demands."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """Rubric name, a key in the components."""
    prompt: str = Field(min_length=1, max_length=20_000)
    """User message sent to the judge; ``{transcript}`` is replaced by the session transcript."""
    pattern: str = Field(r"SCORE: ([1-5])", min_length=1, max_length=512)
    """Regex the whole stripped answer must match; group 1 is the score. Anything else is a failure."""
    min_score: float = Field(1.0, ge=-1e6, le=1e6)
    """Lowest score the format allows (normalised to 0)."""
    max_score: float = Field(5.0, ge=-1e6, le=1e6)
    """Highest score the format allows (normalised to 1)."""

    @model_validator(mode="after")
    def _range(self) -> RubricSettings:
        if self.max_score <= self.min_score:
            raise ValueError("rubric max_score must exceed min_score")
        return self


def _default_rubrics() -> list[RubricSettings]:
    return [
        RubricSettings(
            name="correctness",
            prompt="Rate how correct the assistant's final answer is.\n{transcript}\nReply exactly SCORE: N with N 1-5.",
        ),
        RubricSettings(
            name="helpfulness",
            prompt="Rate how helpful the assistant was.\n{transcript}\nReply exactly SCORE: N with N 1-5.",
        ),
    ]


class GrmSettings(BaseModel):
    """Generative reward model: an OpenAI-compatible judge scoring sessions by several rubrics."""

    enabled: bool = False
    """Call the judge; when off the GRM term is absent from every reward."""
    base_url: str | None = None
    """Judge endpoint (``http://host:port``, no ``/v1``); None uses the local stack's first vLLM replica."""
    model: str | None = Field(None, max_length=256)
    """Model name sent to the judge; None asks the endpoint's ``/v1/models`` for its first model."""
    api_key: SecretStr | None = None
    """Bearer token for the judge, if it wants one."""
    rubrics: list[RubricSettings] = Field(default_factory=_default_rubrics, min_length=1, max_length=16)
    """The rubrics; every session is judged by each of them."""
    aggregation: Literal["mean", "median", "min"] = "mean"
    """How the normalised rubric scores are combined."""
    disagreement_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """Rubrics disagree when their normalised scores span more than this."""
    min_valid_rubrics: int = Field(1, ge=1, le=16)
    """Fewest parsed rubric answers for a GRM value; below it the GRM term is a recorded failure."""
    structured_output: bool = True
    """Ask the server (vLLM ``structured_outputs``) to constrain answers to the rubric pattern."""
    max_tokens: int = Field(8, ge=1, le=4096)
    """Longest judge answer."""
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """Judge sampling temperature (0: greedy, so a recompute gets the same answer)."""
    max_transcript_chars: int = Field(400, ge=16, le=1_000_000)
    """The transcript shown to the judge is cut to its last this many characters."""
    timeout_s: float = Field(30.0, gt=0.0, le=600.0)
    """Deadline of one judge request attempt, from sending it to the whole answer read (not per socket read)."""
    retries: int = Field(2, ge=0, le=10)
    """Retries of a request that timed out, failed to connect or got HTTP 429/5xx."""
    retry_backoff_s: float = Field(0.5, ge=0.0, le=60.0)
    """First retry delay; doubled on each further retry."""
    concurrency: int = Field(4, ge=1, le=1024)
    """Most judge requests in flight per worker."""
    cache_size: int = Field(10_000, ge=0, le=10_000_000)
    """Judge answers cached by content hash (model, rubric, prompt); 0 disables the cache."""


class AnnealSettings(BaseModel):
    """A schedule that takes an auxiliary coefficient from its initial value to zero."""

    kind: Literal["constant", "linear", "cosine", "step"] = "linear"
    """Shape of the decay; ``step`` holds the value until the end, then drops to zero."""
    start_at: datetime | None = None
    """When the decay starts (session start time is the clock); None holds the initial value."""
    duration_s: float = Field(14 * 86400.0, gt=0.0, le=3650 * 86400.0)
    """How long the decay takes; after start_at + duration_s the coefficient is zero."""


class ShapingSettings(BaseModel):
    """Auxiliary latency and length penalties, annealed to zero so task success alone is optimised."""

    latency_coef: float = Field(0.02, ge=0.0, le=100.0)
    """Penalty per second of mean completion latency above ``latency_free_s``."""
    latency_free_s: float = Field(2.0, ge=0.0, le=3600.0)
    """Mean completion latency that costs nothing."""
    length_coef: float = Field(0.1, ge=0.0, le=100.0)
    """Penalty per 1000 generated tokens above ``length_free_tokens``."""
    length_free_tokens: int = Field(512, ge=0, le=10_000_000)
    """Generated tokens per session that cost nothing."""
    anneal: AnnealSettings = Field(default_factory=AnnealSettings)
    """Schedule of both coefficients."""


class ParlSettings(BaseModel):
    """Kimi K2.5 PARL: r_perf + lambda1 r_parallel + lambda2 r_finish, minus a critical-steps cost."""

    perf_outcomes: list[str] = Field(default_factory=lambda: ["task_solved"], min_length=1)
    """Outcomes (mapped by the outcome rules) that make r_perf."""
    lambda_parallel: float = Field(0.1, ge=0.0, le=10.0)
    """Initial coefficient of r_parallel (spawning sub-agents, against serial collapse)."""
    lambda_finish: float = Field(0.1, ge=0.0, le=10.0)
    """Initial coefficient of r_finish (sub-tasks completed, against pointless spawning)."""
    parallel_cap: int = Field(4, ge=1, le=1024)
    """Sub-agents at which r_parallel saturates at 1."""
    critical_step_cost: float = Field(0.01, ge=0.0, le=10.0)
    """Cost per critical step (longest chain through the sub-agent tree)."""
    anneal: AnnealSettings = Field(default_factory=AnnealSettings)
    """Schedule of lambda_parallel and lambda_finish."""


class RetrievalSettings(BaseModel):
    """Chroma Context-1: F-beta over returned documents, credit for relevant ones seen, search penalties."""

    returned_outcome: str = Field("retrieval_returned", min_length=1, max_length=128)
    """Outcome whose ``document_ids`` are the documents the agent finally returned."""
    gold_outcome: str = Field("retrieval_gold", min_length=1, max_length=128)
    """Outcome whose ``document_ids`` are the gold (relevant) documents."""
    beta: float = Field(4.0, gt=0.0, le=100.0)
    """F-beta's beta: recall counts beta^2 times as much as precision."""
    encountered_coef: float = Field(0.2, ge=0.0, le=10.0)
    """Weight of the recall of gold documents seen in tool results, even if later pruned."""
    free_prunes: int = Field(2, ge=0, le=10_000)
    """Prune operations that cost nothing."""
    prune_penalty: float = Field(0.05, ge=0.0, le=10.0)
    """Penalty per prune operation beyond ``free_prunes``."""
    search_tools: list[str] = Field(default_factory=lambda: ["search"])
    """Tool names that count as search turns."""
    max_search_turns: int = Field(8, ge=0, le=10_000)
    """Search turns that cost nothing."""
    search_turn_penalty: float = Field(0.02, ge=0.0, le=10.0)
    """Penalty per search turn beyond ``max_search_turns``."""


class SummarySettings(BaseModel):
    """Cursor Composer 2 self-summarisation: a summary inherits credit from how the session continued."""

    credit_coef: float = Field(1.0, ge=0.0, le=10.0)
    """Scale of the credit given to the completion that wrote a summary."""
    baseline: float = Field(0.5, ge=-1e6, le=1e6)
    """Downstream outcome that earns zero credit: better pushes the summary up, worse pushes it down."""
    redo_penalty: float = Field(0.5, ge=0.0, le=10.0)
    """Penalty times the share of later tool calls repeating one made before the summary (lost context)."""


def _default_weights() -> dict[str, float]:
    return {
        "outcome": 1.0,
        "user_signal": 0.5,
        "grm": 0.5,
        "shaping": 1.0,
        "parl": 0.0,
        "retrieval": 0.0,
        "summary": 1.0,
    }


class ScoringSettings(BaseModel):
    """Everything that decides a reward's value; its hash is every reward row's ``config_hash``."""

    weights: dict[str, float] = Field(default_factory=_default_weights)
    """Composite weight per extractor name; 0 (or absent) does not run it."""
    task_weights: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Per session task (SessionStart.task): weights that replace ``weights`` entry by entry."""
    trainable_roles: list[str] = Field(default_factory=lambda: ["agent", "orchestrator"], min_length=1)
    """Span roles whose completion tokens get loss-mask 1; other roles' samples are all-zero masks."""
    outcome: OutcomeExtractorSettings = Field(default_factory=OutcomeExtractorSettings)
    """Outcome extractor."""
    user_signal: UserSignalSettings = Field(default_factory=UserSignalSettings)
    """User-signal extractor."""
    grm: GrmSettings = Field(default_factory=GrmSettings)
    """Judge extractor."""
    shaping: ShapingSettings = Field(default_factory=ShapingSettings)
    """Shaping terms."""
    parl: ParlSettings = Field(default_factory=ParlSettings)
    """Parallel-orchestration (PARL) extractor."""
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    """Retrieval (Context-1) extractor."""
    summary: SummarySettings = Field(default_factory=SummarySettings)
    """Self-summarisation (Composer 2) extractor."""


class ShiftBound(BaseModel):
    """How far a detector metric may move from the baseline policy version before it is flagged."""

    max_abs: float | None = Field(None, ge=0.0)
    """Largest allowed absolute change; None: not checked."""
    max_rel: float | None = Field(None, ge=0.0)
    """Largest allowed relative change (|new - old| / |old|); None: not checked."""


def _default_bounds() -> dict[str, ShiftBound]:
    return {
        "tool_error_rate": ShiftBound(max_abs=0.1),
        "clarifying_rate": ShiftBound(max_abs=0.1),
        "edit_rate": ShiftBound(max_abs=0.1),
        "mean_completion_tokens": ShiftBound(max_rel=0.5),
        "judge_disagreement_rate": ShiftBound(max_abs=0.15),
    }


class DetectorSettings(BaseModel):
    """Reward-hacking detectors: per-policy-version metrics and the shifts that get flagged."""

    bounds: dict[str, ShiftBound] = Field(default_factory=_default_bounds)
    """Metric name -> allowed shift against the baseline policy version."""
    min_sessions: int = Field(20, ge=1, le=10_000_000)
    """Fewest scored sessions of a policy version (and of its baseline) before a shift is flagged."""
    clarifying_pattern: str = Field(r"\?\s*$", min_length=1, max_length=512)
    """Regex: a completion without tool calls whose text matches it is a clarifying question."""
    window_s: float = Field(86400.0, gt=0.0, le=365 * 86400.0)
    """The worker's detector gauges cover rewards created within this many seconds."""
    refresh_s: float = Field(30.0, gt=0.0, le=86400.0)
    """How often the worker recomputes its detector gauges."""


class RewardingSettings(BaseModel):
    """The rewarding stream processor (faust), its windows, and the scoring configuration."""

    group_id: str = Field("flywheel-rewarding", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """Faust app id: consumer group and table changelog prefix; scale out by starting more workers."""
    feedback_window_s: float = Field(600.0, ge=0.0, le=30 * 86400.0)
    """A session is first scored this long after its end; feedback arriving later makes a new version."""
    session_timeout_s: float = Field(3600.0, gt=0.0, le=30 * 86400.0)
    """A session that never ends is scored this long after its last event (reason ``timeout``)."""
    rescore_delay_s: float = Field(5.0, ge=0.0, le=86400.0)
    """Late events are gathered this long before the session is scored again."""
    state_retention_s: float = Field(7 * 86400.0, gt=0.0, le=365 * 86400.0)
    """A scored session's state is dropped this long after its last event (later events: ``recompute``)."""
    timer_interval_s: float = Field(0.5, gt=0.0, le=60.0)
    """How often each worker looks for sessions whose window closed."""
    finalize_batch_max: int = Field(500, ge=1, le=100_000)
    """Most sessions scored (and written in one transaction) at once; a tick scores chunks until none is due."""
    batch_max_events: int = Field(1000, ge=1, le=100_000)
    """Most events the agent takes from the stream at once."""
    batch_max_wait_s: float = Field(0.2, gt=0.0, le=10.0)
    """Longest the agent waits to fill a batch."""
    publish_scored: bool = True
    """Publish every new reward version, with its samples, on the ``rewards.scored`` topic."""
    session_timeout_broker_s: float = Field(10.0, ge=1.0, le=300.0)
    """Consumer-group session timeout (a killed worker's partitions move after this)."""
    rebalance_timeout_s: float = Field(10.0, ge=1.0, le=600.0)
    """Consumer-group rebalance timeout (Tansu's first join waits this long)."""
    max_poll_interval_s: float = Field(300.0, ge=1.0, le=3600.0)
    """Longest gap between polls before the broker drops the worker from its group."""
    commit_interval_s: float = Field(1.0, gt=0.0, le=60.0)
    """Offset commit interval."""
    rebalance_watchdog_s: float = Field(300.0, ge=0.0, le=86400.0)
    """A worker that stays in a rebalance (not recovering a table) this long exits (code 75)
    for its supervisor to restart it; 0 disables. The soak once left a CPU-starved worker
    wedged after its partitions were revoked, never rejoining its group."""
    fetch_max_wait_s: float = Field(0.1, gt=0.0, le=30.0)
    """Longest a fetch waits for new records (faust's fixed 1.5 s delays every record that long on Tansu)."""
    event_cache_size: int = Field(200_000, ge=0, le=100_000_000)
    """Parsed events kept in memory between consume and scoring (saves a re-parse)."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the worker's Prometheus endpoint; None disables it."""
    web_port: int | None = Field(None, ge=1, le=65535)
    """Port of faust's own web server; None disables it."""
    scoring: ScoringSettings = Field(default_factory=ScoringSettings)
    """Extractors and composite weights (hashed into ``config_hash``)."""
    detectors: DetectorSettings = Field(default_factory=DetectorSettings)
    """Reward-hacking detectors."""


class CanarySettings(BaseModel):
    """The canary controller: traffic steps, sample sizes, the sequential test and guards.

    The decision rule and the trade-offs behind these defaults are in
    ``serving/canary/policy.py``; ``make bench-canary`` measures them (success rate 0.5,
    200 seeds per scenario).
    """

    enabled: bool = True
    """Whether the controller acts (``flywheel canary pause`` also stops it, through the audit log)."""
    auto_deploy: bool = False
    """Continuous deployment: when no canary runs, deploy the newest gated candidate trained from the stable."""
    interval_s: float = Field(5.0, gt=0, le=3600)
    """How often the controller reads the live rewards and decides."""
    steps: list[float] = Field(default_factory=lambda: [0.05, 0.25, 0.5, 1.0], min_length=1, max_length=10)
    """Canary traffic weights, in order; passing the last one below 1.0 promotes (a final 1.0 is the promotion)."""
    min_samples_per_step: int = Field(100, ge=1)
    """Scored canary sessions needed at a step before it may step up or promote."""
    max_duration_s: float = Field(24 * 3600.0, gt=0)
    """Longest a canary may run; then an inconclusive one is rolled back (an equal one needs ~16k scored sessions)."""
    max_canary_sessions: int | None = Field(20_000, ge=1)
    """Most scored canary sessions before an inconclusive canary is rolled back; None: no limit."""
    alpha: float = Field(0.05, gt=0, lt=0.5)
    """Error rate of the sequential test (false rollback of an equal canary, false promotion of a worse one)."""
    non_inferiority_margin: float = Field(0.04, ge=0, le=1)
    """How much worse (success rate) the canary may be and still be promoted; below the smallest drop never to ship."""
    step_margin: float = Field(0.10, ge=0, le=1)
    """Non-inferiority margin for stepping up from a step before the last (bounds the blast radius only)."""
    regression_margin: float = Field(0.0, ge=0, le=1)
    """The canary is a significant regression when the upper bound of (canary - stable) is below -regression_margin."""
    metric: Literal["success", "reward"] = "success"
    """The primary metric compared between canary and stable."""
    success_threshold: float = Field(0.5, ge=-1e6, le=1e6)
    """``success``: a session succeeded when its outcome component's value is at least this."""
    reward_min: float = Field(0.0, ge=-1e6, le=1e6)
    """``reward``: rewards are clipped to [reward_min, reward_max] and rescaled to [0, 1] for the bounded test."""
    reward_max: float = Field(1.0, ge=-1e6, le=1e6)
    """``reward``: upper end of the clipping range."""
    variance: Literal["bound", "empirical"] = "bound"
    """Confidence-sequence variance: Hoeffding's worst case (exact) or the plug-in sample variance (asymptotic)."""
    cs_target_sessions: int = Field(1000, ge=1, le=10_000_000)
    """Canary sample size where the confidence sequence is made tightest (the mixture's tuning)."""
    guard_alpha: float = Field(0.01, gt=0, lt=0.5)
    """Error rate of each guard metric's own sequential test."""
    error_margin: float = Field(0.05, ge=0, le=1)
    """Guard: roll back when the canary's failed-session rate is significantly more than this above stable's."""
    latency_margin: float = Field(0.10, ge=0, le=1)
    """Guard: rolls back when canary's share of sessions slower than stable's p95 is significantly this far above."""
    latency_quantile: float = Field(0.95, gt=0.5, lt=1)
    """Guard: the stable latency quantile (p95) that canary sessions are compared against."""
    min_latency_reference: int = Field(50, ge=1)
    """Guard: stable sessions with a latency needed before the latency quantile is trusted."""
    detector_guards: list[str] = Field(
        default_factory=lambda: ["tool_error_rate", "clarifying_rate", "edit_rate", "judge_disagreement_rate"]
    )
    """Reward-hacking detector metrics guarded, each with the margin ``rewarding.detectors.bounds[metric].max_abs``."""
    hold_log_interval_s: float = Field(300.0, ge=0, le=86400)
    """An unchanged ``hold`` decision is written to the audit log at most this often."""
    hold_log_growth: float = Field(0.25, gt=0, le=100)
    """A ``hold`` is also written when the canary's sample grew by this fraction since the last written decision."""

    @model_validator(mode="after")
    def _ranges(self) -> CanarySettings:
        if any(not 0.0 < w <= 1.0 for w in self.steps) or self.steps != sorted(set(self.steps)):
            raise ValueError(f"canary.steps must be increasing weights in (0, 1], got {self.steps}")
        if self.reward_max <= self.reward_min:
            raise ValueError("canary.reward_max must be above canary.reward_min")
        return self


class ServingSettings(BaseModel):
    """The router (the only public ingress), the hot swap and the admin API."""

    fleet: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name of the fleet this process serves or manages."""
    strategy: Literal["full", "lora"] = "full"
    """How a checkpoint reaches replicas: full weights (reload) or a LoRA adapter."""
    model_alias: str = Field("flywheel", min_length=1, max_length=128)
    """Model name an agent may send to mean "whatever policy this fleet serves my session" (the router rewrites it)."""
    router_host: str = "127.0.0.1"
    """Address the router listens on."""
    router_port: int = Field(18000, ge=1, le=65535)
    """Port of the router."""
    admin_host: str = "127.0.0.1"
    """Address the admin API listens on."""
    admin_port: int = Field(18090, ge=1, le=65535)
    """Port of the admin API."""
    admin_url: str | None = None
    """Where the CLI finds the admin API; None: the local stack's, else admin_host:admin_port."""
    refresh_s: float = Field(0.5, gt=0, le=60)
    """How often the router re-reads the routing table (deployments, replica states)."""
    health_interval_s: float = Field(1.0, gt=0, le=60)
    """How often the router probes each replica."""
    health_timeout_s: float = Field(2.0, gt=0, le=60)
    """A probe slower than this fails."""
    eject_after_failures: int = Field(2, ge=1, le=100)
    """Consecutive failed probes (or connection errors) that eject a replica until it answers again."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Upstream timeout of one proxied request."""
    max_attempts: int = Field(3, ge=1, le=10)
    """Replicas tried for a request that has not started streaming."""
    sticky_ttl_s: float = Field(6 * 3600.0, gt=0)
    """How long the router remembers a session's policy version after its last request."""
    sticky_max_sessions: int = Field(200_000, ge=100)
    """Sessions remembered at most (least recently used forgotten first)."""
    canary_replicas: int = Field(1, ge=1, le=64)
    """Replicas swapped to a canary checkpoint under the full-weight strategy."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """How long a swap waits for in-flight requests to finish before pausing with ``keep``."""
    swap_timeout_s: float = Field(300.0, gt=0)
    """Longest the reload of one replica may take."""
    canary: CanarySettings = Field(default_factory=CanarySettings)
    """The canary controller."""


class SdkSettings(BaseSettings):
    """What an agent product's process configures for the SDK (read by ``Flywheel()``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="ignore")

    project: str | None = None
    """Project (tenant) name; FLYWHEEL_PROJECT."""
    write_key: SecretStr | None = None
    """Write key for the HTTP gateway; FLYWHEEL_WRITE_KEY."""
    transport: Literal["kafka", "http"] = "kafka"
    """How events leave the process; FLYWHEEL_TRANSPORT."""
    kafka_bootstrap: str | None = None
    """Broker for the Kafka transport; FLYWHEEL_KAFKA_BOOTSTRAP (else the local stack's)."""
    topic_prefix: str = "flywheel"
    """Topic prefix, as the services use it; FLYWHEEL_TOPIC_PREFIX."""
    gateway_url: str = "http://127.0.0.1:18080"
    """Gateway for the HTTP transport; FLYWHEEL_GATEWAY_URL."""
    queue_size: int = Field(10_000, ge=1, le=10_000_000)
    """In-memory queue bound; beyond it events go to the disk spool."""
    batch_size: int = Field(500, ge=1, le=100_000)
    """Most events the sender sends at once."""
    linger_ms: int = Field(50, ge=0, le=60_000)
    """Longest the sender waits to fill a batch."""
    spool_dir: Path = Path(".flywheel/spool")
    """Disk spool for when the queue is full or the broker unreachable."""
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    """Spool bound; beyond it events are dropped, counted and logged."""
    sample_rate: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of sessions logged (decided per session id, deterministically)."""
    redact: bool = True
    """Apply the default PII redactor before anything leaves the process."""
    http_timeout_s: float = Field(10.0, gt=0, le=300)
    """Timeout of one request to the gateway (HTTP transport); a timed-out batch is retried later."""
    kafka_connect_timeout_s: float = Field(2.0, gt=0, le=300)
    """How long connecting to the broker may take before the attempt counts as failed (Kafka transport)."""
    kafka_request_timeout_s: float = Field(5.0, gt=0, le=300)
    """Timeout of one produce request, which bounds how long a batch waits for its acknowledgement."""
    retry_backoff_max_s: float = Field(30.0, ge=0.5, le=3600)
    """Longest wait between attempts while the transport is down (the backoff doubles from 0.5 s up to it)."""
    exit_flush_timeout_s: float = Field(5.0, ge=0, le=600)
    """How long the flush at interpreter exit waits; what is left stays in the spool for the next start."""


class Settings(BaseSettings):
    """Root settings shared by every Flywheel process."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    environment: Literal["development", "test", "production"] = "development"
    """Deployment kind; placeholder secrets are refused outside development and test."""
    run_dir: Path = Path(".flywheel/run")
    """Run folder of the local stack: logs, data of embedded servers, stack.json."""
    secret_key: SecretStr = SecretStr("dev-only-secret")
    """Key for signing and hashing tokens; must be a real secret in production."""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    """Broker."""
    postgres: PostgresSettings = Field(default_factory=PostgresSettings)
    """Database."""
    redis: RedisSettings = Field(default_factory=RedisSettings)
    """Celery broker."""
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    """Serving fleet."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """Base model."""
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    """Ingest."""
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    """Trainer."""
    rewarding: RewardingSettings = Field(default_factory=RewardingSettings)
    """Rewarding."""
    serving: ServingSettings = Field(default_factory=ServingSettings)
    """Router, hot swap, canary controller and admin API."""

    @model_validator(mode="after")
    def _no_placeholder_secrets(self) -> Settings:
        if self.environment == "production":
            value = self.secret_key.get_secret_value()
            if value.lower() in PLACEHOLDER_SECRETS or value.startswith("dev-") or len(value) < 16:
                raise ValueError(
                    "secret_key: a placeholder or short secret is refused in production; "
                    "set FLYWHEEL_SECRET_KEY to at least 16 random characters"
                )
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
