"""The router's public surface: product keys, per-key rate limits, the size limit, metrics off the public port.

A real router (uvicorn in a thread, its refresh and probe loops running) in front of the
session's real vLLM replica, with its routing table and its keys in a real, migrated Postgres.
Keys are made by the real CLI (``flywheel keys create --role product``) and by
:func:`flywheel.core.auth.create_key`, as the demo makes them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import VllmReplica, free_port, running_router, wait_for
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.cli import app as cli_app
from flywheel.core.auth import create_key, hash_token, revoke_key
from flywheel.core.contracts import Completion
from flywheel.core.db.engine import get_engine
from flywheel.core.db.models import ApiKey
from flywheel.core.settings import Settings
from flywheel.demo.loop import product_key
from flywheel.sdk import Flywheel
from flywheel.sdk.transports.memory import MemoryTransport
from serving.proxy.router import Router

pytestmark = pytest.mark.integration

FLEET = "keys-test"
PROJECT = "shop"
LIMIT = 4096


@dataclass
class Served:
    """The router's public and metrics addresses, the app (to read its state) and the database."""

    url: str
    metrics_url: str
    router: Router
    engine: Engine
    db_url: str
    model: str
    version: str
    replica_id: int


def new_key(engine: Engine, role: str = "product", project: str | None = PROJECT, **limits: Any) -> tuple[int, str]:
    with Session(engine) as session:
        info, token = create_key(session, name=f"{role}-{time.monotonic_ns()}", role=role, project=project, **limits)
        session.commit()
    return info.id, token


@pytest.fixture(scope="module")
def served(db_url: str, stack_settings: Settings, vllm_replica: VllmReplica) -> Iterator[Served]:
    """The router for a fleet of the session's replica (serving its weight version as the stable)."""
    engine = get_engine(db_url)
    metrics_port = free_port()
    with running_router(engine, stack_settings, vllm_replica, fleet=FLEET, name="router-keys", projects=[PROJECT],
                        max_request_bytes=LIMIT, router_metrics_port=metrics_port) as run:  # fmt: skip
        yield Served(run.url, f"http://127.0.0.1:{metrics_port}", run.router, engine, db_url, vllm_replica.model,
                     run.version, run.replica_id)  # fmt: skip


def complete(served: Served, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": served.model, "prompt": "2+2=", "max_tokens": 2, **body}
    return httpx.post(f"{served.url}/v1/completions", json=payload, headers=headers or {}, timeout=60)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def test_a_product_key_gets_completions_through_the_openai_client(served: Served) -> None:
    key = product_key(served.engine, PROJECT)  # as the demo makes its agent's key
    with Session(served.engine) as s:
        key_id = s.scalar(select(ApiKey.id).where(ApiKey.token_hash == hash_token(key)))
    assert key.startswith("fwp_") and key_id is not None
    client = openai.OpenAI(api_key=key, base_url=f"{served.url}/v1", max_retries=0)
    raw = client.completions.with_raw_response.create(model=served.model, prompt="1+1=", max_tokens=4)
    assert raw.http_response.status_code == 200 and raw.parse().choices[0].text is not None
    assert raw.headers["x-flywheel-policy-version"] == served.version
    assert [m.id for m in client.models.list().data]  # /v1/models takes the key too

    def used() -> bool:  # the router writes last_used_at with its next read of the keys
        with Session(served.engine) as s:
            return s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id)) is not None

    wait_for(used, 10, "the key's last_used_at recorded")


def test_the_sdks_wrapped_client_sends_the_product_key_and_logs_the_routed_version(
    served: Served, tmp_path: Path
) -> None:
    _, key = new_key(served.engine)
    with Flywheel(project=PROJECT, transport=MemoryTransport(), spool_dir=tmp_path) as fw:
        client = fw.wrap_openai(openai.OpenAI(api_key=key, base_url=f"{served.url}/v1", max_retries=0))
        with fw.session():
            client.chat.completions.create(
                model=served.model, messages=[{"role": "user", "content": "3+4="}], max_tokens=4
            )
        assert fw.flush(10)
        (completion,) = [e for e in fw.transport.events() if isinstance(e, Completion)]
    assert completion.policy_version == served.version
    unkeyed = Flywheel(project=PROJECT, transport=MemoryTransport(), spool_dir=tmp_path / "b")
    try:
        bad = unkeyed.wrap_openai(openai.OpenAI(api_key="unused", base_url=f"{served.url}/v1", max_retries=0))
        with pytest.raises(openai.AuthenticationError, match="unknown product key"):
            bad.completions.create(model=served.model, prompt="1", max_tokens=1)
    finally:
        unkeyed.close(2)


def test_missing_unknown_revoked_and_wrong_keys_are_refused_with_a_reason(served: Served) -> None:
    missing = complete(served)
    assert missing.status_code == 401 and "missing product key" in message(missing)
    assert missing.headers["www-authenticate"] == "Bearer"
    malformed = complete(served, {"Authorization": "Basic dXNlcjpwYXNz"})
    assert malformed.status_code == 401 and "malformed" in message(malformed)
    unknown = complete(served, bearer("fwp_" + "x" * 32))
    assert unknown.status_code == 401 and message(unknown) == "unknown product key"
    with pytest.raises(openai.AuthenticationError, match="unknown product key"):
        openai.OpenAI(api_key="fwp_not-a-key", base_url=f"{served.url}/v1", max_retries=0).models.list()

    _, writer = new_key(served.engine, role="writer")
    wrong_role = complete(served, bearer(writer))
    assert wrong_role.status_code == 403 and "role writer" in message(wrong_role)
    _, ops = new_key(served.engine, role="operator", project=None)
    assert complete(served, bearer(ops)).status_code == 403
    _, foreign = new_key(served.engine, project="billing")
    wrong_project = complete(served, bearer(foreign))
    assert wrong_project.status_code == 403
    assert "scoped to project 'billing'" in message(wrong_project) and PROJECT in message(wrong_project)

    key_id, key = new_key(served.engine)
    assert complete(served, bearer(key)).status_code == 200  # new: found at the router's next read
    with Session(served.engine) as s:
        revoke_key(s, key_id)
        s.commit()
    revoked = wait_for(lambda: (r := complete(served, bearer(key))).status_code == 401 and r, 5, "revocation seen")
    assert "revoked" in message(revoked)


def test_a_key_over_its_rate_gets_429_with_retry_after_and_passes_again_after_it(served: Served) -> None:
    created = CliRunner().invoke(
        cli_app,
        ["keys", "create", "--role", "product", "--project", PROJECT, "--name", "slow", "--rate-per-s", "0.2",
         "--burst", "1", "--db-url", served.db_url],
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("fwp_")
    listed = CliRunner().invoke(cli_app, ["keys", "list", "--role", "product", "--db-url", served.db_url])
    assert listed.exit_code == 0 and "slow" in listed.stdout and "0.2 req/s burst 1" in listed.stdout

    assert complete(served, bearer(key)).status_code == 200
    limited = complete(served, bearer(key))
    assert limited.status_code == 429, limited.text
    assert "0.2 requests/s, burst 1" in message(limited)
    retry_after = int(limited.headers["retry-after"])  # a token every 5 s, less the first request's time
    assert 1 <= retry_after <= 5
    _, other = new_key(served.engine)  # every key has its own bucket
    assert complete(served, bearer(other)).status_code == 200
    time.sleep(retry_after)
    assert complete(served, bearer(key)).status_code == 200

    bad = CliRunner().invoke(cli_app, ["keys", "create", "--role", "reader", "--project", PROJECT, "--name", "x",
                                       "--db-url", served.db_url])  # fmt: skip
    assert bad.exit_code == 2 and "--role: must be one of writer, product" in bad.output


def test_a_body_over_the_limit_gets_413_naming_the_limit(served: Served) -> None:
    _, key = new_key(served.engine)
    too_big = complete(served, bearer(key), prompt="x" * LIMIT)
    assert too_big.status_code == 413
    assert f"limit of {LIMIT} bytes (serving.max_request_bytes)" in message(too_big)
    streamed = httpx.post(  # no content-length: the limit holds while the body is read
        f"{served.url}/v1/completions", content=iter([b"{" + b" " * LIMIT, b"}"]), headers=bearer(key), timeout=30
    )
    assert streamed.status_code == 413 and "serving.max_request_bytes" in message(streamed)
    unkeyed = httpx.post(f"{served.url}/v1/completions", content=b"x" * (LIMIT + 1), timeout=30)
    assert unkeyed.status_code == 401  # the key is checked before the body is read


def test_metrics_are_off_the_public_port_and_name_replicas_by_id(served: Served) -> None:
    _, key = new_key(served.engine)
    assert complete(served, bearer(key)).status_code == 200
    assert complete(served).status_code == 401
    for path in ("/metrics", "/router/metrics"):
        assert httpx.get(served.url + path).status_code == 404
    text = httpx.get(f"{served.metrics_url}/metrics", timeout=10).text
    assert re.search(rf'flywheel_router_requests_total\{{[^}}]*replica="{served.replica_id}"', text), text[:2000]
    assert 'flywheel_router_refused_total{code="missing_api_key"}' in text
    assert "127.0.0.1:" not in text.replace(served.metrics_url, "")  # no replica URL anywhere
    assert served.router.cfg.router_metrics_host == "127.0.0.1"
