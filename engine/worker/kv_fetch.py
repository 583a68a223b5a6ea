"""The engine's side of a peer fetch: a prompt prefix's KV copied from the engine that
holds it into one that would otherwise compute it (docs/kv-tiers.md, "Fetching from a
peer").

Holder: `export_prefix` looks the prefix's blocks up by their hashes (the pool, then the
lower tiers, whose hits are promoted first) and packs blocks `first_block`.. of it, in
the handoff's wire layout (engine/worker/kv_handoff.py). The blocks are referenced only
while they are packed: on CPU the pack is a copy, on CUDA a kernel queued on the compute
stream ahead of any step that could reuse them.

Receiver: `import_prefix` writes the fetched blocks into free blocks of its own pool,
registered under the same hashes; the request that wanted them, queued right after on
the same engine thread, finds them as a prefix-cache hit. The engine keeps the prefix
referenced for that request until it is admitted (`LLMEngine.import_prefix`'s
`for_request`), so that no admission before it evicts the blocks. Nothing is ever half
registered: the payload is checked before a block is taken.

No first token crosses: a fetch carries KV only; the receiving engine computes the rest
of the prompt and samples as it always does, so tokens are those of computing it all.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.common.hashing import BlockHash
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.worker.kv_handoff import ExportedPart, KVExport, KVImportError
from pdserve.engine.worker.kv_staging import KVStaging

_PAD_TOKEN = 0  # one token past the prefix: get_computed_blocks always leaves one


def prefix_sequence(
    request_id: str, prompt_token_ids: Seq[int], num_blocks: int, block_size: int, ns: bytes
) -> Sequence:
    """A sequence (never scheduled) of the prompt's first `num_blocks` full blocks, whose
    prefix-cache lookup may return all of them."""
    tokens = [*prompt_token_ids[: num_blocks * block_size], _PAD_TOKEN]
    return Sequence(request_id, tokens, SamplingParams(), frozenset(), ns)


def export_prefix(
    seq: Sequence, num_blocks: int, first_block: int, kv: KVCacheManager, staging: KVStaging
) -> KVExport | None:
    """Pack blocks `first_block`.. of the leading `num_blocks` blocks of `seq` that this
    engine holds (fewer when it holds fewer); None when it holds no more than
    `first_block` of them, or the pool cannot take its lower tier's hits back."""
    computed = kv.get_computed_blocks(seq)[:num_blocks]
    if len(computed) <= first_block:
        return None
    if not kv.allocate_slots(seq, 0, computed):
        return None
    try:
        ids = [b.block_id for b in seq.blocks[first_block : len(computed)]]
        staged = staging.export_blocks(ids)
    finally:
        kv.free(seq)
    hashes = seq.full_block_hashes(kv.block_size)
    return KVExport(
        request_id=seq.request_id,
        first_block=first_block,
        block_hashes=tuple(hashes[first_block : len(computed)]),
        first_token=-1,
        parts=(ExportedPart((0, staging.kv_cache.shape[3]), staged),),
    )


def import_prefix(
    seq: Sequence,
    payload: torch.Tensor,
    first_block: int,
    block_hashes: Seq[BlockHash],
    kv: KVCacheManager,
    staging: KVStaging,
    hold: bool = False,
) -> int:
    """Write `payload` (blocks `first_block`.. of `seq`'s prefix, hashed `block_hashes`)
    into this pool as cached blocks; the number of blocks written (the ones this pool
    gained meanwhile are skipped). Unreferenced, unless `hold`: then `seq` keeps its
    references to the whole prefix until the caller frees it (`kv.free(seq)`), so that
    nothing evicts it before the request that wanted it is admitted. Raises
    KVImportError, holding nothing, when the payload does not fit `seq`'s chain, blocks
    before `first_block` are not cached here, or no blocks are free."""
    num_blocks = first_block + len(block_hashes)
    chain = seq.full_block_hashes(kv.block_size)
    if len(chain) < num_blocks or tuple(chain[first_block:num_blocks]) != tuple(block_hashes):
        raise KVImportError("the fetched blocks are not this prompt's prefix")
    if payload.shape[2] != len(block_hashes):
        raise KVImportError(f"payload holds {payload.shape[2]} blocks, not {len(block_hashes)}")
    try:
        staging.check_payload(payload, len(block_hashes))
    except ValueError as exc:
        raise KVImportError(str(exc)) from exc
    cached = kv.get_computed_blocks(seq)[:num_blocks]
    if len(cached) < first_block:
        raise KVImportError(f"only {len(cached)} of {first_block} prefix blocks are cached here")
    have = len(cached)
    if have == num_blocks and not hold:
        return 0
    if not kv.allocate_slots(seq, (num_blocks - have) * kv.block_size, cached):
        raise KVImportError("no free KV blocks for the fetched prefix")
    try:
        if have < num_blocks:
            part = payload[:, :, have - first_block :]
            staging.import_blocks(part.contiguous(), [b.block_id for b in seq.blocks[have:]])
    except BaseException:
        kv.free(seq)
        raise
    if not hold:
        kv.free(seq)  # cached now, most recently used: the request's admission finds them
    return num_blocks - have
