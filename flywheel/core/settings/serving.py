"""Settings: serving: the router, hot swap, the canary controller, the admin API."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from flywheel.core.plugins import registered


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


class CaptureSettings(BaseModel):
    """Router-side capture: completions proxied for these projects become ``completion`` events."""

    projects: list[str] = Field(default_factory=list, max_length=1000)
    """Projects whose product keys' completions the router records (``"*"``: every project); empty: off."""
    buffer_events: int = Field(10_000, ge=1, le=1_000_000)
    """Captured events waiting for Kafka at most; a full buffer drops new ones (counted), never blocks."""
    max_event_bytes: int = Field(4 << 20, ge=1024, le=64 << 20)
    """A captured event larger than this is dropped (counted) rather than sent."""
    redact: bool = True
    """Apply the SDK's default redactor to what is captured (e-mail addresses, keys, tokens, card
    numbers), dropping the token data of every text it changed, as the SDK does."""

    def covers(self, project: str | None) -> bool:
        """Whether the router captures the completions of ``project``."""
        return project is not None and ("*" in self.projects or project in self.projects)


class ServingSettings(BaseModel):
    """The router (the only public ingress), the hot swap and the admin API."""

    fleet: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name of the fleet this process serves or manages."""
    strategy: str = Field("full", min_length=1, max_length=16, pattern=r"^[a-z][a-z0-9_]*$")
    """How a checkpoint reaches replicas: a swap strategy of the entry-point group
    ``flywheel.swap_strategies`` (built in: ``full``, reload the weights; ``lora``, load an adapter)."""
    model_alias: str = Field("flywheel", min_length=1, max_length=128)
    """Model name an agent may send to mean "whatever policy this fleet serves my session" (the router rewrites it)."""
    router_host: str = "127.0.0.1"
    """Address the router listens on."""
    router_port: int = Field(18000, ge=1, le=65535)
    """Port of the router."""
    router_metrics_host: str = "127.0.0.1"
    """Address the router's Prometheus endpoint (``GET /metrics``) binds; never the public port."""
    router_metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the router's Prometheus endpoint; None: not served."""
    projects: list[str] = Field(default_factory=list, max_length=1000)
    """Projects whose product keys the router accepts; empty: every project's (other keys get 403)."""
    key_rate_per_s: float = Field(50.0, gt=0, le=1_000_000)
    """Requests per second one product key may send through one router process (a token bucket per key,
    per process: N router processes admit up to N times this); a key's own ``rate_per_s`` overrides it."""
    key_burst: int = Field(100, ge=1, le=1_000_000)
    """Requests a product key may send at once (the bucket's size); a key's own ``burst`` overrides it."""
    max_request_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Largest request body the router accepts (413 beyond, naming this setting)."""
    admin_host: str = "127.0.0.1"
    """Address the admin API listens on."""
    admin_port: int = Field(18090, ge=1, le=65535)
    """Port of the admin API."""
    admin_url: str | None = None
    """Where the CLI finds the admin API; None: http://admin_host:admin_port."""
    operation_lease_s: float = Field(30.0, ge=1.0, le=3600.0)
    """An admin API process renews the lease of each deployment operation it runs every third of this;
    an operation not renewed for this long is marked failed (abandoned) by any admin API process."""
    operation_wait_s: float = Field(1800.0, gt=0, le=7200.0)
    """Longest a deployment request with ``?wait=true`` is held before it answers 202 with the operation
    still running (a request may ask for less with ``wait_s``)."""
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
    upstream_keepalive_s: float = Field(4.0, gt=0, le=300)
    """How long the router keeps an idle connection to a replica for reuse. Keep it below the replicas'
    own keep-alive (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default): a connection the replica is
    closing just as the router reuses it fails the request's attempt and counts against the replica."""
    max_attempts: int = Field(3, ge=1, le=10)
    """Replicas tried for a request that has not started streaming."""
    sticky_ttl_s: float = Field(6 * 3600.0, gt=0)
    """How long the router remembers a session's policy version after its last request."""
    sticky_max_sessions: int = Field(200_000, ge=100)
    """Sessions remembered at most (least recently used forgotten first)."""
    canary_replicas: int = Field(1, ge=1, le=64)
    """Replicas swapped to a canary checkpoint under the full-weight strategy."""
    role_pins: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Agent role (the SDK's ``x-flywheel-agent-role`` header) -> the checkpoint id or policy version every
    request of that role is served by, whatever stable and canary do (PARL's frozen sub-agents). Applied by the
    canary controller; the admin API may pin other roles (:mod:`serving.fleet.pins`). A pinned role must not be
    a trainable role."""
    pin_replicas: int = Field(1, ge=1, le=64)
    """Replicas a role pin owns under the full-weight strategy (taken from the stable's, never all of them)."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """How long a swap waits for in-flight requests to finish before pausing with ``keep``."""
    swap_timeout_s: float = Field(300.0, gt=0)
    """Longest the reload of one replica may take."""
    canary: CanarySettings = Field(default_factory=CanarySettings)
    """The canary controller."""
    capture: CaptureSettings = Field(default_factory=CaptureSettings)
    """Router-side capture of the completions it proxies (off unless projects are named)."""

    @field_validator("role_pins")
    @classmethod
    def _pins_named(cls, pins: dict[str, str]) -> dict[str, str]:
        for role, ref in pins.items():
            if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", role):
                raise ValueError(f"agent role {role!r} is not 1-64 characters of letters, digits, '.', '_', '-'")
            if not ref or len(ref) > 128:
                raise ValueError(f"role_pins[{role!r}] must name a checkpoint id or policy version (1-128 characters)")
        return pins

    @field_validator("strategy")
    @classmethod
    def _strategy_registered(cls, name: str) -> str:
        known = registered("flywheel.swap_strategies")
        if known and name not in known:
            raise ValueError(f"unknown swap strategy {name!r}: expected one of {sorted(known)}")
        return name
