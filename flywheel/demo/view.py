"""The demo's live progress view in the terminal (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from serving.overview import Snapshot


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def render(snap: Snapshot, agent: dict[str, Any], elapsed_s: float, budget_s: float) -> Group:
    """One frame: the pipeline counters, the deployment, and the checkpoints with their numbers."""
    head = Table.grid(padding=(0, 3))
    for _ in range(4):
        head.add_column()
    stable = snap.stable["policy_version"] if snap.stable else "-"
    if snap.canary:
        canary = f"{snap.canary['policy_version']} at {snap.canary['weight']:.0%}"
    else:
        canary = "none"
    decision = "-"
    if snap.last_decision:
        details = snap.last_decision.get("details") or {}
        decision = f"{details.get('action', snap.last_decision['action'])}: {details.get('reason', '')}"[:90]
    head.add_row(
        "time", f"{elapsed_s / 60:.1f} / {budget_s / 60:.0f} min", "sessions played", str(agent.get("sessions", 0))
    )
    head.add_row("events in Postgres", str(snap.raw_events), "failed requests", str(agent.get("failed_requests", 0)))
    head.add_row("rewards", str(snap.rewards), "training samples", str(snap.samples))
    cycles = ", ".join(f"{k} {v}" for k, v in sorted(snap.cycles.items())) or "-"
    last = snap.last_cycle
    head.add_row("cycles", cycles, "last cycle", f"{last['status']}: {last['reason'] or ''}"[:60] if last else "-")
    head.add_row("serving (stable)", stable, "canary", canary)
    head.add_row("promotions", str(snap.promotions), "rollbacks", str(snap.rollbacks))
    head.add_row("canary verdict", decision, "", "")

    table = Table(title="checkpoints", expand=True)
    for col in ("policy version", "parent", "status", "role", "held-out", "live success", "live reward", "sessions"):
        table.add_column(col)
    for c in snap.checkpoints[-12:]:
        table.add_row(
            c.policy_version, (c.parent_id or "-")[:20], c.status, c.deployed_as or "", _pct(c.heldout),
            _pct(c.live_success), "-" if c.live_reward is None else f"{c.live_reward:+.2f}", str(c.live_sessions),
        )  # fmt: skip
    return Group(Panel(head, title="Flywheel: learning from its own traffic"), table)
