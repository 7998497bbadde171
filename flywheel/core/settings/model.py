"""Settings: the base model."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, model_validator


class ModelSettings(BaseModel):
    """The base model: a local Hugging Face causal-LM folder, or the project's own build.

    With ``path`` unset the base model is the small Llama built offline by ``flywheel model
    build`` (the other fields below size that build). With ``path`` set, that folder is the
    base model (see docs/model.md); the build fields are then unused.
    """

    path: Path | None = None
    """The base model's folder (config.json, safetensors weights, tokenizer); None: the project's built model."""
    completion_only: bool = False
    """The base model has no chat template and is used through completions only (no chat requests)."""
    cache_dir: Path = Path(".flywheel/models")
    """Where built models are cached, one folder per build key (and the model checks' cache)."""
    task: str = Field("arith", pattern=r"^[a-z][a-z0-9_]{0,31}$")
    """The synthetic task the project's model is pre-trained on (:mod:`flywheel.model.tasks`): ``arith``, the
    demo's calculator agent, or a scenario's (``parl``); part of the build key through the task's version."""
    seed: int = Field(0, ge=0)
    """Seed of the corpus, tokenizer, initialisation and pre-training."""
    hidden_size: int = Field(128, ge=64, le=4096)
    """Model width."""
    num_layers: int = Field(2, ge=1, le=48)
    """Number of decoder layers."""
    num_heads: int = Field(2, ge=1, le=64)
    """Attention heads; hidden_size / num_heads must be >= 64 (vLLM CPU attention)."""
    num_kv_heads: int = Field(1, ge=1, le=64)
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = Field(512, ge=128, le=65536)
    """Byte-level BPE vocabulary size."""
    pretrain_steps: int = Field(1200, ge=0, le=100000)
    """Supervised pre-training steps on the synthetic task's corpus."""

    @model_validator(mode="after")
    def _head_dim(self) -> ModelSettings:
        if self.hidden_size % self.num_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_heads")
        if self.hidden_size // self.num_heads < 64:
            raise ValueError(
                f"model head_dim {self.hidden_size // self.num_heads} < 64: vLLM's CPU attention rejects it"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be divisible by model.num_kv_heads")
        return self
