"""The engine's side of the prefill -> decode KV handoff (docs/kv-handoff.md).

Prefill role: a request runs with `hold_kv` until its first token; its blocks stay
referenced, `export_kv` packs the ones the decode worker lacks, `release_kv` lets them
go (they stay in the prefix cache). Decode role: `import_prefilled` admits a request
whose prompt KV arrived: it reuses the decode worker's own cached leading blocks, copies
the rest in, and the sequence joins the running batch with its first token.

The payload is `kernels/kv_pack.py`'s buffer: [layers, 2, n, kv_heads, block_size,
head_dim] for blocks `first_block`..`ceil(prompt_len / block_size) - 1` of the prompt
(the last one may be partial: its K/V rows past the prompt are unused), always in host
memory: the engine's `KVStaging` (engine/kv_staging.py, which names every device
assumption of the handoff) moves it between the cache's device and the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.hashing import BlockHash
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.kv_staging import KVStaging, StagedKV
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus, TokenLogprobs


class KVImportError(InvalidRequestError):
    """Arrived KV cannot be admitted (prefix no longer cached here, wrong size, no room):
    the decode worker falls back to prefilling the request itself."""


@dataclass(frozen=True)
class KVExport:
    request_id: str
    first_block: int  # index in the prompt of the first block in `payload`
    block_hashes: tuple[BlockHash, ...]  # hashes of the full blocks in `payload`
    first_token: int
    staged: StagedKV  # the payload in host memory, maybe still being copied there
    # the first token's logprob and top-n, when the request asked for logprobs: the
    # decode worker reports them as its first token's, so no token lacks one
    first_logprobs: TokenLogprobs | None = None

    @property
    def payload(self) -> torch.Tensor:
        """[layers, 2, n, KVH, block_size, D], contiguous, on CPU. Blocks until a device
        copy is done: off the event loop, `wait()` first (`asyncio.to_thread`)."""
        return self.staged.wait()

    def ready(self) -> bool:
        """Whether `payload` is in host memory (no wait)."""
        return self.staged.ready()

    def wait(self) -> torch.Tensor:
        """Block until `payload` is in host memory; return it."""
        return self.staged.wait()

    def release(self) -> None:
        """Done with `payload` (sent or failed): its staging region may be reused."""
        self.staged.release()


def export_kv(seq: Sequence, staging: KVStaging, block_size: int, first_block: int) -> KVExport:
    """Pack the prompt blocks of a finished, held prefill from `first_block` on.

    The caller releases the export (`KVExport.release`) once its payload is sent.
    """
    if not seq.hold_kv or not seq.blocks or not seq.output_token_ids:
        raise InvalidRequestError(f"request {seq.request_id!r} holds no finished prefill")
    num_prompt_blocks = cdiv(seq.num_prompt_tokens, block_size)
    if not 0 <= first_block < num_prompt_blocks:
        raise InvalidRequestError(f"first_block {first_block} outside [0, {num_prompt_blocks})")
    ids = [b.block_id for b in seq.blocks[first_block:num_prompt_blocks]]
    num_full = seq.num_prompt_tokens // block_size
    return KVExport(
        request_id=seq.request_id,
        first_block=first_block,
        block_hashes=tuple(seq.full_block_hashes(block_size)[first_block:num_full]),
        first_token=seq.output_token_ids[0],
        staged=staging.export_blocks(ids),
        first_logprobs=seq.output_logprobs[0] if seq.output_logprobs else None,
    )


def import_prefilled(
    seq: Sequence,
    payload: torch.Tensor,
    first_block: int,
    kv: KVCacheManager,
    staging: KVStaging,
    scheduler: Scheduler,
) -> None:
    """Admit `seq` (prompt + its first token) with the prompt's KV: cached + `payload`.

    `payload` is read only during the call (the copy into the cache is synchronous), so
    its buffer may be reused once this returns. Raises KVImportError, holding nothing,
    when the first `first_block` blocks are no longer cached here, the payload has the
    wrong number of blocks or another layout, or blocks run out.
    """
    block_size = kv.block_size
    num_prompt = seq.num_prompt_tokens
    num_prompt_blocks = cdiv(num_prompt, block_size)
    if payload.shape[2] != num_prompt_blocks - first_block:
        raise KVImportError(
            f"payload holds {payload.shape[2]} blocks; blocks {first_block}.."
            f"{num_prompt_blocks - 1} of the prompt are needed"
        )
    try:
        staging.check_payload(payload, payload.shape[2])
    except ValueError as exc:
        raise KVImportError(str(exc)) from exc
    cached = kv.get_computed_blocks(seq)[:first_block] if first_block else []
    if len(cached) < first_block:
        raise KVImportError(f"only {len(cached)} of {first_block} prefix blocks are cached here")
    if not kv.allocate_slots(seq, num_prompt - first_block * block_size, cached):
        raise KVImportError("no free KV blocks for the arriving prompt")
    # the payload was checked above, before any block was taken (allocate_slots already
    # registered the blocks' hashes: a refusal from here on would leave them cached empty)
    staging.import_blocks(payload, [b.block_id for b in seq.blocks[first_block:]])
    seq.num_computed_tokens = num_prompt
    seq.num_cached_prompt_tokens = first_block * block_size
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
