"""The engine's side of the prefill -> decode KV handoff (docs/kv-handoff.md).

Prefill role: a request runs with `hold_kv` until its first token; its blocks stay
referenced, `export_kv` packs the ones the decode worker lacks, `release_kv` lets them
go (they stay in the prefix cache). Decode role: `import_prefilled` admits a request
whose prompt KV arrived: it reuses the decode worker's own cached leading blocks, copies
the rest in, and the sequence joins the running batch with its first token.

The payload is `kernels/kv_pack.py`'s buffer: [layers, 2, n, kv_heads, block_size,
head_dim] for blocks `first_block`..`ceil(prompt_len / block_size) - 1` of the prompt
(the last one may be partial: its K/V rows past the prompt are unused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.hashing import BlockHash
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
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
    payload: torch.Tensor  # [layers, 2, n, KVH, block_size, D], contiguous
    # the first token's logprob and top-n, when the request asked for logprobs: the
    # decode worker reports them as its first token's, so no token lacks one
    first_logprobs: TokenLogprobs | None = None


def export_kv(seq: Sequence, kv_cache: torch.Tensor, block_size: int, first_block: int) -> KVExport:
    """Pack the prompt blocks of a finished, held prefill from `first_block` on."""
    if not seq.hold_kv or not seq.blocks or not seq.output_token_ids:
        raise InvalidRequestError(f"request {seq.request_id!r} holds no finished prefill")
    num_prompt_blocks = cdiv(seq.num_prompt_tokens, block_size)
    if not 0 <= first_block < num_prompt_blocks:
        raise InvalidRequestError(f"first_block {first_block} outside [0, {num_prompt_blocks})")
    ids = torch.tensor(
        [b.block_id for b in seq.blocks[first_block:num_prompt_blocks]], device=kv_cache.device
    )
    num_full = seq.num_prompt_tokens // block_size
    return KVExport(
        request_id=seq.request_id,
        first_block=first_block,
        block_hashes=tuple(seq.full_block_hashes(block_size)[first_block:num_full]),
        first_token=seq.output_token_ids[0],
        payload=kv_cache.index_select(2, ids).contiguous(),
        first_logprobs=seq.output_logprobs[0] if seq.output_logprobs else None,
    )


def import_prefilled(
    seq: Sequence,
    payload: torch.Tensor,
    first_block: int,
    kv: KVCacheManager,
    kv_cache: torch.Tensor,
    scheduler: Scheduler,
) -> None:
    """Admit `seq` (prompt + its first token) with the prompt's KV: cached + `payload`.

    Raises KVImportError, holding nothing, when the first `first_block` blocks are no
    longer cached here, the payload has the wrong number of blocks, or blocks run out.
    """
    block_size = kv.block_size
    num_prompt = seq.num_prompt_tokens
    num_prompt_blocks = cdiv(num_prompt, block_size)
    if payload.shape[2] != num_prompt_blocks - first_block:
        raise KVImportError(
            f"payload holds {payload.shape[2]} blocks; blocks {first_block}.."
            f"{num_prompt_blocks - 1} of the prompt are needed"
        )
    cached = kv.get_computed_blocks(seq)[:first_block] if first_block else []
    if len(cached) < first_block:
        raise KVImportError(f"only {len(cached)} of {first_block} prefix blocks are cached here")
    if not kv.allocate_slots(seq, num_prompt - first_block * block_size, cached):
        raise KVImportError("no free KV blocks for the arriving prompt")
    ids = torch.tensor([b.block_id for b in seq.blocks[first_block:]], device=kv_cache.device)
    kv_cache.index_copy_(2, ids, payload.to(kv_cache.device))
    seq.num_computed_tokens = num_prompt
    seq.num_cached_prompt_tokens = first_block * block_size
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
