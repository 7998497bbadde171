"""Prometheus metrics of the trainer: a text file rewritten after every step and cycle.

The process that trains (a Celery worker child, or ``flywheel-trainer now --inline``)
sets gauges in its own registry and writes them atomically to ``trainer.metrics.textfile``
(node-exporter textfile format). The worker's main process serves that file on
``trainer.metrics.port`` (:func:`serve`), so what Prometheus scrapes is the same whichever
process trained, and survives the child that wrote it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server, write_to_textfile
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "flywheel_trainer"
STEP_FIELDS = {
    "loss": "Loss of the last optimizer step.",
    "reward_mean": "Mean reward of the last step's samples.",
    "adv_mean": "Mean advantage of the last step's samples.",
    "adv_std": "Standard deviation of the last step's advantages.",
    "ratio_mean": "Mean importance ratio (policy / behaviour) over the last step's trained tokens.",
    "ratio_max": "Largest importance ratio of the last step.",
    "clip_frac": "Share of the last step's trained tokens whose ratio was clipped or truncated.",
    "kl": "Mean k3 KL to the parent over the last step's trained tokens.",
    "grad_norm": "Gradient norm of the last step, before clipping.",
    "tokens_per_s": "Training tokens per second of the last step.",
}
CYCLE_FIELDS = {
    "loss_before": "Batch loss of the last trained cycle before its update.",
    "loss_after": "Batch loss of the last trained cycle after its update.",
    "samples": "Samples the last trained cycle used.",
    "gate_candidate_success": "Held-out success of the last gated checkpoint.",
    "gate_parent_success": "Held-out success of the last gated checkpoint's parent.",
    "train_seconds": "Seconds the last cycle's optimizer steps took.",
}


class TrainerMetrics:
    """Gauges of one training process, mirrored to a text file."""

    def __init__(self, textfile: Path) -> None:
        self.textfile = Path(textfile)
        self.registry = CollectorRegistry()
        self.step = {k: Gauge(f"{PREFIX}_step_{k}", doc, registry=self.registry) for k, doc in STEP_FIELDS.items()}
        self.steps_total = Gauge(
            f"{PREFIX}_cycle_steps", "Optimizer steps of the current cycle so far.", registry=self.registry
        )
        self.cycle = {k: Gauge(f"{PREFIX}_cycle_{k}", doc, registry=self.registry) for k, doc in CYCLE_FIELDS.items()}
        self.cycles = Gauge(f"{PREFIX}_cycles", "Cycles in the registry by status.", ["status"], registry=self.registry)
        self.last_cycle = Gauge(
            f"{PREFIX}_last_cycle_timestamp_seconds",
            "When the last cycle of each status finished.",
            ["status"],
            registry=self.registry,
        )

    def on_step(self, metrics: dict[str, float]) -> None:
        """Record one optimizer step and rewrite the file."""
        for key, gauge in self.step.items():
            if key in metrics:
                gauge.set(metrics[key])
        self.steps_total.set(metrics.get("step", 0.0) + 1)
        self.write()

    def on_cycle(self, status: str, summary: dict[str, Any], counts: dict[str, int], finished_at: float) -> None:
        """Record a finished cycle (any status) and the registry's cycle counts, then rewrite the file."""
        for key, gauge in self.cycle.items():
            value = summary.get(key)
            if isinstance(value, (int, float)):
                gauge.set(value)
        for name, count in counts.items():
            self.cycles.labels(status=name).set(count)
        self.last_cycle.labels(status=status).set(finished_at)
        self.write()

    def write(self) -> None:
        """Atomically rewrite the text file."""
        self.textfile.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.textfile), self.registry)


class TextfileCollector:
    """A collector that re-reads the text file on every scrape."""

    def __init__(self, textfile: Path) -> None:
        self.textfile = Path(textfile)

    def collect(self) -> Iterator[Metric]:
        if not self.textfile.is_file():
            return iter(())
        return text_string_to_metric_families(self.textfile.read_text())


def serve(port: int, textfile: Path, addr: str = "127.0.0.1") -> None:
    """Serve the text file's metrics over HTTP on ``port`` (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(TextfileCollector(textfile))  # type: ignore[arg-type]
    start_http_server(port, addr=addr, registry=registry)
