"""``make demo`` / ``flywheel demo``: bring the stack up, exercise every part, summarise, shut down.

Today the demo is a smoke run of the real stack: the broker carries records through a
consumer group, Postgres is migrated, Redis answers, every vLLM replica plays episodes
of the synthetic task through its OpenAI-compatible API, and a product-style agent logs
sessions through the SDK that a real ingest consumer writes to Postgres. The full flywheel
(traffic → rewards → training → canary → promotion) replaces the middle part as the
later pieces land.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from flywheel.core.kafka_security import KafkaSecurity
from flywheel.core.settings import Settings, get_settings

if TYPE_CHECKING:
    from flywheel.core.contracts.checkpoint import HeldoutResult
    from flywheel.model.check import ModelInfo

console = Console(width=120)


@dataclass
class Check:
    """One line of the summary."""

    part: str
    where: str
    ok: bool
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)


def _kafka_round_trip(bootstrap: str, security: KafkaSecurity, n: int = 100) -> Check:
    from kafka.admin import NewTopic

    from flywheel.core import kafka_clients

    topic = f"flywheel.demo.smoke.{uuid.uuid4().hex[:8]}"
    admin = kafka_clients.admin(bootstrap, security=security, client_id="flywheel-demo")
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    admin.close()
    started = time.perf_counter()
    producer = kafka_clients.producer(bootstrap, security=security, acks="all")
    for i in range(n):
        producer.send(topic, key=f"session-{i % 7}".encode(), value=json.dumps({"i": i}).encode())
    producer.flush()
    producer.close()
    consumer = kafka_clients.consumer(
        bootstrap,
        topic,
        security=security,
        group_id=f"flywheel-demo-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_interval_ms=6000,
        session_timeout_ms=6000,
        consumer_timeout_ms=15000,
    )
    seen: set[int] = set()
    for record in consumer:
        seen.add(json.loads(record.value)["i"])
        if len(seen) == n:
            break
    consumer.commit()
    consumer.close()
    took = time.perf_counter() - started
    return Check(
        "broker", bootstrap, len(seen) == n, f"{len(seen)}/{n} records through a consumer group in {took:.1f} s"
    )


def _postgres(url: str) -> Check:
    from flywheel.core.db import migrate

    migrate.upgrade(url)
    revision = migrate.current(url)
    return Check("postgres", url.split("@")[-1], revision is not None, f"migrated to {revision}")


def _redis(url: str) -> Check:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=3)
    ok = bool(client.ping())
    version = client.info("server").get("redis_version", "?")
    client.close()
    return Check("redis", url, ok, f"PING ok, redis {version}")


def _replica(url: str, episodes: int) -> Check:
    from openai import OpenAI

    from flywheel.core.vllm_admin import weight_info
    from flywheel.task.arith import run_episode, sample_problems

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    served = client.models.list().data[0].id

    def generate(messages: list[dict[str, str]]) -> str:
        out = client.chat.completions.create(model=served, messages=messages, max_tokens=24, temperature=1.0)
        return out.choices[0].message.content or ""

    solved = sum(run_episode(p, generate).success for p in sample_problems("heldout", episodes, seed=7))
    version = weight_info(url)
    return Check(
        "vllm",
        url,
        True,
        f"weight version {version}, {solved}/{episodes} held-out episodes solved live",
        {"weight_version": version, "live_success": solved / episodes},
    )


def _sessions_through_ingest(settings: Settings, bootstrap: str, db_url: str, vllm_url: str, n: int) -> Check:
    """Play n task sessions with the SDK-wrapped openai client; check every event lands in Postgres once."""
    import os
    import subprocess
    import sys

    import psycopg
    from openai import OpenAI

    from flywheel.sdk import Flywheel
    from flywheel.stack.endpoints import libpq_conninfo
    from flywheel.task.arith import run_episode, sample_problems

    env = dict(os.environ)
    env.update(
        {
            "FLYWHEEL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "FLYWHEEL_POSTGRES__URL": db_url,
            "FLYWHEEL_INGEST__MAX_POLL_INTERVAL_MS": "6000",
        }
    )
    log = Path(settings.run_dir) / "logs" / "ingest-consumer.log"
    consumer = subprocess.Popen(
        [sys.executable, "-m", "ingest.main", "consume"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    project = f"demo-{uuid.uuid4().hex[:6]}"
    try:
        fw = Flywheel(
            project=project, transport="kafka", kafka_bootstrap=bootstrap, spool_dir=Path(settings.run_dir) / "spool"
        )
        client = fw.wrap_openai(OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0, timeout=60))
        served = client.models.list().data[0].id
        solved = 0
        for problem in sample_problems("heldout", n, seed=11):
            with fw.session(user_id="demo-user", task=problem.kind, group_key=problem.id) as s:

                def generate(messages: list[dict[str, str]]) -> str:
                    out = client.chat.completions.create(model=served, messages=messages, max_tokens=24)
                    return out.choices[0].message.content or ""

                episode = run_episode(problem, generate)
                for turn in episode.turns:
                    if turn.tool_call is not None:
                        call_id = s.tool_call("calc", turn.completion)
                        s.tool_result(call_id, turn.tool_result or "", is_error=turn.tool_error)
                s.outcome("task_solved", episode.success)
                solved += episode.success
        fw.flush()
        expected = fw.stats.sent
        fw.close()
        deadline = time.monotonic() + 60
        with psycopg.connect(libpq_conninfo(db_url)) as conn:
            while True:
                rows, distinct, completions, with_tokens = conn.execute(
                    "SELECT count(*), count(DISTINCT event_id), count(*) FILTER (WHERE type = 'completion'),"
                    " count(*) FILTER (WHERE type = 'completion' AND payload ? 'logprobs')"
                    " FROM raw_events WHERE project = %s",
                    (project,),
                ).fetchone()
                if rows >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        consumer.terminate()
        consumer.wait(30)
    ok = rows == distinct == expected and completions > 0 and with_tokens == completions
    return Check(
        "sdk → ingest",
        f"{project} → raw_events",
        ok,
        f"{n} sessions ({solved} solved): {rows}/{expected} events in Postgres once each, "
        f"{with_tokens}/{completions} completions with token ids and logprobs",
    )


def _summary(checks: list[Check], model: ModelInfo, held: HeldoutResult | None) -> Table:
    table = Table(title="Flywheel stack: smoke run", show_lines=False)
    for col in ("part", "where", "ok", "detail"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.part, c.where, "[green]yes[/]" if c.ok else "[red]NO[/]", c.detail)
    table.caption = f"base model {model.policy_version} ({model.architecture}, {model.parameters:,} parameters)"
    if held is not None:  # the project's build measured its held-out success
        table.caption += (
            f": held-out success {held.success_rate:.1%} (n={held.n}, sampled at T={getattr(held, 'temperature', '?')})"
        )
    return table


def run_smoke(keep_up: bool = False, replicas: int = 2, episodes: int = 20, settings: Settings | None = None) -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    from flywheel.model.base import base_model_dir
    from flywheel.model.check import check_model
    from flywheel.model.register import build_heldout
    from flywheel.stack import ComponentFailed, down, up
    from flywheel.stack.endpoints import kafka_bootstrap, postgres_url, redis_url, vllm_urls

    settings = settings or get_settings()
    if not settings.vllm.urls:
        settings = settings.model_copy(update={"vllm": settings.vllm.model_copy(update={"replicas": replicas})})
    console.rule("[bold]Flywheel demo")
    console.print("resolving the base model (building the project's model if it is the one and not built) ...")
    model_dir = base_model_dir(settings.model, build=True)
    model_info = check_model(model_dir, settings.model.completion_only, settings.model.cache_dir)
    held = next(iter((build_heldout(model_dir) or {}).values()), None)
    console.print(f"model: {model_dir} ({model_info.policy_version}, {model_info.architecture})")
    console.print("starting the stack (broker, Postgres, Redis, vLLM) ...")
    started = time.perf_counter()
    try:
        up(settings, model_dir=model_dir)
    except ComponentFailed as exc:
        console.print(f"[red]stack failed to start[/]: {exc}")
        return 1
    console.print(f"stack healthy in {time.perf_counter() - started:.0f} s")
    checks: list[Check] = []
    try:
        checks.append(_kafka_round_trip(kafka_bootstrap(settings), settings.kafka.security()))
        checks.append(_postgres(postgres_url(settings)))
        checks.append(_redis(redis_url(settings)))
        for url in vllm_urls(settings):
            checks.append(_replica(url, episodes))
        checks.append(
            _sessions_through_ingest(
                settings, kafka_bootstrap(settings), postgres_url(settings), vllm_urls(settings)[0], episodes
            )
        )
    finally:
        console.print(_summary(checks, model_info, held))
        if keep_up:
            console.print("stack left running: `flywheel status`, `flywheel down`")
        else:
            down(settings)
            console.print("stack stopped")
    return 0 if checks and all(c.ok for c in checks) else 1
