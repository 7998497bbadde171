"""The trainer's Celery app: Redis broker and result backend, the beat schedule, the worker's metrics.

    celery -A trainer.celery_app worker -Q trainer --concurrency 1
    celery -A trainer.celery_app beat

(or ``flywheel-trainer worker`` / ``flywheel-trainer beat``). Settings are read once at
import (``FLYWHEEL_REDIS__URL``, ``FLYWHEEL_TRAINER__SCHEDULE__INTERVAL_S``, ...); torch is
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

from flywheel.core.endpoints import redis_url
from flywheel.core.settings import Settings, get_settings
from trainer.metrics import serve

TASK_NAME = "trainer.train_cycle"
BEAT_ENTRY = "train-cycle"


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from ``settings``."""
    settings = settings or get_settings()
    schedule = settings.trainer.schedule
    url = redis_url(settings)
    app = Celery("flywheel-trainer", broker=url, backend=url, include=["trainer.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=schedule.queue,
        task_routes={TASK_NAME: {"queue": schedule.queue}},
        task_track_started=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=7 * 86400,
        broker_transport_options={"visibility_timeout": int(schedule.time_limit_s) + 300},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_schedule={
            BEAT_ENTRY: {
                "task": TASK_NAME,
                "schedule": timedelta(seconds=schedule.interval_s),
                "kwargs": {"trigger": "beat"},
                "options": {"queue": schedule.queue, "expires": schedule.interval_s},
            }
        },
    )
    return app


app = make_app()


@signals.worker_init.connect
def _serve_metrics(**_: Any) -> None:
    """Serve the trainer's Prometheus text file from the worker's main process."""
    metrics = get_settings().trainer.metrics
    if metrics.port is not None:
        serve(metrics.port, metrics.textfile)
