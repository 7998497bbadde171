"""Settings: redis, the Celery broker."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RedisSettings(BaseModel):
    """Redis, the Celery broker and result backend."""

    url: str | None = None
    """URL of an existing Redis; ``None`` uses the machine's at 127.0.0.1:6379 or starts one."""
    host: str = "127.0.0.1"
    """Host of the machine's Redis, tried first when ``url`` is unset."""
    port: int = Field(6379, ge=1, le=65535)
    """Port of the machine's Redis."""
    local_port: int = Field(16379, ge=1024, le=65535)
    """Port of the Redis that the stack starts when none is reachable."""
