"""Validated engine configuration: one object, passed in explicitly (no globals)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton"]


class EngineConfig(BaseModel):
    """Knobs of one engine instance (one worker process).

    The KV pool is sized either by `num_kv_blocks` or by `kv_cache_memory_gb`; with
    neither, it gets enough blocks for `max_num_seqs` sequences of `max_model_len` tokens
    but at most 1 GiB on CPU.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str | None = Field(
        default=None, description="Name served and hashed into block hashes; folder name if unset."
    )
    dtype: DType = "auto"
    device: str = "cpu"
    num_threads: int | None = Field(
        default=1, ge=1, description="torch threads for this process; None leaves torch's default."
    )
    block_size: int = Field(default=16, ge=1, le=1024)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    max_model_len: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="Token budget of one step (prefill chunks + decodes)."
    )
    enable_chunked_prefill: bool = True
    tpot_target_ms: float | None = Field(
        default=None,
        gt=0,
        description="Keep a step that has decode rows within this time, by capping its prefill"
        " tokens from the measured step cost (needs chunked prefill); None: the token budget"
        " alone.",
    )
    enable_prefix_caching: bool = True
    cache_salt: str | None = None
    attention_backend: AttentionBackendName = "auto"
    seed: int = 0

    @model_validator(mode="after")
    def _check_block_size(self) -> EngineConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        return self
