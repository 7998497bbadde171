"""The eval gate through a real vLLM gate replica: full and LoRA checkpoints, and the replay suite on Postgres.

The replica is the local stack's gate replica (``gate_engine_url``), serving the project's
base model; checkpoints are written here: a damaged copy of the base (full) and a peft
adapter with random weights (LoRA). Replay sessions are written to a fresh database as
ingest stores them (``sessions`` and ``raw_events`` rows of real event contracts).
"""

from __future__ import annotations

import hashlib
import random
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from flywheel.core import vllm_admin
from flywheel.core.contracts.events import Completion, Message, Outcome, SamplingParams
from flywheel.core.db.engine import session_factory
from flywheel.core.db.models import AgentSession, RawEvent
from flywheel.core.settings import Settings
from flywheel.task import arith
from trainer import gate
from trainer.ckpt import PolicyRef
from trainer.engine import Sampling, VllmEngine
from trainer.select import BUCKET_SQL, holdout_bucket, is_held_out

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROJECT = "replay-test"


def gate_settings(url: str, **gate_fields) -> Settings:
    fields = {"engine_url": url, "run": ["arith"], "suites": {"arith": {"n": 40}}} | gate_fields
    return Settings(environment="test", trainer={"gate": fields})


def full_ref(folder: Path, name: str) -> PolicyRef:
    return PolicyRef(name, name, str(folder), "full", str(folder))


@pytest.fixture(scope="module")
def damaged_dir(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the base model with every weight drowned in noise."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("damaged") / "damaged"
    shutil.copytree(base_model_dir, folder)
    generator = torch.Generator().manual_seed(0)
    for file in folder.glob("*.safetensors"):
        tensors = load_file(str(file))
        noisy = {k: v + torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in tensors.items()}
        save_file(noisy, str(file), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def adapter_dir(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 peft adapter over the base model whose B matrices are random (it changes the policy)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(base_model_dir)).save_pretrained(str(folder))
    return folder


def greedy(served, problem: arith.Problem) -> str:
    return served.chat(arith.render_messages(problem), Sampling(temperature=0.0, max_tokens=16))


# --------------------------------------------------------------------------- full and LoRA checkpoints


def test_the_gate_evaluates_full_checkpoints_by_reloading_the_weights(gate_engine_url, base_model_dir, damaged_dir):
    settings = gate_settings(gate_engine_url)
    engine = VllmEngine.from_settings(settings)
    context = gate.context_of(settings, None, engine.kind)
    [arith_suite] = gate.prepare(settings, context)
    assert arith_suite.key == "arith-v1/heldout/n40/s1234/t1.0/m24/vllm"
    base = full_ref(base_model_dir, "base")

    with engine.serve(base) as served:
        assert vllm_admin.weight_info(gate_engine_url) == str(base_model_dir.resolve())
        parent = gate.evaluate_all(served, [arith_suite], context)["arith"]
    with engine.serve(full_ref(damaged_dir, "damaged")) as served:
        assert vllm_admin.weight_info(gate_engine_url) == str(damaged_dir.resolve())
        damaged = gate.evaluate_all(served, [arith_suite], context)["arith"]
    with engine.serve(base) as served:
        again = gate.evaluate_all(served, [arith_suite], context)["arith"]

    assert parent.n == damaged.n == 40 and parent.model_extra["engine"] == "vllm"
    assert parent.success_rate > 0.05 and damaged.success_rate == 0.0
    # the same weights with the same request seeds: the same episodes, so the same score
    assert again.success_rate == parent.success_rate
    decision = gate.decide_suites([arith_suite], {"arith": damaged}, {"arith": parent})
    assert not decision.passed and decision.reason.startswith(
        f"regressed on arith 0.000 vs parent {parent.success_rate:.3f}"
    )


def test_the_gate_evaluates_a_lora_checkpoint_as_an_adapter_over_its_base(
    gate_engine_url, base_model_dir, damaged_dir, adapter_dir
):
    settings = gate_settings(gate_engine_url, suites={"arith": {"n": 16}})
    engine = VllmEngine.from_settings(settings)
    context = gate.context_of(settings, None, engine.kind)
    [arith_suite] = gate.prepare(settings, context)
    problem = arith.sample_problems("heldout", 1, 3)[0]
    with engine.serve(full_ref(base_model_dir, "base")) as served:
        base_answer = greedy(served, problem)
    with engine.serve(full_ref(damaged_dir, "damaged")):
        pass  # the replica now holds other weights than the adapter's base

    lora = PolicyRef("c-lora", "c-lora-v1", str(adapter_dir), "lora", str(base_model_dir))
    with engine.serve(lora) as served:
        assert served.model == "c-lora-v1"
        assert "c-lora-v1" in {m["id"] for m in vllm_admin.models(gate_engine_url)}
        assert vllm_admin.weight_info(gate_engine_url) == str(base_model_dir.resolve())  # its base, reloaded
        assert greedy(served, problem) != base_answer  # the adapter is applied
        result = gate.evaluate_all(served, [arith_suite], context)["arith"]
    assert result.n == 16 and 0.0 <= result.success_rate <= 1.0
    assert "c-lora-v1" not in {m["id"] for m in vllm_admin.models(gate_engine_url)}  # unloaded after


def test_an_engine_that_is_not_configured_or_not_up_says_so(unused_port):
    from flywheel.core.endpoints import NotConfigured
    from trainer.engine import EngineError

    with pytest.raises(NotConfigured, match="FLYWHEEL_TRAINER__GATE__ENGINE_URL"):
        VllmEngine.from_settings(Settings(environment="test"))
    engine = VllmEngine(f"http://127.0.0.1:{unused_port()}")
    with pytest.raises(EngineError, match="does not answer /health"), engine.serve(full_ref(Path("/x"), "x")):
        pass


# --------------------------------------------------------------------------- the replay suite


def write_sessions(url: str, count: int, seed: int = 0) -> dict[str, bool]:
    """``count`` calculator sessions as ingest stores them; returns the verifiable ones' outcome by session id.

    Every seventh session reports no outcome and every eleventh has a task without a verifier:
    neither qualifies for the replay suite.
    """
    rng = random.Random(seed)
    problems = arith.sample_problems("train", count, seed)
    outcomes: dict[str, bool] = {}
    at = datetime.now(UTC) - timedelta(hours=1)
    with session_factory(url)() as db:
        for i, problem in enumerate(problems):
            session_id = f"s{seed}-{i}"
            task = "code-review" if i % 11 == 0 else f"arith:{problem.kind}"
            db.add(AgentSession(project=PROJECT, session_id=session_id, task=task, group_key=problem.id,
                                status="completed", started_at=at))  # fmt: skip
            messages = [Message(role=m["role"], content=m["content"]) for m in arith.render_messages(problem)]
            events = [
                Completion(
                    project=PROJECT,
                    session_id=session_id,
                    occurred_at=at,
                    model="m",
                    policy_version="p0",
                    prompt_messages=messages,
                    completion_text="answer: 1",
                    sampling=SamplingParams(temperature=1.0, max_tokens=24),
                )  # fmt: skip
            ]
            if i % 7 != 0:
                solved = rng.random() < 0.3
                events.append(Outcome(project=PROJECT, session_id=session_id, name="task_solved", value=solved,
                                      occurred_at=at + timedelta(seconds=1)))  # fmt: skip
                if task.startswith("arith"):
                    outcomes[session_id] = solved
            for event in events:
                db.add(RawEvent(event_id=event.event_id, project=PROJECT, session_id=session_id, type=event.type.value,
                                schema_version=1, occurred_at=event.occurred_at,
                                payload=event.model_dump(mode="json")))  # fmt: skip
        db.commit()
    return outcomes


def by_hash(session_ids) -> list[str]:
    return sorted(session_ids, key=lambda s: hashlib.sha256(f"{PROJECT}/{s}".encode()).hexdigest())


def test_the_replay_suite_replays_a_fixed_hash_slice_of_held_out_sessions(db_url, gate_engine_url, base_model_dir):
    outcomes = write_sessions(db_url, 300)
    per_mille = 200
    settings = gate_settings(
        gate_engine_url,
        run=["replay"],
        holdout_per_mille=per_mille,
        suites={"replay": {"n": 25, "min_sessions": 10}},
    ).model_copy(update={"postgres": Settings().postgres.model_copy(update={"url": db_url})})
    engine = VllmEngine.from_settings(settings)
    with session_factory(db_url)() as db:
        # The database's bucket is the trainer's: the split is one split.
        digest = "encode(sha256(convert_to(project || '/' || session_id, 'UTF8')), 'hex')"
        rows = db.execute(text(f"SELECT session_id, {BUCKET_SQL.format(hex=digest)} FROM sessions"))
        buckets = dict(rows.all())
        assert buckets == {s: holdout_bucket(PROJECT, s) for s in buckets} and len(buckets) == 300

        context = gate.context_of(settings, db, engine.kind)
        [replay] = gate.prepare(settings, context)
        held = [s for s in outcomes if is_held_out(PROJECT, s, per_mille)]
        expected = by_hash(held)[:25]
        assert len(held) > 25
        assert [s.session_id for s in replay.prepared.items] == expected
        assert replay.key.startswith(f"replay-v1/p{per_mille}/n25/") and replay.key.endswith("/vllm")
        assert gate.prepare(settings, context)[0].key == replay.key  # fixed: the same slice again

        with engine.serve(full_ref(base_model_dir, "base")) as served:
            result = gate.evaluate(served, replay, context)
        assert result.n == 25 and 0.0 <= result.success_rate <= 1.0
        assert result.model_extra["production_rate"] == pytest.approx(sum(outcomes[s] for s in expected) / 25)
        assert result.model_extra["not_replayed"] == {}

        # Fewer qualifying sessions than min_sessions: nothing is measured, and the gate passes the suite.
        few = settings.model_copy(deep=True)
        few.trainer.gate.suites["replay"] = {"n": 25, "min_sessions": 1000}
        [empty] = gate.prepare(few, gate.context_of(few, db, engine.kind))
        assert empty.prepared.items == [] and "/n0/" in empty.key
        with engine.serve(full_ref(base_model_dir, "base")) as served:
            nothing = gate.evaluate(served, empty, context)
        assert nothing.n == 0
        assert gate.decide_suites([empty], {"replay": nothing}, {"replay": nothing}).passed


# --------------------------------------------------------------------------- a user suite, as docs/evals.md writes it


def test_the_user_suite_of_the_docs_runs_as_written(gate_engine_url, base_model_dir, monkeypatch):
    import re
    import sys
    import types
    from importlib.metadata import EntryPoint

    from flywheel.core import plugins

    doc = (Path(__file__).resolve().parents[2] / "docs" / "evals.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    [entry] = re.findall(r'\[project\.entry-points\."flywheel\.eval_suites"\]\n(greeting = "[^"]+")', doc)
    module = types.ModuleType("mysuites.greeting")
    exec(compile(code, "docs/evals.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "mysuites", types.ModuleType("mysuites"))
    monkeypatch.setitem(sys.modules, "mysuites.greeting", module)
    name, value = (part.strip().strip('"') for part in entry.split("="))
    registered = dict(plugins.registered("flywheel.eval_suites"))
    registered[name] = EntryPoint(name, value, "flywheel.eval_suites")
    monkeypatch.setattr(plugins, "registered", lambda group: registered if group == "flywheel.eval_suites" else {})

    settings = gate_settings(gate_engine_url, run=["arith", "greeting"],
                             suites={"arith": {"n": 8}, "greeting": {"margin": 0.1, "n": 6}})  # fmt: skip
    engine = VllmEngine.from_settings(settings)
    context = gate.context_of(settings, None, engine.kind)
    prepared = gate.prepare(settings, context)
    assert [p.name for p in prepared] == ["arith", "greeting"] and prepared[1].gate_suite.margin == 0.1
    assert prepared[1].key == "greeting-v1/n6/t1.0/vllm"
    with engine.serve(full_ref(base_model_dir, "base")) as served:
        results = gate.evaluate_all(served, prepared, context)
    assert results["greeting"].n == 6 and 0.0 <= results["greeting"].success_rate <= 1.0
    decision = gate.decide_suites(prepared, results, results)
    assert decision.passed and [v.suite for v in decision.suites] == ["arith", "greeting"]
