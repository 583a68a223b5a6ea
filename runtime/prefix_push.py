"""Peer fetch, the holder's side, whichever pool it is in (docs/kv-tiers.md, "Fetching
from a peer"): the prompt prefix's blocks this engine holds, packed on its engine thread
and pushed to a receiver with the handoff's header and checks."""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.worker.kv_handoff import KVExport, KVImportError
from pdserve.kv_transfer.base import KVLayout, KVSender, TransferStats, make_header
from pdserve.kv_transfer.errors import NotHeldError
from pdserve.kv_transfer.torch_payload import payload_bytes


async def push_prefix(
    engine: AsyncEngine,
    sender: KVSender,
    layout: KVLayout,
    cluster_token: str,
    fetch: str,
    prompt_token_ids: list[int],
    num_blocks: int,
    first_block: int,
    address: str,
    cache_salt: str | None = None,
    lora: str | None = None,
    lease_ms: int = 30_000,
    timeout_s: float = 30.0,
) -> TransferStats:
    """Push blocks `first_block`.. of the prompt's first `num_blocks` full blocks that
    `engine` holds (pool or lower tier) to the receiver at `address`, as transfer `fetch`
    (the request's `fetch_id`); the stats' blocks are those sent. Raises the transfer's
    typed error, or NotHeldError when it holds none of them past `first_block` (evicted
    since the index said so, or tensor parallelism): the receiver then computes them."""

    def export(e: LLMEngine) -> KVExport | None:
        return e.export_prefix(fetch, prompt_token_ids, num_blocks, first_block, cache_salt, lora)

    try:
        exported = await engine.call(export)
    except KVImportError as exc:
        raise NotHeldError(f"{fetch}: {exc}") from exc
    if exported is None:
        raise NotHeldError(f"{fetch}: no block past {first_block} of the prefix is held here")
    try:
        payload = payload_bytes(await asyncio.to_thread(exported.wait))
        header = make_header(
            fetch,
            engine.engine.kv_model_id(lora),
            layout,
            payload,
            cluster_token,
            block_hashes=exported.block_hashes,
            first_block_index=first_block,
            lease_ms=lease_ms,
        )
        stats = await sender.send(address, header, payload, timeout_s=timeout_s)
    finally:
        exported.release()
    return dataclasses.replace(stats, num_blocks=len(exported.block_hashes))
