"""Settings: the Postgres database."""

from __future__ import annotations

from pydantic import BaseModel, Field


class PostgresSettings(BaseModel):
    """The Postgres database that holds events, rewards, samples and the registry."""

    url: str | None = None
    """SQLAlchemy URL of an existing database; ``None`` uses the machine's server or an embedded one."""
    host: str = "127.0.0.1"
    """Host of the machine's Postgres server, tried first when ``url`` is unset."""
    port: int = Field(5432, ge=1, le=65535)
    """Port of the machine's Postgres server."""
    user: str = "postgres"
    """Role used on the machine's (trust-auth) server or the embedded one."""
    database: str = Field("flywheel", pattern=r"^[a-z_][a-z0-9_]*$")
    """Database name; created if missing."""
    embedded_port: int = Field(15432, ge=1024, le=65535)
    """Port of the embedded server started when no server is reachable."""
