"""The trainer's Celery app: Redis broker and result backend, the beat schedule, the worker's metrics.

    celery -A trainer.celery_app worker -Q trainer --concurrency 1
    celery -A trainer.celery_app beat

(or ``flywheel-trainer worker`` / ``flywheel-trainer beat``). Settings are read once at
import (``FLYWHEEL_REDIS__URL``, ``FLYWHEEL_TRAINER__SCHEDULE_SECONDS``, ...); torch is
not imported here: the task imports it when a cycle runs.

Delivery: ``acks_late`` with ``prefetch_multiplier=1`` and ``reject_on_worker_lost``, so a
task whose worker dies is delivered again; the cycle is idempotent per task id, so a second
delivery only records what happened (see ``trainer.cycle``). The Redis visibility timeout
is the cycle time limit plus a margin, so a task is not handed to a second worker while the
first may still be running it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import Celery, signals

from flywheel.core.settings import Settings, get_settings

TASK_NAME = "trainer.train_cycle"
BEAT_ENTRY = "train-cycle"


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from ``settings``."""
    from flywheel.core.endpoints import redis_url

    settings = settings or get_settings()
    t = settings.trainer
    url = redis_url(settings)
    app = Celery("flywheel-trainer", broker=url, backend=url, include=["trainer.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=t.queue,
        task_routes={TASK_NAME: {"queue": t.queue}},
        task_track_started=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=7 * 86400,
        broker_transport_options={"visibility_timeout": int(t.time_limit_s) + 300},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_schedule={
            BEAT_ENTRY: {
                "task": TASK_NAME,
                "schedule": timedelta(seconds=t.schedule_seconds),
                "kwargs": {"trigger": "beat"},
                "options": {"queue": t.queue, "expires": t.schedule_seconds},
            }
        },
    )
    return app


app = make_app()


@signals.worker_init.connect
def _serve_metrics(**_: Any) -> None:
    """Serve the trainer's Prometheus text file from the worker's main process."""
    t = get_settings().trainer
    if t.metrics_port is not None:
        from trainer.metrics import serve

        serve(t.metrics_port, t.metrics_textfile)
