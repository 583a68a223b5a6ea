"""Sizing the KV pool from the device's memory (`EngineConfig.gpu_memory_utilization`).

As vLLM's: on CUDA, with neither `num_kv_blocks` nor `kv_cache_memory_gb`, the engine
may use `gpu_memory_utilization` x the device's total memory, all of it: the weights, the
activations and logits of its largest step, what it allocates outside torch (cuBLAS and
Triton modules, ...) and the KV pool, which gets the rest. So the engine

1. at start, before the model, takes a snapshot of the device (`MemoryReader.snapshot`:
   torch's cached blocks released first) and checks that its share is free: memory other
   processes (or other engines of this process) hold is theirs, not part of the share;
2. loads the model, then runs its largest step for real (`measure_step_peak`): one
   prefill of `max_num_batched_tokens` tokens (the longest attention), then that budget
   spread over `max_num_seqs` sequences that all sample (the most logits rows: sampling
   allocates [rows, vocab] float32 and more), through a `ModelRunner` over a scratch KV
   cache just large enough, with the sampling options that allocate the most; with
   speculative decoding also a step of verify rows that all sample at every position
   (`profile_verify_rows`: up to the whole budget of logits rows);
3. reads torch's peak allocation over those steps (less the scratch cache, which the
   real pool replaces) and a second snapshot: the growth of memory outside torch since
   the first one is this engine's too;
4. gives the KV pool `kv_blocks_for_memory(...)` blocks, but never more than
   `max_num_seqs` sequences of `max_model_len` tokens can use: a block costs host
   memory and start time in the block pool too, which matters for tiny models.

Replicas sharing a GPU each take their share (`ClusterConfig` defaults it to 0.9 x
`replica_num_gpus`). Device memory taken after sizing is kept out of the pool too, so
that it never comes out of another replica's share: the decode graphs' outputs (each
captured size keeps its [size, vocab] float32 logits) and the KV handoff's device copies
(an export's packed payload until its copy to the host is done, an import's until it is
unpacked), each at most `kv_staging.DEVICE_CHUNK_BYTES` (larger payloads cross in
chunks). The pinned host staging area is host memory.

The arithmetic is pure and the measurement sits behind `MemoryReader`, so a CPU test
drives the whole path with a fake reader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.sched.scheduler import ScheduledSeq, Scheduler, SchedulerLimits, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.worker.model_runner import ModelRunner

GIB = 1 << 30
# The sampling path that allocates the most: top_p alone sorts the whole vocabulary, and
# logprobs add a log_softmax over it.
_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS)


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of the device, taken with torch's cached (unused) blocks released."""

    total_bytes: int
    free_bytes: int
    torch_reserved_bytes: int  # held by this process's torch allocator
    torch_allocated_bytes: int  # in live tensors of this process

    @property
    def non_torch_bytes(self) -> int:
        """In use but not through this process's torch: other processes, CUDA contexts,
        libraries' own allocations."""
        return max(self.total_bytes - self.free_bytes - self.torch_reserved_bytes, 0)


class MemoryReader(Protocol):
    """What the sizing reads of the device (`CudaMemoryReader`; tests pass a fake)."""

    def snapshot(self) -> DeviceMemory:
        """Release torch's cached blocks, then read the device."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak measurement (at what is allocated now)."""
        ...

    def peak_allocated(self) -> int:
        """Torch's peak allocation since `reset_peak`, once the device's work is done."""
        ...


class CudaMemoryReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> DeviceMemory:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(
            total_bytes=total,
            free_bytes=free,
            torch_reserved_bytes=torch.cuda.memory_reserved(self.device),
            torch_allocated_bytes=torch.cuda.memory_allocated(self.device),
        )

    def reset_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def kv_blocks_for_memory(
    total_bytes: int,
    utilization: float,
    peak_torch_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
    reserved_bytes: int = 0,
) -> int:
    """KV blocks that fit in `utilization` x `total_bytes` beside the engine's torch peak
    (weights + its largest step), its memory outside torch and what it takes after the
    pool is sized (`reserved_bytes`); 0 when nothing is left."""
    budget = int(total_bytes * utilization) - peak_torch_bytes - non_torch_bytes
    return max((budget - reserved_bytes) // block_bytes, 0)


@dataclass(frozen=True)
class MemoryProfile:
    """What the engine measured, and the pool it implies (before any cap)."""

    utilization: float
    total_bytes: int
    peak_torch_bytes: int  # weights + activations and logits of the largest step
    non_torch_bytes: int  # this engine's growth outside torch, model load to profile end
    block_bytes: int
    step_tokens: int  # the profiled step's token budget
    # Taken after the pool is sized: the decode graphs' outputs and the KV handoff's
    # device copies (LLMEngine._reserved_after_sizing).
    reserved_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return kv_blocks_for_memory(
            self.total_bytes,
            self.utilization,
            self.peak_torch_bytes,
            self.non_torch_bytes,
            self.block_bytes,
            self.reserved_bytes,
        )

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        """The numbers, for the log line and for errors."""
        return (
            f"gpu_memory_utilization={self.utilization:g} of {self.total_bytes / GIB:.2f} GiB"
            f" = {self.total_bytes * self.utilization / GIB:.2f} GiB; torch peak"
            f" {self.peak_torch_bytes / GIB:.2f} GiB (weights + a {self.step_tokens}-token"
            f" step), {self.non_torch_bytes / GIB:.2f} GiB outside torch,"
            f" {self.reserved_bytes / GIB:.2f} GiB kept for graphs and KV handoffs; KV"
            f" {self.kv_bytes / GIB:.2f} GiB = {self.num_blocks} blocks"
        )


def check_share_is_free(start: DeviceMemory, utilization: float) -> str | None:
    """Why the engine cannot have its share of the device, or None if it can."""
    wanted = int(start.total_bytes * utilization)
    if start.free_bytes >= wanted:
        return None
    return (
        f"gpu_memory_utilization={utilization:g} asks for {wanted / GIB:.2f} GiB of the"
        f" device's {start.total_bytes / GIB:.2f} GiB, but only {start.free_bytes / GIB:.2f}"
        " GiB are free (other processes, or other engines of this one, hold the rest):"
        " lower it (replicas sharing one GPU split it, e.g. 0.45 each for two) or set"
        " num_kv_blocks / kv_cache_memory_gb"
    )


def profile_batches(
    max_num_seqs: int, max_num_batched_tokens: int, max_len: int
) -> list[list[int]]:
    """Prompt lengths of the steps the profile runs: the longest prefill one step takes
    (its attention), then the token budget spread over as many sequences as can sample
    in one step (its logits); each prompt shorter than `max_len`."""
    longest = max(min(max_num_batched_tokens, max_len - 1), 1)
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    if num_seqs == 1:
        return [[longest]]
    per_seq, extra = divmod(max_num_batched_tokens, num_seqs)
    spread = [min(per_seq + (i < extra), longest) for i in range(num_seqs)]
    return [[longest], spread]


def profile_verify_rows(
    max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int, max_len: int
) -> int:
    """Verify rows (speculative decoding: 1 + k query tokens, all sampling) in the step
    with the most logits rows that speculation can make: 0 when none fits."""
    if num_speculative_tokens + 2 > max_len:
        return 0
    return min(max_num_seqs, max_num_batched_tokens // (num_speculative_tokens + 1))


def measure_step_peak(
    make_runner: Callable[[int], ModelRunner],
    reader: MemoryReader,
    batches: list[list[int]],
    block_size: int,
    max_len: int,
    vocab_size: int,
    verify: tuple[int, int] = (0, 0),
) -> tuple[int, int]:
    """Run each batch of prompts as one step, then (`verify`: rows, proposals per row)
    one step of verify rows; return (torch's peak allocation over the steps, the bytes
    of the scratch KV cache counted in it).

    `make_runner(num_blocks)` builds a runner over a fresh KV cache of that many blocks.
    """
    num_rows, k = verify
    num_blocks = max(sum(cdiv(n, block_size) for n in lengths) for lengths in batches)
    num_blocks = max(num_blocks, num_rows * cdiv(k + 1, block_size))
    reader.reset_peak()
    runner = make_runner(num_blocks)
    scratch_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    for lengths in batches:
        _run_step(runner, num_blocks, lengths, block_size, max_len, vocab_size)
    if num_rows:
        _run_verify_step(runner, num_blocks, num_rows, k, block_size, vocab_size)
    return reader.peak_allocated(), scratch_bytes


def _run_verify_step(
    runner: ModelRunner, num_blocks: int, num_rows: int, k: int, block_size: int, vocab_size: int
) -> None:
    """One step of `num_rows` verify rows of 1 + k tokens (a one-token sequence and k
    proposals each), every position sampled."""
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size)
    out = SchedulerOutput()
    for i in range(num_rows):
        seq = Sequence(f"profile-spec-{i}", [i % vocab_size], _PROFILE_PARAMS, frozenset(), b"")
        if not kv.allocate_slots(seq, 1 + k):
            raise RuntimeError(f"the profile's verify step has no blocks for row {i}")
        proposals = tuple((i + j + 1) % vocab_size for j in range(k))
        out.verifies.append(ScheduledSeq(seq, 1 + k, 0, proposals))
    runner.execute(out)


def _run_step(
    runner: ModelRunner,
    num_blocks: int,
    lengths: list[int],
    block_size: int,
    max_len: int,
    vocab_size: int,
) -> None:
    """One step that prefills (and samples after) every prompt of `lengths` at once,
    scheduled by a real scheduler over a throwaway block pool."""
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size)
    limits = SchedulerLimits(
        max_num_seqs=len(lengths), max_num_batched_tokens=sum(lengths), max_model_len=max_len
    )
    scheduler = Scheduler(kv, limits)
    for i, n in enumerate(lengths):
        prompt = [(i + j) % vocab_size for j in range(n)]
        scheduler.add(Sequence(f"profile-{i}", prompt, _PROFILE_PARAMS, frozenset(), b""))
    out = scheduler.schedule()
    if out.num_tokens != sum(lengths):
        raise RuntimeError(f"the profile step scheduled {out.num_tokens} of {sum(lengths)} tokens")
    runner.execute(out)
