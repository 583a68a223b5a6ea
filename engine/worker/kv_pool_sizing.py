"""How many KV blocks an engine gets, and the context they allow.

Three ways, in order: `num_kv_blocks`; `kv_cache_memory_gb` over one block's bytes; and
otherwise, on a device that can be measured (CUDA, or a `MemoryReader` a test gives),
what the loaded model leaves of `gpu_memory_utilization` once its largest step and the
memory taken after sizing are counted (engine/worker/memory_profile.py). Without a device to
measure, the pool holds `max_num_seqs` sequences of the context, at most 1 GiB. Either
way the context (`max_model_len`, else the model's) is capped to what the pool can hold
unless it was set, which makes a too small pool an error instead.

`LLMEngine` asks this before the weights load (a configured pool that cannot hold one
sequence fails early) and, when measuring, after (`measure`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.common.engine_config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from pdserve.common.errors import InvalidRequestError
from pdserve.common.model_config import ModelConfig
from pdserve.engine.modeling import kv_quant
from pdserve.engine.sched.kv_cache_manager import cdiv
from pdserve.engine.worker.cuda_graphs import capture_sizes
from pdserve.engine.worker.kv_staging import handoff_device_bytes
from pdserve.engine.worker.memory_profile import (
    CudaMemoryReader,
    DeviceMemory,
    MemoryProfile,
    MemoryReader,
    check_share_is_free,
    measure_step_peak,
    profile_batches,
    profile_verify_rows,
)
from pdserve.engine.worker.model_runner import ModelRunner
from pdserve.engine.worker.parallel import TPShard

DEFAULT_KV_BYTES = 1 << 30  # 1 GiB when nothing sizes the pool


class KVPoolSizing:
    """The KV pool's size for one engine (on each rank: its shard's KV heads).

    `draft_config`: the draft model's, with speculative decoding by a draft model (its
    KV cache has the pool's blocks too, so each block costs both)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        shard: TPShard | None,
        draft_config: ModelConfig | None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.shard = shard
        self.draft_config = draft_config

    def context_len(self) -> int:
        """max_model_len, else the model's positions; within any sliding window."""
        cfg, mc = self.config, self.model_config
        max_len = cfg.max_model_len or mc.max_position_embeddings
        if mc.sliding_window is not None and max_len > mc.sliding_window:
            # NOTE: sliding-window attention is not implemented; within the window full
            # attention is identical, so the context is capped to it instead.
            max_len = mc.sliding_window
        return max_len

    @property
    def block_bytes(self) -> int:
        """One KV block's bytes (on each rank: its KV heads' share)."""
        mc = self.model_config
        kv_heads = mc.num_kv_heads if self.shard is None else self.shard.num_kv_heads
        row = kv_quant.row_bytes(self.config.kv_cache_dtype, mc.head_dim, self.dtype.itemsize)
        return self.config.block_size * 2 * mc.num_layers * kv_heads * row

    def pool_block_bytes(self) -> int:
        """What one block of the pool costs this process: the target's KV block, and with
        a draft model its KV block too (a second cache of the same number of blocks)."""
        draft = self.draft_config
        if draft is None:
            return self.block_bytes
        return self.block_bytes + (
            self.config.block_size * draft.kv_bytes_per_token * self.dtype.itemsize // 4
        )

    def from_config(self) -> tuple[int, int]:
        """(max_model_len, blocks) of a pool sized by the configuration alone."""
        cfg = self.config
        max_len, block_bytes = self.context_len(), self.pool_block_bytes()
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_memory_gb is not None:
            num_blocks = int(cfg.kv_cache_memory_gb * (1 << 30)) // block_bytes
        else:
            wanted = cfg.max_num_seqs * cdiv(max_len, cfg.block_size)
            num_blocks = min(wanted, DEFAULT_KV_BYTES // block_bytes)
        return self.fit_context(max_len, num_blocks, "")

    def fit_context(self, max_len: int, num_blocks: int, why: str) -> tuple[int, int]:
        """(max_model_len, blocks): the context capped to the pool, unless it was set."""
        cfg = self.config
        if num_blocks * cfg.block_size < max_len:
            if cfg.max_model_len is not None:
                raise InvalidRequestError(
                    f"the KV pool ({num_blocks} blocks of {cfg.block_size}{why}) cannot hold "
                    f"one sequence of max_model_len={max_len} tokens"
                )
            max_len = num_blocks * cfg.block_size
        return max_len, max(num_blocks, 1)

    def reader(self, given: MemoryReader | None) -> MemoryReader | None:
        """The reader that sizes the pool, or None when the configuration does."""
        cfg = self.config
        if cfg.num_kv_blocks is not None or cfg.kv_cache_memory_gb is not None:
            return None
        if given is None and self.device.type == "cuda":
            return CudaMemoryReader(self.device)
        return given

    @property
    def utilization(self) -> float:
        util = self.config.gpu_memory_utilization
        return DEFAULT_GPU_MEMORY_UTILIZATION if util is None else util

    def memory_at_start(self, reader: MemoryReader) -> DeviceMemory:
        """The device before the weights load; an error if the engine's share is taken."""
        start = reader.snapshot()
        why_not = check_share_is_free(start, self.utilization)
        if why_not is not None:
            raise InvalidRequestError(why_not)
        return start

    def measure(
        self,
        reader: MemoryReader,
        start: DeviceMemory,
        max_len: int,
        profile_runner: Callable[[int], ModelRunner],
        reserved_bytes: int,
    ) -> tuple[int, int, MemoryProfile]:
        """(max_model_len, blocks, the profile) from the memory the loaded model leaves of
        the engine's share, measured over its largest step run by `profile_runner(blocks)`
        (a runner like the engine's over a scratch cache); `reserved_bytes`: what the
        engine takes after sizing (`reserved_after_sizing`). The engine logs the result."""
        cfg = self.config
        spec = cfg.speculative_config
        k = 0 if spec is None else spec.num_speculative_tokens
        rows = profile_verify_rows(cfg.max_num_seqs, cfg.max_num_batched_tokens, k, max_len)
        peak, scratch_bytes = measure_step_peak(
            profile_runner,
            reader,
            profile_batches(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_len),
            cfg.block_size,
            max_len,
            self.model_config.vocab_size,
            verify=(rows, k) if spec is not None else (0, 0),
        )
        end = reader.snapshot()  # the profile's tensors are gone: only the model remains
        profile = MemoryProfile(
            utilization=self.utilization,
            total_bytes=start.total_bytes,
            peak_torch_bytes=peak - start.torch_allocated_bytes - scratch_bytes,
            non_torch_bytes=max(end.non_torch_bytes - start.non_torch_bytes, 0),
            block_bytes=self.pool_block_bytes(),
            step_tokens=cfg.max_num_batched_tokens,
            reserved_bytes=reserved_bytes,
        )
        # Never more than the running sequences can use: each block costs the block pool
        # host memory and start time too (millions for a tiny model on a large GPU).
        num_blocks = min(profile.num_blocks, cfg.max_num_seqs * cdiv(max_len, cfg.block_size))
        if num_blocks == 0:
            raise InvalidRequestError(
                f"no memory is left for the KV cache: {profile.describe()}; raise "
                "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or set "
                "num_kv_blocks / kv_cache_memory_gb"
            )
        why = f" that gpu_memory_utilization={profile.utilization:g} leaves"
        return (*self.fit_context(max_len, num_blocks, why), profile)

    def reserved_after_sizing(self, max_len: int, graphs: bool) -> int:
        """Device memory the engine takes once its pool is sized, kept out of the pool:
        a KV handoff's device copies, one export and one import at a time, each at most
        one chunk of a sequence of `max_len` tokens (engine/worker/kv_staging.py), and with
        `graphs` (decode CUDA graphs captured) each captured size's float32 logits."""
        cfg = self.config
        sequence = cdiv(max_len, cfg.block_size) * self.pool_block_bytes()
        reserved = 2 * handoff_device_bytes(sequence, self.model_config.num_layers)
        if graphs:
            rows = sum(capture_sizes(min(cfg.max_cuda_graph_batch_size, cfg.max_num_seqs)))
            reserved += rows * self.model_config.vocab_size * 4
        return reserved
