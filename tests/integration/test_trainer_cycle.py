"""Training cycles against real Postgres, Redis, Celery workers and the project's base model.

Samples are real: episodes of the calculator task sampled from the base model with their
sampling logprobs, scored by the task's outcome (``test_trainer_rollouts.sample_rows``).
Every test gets its own throw-away database on the test server and its own checkpoint
folder; Celery tests run real workers (``flywheel-trainer worker``) on a private queue. Every
cycle gates through one real eval-gate vLLM replica (the ``gate_engine_url`` fixture).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import fresh_database
from sqlalchemy import create_engine, select, text
from test_trainer_rollouts import insert_rows, sample_rows

from flywheel.core.db.models import Checkpoint, TrainingCycle
from flywheel.core.settings import Settings, get_settings

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TASK = "trainer.train_cycle"
FAST = {
    "data": {"min_samples": 16, "window_settle_s": 0.0},
    # the held-out split off: these tests train on exactly the rows they insert (tests/unit/test_trainer_gate.py
    # and tests/integration/test_trainer_gate_engine.py test the split and the replay suite)
    "gate": {"suites": {"arith": {"n": 32}}, "holdout_per_mille": 0},
    "step": {"learning_rate": 3e-4, "epochs": 1, "mini_batch_samples": 24, "show_progress": False, "torch_threads": 2},
    "schedule": {"time_limit_s": 600.0},
}


# --------------------------------------------------------------------------- fixtures

GATE: dict[str, str] = {}
"""The eval gate's replica of this module's tests (every cycle gates through it)."""


@pytest.fixture(scope="module", autouse=True)
def _gate_replica(gate_engine_url: str) -> None:
    GATE["engine_url"] = gate_engine_url


@pytest.fixture(scope="module")
def scored_rows(base_model_dir: Path) -> list[dict[str, Any]]:
    """48 real scored episodes: 12 problems x 4 samples (the group key is the problem)."""
    return sample_rows(base_model_dir, n_problems=12, group_size=4, seed=11)


@pytest.fixture
def db_url(pg_url: str) -> Iterator[str]:
    """A fresh, migrated database of this test alone (dropped afterwards)."""
    with fresh_database(pg_url, "trainer_scratch") as url:
        yield url


def make_settings(
    db_url: str, base_model_dir: Path, tmp_path: Path, redis_url: str | None = None, **trainer: Any
) -> Settings:
    """Settings for one test: its database, checkpoint folder, queue and fast training.

    ``trainer`` holds sections (or top-level fields) merged over the fast ones, e.g. ``step={"epochs": 100}``.
    """
    own = {
        "checkpoints": {"dir": tmp_path / "checkpoints"},
        "metrics": {"textfile": tmp_path / "trainer.prom"},
        "schedule": {"queue": f"trainer-test-{uuid.uuid4().hex[:8]}"},
        "gate": {"engine_url": GATE["engine_url"]},
    }
    fields = merged(merged(FAST, own), trainer)
    return Settings(
        environment="test",
        run_dir=tmp_path / "run",
        postgres={"url": db_url},
        redis={"url": redis_url},
        model=get_settings().model.model_copy(update={"cache_dir": base_model_dir.parent}),
        trainer=fields,
    )


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, section by section."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def env_of(settings: Settings) -> dict[str, str]:
    """Environment variables that give a subprocess the same settings (trainer sections as JSON)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {
        "FLYWHEEL_ENVIRONMENT": "test",
        "FLYWHEEL_RUN_DIR": str(settings.run_dir),
        "FLYWHEEL_POSTGRES__URL": str(settings.postgres.url),
        "FLYWHEEL_REDIS__URL": str(settings.redis.url),
        "FLYWHEEL_MODEL__CACHE_DIR": str(settings.model.cache_dir),
        "TQDM_DISABLE": "1",
    }
    for name, value in settings.trainer.model_dump(mode="json").items():
        if value is not None:
            env[f"FLYWHEEL_TRAINER__{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def rows_of(url: str, model: Any) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(model).order_by(model.created_at if model is Checkpoint else model.id)))
    finally:
        engine.dispose()


def trained_checkpoints(url: str) -> list[Any]:
    return [c for c in rows_of(url, Checkpoint) if c.parent_id is not None]


def visible_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def state_dict(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# --------------------------------------------------------------------------- inline cycles


def test_cycle_on_real_samples_trains_a_checkpoint(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.ckpt import read_sidecar
    from trainer.cycle import run_cycle

    ids = insert_rows(db_url, scored_rows)
    settings = make_settings(db_url, base_model_dir, tmp_path)
    outcome = run_cycle("manual:first", "manual", settings)

    assert outcome.status in ("candidate", "rejected"), outcome
    [ckpt] = trained_checkpoints(db_url)
    assert ckpt.id == outcome.checkpoint_id == ckpt.policy_version
    folder = Path(ckpt.path)
    assert folder.resolve().parent == settings.trainer.checkpoints.dir.resolve()
    sidecar = read_sidecar(folder)
    assert sorted(sidecar.sample_ids) == sorted(ids)
    assert sidecar.parent_id == ckpt.parent_id and ckpt.parent_id.startswith("base-")
    [cycle] = rows_of(db_url, TrainingCycle)
    assert sorted(cycle.sample_ids) == sorted(ids)
    assert cycle.checkpoint_id == ckpt.id and cycle.status == ckpt.status

    # The weights moved, and the loss on the cycle's own batch went down.
    before, after = state_dict(base_model_dir), state_dict(folder)
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before)
    assert sidecar.metrics["loss_after"] < sidecar.metrics["loss_before"]
    step = sidecar.steps[0]
    for key in (
        "loss",
        "reward_mean",
        "adv_mean",
        "adv_std",
        "ratio_mean",
        "ratio_max",
        "clip_frac",
        "kl",
        "tokens_per_s",
    ):
        assert key in step
    assert abs(step["ratio_mean"] - 1.0) < 0.05  # on-policy data: ratios start at 1
    assert "passed" in ckpt.status_reason or "regressed" in ckpt.status_reason
    assert ckpt.eval["gate"]["parent"]["n"] == 32

    # Prometheus text file.
    prom = settings.trainer.metrics.textfile.read_text()
    assert "flywheel_trainer_step_loss" in prom and "flywheel_trainer_cycle_loss_after" in prom

    # The same key again replays the outcome; nothing new is written.
    again = run_cycle("manual:first", "manual", settings)
    assert again.replayed and again.checkpoint_id == outcome.checkpoint_id
    assert len(rows_of(db_url, TrainingCycle)) == 1


def test_too_little_data_is_skipped_with_its_reason_and_pause_skips(db_url, base_model_dir, scored_rows, tmp_path):
    from sqlalchemy.orm import Session

    from trainer import registry
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows[:5])
    settings = make_settings(db_url, base_model_dir, tmp_path)
    outcome = run_cycle("manual:few", "manual", settings)
    assert outcome.status == "skipped"
    assert "too few samples: 5 < min_samples 16" in outcome.reason

    with Session(create_engine(db_url)) as session:
        registry.set_paused(session, True, "test", "incident 42")
    paused = run_cycle("manual:paused", "manual", settings)
    assert paused.status == "skipped" and "paused by test" in paused.reason and "incident 42" in paused.reason
    with Session(create_engine(db_url)) as session:
        assert registry.set_paused(session, False, "test").paused is False

    cycles = rows_of(db_url, TrainingCycle)
    assert [c.status for c in cycles] == ["skipped", "skipped"]
    assert trained_checkpoints(db_url) == []
    assert visible_folders(settings.trainer.checkpoints.dir) == []


def test_gate_rejects_a_damaged_checkpoint(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows)
    # A learning rate of 1 on every weight wrecks the policy: the gate must catch it.
    settings = make_settings(db_url, base_model_dir, tmp_path, step={"learning_rate": 1.0, "grad_clip": 1e6})
    outcome = run_cycle("manual:damage", "manual", settings)
    assert outcome.status == "rejected", outcome
    [ckpt] = trained_checkpoints(db_url)
    assert ckpt.status == "rejected"
    gate = ckpt.eval["gate"]
    assert not gate["passed"]
    assert gate["candidate"]["success_rate"] < gate["parent"]["success_rate"] - gate["margin"]
    assert f"{gate['candidate']['success_rate']:.3f} vs parent {gate['parent']['success_rate']:.3f}" in outcome.reason


def test_lora_cycle_writes_an_adapter(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.ckpt import load_policy
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows)
    settings = make_settings(db_url, base_model_dir, tmp_path, mode="lora", step={"learning_rate": 2e-3})
    outcome = run_cycle("manual:lora", "manual", settings)
    assert outcome.status in ("candidate", "rejected"), outcome
    [ckpt] = trained_checkpoints(db_url)
    assert ckpt.format == "lora" and ckpt.base_model == str(base_model_dir.resolve())
    folder = Path(ckpt.path)
    assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    model, _ = load_policy(folder, "lora", ckpt.base_model, trainable=False)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b)  # B starts at zero: it was trained
    assert ckpt.metrics["loss_after"] < ckpt.metrics["loss_before"]


# --------------------------------------------------------------------------- Celery workers


def start_worker(settings: Settings, log: Path, pool: str = "solo", concurrency: int = 1) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "trainer.main",
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--loglevel",
        "INFO",
    ]
    return subprocess.Popen(
        command, env=env_of(settings), cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen, settings: Settings) -> None:
    """Kill the worker (its whole process group) and delete its private queue from Redis."""
    import redis

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    queue = settings.trainer.schedule.queue
    client = redis.Redis.from_url(settings.redis.url)
    for tag, raw in client.hgetall("unacked").items():  # kombu's unacked messages of a killed worker
        if json.loads(raw)[2] == queue:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)
    client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


def client(settings: Settings) -> Any:
    from celery import Celery

    return Celery("trainer-test-client", broker=settings.redis.url, backend=settings.redis.url)


def send(settings: Settings, key: str) -> Any:
    return client(settings).send_task(
        TASK, kwargs={"trigger": "manual", "idempotency_key": key}, queue=settings.trainer.schedule.queue
    )


def wait_for(
    predicate: Any, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker exited while waiting for {what}:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def test_two_concurrent_triggers_produce_one_cycle(db_url, base_model_dir, scored_rows, tmp_path, redis_url):
    insert_rows(db_url, scored_rows)
    settings = make_settings(db_url, base_model_dir, tmp_path, redis_url)
    log = tmp_path / "worker.log"
    worker = start_worker(settings, log, pool="prefork", concurrency=2)
    try:
        first, second = send(settings, "manual:a"), send(settings, "manual:b")
        results = [first.get(timeout=300), second.get(timeout=300)]
    finally:
        stop(worker, settings)
    statuses = sorted(r["status"] for r in results)
    assert statuses[1] == "skipped" and statuses[0] in ("candidate", "rejected"), (results, log.read_text()[-3000:])
    skipped = next(r for r in results if r["status"] == "skipped")
    assert skipped["reason"] == "another cycle is running"
    assert len(trained_checkpoints(db_url)) == 1
    trained = [c for c in rows_of(db_url, TrainingCycle) if c.status != "skipped"]
    assert len(trained) == 1


def test_worker_killed_mid_cycle_leaves_nothing_and_next_cycle_succeeds(
    db_url, base_model_dir, scored_rows, tmp_path, redis_url
):
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows)
    # A long training loop (many epochs) so the kill lands in the middle of it.
    slow = make_settings(db_url, base_model_dir, tmp_path, redis_url, step={"epochs": 100, "mini_batch_samples": 4})
    log = tmp_path / "worker.log"
    worker = start_worker(slow, log, pool="solo")
    try:
        send(slow, "manual:doomed")

        def training() -> Any:
            rows = [c for c in rows_of(db_url, TrainingCycle) if c.status == "running"]
            return rows and rows[0].metrics.get("phase") == "train" and rows[0].metrics.get("step", 0) >= 2

        wait_for(training, 300, "the cycle to reach its training loop", worker, log)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        stop(worker, slow)

    [running] = rows_of(db_url, TrainingCycle)
    assert running.status == "running"  # nobody could record anything
    assert trained_checkpoints(db_url) == []
    assert visible_folders(slow.trainer.checkpoints.dir) == []
    engine = create_engine(db_url)
    with engine.connect() as conn:  # the advisory lock died with the worker's connection
        assert conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")).scalar() == 0
    engine.dispose()

    # The next cycle marks the lost one and trains (the same data is still unconsumed).
    outcome = run_cycle("manual:next", "manual", make_settings(db_url, base_model_dir, tmp_path, redis_url))
    assert outcome.status in ("candidate", "rejected"), outcome
    lost, done = rows_of(db_url, TrainingCycle)
    assert (lost.status, lost.reason) == ("failed", "worker lost")
    assert done.checkpoint_id == outcome.checkpoint_id
    root = slow.trainer.checkpoints.dir
    assert [p.name for p in visible_folders(root)] == [outcome.checkpoint_id]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_two_workers_one_killed_mid_cycle_the_other_takes_the_next_cycle(
    db_url, base_model_dir, scored_rows, tmp_path, redis_url
):
    """Scale-out: two solo workers on one queue. While one trains, a trigger reaches the other and is skipped
    (one cycle at a time across workers); the busy one is killed; the next trigger trains on the other."""
    insert_rows(db_url, scored_rows)
    slow = make_settings(db_url, base_model_dir, tmp_path, redis_url, step={"epochs": 100, "mini_batch_samples": 4})
    fast = make_settings(db_url, base_model_dir, tmp_path, redis_url, schedule={"queue": slow.trainer.schedule.queue})
    logs = [tmp_path / "worker-busy.log", tmp_path / "worker-other.log"]
    busy = start_worker(slow, logs[0])
    other = None
    try:
        doomed = send(slow, "manual:doomed")

        def training() -> Any:
            rows = [c for c in rows_of(db_url, TrainingCycle) if c.status == "running"]
            return rows and rows[0].metrics.get("phase") == "train" and rows[0].metrics.get("step", 0) >= 2

        wait_for(training, 300, "the cycle to reach its training loop", busy, logs[0])
        other = start_worker(fast, logs[1])  # the same queue; the busy worker holds one task at a time
        concurrent = send(fast, "manual:concurrent")
        skipped = concurrent.get(timeout=180)
        assert (skipped["status"], skipped["reason"]) == ("skipped", "another cycle is running"), skipped
        assert concurrent.id in logs[1].read_text() and concurrent.id not in logs[0].read_text()
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait(timeout=30)
        killed_at = time.monotonic()
        result = send(fast, "manual:next").get(timeout=600)
        took = time.monotonic() - killed_at
        assert other.poll() is None, logs[1].read_text()[-3000:]
    finally:
        stop(busy, slow)
        if other is not None:
            stop(other, fast)
    assert doomed.id in logs[0].read_text()
    assert result["status"] in ("candidate", "rejected"), (result, logs[1].read_text()[-3000:])
    rows = rows_of(db_url, TrainingCycle)
    cycles = {c.idempotency_key: c for c in rows if c.idempotency_key}
    assert (cycles["manual:doomed"].status, cycles["manual:doomed"].reason) == ("failed", "worker lost")
    [skipped_row] = [c for c in rows if c.status == "skipped"]  # a skip keeps no key: the trigger may come again
    assert skipped_row.metrics["requested_key"] == "manual:concurrent"
    [trained] = trained_checkpoints(db_url)
    assert cycles["manual:next"].checkpoint_id == trained.id
    print(f"the next cycle finished {took:.1f} s after the busy worker was killed")


def test_windows_advance_and_retention_deletes_old_checkpoints(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.ckpt import read_sidecar
    from trainer.cycle import run_cycle

    settings = make_settings(db_url, base_model_dir, tmp_path, checkpoints={"keep_latest": 1}, parent="latest")
    batches = []
    for i in range(3):
        batches.append(insert_rows(db_url, scored_rows[16 * i : 16 * (i + 1)]))
        outcome = run_cycle(f"manual:{i}", "manual", settings)
        assert outcome.status in ("candidate", "rejected"), outcome
        # Each cycle trains on exactly the rows that arrived since the previous checkpoint.
        assert sorted(read_sidecar(Path(trained_checkpoints(db_url)[-1].path)).sample_ids) == sorted(batches[-1])
    checkpoints = trained_checkpoints(db_url)
    assert len(checkpoints) == 3
    deleted = [c for c in checkpoints if c.status == "deleted"]
    kept = [c for c in checkpoints if c.status != "deleted"]
    assert deleted and checkpoints[-1] in kept  # the latest is always kept
    assert all(not Path(c.path).exists() for c in deleted)
    assert all(Path(c.path).is_dir() for c in kept)
    assert Path(rows_of(db_url, Checkpoint)[0].path).is_dir()  # the base model is never touched


def test_cycle_past_its_time_limit_fails_with_the_reason(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows)
    settings = make_settings(
        db_url, base_model_dir, tmp_path, schedule={"time_limit_s": 10.0}, step={"epochs": 100, "mini_batch_samples": 4}
    )
    outcome = run_cycle("manual:slow", "manual", settings)
    assert outcome.status == "failed" and outcome.reason.startswith("time limit (10 s)"), outcome
    assert trained_checkpoints(db_url) == []
    assert visible_folders(settings.trainer.checkpoints.dir) == []


def test_cycle_under_torchrun(db_url, base_model_dir, scored_rows, tmp_path):
    from trainer.cycle import run_cycle

    insert_rows(db_url, scored_rows)
    settings = make_settings(db_url, base_model_dir, tmp_path, distributed={"nproc_per_node": 2})
    outcome = run_cycle("manual:dist", "manual", settings)
    assert outcome.status in ("candidate", "rejected"), outcome
    [ckpt] = trained_checkpoints(db_url)
    assert ckpt.metrics["loss_after"] < ckpt.metrics["loss_before"]
    assert not [p for p in settings.trainer.checkpoints.dir.iterdir() if p.name.startswith(".tmp-")]
