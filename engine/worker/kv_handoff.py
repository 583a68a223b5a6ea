"""The engine's side of the prefill -> decode KV handoff (docs/kv-handoff.md).

Prefill role: a request runs with `hold_kv` until its first token; its blocks stay
referenced, `export_kv` packs the ones the decode worker lacks, `release_kv` lets them
go (they stay in the prefix cache). Decode role: `import_prefilled` admits a request
whose prompt KV arrived: it reuses the decode worker's own cached leading blocks, copies
the rest in, and the sequence joins the running batch with its first token.

The payload is `kernels/kv_pack.py`'s buffer: [layers, 2, n, kv_heads, block_size,
head_dim] for blocks `first_block`..`ceil(prompt_len / block_size) - 1` of the prompt
(the last one may be partial: its K/V rows past the prompt are unused), always in host
memory: the engine's `KVStaging` (engine/worker/kv_staging.py, which names every device
assumption of the handoff) moves it between the cache's device and the host.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.hashing import BlockHash
from pdserve.engine.sched.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.engine.sched.sequence import Sequence, SequenceStatus, TokenLogprobs
from pdserve.engine.worker.kv_staging import KVStaging, StagedKV

HeadRange = tuple[int, int]  # KV heads [start, end), the model's global head indices


class KVImportError(InvalidRequestError):
    """Arrived KV cannot be admitted (prefix no longer cached here, wrong size, no room):
    the decode worker falls back to prefilling the request itself."""


@dataclass(frozen=True)
class ExportedPart:
    """KV heads `kv_heads` (global indices) of an export's blocks, in host memory."""

    kv_heads: HeadRange
    staged: StagedKV  # maybe still being copied there


@dataclass(frozen=True)
class KVExport:
    request_id: str
    first_block: int  # index in the prompt of the first block in `payload`
    block_hashes: tuple[BlockHash, ...]  # hashes of the full blocks in `payload`
    first_token: int
    # what this rank packed: one part per KV-head range a receiver owns (all of this
    # rank's heads in one part, unless the decode side splits them differently)
    parts: tuple[ExportedPart, ...]
    # the first token's logprob and top-n, when the request asked for logprobs: the
    # decode worker reports them as its first token's, so no token lacks one
    first_logprobs: TokenLogprobs | None = None

    @property
    def staged(self) -> StagedKV:
        """The one part's payload (ValueError for an export of several parts)."""
        if len(self.parts) != 1:
            raise ValueError(f"the export of {self.request_id!r} has {len(self.parts)} parts")
        return self.parts[0].staged

    @property
    def payload(self) -> torch.Tensor:
        """[layers, 2, n, KVH, block_size, D], contiguous, on CPU (one part). Blocks until
        a device copy is done: off the event loop, `wait()` first (`asyncio.to_thread`)."""
        return self.staged.wait()

    def ready(self) -> bool:
        """Whether every part is in host memory (no wait)."""
        return all(p.staged.ready() for p in self.parts)

    def wait(self) -> torch.Tensor:
        """Block until the (one part's) payload is in host memory; return it."""
        return self.staged.wait()

    def wait_parts(self) -> list[tuple[HeadRange, torch.Tensor]]:
        """Block until every part is in host memory; (global head range, payload) each."""
        return [(p.kv_heads, p.staged.wait()) for p in self.parts]

    def release(self) -> None:
        """Done with the payloads (sent or failed): their staging regions may be reused."""
        for part in self.parts:
            part.staged.release()


def export_ranges(
    own: HeadRange, sends_own: bool, wanted: Seq[HeadRange] | None
) -> list[HeadRange]:
    """The global KV-head ranges a rank holding heads `own` packs for receivers owning
    `wanted` (None: one receiver owning every head): its overlap with each distinct
    range, none when `sends_own` is False (another rank holds the same replicated head
    and sends it: no byte goes twice)."""
    if not sends_own:
        return []
    if wanted is None:
        return [own]
    ranges = []
    for start, end in dict.fromkeys(wanted):  # distinct, in order
        lo, hi = max(own[0], start), min(own[1], end)
        if lo < hi:
            ranges.append((lo, hi))
    return ranges


def export_block_ids(seq: Sequence, block_size: int, first_block: int) -> list[int]:
    """The ids of the prompt blocks of a finished, held prefill from `first_block` on."""
    if not seq.hold_kv or not seq.blocks or not seq.output_token_ids:
        raise InvalidRequestError(f"request {seq.request_id!r} holds no finished prefill")
    num_prompt_blocks = cdiv(seq.num_prompt_tokens, block_size)
    if not 0 <= first_block < num_prompt_blocks:
        raise InvalidRequestError(f"first_block {first_block} outside [0, {num_prompt_blocks})")
    return [b.block_id for b in seq.blocks[first_block:num_prompt_blocks]]


def export_kv(
    seq: Sequence,
    staging: KVStaging,
    block_size: int,
    first_block: int,
    ranges: Seq[HeadRange] | None = None,
    own_start: int = 0,
) -> KVExport:
    """Pack the prompt blocks of a finished, held prefill from `first_block` on.

    `ranges`: the global KV-head ranges to pack, one part each (`export_ranges`); None:
    all of this cache's heads, one part. `own_start`: the global index of this cache's
    first KV head (a tensor-parallel rank's). The caller releases the export
    (`KVExport.release`) once its payloads are sent.
    """
    ids = export_block_ids(seq, block_size, first_block)
    num_full = seq.num_prompt_tokens // block_size
    if ranges is None:
        ranges = [(own_start, own_start + staging.kv_cache.shape[3])]
    parts = tuple(
        ExportedPart(r, staging.export_blocks(ids, (r[0] - own_start, r[1] - own_start)))
        for r in ranges
    )
    return KVExport(
        request_id=seq.request_id,
        first_block=first_block,
        block_hashes=tuple(seq.full_block_hashes(block_size)[first_block:num_full]),
        first_token=seq.output_token_ids[0],
        parts=parts,
        first_logprobs=seq.output_logprobs[0] if seq.output_logprobs else None,
    )


def import_prefilled(
    seq: Sequence,
    payload: torch.Tensor | Seq[tuple[HeadRange, torch.Tensor]],
    first_block: int,
    kv: KVCacheManager,
    staging: KVStaging,
    scheduler: Scheduler,
    own: HeadRange | None = None,
    on_blocks: Callable[[list[int]], None] | None = None,
) -> None:
    """Admit `seq` (prompt + its first token) with the prompt's KV: cached + `payload`.

    `payload`: one tensor holding all of this cache's KV heads, or parts (global head
    range, tensor) that tile `own` (this cache's global head range; default all of its
    heads from 0) exactly. `on_blocks(ids)`: called with the blocks written, once they
    are (a tensor-parallel driver tells its other ranks to write their parts there).
    The payload is read only during the call (the copy into the cache is synchronous),
    so its buffers may be reused once this returns. Raises KVImportError, holding
    nothing, when the first `first_block` blocks are no longer cached here, a payload
    has the wrong number of blocks, heads or another layout, or blocks run out, or
    its LoRA adapter can get no slot (the caller prefills it locally, through the queue).
    """
    block_size = kv.block_size
    num_prompt = seq.num_prompt_tokens
    num_prompt_blocks = cdiv(num_prompt, block_size)
    own = (0, staging.kv_cache.shape[3]) if own is None else own
    parts = [(own, payload)] if isinstance(payload, torch.Tensor) else list(payload)
    parts.sort(key=lambda part: part[0][0])
    at = own[0]
    for (start, end), tensor in parts:
        if start != at or end > own[1]:
            raise KVImportError(
                f"KV parts {[r for r, _ in parts]} do not tile this rank's heads {list(own)}"
            )
        at = end
        if tensor.shape[2] != num_prompt_blocks - first_block:
            raise KVImportError(
                f"payload holds {tensor.shape[2]} blocks; blocks {first_block}.."
                f"{num_prompt_blocks - 1} of the prompt are needed"
            )
        try:
            staging.check_payload(tensor, tensor.shape[2], (start - own[0], end - own[0]))
        except ValueError as exc:
            raise KVImportError(str(exc)) from exc
    if at != own[1]:
        raise KVImportError(f"KV parts {[r for r, _ in parts]} do not cover heads {list(own)}")
    cached = kv.get_computed_blocks(seq)[:first_block] if first_block else []
    if len(cached) < first_block:
        raise KVImportError(f"only {len(cached)} of {first_block} prefix blocks are cached here")
    if not scheduler.take_lora_slot(seq):
        raise KVImportError(
            f"no slot for LoRA adapter {seq.params.lora!r}: every one serves running requests"
        )
    if not kv.allocate_slots(seq, num_prompt - first_block * block_size, cached):
        raise KVImportError("no free KV blocks for the arriving prompt")
    # the payload was checked above, before any block was taken (allocate_slots already
    # registered the blocks' hashes: a refusal from here on would leave them cached empty)
    ids = [b.block_id for b in seq.blocks[first_block:]]
    for (start, end), tensor in parts:
        staging.import_blocks(tensor, ids, (start - own[0], end - own[0]))
    if on_blocks is not None:
        on_blocks(ids)
    seq.num_computed_tokens = num_prompt
    seq.num_cached_prompt_tokens = first_block * block_size
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
