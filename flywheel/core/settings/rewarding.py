"""Settings: rewarding: extractors, scoring, detectors."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator


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
