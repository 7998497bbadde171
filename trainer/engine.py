"""The eval gate's inference engine: a registered policy loaded into a vLLM replica, generating over HTTP.

The gate evaluates policies the way the fleet serves them, so its cost scales like serving
and not like the trainer's forward pass. :class:`VllmEngine` drives a vLLM replica of the
gate's own (``trainer.gate.engine_url``, started in development mode with runtime LoRA
loading; the local stack starts one, see :mod:`flywheel.stack.gate`):

- a **full** checkpoint is loaded the way serving hot-swaps one: pause (waiting for in-flight
  requests), ``reload_weights`` from the folder, ``update_weight_version``, reset the prefix
  cache, resume (:mod:`flywheel.core.vllm_admin`). The replica's weight version is then the
  folder's resolved path, so loading the same folder again costs nothing;
- a **LoRA** checkpoint is loaded as a named adapter (``/v1/load_lora_adapter``, the name being
  its policy version) over its base model's weights (reloaded first when the replica holds
  others), and unloaded when :meth:`VllmEngine.serve` exits.

Requests go to the replica's OpenAI-compatible chat API (the official ``openai`` client), up
to ``trainer.gate.concurrency`` at a time (:meth:`ServedPolicy.map`). One gate replica serves
one trainer: the trainer's cycle lock keeps evaluations from overlapping on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from flywheel.core import vllm_admin
from flywheel.core.endpoints import gate_engine_url
from flywheel.core.settings import Settings
from trainer.ckpt import PolicyRef

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
Message = dict[str, str]


class EngineError(RuntimeError):
    """The gate's replica could not load a policy or answer a request (names the replica and what failed)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generation request (None leaves vLLM's default)."""

    temperature: float = 1.0
    """Sampling temperature (0 decodes greedily)."""
    max_tokens: int = 24
    """Longest completion, in tokens."""
    top_p: float | None = None
    """Nucleus sampling (None: the full distribution)."""
    top_k: int | None = None
    """Top-k sampling (None: the full distribution)."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt sample the same tokens from the same weights, so a
    parent and its candidate evaluated with the same seeds differ by their weights, not by luck."""

    def with_seed(self, seed: int) -> Sampling:
        """A copy with ``seed``."""
        return Sampling(self.temperature, self.max_tokens, self.top_p, self.top_k, seed)


class ServedPolicy:
    """One policy loaded in the engine: what an eval suite generates with."""

    def __init__(self, engine: VllmEngine, policy: PolicyRef, model: str):
        self.engine = engine
        self.policy = policy
        self.model = model
        """The ``model`` name requests carry (the base model's served name, or the adapter's)."""

    @property
    def engine_kind(self) -> str:
        """The engine's kind (``vllm``), part of every cache key."""
        return self.engine.kind

    def chat(self, messages: Sequence[Message], sampling: Sampling) -> str:
        """The next assistant turn for ``messages`` (raises :class:`EngineError` when the replica fails)."""
        return self.engine.chat(self.model, messages, sampling)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``[fn(item) for item in items]``, with up to the engine's concurrency running at once (order kept)."""
        return self.engine.map(fn, items)


class VllmEngine:
    """A vLLM replica that loads each policy it is asked to serve (see the module docstring)."""

    kind = "vllm"

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 16,
        request_timeout_s: float = 120.0,
        load_timeout_s: float = 300.0,
    ):
        import openai

        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self.load_timeout_s = load_timeout_s
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=2, timeout=request_timeout_s
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> VllmEngine:
        """The engine at ``trainer.gate.engine_url`` (raises :class:`~flywheel.core.endpoints.NotConfigured`
        naming ``FLYWHEEL_TRAINER__GATE__ENGINE_URL`` when none is set)."""
        gate = settings.trainer.gate
        return cls(gate_engine_url(settings), concurrency=gate.concurrency, request_timeout_s=gate.request_timeout_s)

    # -- loading ---------------------------------------------------------------------------

    @contextmanager
    def serve(self, policy: PolicyRef) -> Iterator[ServedPolicy]:
        """Load ``policy`` (full or LoRA) into the replica for the duration of the block."""
        if not vllm_admin.health(self.url):
            raise EngineError(f"the gate's vLLM replica at {self.url} does not answer /health")
        name: str | None = None
        try:
            if policy.format == "full":
                self._hold_weights(policy.path)
                model = vllm_admin.base_model_name(self.url)
            elif policy.format == "lora":
                self._hold_weights(policy.base_model)
                model = name = policy.policy_version
                if any(m.get("id") == name for m in vllm_admin.models(self.url)):
                    vllm_admin.unload_lora_adapter(self.url, name)  # left over by a run that died: load afresh
                vllm_admin.load_lora_adapter(self.url, name, policy.path, timeout_s=self.load_timeout_s)
            else:
                raise EngineError(f"checkpoint {policy.id}: unknown format {policy.format!r}")
        except (vllm_admin.VllmAdminError, vllm_admin.CheckpointInvalid) as err:
            hint = ""
            if policy.format == "lora" and isinstance(err, vllm_admin.VllmAdminError) and err.status == 404:
                hint = " (the replica loads no LoRA adapters: start it with --enable-lora and "
                hint += "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            raise EngineError(f"loading checkpoint {policy.id} ({policy.format}) into {self.url}: {err}{hint}") from err
        try:
            yield ServedPolicy(self, policy, model)
        finally:
            if name is not None:
                try:
                    vllm_admin.unload_lora_adapter(self.url, name)
                except vllm_admin.VllmAdminError as err:
                    log.warning("could not unload LoRA adapter %s from %s: %s", name, self.url, err)

    def _hold_weights(self, folder: str) -> None:
        """Make the replica's full weights those of ``folder`` (nothing to do when they already are)."""
        tag = str(Path(folder).resolve())
        if vllm_admin.weight_info(self.url) == tag:
            return
        vllm_admin.pause(self.url, mode="wait", timeout_s=self.load_timeout_s)
        try:
            vllm_admin.reload_weights(self.url, tag, timeout_s=self.load_timeout_s)
            vllm_admin.update_weight_version(self.url, tag)
            if not vllm_admin.reset_prefix_cache(self.url):
                log.warning("%s: the prefix cache could not be reset after the reload", self.url)
        finally:
            vllm_admin.resume(self.url)

    # -- generation ------------------------------------------------------------------------

    def chat(self, model: str, messages: Sequence[Message], sampling: Sampling) -> str:
        """One chat completion of ``model`` (the text of its first choice)."""
        import openai

        extra: dict[str, Any] = {}
        if sampling.top_k is not None:
            extra["top_k"] = sampling.top_k
        try:
            answer = self.client.chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p if sampling.top_p is not None else openai.NOT_GIVEN,
                seed=sampling.seed if sampling.seed is not None else openai.NOT_GIVEN,
                extra_body=extra or None,
            )
        except openai.OpenAIError as err:
            raise EngineError(f"{self.url}: chat completion of {model!r} failed: {type(err).__name__}: {err}") from err
        return answer.choices[0].message.content or ""

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """``fn`` over ``items`` with up to :attr:`concurrency` at once, results in order."""
        work = list(items)
        if not work:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(work)), thread_name_prefix="gate") as pool:
            return list(pool.map(fn, work))
