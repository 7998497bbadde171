"""Step-0 truth against real vLLM: the trainer's log-probs of served completions are the ones vLLM recorded.

A replica of the project's built model (started by ``flywheel.stack`` with
``--logprobs-mode processed_logprobs``) samples completions at T=1, at T=0.7 / top_p=0.9 /
top_k=50, with min_p and with top-k alone, concurrently (so vLLM batches different settings
together). The trainer, loaded with the same weights, computes every completion token's
log-prob under each completion's recorded sampling (:func:`trainer.truth.check_logprobs`, the
code path of a training step); each must be within 1e-3 of vLLM's, so the importance ratio
at step 0 is 1.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from flywheel.core.contracts.events import SamplingParams
from trainer.step import TokenSampling
from trainer.truth import TruthSample, check_logprobs

pytestmark = pytest.mark.integration

TOLERANCE = 1e-3
PROMPTS = ["12+7=", "What is 3*4?", "user: add 5 and 9\nassistant:", "Compute 81-27 using the calculator."]
SETTINGS = {
    "plain": {"temperature": 1.0},
    "truncated": {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "top_k": {"temperature": 1.3, "top_k": 5},
}


def sample(url: str, model: str, prompt: str, params: dict, seed: int, n: int = 3) -> list[TruthSample]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 24,
        "n": n,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        **params,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    out = []
    for choice in response.json()["choices"]:
        recorded = choice["logprobs"]["token_logprobs"]
        assert len(recorded) == len(choice["token_ids"]) > 0
        out.append(TruthSample(choice["prompt_token_ids"], choice["token_ids"], recorded, SamplingParams(**params)))
    return out


def served(url: str, model: str, settings: dict[str, dict]) -> dict[str, list[TruthSample]]:
    """Completions of every prompt under every setting, requested concurrently."""
    jobs = [(name, p, i) for name in settings for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda j: sample(url, model, j[1], settings[j[0]], 100 + j[2]), jobs))
    out: dict[str, list[TruthSample]] = {name: [] for name in settings}
    for (name, _, _), samples in zip(jobs, results):
        out[name] += samples
    return out


@pytest.fixture(scope="module")
def policy(vllm_replica):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_replica.model_dir, dtype=torch.float32)
    return model.eval()


def test_replica_records_processed_logprobs(vllm_replica):
    argv = Path(f"/proc/{vllm_replica.pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--logprobs-mode") + 1] == b"processed_logprobs"
    assert argv[argv.index(b"--generation-config") + 1] == b"vllm"


def test_step0_importance_ratio_is_one_for_every_token(vllm_replica, policy):
    by_setting = served(vllm_replica.url, vllm_replica.model, SETTINGS)
    for name, samples in by_setting.items():
        report = check_logprobs(policy, samples)
        assert report.excluded == {} and report.tokens == sum(len(s.completion_ids) for s in samples)
        assert report.max_abs_log_ratio < TOLERANCE, (name, report.to_dict())
        if name != "plain":
            # The check can fail: the same tokens under the untruncated distribution are off by far more.
            untruncated = [
                TruthSample(s.prompt_ids, s.completion_ids, s.recorded_logprobs, TokenSampling(s.sampling.temperature))
                for s in samples
            ]
            assert check_logprobs(policy, untruncated).max_abs_log_ratio > 10 * TOLERANCE, name
    # All settings at once, packed together as a training step packs them.
    everything = [s for samples in by_setting.values() for s in samples]
    assert check_logprobs(policy, everything).max_abs_log_ratio < TOLERANCE


def test_greedy_completions_are_excluded_not_misread(vllm_replica, policy):
    samples = [sample(vllm_replica.url, vllm_replica.model, p, {"temperature": 0.0}, 1, n=1)[0] for p in PROMPTS]
    report = check_logprobs(policy, samples)
    assert report.excluded == {"greedy": len(PROMPTS)} and report.tokens == 0
