"""Session events: the records the SDK produces and every service consumes.

Every event is one flat JSON object: the envelope fields of :class:`EventBase`
(schema version, UUIDv7 event id, project, session id, timestamps) plus the fields
of its ``type``. ``Event`` is the discriminated union of all types; parse untrusted
input with :func:`parse_event`, which names the offending field on rejection.

Schema history:
  1 — initial version. Additive change within 1: a ``feedback`` may omit ``session_id``
      when it names a UUIDv7 ``completion_id`` (feedback by completion id alone, from a
      process that does not know the session). Every record valid before is still valid;
      a reader built before the change refuses such a record (it cannot misread it), and
      ingest re-produces it with ``session_id`` filled, which every reader understands.
      Additive change within 1: a completion's ``sampling`` may carry ``min_p``, the penalties,
      ``logit_bias``, ``min_tokens`` and ``constraints`` (what else shaped the sampled
      distribution); a reader built before refuses such a record rather than misread it.
      From here on readers are forward-compatible within a version: :func:`parse_event` accepts
      fields it does not know at any nesting level and keeps them (:func:`unknown_fields` lists
      them; :func:`dump_event` writes them back), so a newer SDK may add optional fields that a
      reader can ignore without misreading the record. A field an older reader would misread if
      it ignored it needs a new schema version (see docs/contracts.md).
      Additive change within 1: a ``feedback`` of kind ``score`` may be a *named score*
      (``name``, ``value`` as a number, boolean or category, ``data_type``, ``comment``)
      instead of carrying ``score``; a reader built before refuses such a record (its
      ``score`` is missing), so it cannot misread it as an unnamed score.
      Additive change within 1: event type ``budget`` (a token budget's enforcement, logged by
      the SDK's budget context manager); a reader built before refuses it as an unknown type
      (it cannot misread it), and every record valid before is still valid.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.config import ExtraValues

from flywheel.core.contracts.ids import uuid7

SCHEMA_VERSION = 1
"""The schema version this code writes."""
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
"""Schema versions this code reads."""

MAX_TEXT = 64 * 1024 * 1024
"""Longest text field, in characters: a static bound above any configurable event size (the
deployment's own limit is ``ingest.max_event_bytes``, in bytes, checked by the SDK and ingest)."""
MAX_TOKENS = 1_048_576
"""Longest token id or logprob list: a static bound above any configurable completion length
(the deployment's own limit is ``ingest.max_completion_tokens``, checked by the SDK and ingest)."""
MAX_FUTURE_SKEW = timedelta(hours=1)
"""How far ahead of the receiver's clock an event time may be."""
EARLIEST_EVENT_TIME = datetime(2020, 1, 1, tzinfo=UTC)
"""Event times before this are refused as clock errors."""

Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")]
"""An identifier: project, session id, policy version, outcome name, ..."""
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Scalar = str | int | float | bool | None
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=128)], Scalar], Field(max_length=64)]
"""Flat key/value metadata: JSON scalars only, at most 64 keys (no nesting to abuse)."""


def utcnow() -> datetime:
    """Timezone-aware now in UTC."""
    return datetime.now(UTC)


class EventType(StrEnum):
    """Every event type on the events topic."""

    SESSION_START = "session_start"
    SESSION_END = "session_end"
    SPAN_START = "span_start"
    SPAN_END = "span_end"
    TURN = "turn"
    COMPLETION = "completion"
    CONTEXT = "context"
    FEEDBACK = "feedback"
    OUTCOME = "outcome"
    BUDGET = "budget"


class _Model(BaseModel):
    """Base of every event model: strict when built, forward-compatible when read.

    Building a model (``Model(...)``, ``model_validate``, ``model_validate_json``) refuses a
    field the model does not declare, at any nesting level, so a misspelt keyword fails
    loudly where it is written. The readers (:func:`parse_event`, :func:`parse_event_fast`)
    validate with ``extra="allow"``: a field that a newer producer of the same schema
    version added is kept on its model (``model_extra``), serialized again by
    :func:`dump_event` and listed by :func:`unknown_fields`.
    """

    model_config = ConfigDict(extra="allow", frozen=True, str_max_length=MAX_TEXT, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        __tracebackhide__ = True
        self.__pydantic_validator__.validate_python(data, self_instance=self, extra="forbid")

    # Marked as pydantic's own __init__, so validation builds models without calling it (and a
    # reader's per-call ``extra="allow"`` applies at every level); only direct construction is strict.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *, extra: ExtraValues | None = None, **kwargs: Any) -> Self:
        """Validate ``obj``; unknown fields are refused unless ``extra`` says otherwise."""
        return super().model_validate(obj, extra=extra or "forbid", **kwargs)

    @classmethod
    def model_validate_json(
        cls, json_data: str | bytes | bytearray, *, extra: ExtraValues | None = None, **kwargs: Any
    ) -> Self:
        """Validate JSON text; unknown fields are refused unless ``extra`` says otherwise."""
        return super().model_validate_json(json_data, extra=extra or "forbid", **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, *, extra: ExtraValues | None = None, **kwargs: Any) -> Self:
        """Validate string data; unknown fields are refused unless ``extra`` says otherwise."""
        return super().model_validate_strings(obj, extra=extra or "forbid", **kwargs)


class EventBase(_Model):
    """The envelope every event carries."""

    schema_version: Literal[1] = SCHEMA_VERSION
    """Version of this schema; readers refuse versions they do not know."""
    event_id: uuid.UUID = Field(default_factory=uuid7)
    """UUIDv7, unique per event; a retry or replay carries the same id and is a no-op downstream."""
    project: Name
    """The agent product (tenant) that produced the event; write keys are scoped to it."""
    session_id: Name
    """The agent session the event belongs to; also the Kafka message key."""
    occurred_at: datetime = Field(default_factory=utcnow)
    """When it happened, in the producer's clock (timezone-aware)."""
    sent_at: datetime | None = None
    """When the SDK handed it to a transport (set by the sender)."""
    sdk: Annotated[str, StringConstraints(max_length=64)] | None = None
    """Producer library and version, e.g. ``flywheel-sdk/0.1.0``."""

    @property
    def kafka_key(self) -> str:
        """The Kafka message key of this event: its session id (so a session's events keep their order)."""
        return self.session_id

    @field_validator("event_id")
    @classmethod
    def _is_uuid7(cls, value: uuid.UUID) -> uuid.UUID:
        if value.version != 7:
            raise ValueError(f"must be a UUIDv7 (got version {value.version})")
        return value

    @field_validator("occurred_at", "sent_at")
    @classmethod
    def _plausible_time(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("must carry a timezone (e.g. 2026-01-01T00:00:00Z)")
        if value < EARLIEST_EVENT_TIME:
            raise ValueError(f"{value.isoformat()} is before {EARLIEST_EVENT_TIME.date()}: a clock error")
        if value > utcnow() + MAX_FUTURE_SKEW:
            raise ValueError(f"{value.isoformat()} is more than {MAX_FUTURE_SKEW} in the future")
        return value


class SpanRef(_Model):
    """Which agent within a multi-agent session produced something."""

    span_id: Name = "root"
    """The agent span: ``root`` for the main agent, else a sub-agent's span id."""
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "agent"
    """The agent's role, e.g. ``agent``, ``orchestrator``, ``subagent``; the trainer trains configured roles only."""


class SessionStart(EventBase):
    """A session began."""

    type: Literal[EventType.SESSION_START] = EventType.SESSION_START
    user_id: Name | None = None
    """The product's (pseudonymous) user id."""
    agent: Annotated[str, StringConstraints(max_length=128)] | None = None
    """Name and version of the agent harness."""
    task: Annotated[str, StringConstraints(max_length=128)] | None = None
    """Task kind, for per-kind baselines and metrics."""
    group_key: Annotated[str, StringConstraints(max_length=256)] | None = None
    """Sessions sharing a group key answer the same prompt (group-relative advantages)."""
    metadata: Metadata = Field(default_factory=dict)
    """Product metadata (flat)."""


class SessionEnd(EventBase):
    """A session ended; its reward can be finalised once its feedback window closes."""

    type: Literal[EventType.SESSION_END] = EventType.SESSION_END
    status: Literal["completed", "failed", "abandoned", "timeout"] = "completed"
    """How the session ended."""
    error: Annotated[str, StringConstraints(max_length=4096)] | None = None
    """The error, when the session failed."""


class SpanStart(EventBase):
    """A sub-agent was created and assigned a task (an orchestrator's decision)."""

    type: Literal[EventType.SPAN_START] = EventType.SPAN_START
    span_id: Name
    """The new agent's span id."""
    parent_span_id: Name = "root"
    """The span that created it."""
    role: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "subagent"
    """The new agent's role."""
    assignment: Text | None = None
    """The task it was given."""


class SpanEnd(EventBase):
    """A sub-agent finished."""

    type: Literal[EventType.SPAN_END] = EventType.SPAN_END
    span_id: Name
    """The span that finished."""
    status: Literal["completed", "failed", "cancelled"] = "completed"
    """Whether its sub-task was completed."""
    result: Text | None = None
    """What it reported back."""


class Message(_Model):
    """One chat message as the model saw it."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | None = None
    name: Annotated[str, StringConstraints(max_length=128)] | None = None
    tool_call_id: Annotated[str, StringConstraints(max_length=128)] | None = None


class ToolCall(_Model):
    """A tool invocation decided by the model."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    """Call id, matched by the tool result."""
    name: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    """Tool name."""
    arguments: Text = ""
    """Arguments as the model wrote them (usually JSON text)."""


class ToolResult(_Model):
    """What a tool returned."""

    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    """The call this answers."""
    content: Text = ""
    """The result as fed back to the model."""
    is_error: bool = False
    """The tool failed (counted by the tool-error-rate detector)."""
    document_ids: Annotated[list[Annotated[str, StringConstraints(max_length=256)]], Field(max_length=1024)] = Field(
        default_factory=list
    )
    """Documents a retrieval tool returned (for retrieval rewards)."""


class Turn(EventBase):
    """Messages, tool calls or tool results that were not a logged model completion."""

    type: Literal[EventType.TURN] = EventType.TURN
    span: SpanRef = Field(default_factory=SpanRef)
    """Which agent the turn belongs to."""
    messages: Annotated[list[Message], Field(max_length=1024)] = Field(default_factory=list)
    """Messages added to the conversation (e.g. the user's)."""
    tool_calls: Annotated[list[ToolCall], Field(max_length=256)] = Field(default_factory=list)
    """Tool calls made."""
    tool_results: Annotated[list[ToolResult], Field(max_length=256)] = Field(default_factory=list)
    """Tool results returned."""

    @model_validator(mode="after")
    def _not_empty(self) -> Turn:
        if not (self.messages or self.tool_calls or self.tool_results):
            raise ValueError("a turn needs at least one of messages, tool_calls, tool_results")
        return self


class SamplingParams(_Model):
    """The sampling parameters of a completion request: everything that shapes the distribution it sampled from.

    ``None`` means the request left the parameter unset, so the server's default applied
    (replicas run with ``--generation-config vllm``: temperature 1, no truncation, no penalty).
    The trainer reproduces temperature, ``top_k``, ``top_p`` and ``min_p`` exactly (vLLM's
    order: temperature, min-p, top-k, top-p); a completion with a penalty, a logit bias,
    ``min_tokens`` or any of ``constraints`` is not trained (see docs/trainer.md).
    """

    temperature: float | None = Field(None, ge=0, le=10)
    """Softmax temperature; below 1e-5 the server samples greedily."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus: the smallest set of most likely tokens whose probability reaches ``top_p``."""
    top_k: int | None = Field(None, ge=-1)
    """The ``top_k`` most likely tokens only (0 or -1: no limit)."""
    min_p: float | None = Field(None, ge=0, le=1)
    """Tokens less likely than ``min_p`` times the most likely one are dropped (vLLM)."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    """Subtracted from the logit of every token already generated."""
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    """Divides positive (multiplies negative) logits of tokens seen in the prompt or output (vLLM; 1 is none)."""
    logit_bias: Annotated[
        dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100, le=100)]],
        Field(max_length=4096),
    ] = Field(default_factory=dict)
    """Token id (as text) to the bias added to its logit."""
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    """End-of-sequence and stop tokens are impossible before this many tokens (vLLM)."""
    constraints: Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    """Other request options that restricted which tokens could be sampled, by name (``allowed_token_ids``,
    ``bad_words``, ``structured_outputs``, ``response_format``, ``tool_choice``, ``beam_search``, ...)."""
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    seed: int | None = None
    stop: Annotated[list[Annotated[str, StringConstraints(max_length=256)]], Field(max_length=16)] = Field(
        default_factory=list
    )


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_TOKENS)]


class Completion(EventBase):
    """One model completion, with what the trainer needs to learn from it."""

    type: Literal[EventType.COMPLETION] = EventType.COMPLETION
    completion_id: uuid.UUID = Field(default_factory=uuid7)
    """Id that feedback may target."""
    span: SpanRef = Field(default_factory=SpanRef)
    """Which agent produced it."""
    model: Annotated[str, StringConstraints(max_length=256)]
    """The model name the request asked for / the server answered with."""
    policy_version: Name
    """The policy version that produced every token of it (router header or served model)."""
    prompt_messages: Annotated[list[Message], Field(max_length=1024)] = Field(default_factory=list)
    """The chat prompt (empty for a text completion)."""
    prompt_text: Text | None = None
    """The text prompt of a text completion."""
    completion_text: Text = ""
    """What the model generated."""
    tool_calls: Annotated[list[ToolCall], Field(max_length=256)] = Field(default_factory=list)
    """Tool calls parsed from the completion."""
    finish_reason: Annotated[str, StringConstraints(max_length=32)] | None = None
    """Why generation stopped."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling parameters."""
    prompt_token_ids: TokenIds | None = None
    """Token ids of the prompt as the server tokenised it."""
    completion_token_ids: TokenIds | None = None
    """Token ids the model sampled."""
    logprobs: Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=MAX_TOKENS)] | None = None
    """Behaviour log-probability of each sampled token (one per completion token id)."""
    latency_ms: float = Field(0.0, ge=0, le=86_400_000)
    """Wall time of the request as the client saw it."""
    served_by: Annotated[str, StringConstraints(max_length=256)] | None = None
    """Replica that served it, when the router says (``x-flywheel-replica``): its public id, e.g. ``"3"``.
    Events recorded before the router stopped naming replicas by URL carry the URL; both validate."""

    @model_validator(mode="after")
    def _aligned(self) -> Completion:
        if self.logprobs is not None:
            if self.completion_token_ids is None:
                raise ValueError("logprobs: given without completion_token_ids")
            if len(self.logprobs) != len(self.completion_token_ids):
                raise ValueError(
                    f"logprobs: {len(self.logprobs)} values for {len(self.completion_token_ids)} completion tokens"
                )
            if any(lp > 0.0 for lp in self.logprobs):
                raise ValueError("logprobs: every value must be a log-probability (<= 0)")
        return self


class ContextUpdate(EventBase):
    """The agent rewrote its own context: a self-summary or pruned chunks."""

    type: Literal[EventType.CONTEXT] = EventType.CONTEXT
    span: SpanRef = Field(default_factory=SpanRef)
    """Which agent's context changed."""
    kind: Literal["summary", "prune"]
    """``summary``: earlier context replaced by a summary (Composer-style); ``prune``: chunks dropped
    (Context-1-style)."""
    summary: Text | None = None
    """The summary text, for ``summary``."""
    summary_completion_id: uuid.UUID | None = None
    """The completion that wrote the summary, which inherits credit from what followed."""
    replaced_through: uuid.UUID | None = None
    """Last event id whose content the summary replaces."""
    pruned_chunk_ids: Annotated[list[Annotated[str, StringConstraints(max_length=256)]], Field(max_length=4096)] = (
        Field(default_factory=list)
    )
    """Ids of pruned chunks or documents, for ``prune``."""
    tokens_before: int | None = Field(None, ge=0)
    """Context size before, in tokens."""
    tokens_after: int | None = Field(None, ge=0)
    """Context size after, in tokens."""

    @model_validator(mode="after")
    def _kind_fields(self) -> ContextUpdate:
        if self.kind == "summary" and not self.summary:
            raise ValueError("summary: required when kind is 'summary'")
        if self.kind == "prune" and not self.pruned_chunk_ids:
            raise ValueError("pruned_chunk_ids: required when kind is 'prune'")
        return self


class FeedbackKind(StrEnum):
    """What the user did with the agent's work."""

    ACCEPT = "accept"
    REJECT = "reject"
    REVERT = "revert"
    EDIT = "edit"
    PERSISTED = "persisted"
    FOLLOW_UP = "follow_up"
    SCORE = "score"


ScoreDataType = Literal["numeric", "boolean", "categorical"]
"""What a named score's value is: a number, true/false, or a category (a label)."""
MAX_SCORE_NUMBER = 1e12
"""Largest magnitude of a numeric score."""
MAX_CATEGORY = 256
"""Longest category of a categorical score, in characters."""
ScoreValue = (
    bool
    | Annotated[int, Field(ge=-(10**12), le=10**12)]
    | Annotated[float, Field(ge=-MAX_SCORE_NUMBER, le=MAX_SCORE_NUMBER)]
    | Annotated[str, StringConstraints(min_length=1, max_length=MAX_CATEGORY)]
)
"""A named score's value: a number, a boolean, or a category (non-empty text)."""
MAX_COMMENT = 4096
"""Longest feedback comment, in characters."""


def score_data_type(value: bool | int | float | str) -> ScoreDataType:
    """The data type a score value implies: a bool is ``boolean``, a number ``numeric``, text ``categorical``."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "numeric"
    return "categorical"


class Feedback(EventBase):
    """A user signal about a session or one completion; may arrive hours later, from another process.

    Kind ``score`` is either an unnamed free ``score`` (read by the ``user_signal`` reward
    extractor) or a *named score*: ``name`` and ``value`` (number, boolean or category), with a
    ``data_type`` that is inferred from the value when not given and must agree with it, as
    Langfuse and LangSmith scores are (read by the ``scores`` extractor, where configured).

    Feedback by completion id alone (no ``session_id``, a UUIDv7 ``completion_id``) is
    *unattached*: it is keyed by the completion id on the topic, and ingest finds the
    completion's session and re-produces it (same event id, ``session_id`` filled, keyed by
    the session). Consumers other than ingest skip unattached feedback and score the copy.
    """

    session_id: Name | None = None  # type: ignore[assignment]
    """The session it is about; may be omitted only when ``completion_id`` is set (ingest then fills it in)."""
    type: Literal[EventType.FEEDBACK] = EventType.FEEDBACK
    kind: FeedbackKind
    """The signal."""
    completion_id: uuid.UUID | None = None
    """The completion it is about, if any (else the whole session); a UUIDv7 when ``session_id`` is omitted."""
    score: float | None = Field(None, ge=-1e6, le=1e6)
    """A free, unnamed score, for ``score`` (a named score carries ``name`` and ``value`` instead)."""
    name: Name | None = None
    """A named score's name, e.g. ``helpfulness``, ``correct``, ``tone`` (kind ``score`` only)."""
    value: ScoreValue | None = None
    """A named score's value: a number, ``true``/``false``, or a category such as ``"good"``."""
    data_type: ScoreDataType | None = None
    """A named score's type: ``numeric``, ``boolean`` or ``categorical``; inferred from ``value`` when not
    given. ``boolean`` also takes 1 and 0 (as Langfuse sends booleans) and stores them as true and false."""
    comment: Annotated[str, StringConstraints(max_length=MAX_COMMENT)] | None = None
    """Free text about the feedback, e.g. why a score was given (redacted by the SDK)."""
    edit_ratio: float | None = Field(None, ge=0, le=1)
    """Fraction of the agent's output the user changed, for ``edit``."""
    persisted_minutes: float | None = Field(None, ge=0, le=525_600)
    """How long the work survived unchanged, for ``persisted``."""
    dissatisfied: bool | None = None
    """For ``follow_up``: the user asked again or said it was wrong."""
    text: Text | None = None
    """The user's words, for ``follow_up`` (redacted by the SDK)."""
    user_id: Name | None = None
    """Who gave it."""

    @model_validator(mode="after")
    def _kind_fields(self) -> Feedback:
        if self.name is not None or self.value is not None or self.data_type is not None:
            self._check_named_score()
        required = {
            FeedbackKind.SCORE: "score",
            FeedbackKind.EDIT: "edit_ratio",
            FeedbackKind.PERSISTED: "persisted_minutes",
        }.get(self.kind)
        if required and getattr(self, required) is None and self.name is None:
            raise ValueError(f"{required}: required when kind is '{self.kind.value}' (or name and value)")
        if self.session_id is None:
            if self.completion_id is None:
                raise ValueError("session_id: required unless completion_id is set (feedback by completion id alone)")
            if self.completion_id.version != 7:
                raise ValueError(
                    f"completion_id: must be a UUIDv7 when session_id is omitted (got version "
                    f"{self.completion_id.version}); ingest finds the completion by the time in its id"
                )
        return self

    @field_validator("value", mode="before")
    @classmethod
    def _score_value(cls, value: Any) -> Any:
        """Name what is wrong with a value here: the union's own errors would speak of its first member only."""
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            if not (isinstance(value, int) or math.isfinite(value)) or abs(value) > MAX_SCORE_NUMBER:
                raise ValueError(f"a number must be finite and within ±{MAX_SCORE_NUMBER:g} (got {value!r})")
            return value
        if isinstance(value, str):
            if not 0 < len(value) <= MAX_CATEGORY:
                raise ValueError(f"a category must be 1 to {MAX_CATEGORY} characters (got {len(value)})")
            return value
        raise ValueError(f"must be a number, true/false or a text label (got {type(value).__name__})")

    def _check_named_score(self) -> None:
        """A named score: kind ``score``, ``name`` and ``value`` given, ``data_type`` agreeing with the value."""
        if self.kind is not FeedbackKind.SCORE:
            field = "name" if self.name is not None else "value" if self.value is not None else "data_type"
            raise ValueError(f"{field}: only for kind 'score' (got kind '{self.kind.value}')")
        if self.name is None:
            raise ValueError("name: required with value or data_type (a named score)")
        if self.value is None:
            raise ValueError("value: required for a named score (a number, true/false or a category)")
        if self.score is not None:
            raise ValueError("score: a named score carries its value in value, not score")
        value, implied = self.value, score_data_type(self.value)
        declared = self.data_type or implied
        if declared == "boolean" and implied == "numeric" and value in (0, 1):
            value, implied = bool(value), "boolean"  # Langfuse sends a boolean score as 1 or 0
        if declared != implied:
            raise ValueError(f"value: {value!r} is not {declared} (a {declared} score takes {_TAKES[declared]})")
        object.__setattr__(self, "value", value)  # frozen: settled once, while it is validated
        object.__setattr__(self, "data_type", declared)

    @property
    def attached(self) -> bool:
        """Whether the feedback names its session (else ingest has yet to find it from ``completion_id``)."""
        return self.session_id is not None

    @property
    def kafka_key(self) -> str:
        """The session id, or for unattached feedback the completion id (canonical UUID text)."""
        return self.session_id if self.session_id is not None else str(self.completion_id)


_TAKES: dict[str, str] = {
    "numeric": "a number",
    "boolean": "true or false (or 1 or 0)",
    "categorical": "a non-empty text label",
}


class Outcome(EventBase):
    """A named, verifiable result of the session (tests passed, task solved, a metric)."""

    type: Literal[EventType.OUTCOME] = EventType.OUTCOME
    name: Name
    """What was measured, e.g. ``tests_passed``, ``task_solved``."""
    value: float | bool
    """The result."""
    completion_id: uuid.UUID | None = None
    """The completion it is about, if any."""
    document_ids: Annotated[list[Annotated[str, StringConstraints(max_length=256)]], Field(max_length=4096)] = Field(
        default_factory=list
    )
    """For retrieval tasks: the documents the agent finally returned."""
    details: Metadata = Field(default_factory=dict)
    """Flat details."""


BudgetState = Literal["ok", "near", "over"]
"""Where a token budget stands: ``ok`` below its warn line, ``near`` at or past it (the harness
asks the agent to prune or summarise), ``over`` past the budget (only that action is allowed)."""
BudgetAction = Literal["prune", "summary"]
"""What a token budget asks for near it and allows alone over it."""
ToolName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class BudgetEnforcement(EventBase):
    """What a token budget on an agent's context enforced (the SDK's ``session.budget(...)``).

    ``kind`` says what happened: ``near``, the count reached the warn line (``warn_at`` ×
    ``budget_tokens``) and the agent is asked to ``action``; ``over``, it passed
    ``budget_tokens`` and only ``action`` is allowed; ``refused``, a tool other than the allowed
    ones was refused while over (``refused_tool``, and ``tool_call_id`` when the harness named
    the call); ``reduced``, a prune or summary was recorded while near or over (``reduced_by``,
    ``context_event_id`` the ``context`` event, ``tokens_before`` and ``state_before``).
    ``tokens`` and ``state`` are the count and the state after the event.
    """

    type: Literal[EventType.BUDGET] = EventType.BUDGET
    span: SpanRef = Field(default_factory=SpanRef)
    """Which agent's context the budget counts."""
    kind: Literal["near", "over", "refused", "reduced"]
    """What the budget enforced (see the class docstring)."""
    budget_tokens: int = Field(ge=1, le=2**31 - 1)
    """The budget: most tokens the context may hold."""
    warn_at: float = Field(gt=0.0, le=1.0)
    """Share of ``budget_tokens`` at which the budget is ``near``."""
    action: BudgetAction
    """What the harness asks for near the budget and allows alone over it."""
    tokens: int = Field(ge=0, le=2**31 - 1)
    """The context's size after the event, in tokens (the product's tokenizer or count)."""
    state: BudgetState
    """The budget's state after the event."""
    refused_tool: ToolName | None = None
    """The tool refused, for ``refused``."""
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    """The refused tool call's id, for ``refused``, when the harness gave it."""
    reduced_by: BudgetAction | None = None
    """Whether a prune or a summary reduced the context, for ``reduced``."""
    context_event_id: uuid.UUID | None = None
    """The ``context`` event that reduced it, for ``reduced``."""
    tokens_before: int | None = Field(None, ge=0, le=2**31 - 1)
    """The count before the prune or summary, for ``reduced``."""
    state_before: BudgetState | None = None
    """The state before the prune or summary (``near`` or ``over``), for ``reduced``."""

    @model_validator(mode="after")
    def _kind_fields(self) -> BudgetEnforcement:
        expected = {"near": ("near",), "over": ("over",), "refused": ("over",)}.get(self.kind)
        if expected is not None and self.state not in expected:
            raise ValueError(f"state: must be '{expected[0]}' for kind '{self.kind}' (got '{self.state}')")
        if self.kind == "refused" and self.refused_tool is None:
            raise ValueError("refused_tool: required when kind is 'refused'")
        if self.kind == "reduced":
            for name in ("reduced_by", "context_event_id", "tokens_before", "state_before"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required when kind is 'reduced'")
            if self.state_before == "ok":
                raise ValueError("state_before: a reduction is logged only while 'near' or 'over' (got 'ok')")
        return self


Event = Annotated[
    SessionStart
    | SessionEnd
    | SpanStart
    | SpanEnd
    | Turn
    | Completion
    | ContextUpdate
    | Feedback
    | Outcome
    | BudgetEnforcement,
    Field(discriminator="type"),
]
"""Any event."""

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: dict[str, type[EventBase]] = {
    cls.model_fields["type"].default.value: cls
    for cls in (
        SessionStart,
        SessionEnd,
        SpanStart,
        SpanEnd,
        Turn,
        Completion,
        ContextUpdate,
        Feedback,
        Outcome,
        BudgetEnforcement,
    )
}


def _subclasses(cls: type) -> set[type]:
    return {cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))}


_CONTRACT_MODELS = frozenset(_subclasses(_Model))
"""Every model of this module (events and the models nested in them)."""


class ContractError(ValueError):
    """A record that is not a valid event. Not recoverable by retrying: dead-letter it.

    ``field`` is the dotted path of the first offending field (``""`` for the record itself)
    and ``reason`` says what is wrong with it.
    """

    def __init__(self, field: str, reason: str, errors: list[dict[str, str]] | None = None):
        self.field = field
        self.reason = reason
        self.errors = errors or [{"field": field, "reason": reason}]
        super().__init__(f"{field}: {reason}" if field else reason)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|[\w-]+\[.*\])$")
"""Union member tags that pydantic puts into error locations; not field names."""


def _field_and_reason(err: Any) -> dict[str, str]:
    """Turn one pydantic error into ``{"field": dotted.path, "reason": text}``.

    Model-level validators here word their errors ``"<field>: <reason>"``; that field is
    lifted into the path so every rejection names what is wrong.
    """
    parts = [str(p) for p in err["loc"] if str(p) not in EVENT_TYPES and not _UNION_TAG.match(str(p))]
    reason = str(err["msg"])
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, ") :]
        head, sep, rest = reason.partition(": ")
        if sep and head.replace("_", "").isalnum():
            parts.append(head)
            reason = rest
    return {"field": ".".join(parts), "reason": reason}


FAST_PREFIX = '{"schema_version":1,'
"""How every event serialized by :func:`dump_event` begins (the SDK's, the gateway's and ingest's)."""


def parse_event_fast(text: str) -> Event | None:
    """The event, validated straight from its JSON text; ``None`` if the careful path must decide.

    Only for text that begins like :data:`FAST_PREFIX`, so the schema version is known to be
    present and supported: then one pass of the contract's validator over the text (JSON
    parsed in Rust, no dict built first: ~2x faster) is equivalent to :func:`parse_event`'s
    checks. Anything it refuses goes through the careful path, which words the reason.
    """
    if not text.startswith(FAST_PREFIX) or '"schema_version"' in text[len(FAST_PREFIX) :]:
        return None  # a second schema_version (a later duplicate key wins) could be `true`, which 1 accepts
    try:
        return EVENT_ADAPTER.validate_json(text, extra="allow")
    except ValidationError:
        return None


def parse_event(data: bytes | str | dict[str, Any]) -> Event:
    """Validate one untrusted record into an event, or raise :class:`ContractError` naming the field.

    Forward-compatible within a schema version: a field the contract does not declare, at
    any nesting level, is kept on the event (see :func:`unknown_fields`), never refused. A
    declared field with a bad value, an unknown ``type`` or an unsupported ``schema_version``
    is refused.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ContractError("", f"not valid UTF-8 at byte {exc.start}") from None
    if isinstance(data, str):
        event = parse_event_fast(data)
        if event is not None:
            return event
        try:
            data = json.loads(data)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ContractError("", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ContractError("", f"an event must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version", None)
    if version is None:
        raise ContractError("schema_version", "missing")
    if isinstance(version, bool) or not isinstance(version, int) or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ContractError(
            "schema_version",
            f"unsupported version {version!r} (this reader supports {sorted(SUPPORTED_SCHEMA_VERSIONS)})",
        )
    kind = data.get("type")
    if kind is None:
        raise ContractError("type", "missing")
    if not isinstance(kind, str) or kind not in EVENT_TYPES:  # a list or an object is not hashable
        raise ContractError("type", f"unknown event type {kind!r} (known: {', '.join(sorted(EVENT_TYPES))})")
    try:
        return EVENT_ADAPTER.validate_python(data, extra="allow")
    except ValidationError as exc:
        errors = [_field_and_reason(err) for err in exc.errors(include_url=False)]
        first = errors[0]
        raise ContractError(first["field"], first["reason"], errors) from None


def dump_event(event: EventBase) -> bytes:
    """Serialize an event to the JSON bytes that go on the wire (with any unknown fields it was read with)."""
    return event.model_dump_json(exclude_none=True).encode("utf-8")


def unknown_fields(model: BaseModel) -> list[str]:
    """Dotted paths of the fields a reader kept without knowing them (a newer producer's), e.g.
    ``["sampling.typical_p", "prompt_messages.0.audio"]``; empty for an event fully known here.

    Each path names the outermost unknown field: what is inside it is not looked into.
    """
    paths: list[str] = []
    _collect_unknown(model, "", paths)
    return paths


def _collect_unknown(model: BaseModel, prefix: str, paths: list[str]) -> None:
    if model.__pydantic_extra__:
        paths.extend(prefix + name for name in model.__pydantic_extra__)
    for name, value in model.__dict__.items():  # type() lookups: isinstance on models is slow (ABCMeta)
        kind = type(value)
        if kind in _CONTRACT_MODELS:
            _collect_unknown(value, f"{prefix}{name}.", paths)
        elif kind is list and value and type(value[0]) in _CONTRACT_MODELS:
            for index, item in enumerate(value):
                _collect_unknown(item, f"{prefix}{name}.{index}.", paths)


def event_json_schema() -> dict[str, Any]:
    """JSON Schema of :data:`Event` (the union of all event types): what a producer must write.

    Every object is closed (``additionalProperties: false``), as building a model is: a
    producer's misspelt field fails there. Readers accept more (see :func:`parse_event`).
    """
    schema = EVENT_ADAPTER.json_schema(mode="validation")
    _close_objects(schema)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"Flywheel event, schema version {SCHEMA_VERSION}"
    return schema


def _close_objects(node: Any) -> None:
    """Turn every ``additionalProperties: true`` (a model's ``extra="allow"``) into ``false``, in place."""
    if isinstance(node, dict):
        if node.get("additionalProperties") is True:
            node["additionalProperties"] = False
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)
