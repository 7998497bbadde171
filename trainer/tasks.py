"""Celery tasks of the trainer: thin wrappers that take ids and call ``trainer.cycle``."""

from __future__ import annotations

from typing import Any

from flywheel.core.settings import get_settings
from trainer.celery_app import TASK_NAME, app

_LIMIT = get_settings().trainer.schedule.time_limit_s


@app.task(
    name=TASK_NAME,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=_LIMIT + 30,
    time_limit=_LIMIT + 120,
)
def train_cycle(self: Any, trigger: str = "beat", idempotency_key: str | None = None) -> dict[str, Any]:
    """Run one training cycle; ``idempotency_key`` defaults to the task id (the same on redelivery).

    The cycle enforces ``trainer.schedule.time_limit_s`` itself (any pool); Celery's soft and hard
    limits, a little later, back it up in the prefork pool.
    """
    from trainer.cycle import run_cycle  # here, not at the top: the worker's main process does not load torch

    key = idempotency_key or f"{trigger}:{self.request.id}"
    return run_cycle(key, trigger).to_dict()
