"""Migrations against a real Postgres: apply, agree with the models, roll back."""

from __future__ import annotations

import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, make_url, text

from flywheel.core.db import migrate
from flywheel.core.db.models import Base

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_db(pg_url):
    """A brand-new empty database on the test server, dropped afterwards."""
    name = f"fw_mig_{uuid.uuid4().hex[:10]}"
    admin = create_engine(make_url(pg_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_matches_models_and_downgrade_empties(empty_db):
    head = ScriptDirectory.from_config(migrate.alembic_config(empty_db)).get_current_head()
    assert migrate.current(empty_db) is None

    migrate.upgrade(empty_db)
    assert migrate.current(empty_db) == head
    assert set(Base.metadata.tables) <= _tables(empty_db)

    engine = create_engine(empty_db)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations disagree: {diff}"

    migrate.downgrade(empty_db, "base")
    assert migrate.current(empty_db) is None
    assert _tables(empty_db) - {"alembic_version"} == set()

    migrate.upgrade(empty_db)  # and back up again from base
    assert migrate.current(empty_db) == head


def test_schema_enforces_invariants(empty_db):
    migrate.upgrade(empty_db)
    engine = create_engine(empty_db)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO checkpoints (id, policy_version, base_model, path, format, status) "
                    "VALUES ('c1', 'v1', 'base', '/x', 'full', 'candidate'), "
                    "('c2', 'v2', 'base', '/y', 'full', 'candidate')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO deployments (fleet, checkpoint_id, role, weight, status) "
                    "VALUES ('default', 'c1', 'stable', 1.0, 'active')"
                )
            )
        # a second active stable in the same fleet is refused
        with pytest.raises(Exception, match="uq_deployments_active_role"):
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO deployments (fleet, checkpoint_id, role, weight, status) "
                        "VALUES ('default', 'c2', 'stable', 1.0, 'active')"
                    )
                )
        # a writer key must be scoped to a project
        with pytest.raises(Exception, match="writer_has_project"):
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO api_keys (name, role, token_prefix, token_hash) VALUES ('k', 'writer', 'fw_', 'h')"
                    )
                )
        # and so must a router product key
        with pytest.raises(Exception, match="product_has_project"):
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO api_keys (name, role, token_prefix, token_hash) "
                        "VALUES ('p', 'product', 'fwp_', 'h')"
                    )
                )
        # reward versions are unique per session
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO rewards "
                    "(project, session_id, version, reward, components, extractor_versions, config_hash)"
                    " VALUES ('p', 's', 1, 0.5, '{}', '{}', 'h')"
                )
            )
        with pytest.raises(Exception, match="uq_rewards_session_version"):
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO rewards (project, session_id, version, reward, components, extractor_versions,"
                        " config_hash) VALUES ('p', 's', 1, 0.9, '{}', '{}', 'h')"
                    )
                )
    finally:
        engine.dispose()
