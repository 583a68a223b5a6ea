"""Peer fetch, the receiving side, whichever pool it is in (docs/kv-tiers.md, "Fetching
from a peer"): a worker about to compute a prompt expects the blocks of its prefix that
another worker holds, waits for them as long as the router asks, and writes them into
its pool under their hashes right before the request is added, so that the request
finds them as its cached prefix. A decode worker does this for the prompts it prefills
itself, a prefill worker for the prompts it prefills for others; anything that goes
wrong leaves the prompt computed, with the reason (`fetch_outcome`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pdserve.cluster.messages import fetch_id
from pdserve.common.hashing import hash_block_chain
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.worker.kv_handoff import KVImportError
from pdserve.kv_transfer.base import KVReceiver, ReceivedKV
from pdserve.kv_transfer.errors import (
    LeaseExpiredError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from pdserve.kv_transfer.torch_payload import received_tensors

logger = logging.getLogger(__name__)


class FetchInbox:
    """The fetches one worker's receiver expects, for its engine.

    `kv_wait_timeout_s`: the longest any fetch is waited for (the router asks for less:
    what computing the blocks would take, `kv_wait_factor` and `kv_wait_floor_s`).
    """

    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, kv_wait_timeout_s: float):
        self.engine = engine
        self.receiver = receiver
        self.kv_wait_timeout_s = kv_wait_timeout_s

    def wait_s(self, wait_s: float | None) -> float:
        """How long to wait: `wait_s`, at most `kv_wait_timeout_s`."""
        return self.kv_wait_timeout_s if wait_s is None else min(wait_s, self.kv_wait_timeout_s)

    def expect(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_blocks: int,
        wait_s: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Register a fetch of the prompt's first `num_blocks` full blocks for
        `request_id`: its KV arrives under `fetch_id(request_id)`, from the worker holding
        them, pushed when the router tells it. The chain is computed here, in the
        request's namespace (cache salt, adapter), so only those blocks are taken; a
        holder that lost its last blocks may send a leading part. Raises TransferError
        when the id is expected already."""
        engine = self.engine.engine  # immutable settings only: safe off the engine thread
        self.receiver.expect(
            fetch_id(request_id),
            self.wait_s(wait_s),
            model_id=engine.kv_model_id(lora),
            block_hashes=prompt_chain(engine, prompt_token_ids, cache_salt, lora)[:num_blocks],
            leading=True,
        )

    async def claim(
        self, request_id: str, info: dict[str, Any], wait_s: float | None
    ) -> ReceivedKV | None:
        """The fetched prefix's KV (None, "fetch_error" in `info`, when it did not come)."""
        try:
            return await self.receiver.claim(fetch_id(request_id), self.wait_s(wait_s))
        except TransferError as exc:
            info["fetch_error"] = exc
            logger.debug("%s: no fetched prefix (%s); computing it", request_id, exc)
            return None

    def cancel(self, request_id: str) -> None:
        """Stop expecting `request_id`'s fetch (idempotent; frees KV that came late)."""
        self.receiver.cancel(fetch_id(request_id))


def prompt_chain(
    engine: LLMEngine,
    prompt_token_ids: Sequence[int],
    cache_salt: str | None,
    lora: str | None = None,
) -> list[bytes]:
    """The prompt's block-hash chain in the request's namespace (its cache salt, its
    adapter), as the engine caches its blocks: what a receiver checks a push against."""
    namespace = engine.namespace_for(cache_salt, lora)
    return hash_block_chain(prompt_token_ids, engine.config.block_size, namespace)


def import_fetched(
    engine: LLMEngine,
    request_id: str,
    fetched: ReceivedKV,
    prompt_token_ids: list[int],
    params: SamplingParams,
    info: dict[str, Any],
) -> None:
    """On the engine thread: cache the fetched prefix for request `request_id`, added
    right after (held for it until it is admitted). "fetch" in `info`: "used" (and
    "fetched_blocks"), "already_held" (this worker held them: none written), or
    "fetch_error" says why they could not be written."""
    header = fetched.header
    ((_, payload),) = received_tensors(fetched)
    info.update(fetch_bytes=fetched.stats.num_bytes, fetch_seconds=fetched.stats.seconds)
    try:
        n = engine.import_prefix(
            prompt_token_ids,
            payload,
            header.first_block_index,
            header.block_hashes,
            params.cache_salt,
            params.lora,
            for_request=request_id,
        )
    except KVImportError as exc:
        info["fetch_error"] = exc
        logger.debug("%s: fetched prefix unusable (%s)", header.request_id, exc)
        return
    # none written: this worker held the blocks already (Serve gave the request to
    # another replica than the one placement chose, or it computed them meanwhile)
    info.update(fetch="used" if n else "already_held", fetched_blocks=n)


def fetch_outcome(info: dict[str, Any], cancelled: str | None) -> str:
    """What became of a fetch (`pdserve_kv_fetch_total{outcome}`): "used" or
    "already_held", else why not. `cancelled`: the reason the router gave when it ended
    the wait (the holder's push failed), None if it did not."""
    if info.get("fetch") in ("used", "already_held"):
        return str(info["fetch"])
    error = info.get("fetch_error")
    if isinstance(error, UnknownRequestError) and cancelled is not None:
        return cancelled  # the router ended the wait: the holder's push failed
    if isinstance(error, TransferTimeoutError | LeaseExpiredError):
        return "late"
    if isinstance(error, KVImportError):
        return "unusable"
    return "transfer_failed"
