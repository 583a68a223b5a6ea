"""A prefill worker: prompt in, first token out, the prompt's KV pushed to a decode worker.

Framework-free (the Ray Serve deployment wraps it). The request's blocks stay held from
its prefill until the push ends, then go back to the prefix cache, whatever the outcome
(docs/kv-handoff.md: P frees what D never acknowledged).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cluster.rate_meter import RateMeter
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineClosedError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.worker.kv_handoff import KVExport
from pdserve.kv_transfer.base import KVSender, TransferStats
from pdserve.kv_transfer.torch_payload import layout_of
from pdserve.runtime.fetch_inbox import FetchInbox, import_fetched
from pdserve.runtime.kv_targets import send_parts, split_targets

if TYPE_CHECKING:  # ray is imported only where ranks are actors
    from pdserve.runtime.tp_ranks import RankSenders


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill did; the seconds feed the router's TTFT breakdown."""

    request_id: str
    first_token: int
    num_blocks_sent: int
    transfer: TransferStats
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # this worker's own prefix-cache hit
    queue_s: float = 0.0  # arrival here -> first scheduled
    compute_s: float = 0.0  # first scheduled -> first token sampled
    pack_s: float = 0.0  # export + checksums, before the first byte is sent


class PrefillWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        sender: KVSender,
        cluster_token: str,
        transfer_timeout_s: float = 30.0,
        lease_ms: int = 30_000,
        ranks: RankSenders | None = None,
        fetches: FetchInbox | None = None,
    ) -> None:
        """`ranks`: a tensor-parallel replica's other ranks, which send their own KV
        heads (runtime/tp_ranks.py); this process sends rank 0's. `fetches`: this
        worker's receiver of peer fetches (None: it takes none, e.g. tensor parallel)."""
        self.engine = engine
        self.fetches = fetches
        self.ranks = ranks
        self.total_kv_heads = engine.engine.model_config.num_kv_heads
        self.sender = sender
        self.cluster_token = cluster_token
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_ms = lease_ms
        self.layout = layout_of(engine.engine.runner.kv_cache, engine.engine.config.kv_cache_dtype)
        # prompt tokens per busy second, published with each heartbeat: the router's
        # estimate of how long this worker's queue takes (placement, admission)
        self.rate = RateMeter()

    async def warm_up(self, num_tokens: int) -> float | None:
        """Prefill two dummy prompts of `num_tokens` tokens; seed the rate with the second.

        A worker's first prefills are its slowest (allocator, kernels, caches warming),
        and until it has a rate the router cannot estimate its queue: it sends every
        prompt here (`unmeasured`), so a busy cluster's first seconds piled up on the
        prefill pool (measured: 429s and 6-15 s first tokens at 2 req/s of 512-token
        prompts). Returns the seeded tokens per second. The dummy blocks stay in the
        prefix cache like any other, evictable.
        """
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine = self.engine.engine  # immutable settings only: safe off the engine thread
        vocab = engine.model_config.vocab_size
        num_tokens = max(min(num_tokens, engine.max_model_len - 1), 1)
        for i in range(2):
            request_id = f"warm-up-{i}"
            prompt = [1 + (7 * k + i) % (vocab - 1) for k in range(num_tokens)]

            def add(engine: LLMEngine, r: str = request_id, p: list[int] = prompt) -> None:
                engine.add_request(r, p, params)

            start = time.monotonic()
            async for _ in self.engine.stream(request_id, add):
                pass
            if i == 1:
                self.rate.add(num_tokens, start, time.monotonic())
        return self.rate.tokens_per_s

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode_address: str,
        first_block: int = 0,
        fetch_blocks: int = 0,
        fetch_wait_s: float | None = None,
        info: dict[str, Any] | None = None,
    ) -> PrefillResult:
        """Prefill, then push blocks `first_block`.. of the prompt to `decode_address`
        (a receiver's address, or a tensor-parallel decode replica's: each of its ranks
        gets its own KV heads, from every rank here that holds them).

        `fetch_blocks` (the router had `fetches` expect them): the prompt's first blocks
        come from the peer holding them, waited for up to `fetch_wait_s`, instead of
        being computed here; "fetch" or "fetch_error" in `info` says what became of them
        (runtime/fetch_inbox.py), and the prompt is computed past whatever came.

        Raises the transfer's typed error (the decode worker then prefills locally).
        """
        # Prefill samples exactly the first token, as the request would (same seed, filters).
        first_params = dataclasses.replace(params, max_tokens=1, ignore_eos=True, stop=())
        info = {} if info is None else info
        fetched = None
        if fetch_blocks and self.fetches is not None:
            fetched = await self.fetches.claim(request_id, info, fetch_wait_s)

        def start(engine: LLMEngine) -> None:
            if fetched is not None:
                import_fetched(engine, request_id, fetched, prompt_token_ids, first_params, info)
            engine.add_request(request_id, prompt_token_ids, first_params, hold_kv=True)

        def release_fetched() -> None:
            if fetched is not None:
                fetched.release()

        first_token = -1
        arrived = time.monotonic()
        scheduled = arrived
        queue_s = compute_s = 0.0
        num_cached = 0

        targets = split_targets(decode_address)
        # the decode ranks' KV heads (None: one receiver owning them all)
        ranges = None if targets[0][1] is None else [r for _, r in targets if r is not None]
        resolved = [(a, r or (0, self.total_kv_heads)) for a, r in targets]

        def export_now(engine: LLMEngine) -> KVExport:
            return engine.export_kv(request_id, first_block, ranges)

        export: KVExport | None = None
        try:
            # the KV is exported on the engine thread as soon as the prefill ends, not
            # after the next step (a whole prefill chunk when others are queued)
            stream = self.engine.stream(
                request_id, start, on_started=release_fetched, on_finish=export_now
            )
            async for out in stream:
                first_token = out.token_ids[0]
                num_cached = out.num_cached_tokens
                scheduled = out.first_scheduled_s or arrived
                queue_s = max(scheduled - arrived, 0.0)
                compute_s = max(time.monotonic() - scheduled, 0.0)
            self.rate.add(len(prompt_token_ids) - num_cached, scheduled, scheduled + compute_s)
            packed = time.monotonic()
            export = self.engine.take_finish_result(request_id)
            # the first token's logprobs (if asked for) cross with its KV: the decode
            # worker reports them, so a response has one for every token
            first_lp = export.first_logprobs
            header = {
                "model_id": self.engine.engine.kv_model_id(params.lora),
                "token": self.cluster_token,
                "total_kv_heads": self.total_kv_heads,
                "block_hashes": export.block_hashes,
                "first_block_index": first_block,
                "first_token": first_token,
                "first_token_logprob": None if first_lp is None else first_lp.logprob,
                "first_token_top_logprobs": () if first_lp is None else first_lp.top,
                "lease_ms": self.lease_ms,
            }
            pack_s = time.monotonic() - packed
            sends = [
                send_parts(
                    self.sender,
                    request_id,
                    export.parts,
                    resolved,
                    header,
                    self.layout,
                    self.transfer_timeout_s,
                )
            ]
            if self.ranks is not None:  # every other rank sends its own heads
                sends.append(self.ranks.send(request_id, resolved, header, self.transfer_timeout_s))
            results = await asyncio.gather(*sends, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            moved = [t for r in results if not isinstance(r, BaseException) for t in r]
            block_size = self.engine.engine.config.block_size
            num_blocks = -(-len(prompt_token_ids) // block_size) - first_block
            stats = TransferStats(
                request_id, sum(b for b, _ in moved), num_blocks, max(s for _, s in moved)
            )
        finally:
            release_fetched()  # idempotent: the start may have failed before it ran
            if export is not None:  # sent or failed: its staging region may be reused
                export.release()
            # not awaited: the result does not depend on it, and it would wait a step
            with contextlib.suppress(EngineClosedError):  # a closed engine holds nothing
                self.engine.submit(lambda e: e.release_kv(request_id))
        return PrefillResult(
            request_id,
            first_token,
            stats.num_blocks,
            stats,
            num_prompt_tokens=len(prompt_token_ids),
            num_cached_tokens=num_cached,
            queue_s=queue_s,
            compute_s=compute_s,
            pack_s=pack_s,
        )
