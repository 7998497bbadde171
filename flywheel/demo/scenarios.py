"""The demo's scenarios (``flywheel demo --scenario NAME``): which task, agent and settings a run uses.

``arith`` is the calculator assistant (the default, ``make demo``). ``parl`` is Kimi K2.5's
parallel-agent RL at the calculator's scale (:mod:`flywheel.task.parl`, docs/scenarios.md):
the base model is pre-trained on the orchestrator task (``model.task=parl``), the agent
product is :class:`flywheel.demo.parl_agent.ParlAgent`, the reward is the ``parl``
extractor's alone (outcome + annealed r_parallel and r_finish, minus a cost per critical
step; the anneal starts when the services start and reaches 0 well before the budget ends),
the gate runs the ``parl`` suite, and the ``subagent`` role is pinned to the base model's
policy version (``serving.role_pins``), so sub-agents stay frozen while the orchestrator
learns. Under the full-weight strategy the pin owns a replica of its own, so the scenario
runs one replica more than the calculator's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.demo.loop import DemoConfig


@dataclass(frozen=True)
class Scenario:
    name: str
    model_task: str
    """``model.task`` of its base model."""
    replicas: int
    """Fewest vLLM replicas it runs on (stable, canary, and a pinned role's own)."""
    metric: str | None = None
    """The scenario's own held-out figure (a key of the gate result's ``metrics``), reported before and after."""
    pinned_roles: tuple[str, ...] = ()
    """Agent roles served by the base model's policy version throughout."""
    anneal_share: float = 0.0
    """Share of the learning budget over which the extractor's auxiliary terms anneal to 0 (0: none)."""
    target_gain_points: float = 25.0
    """The held-out gain (points) its demo and benchmark aim at."""

    def overrides(self, config: DemoConfig, started_at: datetime) -> dict[str, dict[str, Any]]:
        """The settings the scenario's services get on top of the demo's own."""
        if self.name == "arith":
            return {}
        if self.name == "parl":
            duration_s = max(config.budget_minutes * 60 * self.anneal_share, 1.0)
            weights = {k: 0.0 for k in ("outcome", "user_signal", "grm", "shaping", "retrieval", "summary", "scores")}
            return {
                "model": {"task": self.model_task},
                "trainer": {
                    "gate": {"run": ["parl"]},
                    # From the stable, not the lineage: a cycle trained from an undecided canary of the
                    # first run (+9 points) collapsed to 2.5 %; and half the calculator's window, since
                    # a parl sample is about twice as long (cycles took ~7 minutes at 768).
                    "parent": "stable",
                    "data": {"max_samples": PARL_MAX_SAMPLES},
                },
                "serving": {"canary": PARL_CANARY},
                "rewarding": {
                    "scoring": {
                        "weights": weights | {"parl": 1.0},
                        "extractors": {
                            "parl": {
                                "anneal": {"kind": "linear", "start_at": started_at.isoformat(),
                                           "duration_s": duration_s},
                            }
                        },
                    }
                },
            }  # fmt: skip
        raise AssertionError(self.name)

    def anneal_ends_at(self, config: DemoConfig, started_at: datetime) -> datetime | None:
        if not self.anneal_share:
            return None
        return started_at + timedelta(seconds=max(config.budget_minutes * 60 * self.anneal_share, 1.0))

    def agent(self, fw: Any, router: str, api_key: str, config: DemoConfig) -> Any:
        """The scenario's agent product."""
        if self.name == "parl":
            from flywheel.demo.parl_agent import ParlAgent

            return ParlAgent(fw, router, api_key=api_key, concurrency=config.concurrency, seed=config.seed)
        from flywheel.demo.agent import DemoAgent

        return DemoAgent(fw, router, api_key=api_key, concurrency=config.concurrency, seed=config.seed)


PARL_MAX_SAMPLES = 384
"""Most samples a parl cycle trains on (the calculator's demo: 768)."""
PARL_CANARY: dict[str, Any] = {"non_inferiority_margin": 0.10, "variance": "empirical", "cs_target_sessions": 200}
"""The parl demo's canary: about one session a second reaches the fleet (half of them the canary's).
At the calculator's 5-point margin a canary 10 points better needs a median of 489 canary sessions
to be promoted (16 minutes), at these settings 236 (``bench/canary.py --settings``, stable at 32 %,
docs/scenarios.md). The price, for the demo only: equal canaries are promoted too, and one 5 points
worse about half the time; one 20 points worse is still rolled back. Each candidate has passed the
gate's held-out measurement first."""

SCENARIOS: dict[str, Scenario] = {
    "arith": Scenario("arith", "arith", replicas=2),
    "parl": Scenario("parl", "parl", replicas=3, metric="critical_steps", pinned_roles=("subagent",),
                     anneal_share=0.5, target_gain_points=10.0),
}  # fmt: skip


def scenario(name: str) -> Scenario:
    """The scenario ``name``; ValueError naming the known ones."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None


def now() -> datetime:
    return datetime.now(UTC)
