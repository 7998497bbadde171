"""Engines and sessions. One engine per process and URL."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import sessionmaker

from flywheel.core.endpoints import postgres_url
from flywheel.core.settings import get_settings


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """A pooled engine for ``url`` (``postgresql+psycopg://...``); reconnects after a server restart."""
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, future=True)


def session_factory(url: str) -> sessionmaker:
    """A session factory bound to the engine of ``url``."""
    return sessionmaker(get_engine(url), expire_on_commit=False)


def default_url() -> str:
    """The database URL from settings."""
    return postgres_url(get_settings())
