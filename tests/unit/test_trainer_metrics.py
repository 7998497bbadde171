"""Prometheus: the text file the training process writes is what the worker's endpoint serves."""

from __future__ import annotations

import socket
import urllib.request

from trainer.metrics import TrainerMetrics, serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_step_and_cycle_metrics_reach_the_http_endpoint(tmp_path):
    textfile = tmp_path / "trainer.prom"
    metrics = TrainerMetrics(textfile)
    metrics.on_step({"step": 0.0, "loss": 0.25, "reward_mean": 0.5, "clip_frac": 0.1, "tokens_per_s": 1000.0})
    metrics.on_cycle(
        "candidate", {"loss_before": 0.3, "loss_after": 0.2, "samples": 64}, {"candidate": 2, "skipped": 5}, 1.7e9
    )
    port = free_port()
    serve(port, textfile)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "flywheel_trainer_step_loss 0.25" in body
    assert "flywheel_trainer_cycle_loss_after 0.2" in body
    assert 'flywheel_trainer_cycles{status="skipped"} 5.0' in body
    # A later write by another process shows on the next scrape.
    TrainerMetrics(textfile).on_step({"step": 3.0, "loss": 0.125})
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "flywheel_trainer_step_loss 0.125" in body
