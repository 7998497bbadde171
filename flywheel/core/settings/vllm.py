"""Settings: the vLLM fleet."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class VllmSettings(BaseModel):
    """The vLLM fleet that serves the policy."""

    urls: list[str] = Field(default_factory=list)
    """Existing replicas (``http://host:port``); empty starts ``replicas`` local servers."""
    replicas: int = Field(1, ge=0, le=8)
    """Number of local replicas to start when ``urls`` is empty."""
    base_port: int = Field(18100, ge=1024, le=65000)
    """Port of the first local replica; replica i listens on base_port + i (loopback only)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weight dtype passed to vLLM."""
    max_model_len: int = Field(256, ge=32, le=32768)
    """Context length passed to vLLM."""
    kv_cache_gib: int = Field(1, ge=1, le=64)
    """CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    startup_timeout_s: float = Field(240.0, gt=0, le=3600)
    """How long to wait for a replica's /health before declaring it failed."""
    enable_lora: bool = False
    """Start replicas with runtime LoRA adapter loading."""
    max_lora_rank: int = Field(16, ge=1, le=256)
    """Largest LoRA rank a replica accepts."""
    cpu_binding: Literal["spread", "auto", "nobind"] = "spread"
    """vllm-cpu worker pinning (VLLM_CPU_OMP_THREADS_BIND): ``spread`` pins local replica i to the
    i-th usable core (round robin); ``auto`` is vLLM's own choice, which pins every replica of a
    machine to the same first core (measured here: a second replica's worker then starved the
    first one for minutes); ``nobind`` leaves scheduling to the OS."""
    nice: int = Field(0, ge=0, le=19)
    """Niceness of local replicas (their engine and worker processes inherit it): above 0,
    serving yields the CPU to the trainer and the other services of a shared machine. Two
    demo runs here (two replicas, two cores) differed little: training cycles of 345/496 s
    at 0 and 320/457 s at 10; production gives replicas machines of their own."""
