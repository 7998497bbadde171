"""The demo's report folder: a plot, the canary decisions and a JSON summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serving.overview import Snapshot


def write_report(folder: Path, snap: Snapshot, summary: dict[str, Any]) -> dict[str, Path]:
    """Write ``flywheel.png``, ``decisions.json``, ``checkpoints.json`` and ``summary.json`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "plot": folder / "flywheel.png",
        "decisions": folder / "decisions.json",
        "checkpoints": folder / "checkpoints.json",
        "summary": folder / "summary.json",
    }
    data = snap.to_dict()
    paths["decisions"].write_text(json.dumps(data["decisions"], indent=2, default=str))
    paths["checkpoints"].write_text(json.dumps(data["checkpoints"], indent=2, default=str))
    paths["summary"].write_text(json.dumps(summary, indent=2, default=str))
    plot(paths["plot"], snap, summary)
    return paths


def plot(path: Path, snap: Snapshot, summary: dict[str, Any]) -> None:
    """Held-out and live success per checkpoint, in creation order; promoted ones joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in snap.checkpoints if c.heldout is not None or c.live_sessions]
    x = list(range(len(rows)))
    served = [i for i, c in enumerate(rows) if c.parent_id is None or c.canary_outcome == "promoted"]
    fig, ax = plt.subplots(figsize=(9.5, 5), dpi=120)
    ax.plot([x[i] for i in served], [rows[i].heldout for i in served], marker="o", linewidth=2.2, color="tab:blue",
            label="held-out success of the promoted line (eval gate, n=200)")  # fmt: skip
    others = [i for i in x if i not in served and rows[i].heldout is not None]
    ax.scatter([x[i] for i in others], [rows[i].heldout for i in others], color="tab:blue", alpha=0.35,
               label="held-out success of other candidates")  # fmt: skip
    live = [i for i in x if rows[i].live_success is not None]
    ax.scatter([x[i] for i in live], [rows[i].live_success for i in live], marker="s", color="tab:orange",
               label="live success of served sessions", zorder=3)  # fmt: skip
    for i, c in enumerate(rows):
        label = {"promoted": "promoted", "rolled_back": "rolled back", "failed": "swap failed", "active": "canary"}.get(
            c.canary_outcome or "", "base" if c.parent_id is None else "not deployed"
        )
        y = c.heldout if c.heldout is not None else c.live_success or 0
        color = "tab:red" if c.canary_outcome == "rolled_back" else "dimgray"
        ax.annotate(label, (i, y), textcoords="offset points", xytext=(0, -15), ha="center", fontsize=7, color=color)
    ax.set_xticks(x, [c.policy_version for c in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate")
    ax.set_xlabel("checkpoint (creation order)")
    ax.grid(alpha=0.3)
    base, final = summary.get("base_success"), summary.get("final_success")
    heldout = f"held-out success {base:.0%} → {final:.0%}" if base is not None and final is not None else "checkpoints"
    scenario = summary.get("scenario")
    title = (
        f"Flywheel{f' ({scenario})' if scenario and scenario != 'arith' else ''}: {heldout} "
        f"in {summary.get('minutes', 0):.1f} min from live traffic ({summary.get('promotions', 0)} promoted, "
        f"{summary.get('rollbacks', 0)} rolled back)"
    )
    metric = summary.get("metric")  # the scenario's own held-out figure, before and after
    if metric and summary.get(f"{metric}_before") is not None and summary.get(f"{metric}_after") is not None:
        title += f"\n{metric.replace('_', ' ')} {summary[f'{metric}_before']:.2f} → {summary[f'{metric}_after']:.2f}"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
