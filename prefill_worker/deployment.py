"""The prefill role as a Ray Serve deployment.

Each replica runs its own engine (chunked prefill with a per-step token budget, several
requests per step, reuse of its own cached prefix), samples the first token, pushes the
KV blocks the chosen decode worker lacks to that worker's receiver, and publishes its KV
events to the prefix index. The router calls `prefill` with the address of the decode
replica that took the request (its first stream item says it); `target_replica` (the
chosen prefill replica, or None when placement had no index) is read by
`TargetedRequestRouter`, not here. The result names the replica that served, which the
router counts.

Each heartbeat also publishes `prefill_tokens_per_s`, the worker's measured prefill
throughput (prompt tokens per busy second; first measured by two warm-up prefills before
the worker joins the index): with `queued_prefill_tokens` it tells the router how long
this worker's queue takes to drain (placement, conditional disaggregation, admission).

Each replica also runs a KV receiver (its address is the one it announces in the index)
for peer fetches (docs/kv-tiers.md, "Fetching from a peer"): when the router sends it a
prompt whose prefix another worker holds and pushing it is sooner than computing it, it
first calls `expect_fetch`, has the holder push the blocks here, and the `prefill` call
then waits for them (`fetch_blocks`, `fetch_wait_s`), writes them into the pool and
computes the rest; its report says what became of the fetch ("fetch").

With tracing on (`cluster/tracing.py`), a call that carries the router's W3C carrier
(`trace`) is a `pdserve.prefill` span with `pdserve.prefill.queue`,
`pdserve.prefill.compute` and `pdserve.kv.push` children.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry.trace import Span, SpanKind

from pdserve.cluster import tracing
from pdserve.cluster.log_once import OncePerCause
from pdserve.cluster.messages import FetchAccepted, LoadReport, PrefillReport, fetch_id
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.base import KVSender
from pdserve.kv_transfer.errors import TransferError
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.runtime.fetch_inbox import FetchInbox, fetch_outcome
from pdserve.runtime.replica import WorkerReplica

logger = logging.getLogger(__name__)


class PrefillServer(WorkerReplica):
    role = "prefill"

    # Ray Serve awaits an async constructor (type checkers want __init__ to be sync).
    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]
        super().__init__(config)
        cfg = self.config
        # tensor parallel: every rank sends its own KV heads (runtime/tp_ranks.py)
        ranks = None
        if self.rank_launcher is not None:
            from pdserve.runtime.tp_ranks import RankSenders

            ranks = RankSenders(self.rank_launcher.actors)
            await ranks.start(cfg.transport, cfg.transfer_tls())
        # peer fetches: a receiver of this worker's own (not with tensor parallelism: a
        # fetch moves one rank's KV)
        self.fetches: FetchInbox | None = None
        if ranks is None:
            receiver = make_receiver(cfg.transport, self.receiver_config(), tls=cfg.transfer_tls())
            self.fetches = FetchInbox(self.engine, receiver, cfg.kv_wait_timeout_s)
        # fetch id -> the reason the router gave `cancel_kv` (None until it does)
        self._awaiting_fetch: dict[str, str | None] = {}
        self._log = OncePerCause(logger)
        self.worker = PrefillWorker(
            self.engine,
            make_sender(cfg.transport, tls=cfg.transfer_tls()),
            cfg.cluster_token,
            transfer_timeout_s=cfg.transfer_timeout_s,
            lease_ms=int(cfg.kv_wait_timeout_s * 1000),
            ranks=ranks,
            fetches=self.fetches,
        )
        await self.load_lora_modules()
        # Measured before joining: the router never sees this worker without a rate.
        await self.worker.warm_up(min(cfg.max_num_batched_tokens, 512))
        self.tracer = tracing.tracer("prefill")  # None unless OTEL_* variables ask for it
        self.address = "" if self.fetches is None else await self.fetches.receiver.start()
        await self.join_index(self.address)

    async def expect_fetch(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        num_blocks: int,
        wait_s: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
        target_replica: str | None = None,
    ) -> FetchAccepted:
        """Expect a peer fetch of the prompt's first `num_blocks` full blocks for the
        `prefill` call of `request_id` that follows. Not taken (`fetch_expected` False)
        by another replica than `target_replica` (Serve routed the call on: the prefill
        would not come here either), with tensor parallelism, or for an id expected
        already."""
        accepted: FetchAccepted = {
            "worker_id": self.worker_id,
            "address": self.address,
            "fetch_expected": False,
        }
        if self.fetches is None or (target_replica not in (None, self.worker_id)):
            return accepted
        try:
            self.fetches.expect(request_id, prompt_token_ids, num_blocks, wait_s, cache_salt, lora)
        except TransferError as exc:
            self._log.log("fetch_refused", "%s: cannot take a fetch (%r)", request_id, exc)
            return accepted
        self._awaiting_fetch[fetch_id(request_id)] = None
        accepted["fetch_expected"] = True
        return accepted

    async def cancel_kv(
        self, request_id: str, reason: str = "holder_failed", target_replica: str | None = None
    ) -> str:
        """The peer push for fetch `request_id` (`fetch_id`) failed (`reason`): stop
        waiting for it and compute the prompt now. Returns this replica's id."""
        if request_id in self._awaiting_fetch:
            self._awaiting_fetch[request_id] = reason
        if self.fetches is not None:
            self.fetches.receiver.cancel(request_id)
        return self.worker_id

    def prefix_sender(self) -> KVSender:
        """A peer fetch's push goes out on the prefill pushes' own sender."""
        return self.worker.sender

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode_address: str,
        first_block: int = 0,
        target_replica: str | None = None,
        trace: dict[str, str] | None = None,
        fetch_blocks: int = 0,
        fetch_wait_s: float | None = None,
    ) -> PrefillReport:
        """Prefill and push to `decode_address`; returns timings and transfer figures.

        `trace`: the router's W3C carrier (tracing on), the parent of this call's spans.
        `fetch_blocks`, `fetch_wait_s`: a peer fetch `expect_fetch` registered (its
        outcome is the report's "fetch", with "fetched_blocks").

        Raises the transfer's typed error (`pdserve.kv_transfer.errors`); the router then
        tells the decode worker to stop waiting and prefill locally.
        """
        span: Span | None = None
        if trace is not None and self.tracer is not None:
            span = tracing.start(
                self.tracer,
                "pdserve.prefill",
                tracing.parent(trace),
                kind=SpanKind.SERVER,
                attributes={
                    "pdserve.request_id": request_id,
                    "pdserve.prefill.worker_id": self.worker_id,
                    "gen_ai.request.model": self.config.model_id,
                    "pdserve.prompt_tokens": len(prompt_token_ids),
                    "pdserve.kv.first_block": first_block,
                    "pdserve.kv.transport": self.config.transport,
                },
            )
        arrived = time.monotonic()
        info: dict[str, Any] = {}
        fid = fetch_id(request_id)
        if fid not in self._awaiting_fetch:
            fetch_blocks = 0  # not expected here (another replica took `expect_fetch`)
        try:
            result = await self.worker.prefill(
                request_id,
                prompt_token_ids,
                params,
                decode_address,
                first_block,
                fetch_blocks,
                fetch_wait_s,
                info,
            )
            done = time.monotonic()  # the push's end (before the events' flush)
        except BaseException as exc:
            if span is not None:
                tracing.fail(span, exc)
                span.end()
            raise
        finally:
            cancelled = self._awaiting_fetch.pop(fid, None)
            if fetch_blocks and self.fetches is not None:
                self.fetches.cancel(request_id)  # idempotent: frees a push that came late
            await self.flush_events()
        if span is not None:
            self._trace(span, result, arrived, done, decode_address)
        report: PrefillReport = {
            "worker_id": self.worker_id,
            "first_token": result.first_token,
            "num_prompt_tokens": result.num_prompt_tokens,
            "num_cached_tokens": result.num_cached_tokens,
            "num_blocks_sent": result.num_blocks_sent,
            "transfer_bytes": result.transfer.num_bytes,
            "transfer_s": result.transfer.seconds,
            "queue_s": result.queue_s,
            "compute_s": result.compute_s,
            "pack_s": result.pack_s,
        }
        if fetch_blocks:
            report["fetch"] = fetch_outcome(info, cancelled)
            report["fetched_blocks"] = int(info.get("fetched_blocks", 0))
            if report["fetch"] not in ("used", "already_held"):
                self._log.log(
                    f"fetch_{report['fetch']}",
                    "%s: fetched prefix not used (%s: %r); computed here",
                    request_id,
                    report["fetch"],
                    info.get("fetch_error"),
                )
        return report

    def _trace(
        self, span: Span, result: Any, arrived: float, now: float, decode_address: str
    ) -> None:
        """The call's stages as children of its span, from the result's timings."""
        assert self.tracer is not None
        scheduled = arrived + result.queue_s
        computed = scheduled + result.compute_s
        pushed_from = max(now - result.pack_s - result.transfer.seconds, computed)
        tracing.record(self.tracer, "pdserve.prefill.queue", span, arrived, scheduled)
        tracing.record(
            self.tracer,
            "pdserve.prefill.compute",
            span,
            scheduled,
            computed,
            {
                "pdserve.prompt_tokens": result.num_prompt_tokens,
                "pdserve.cached_tokens": result.num_cached_tokens,
            },
        )
        tracing.record(
            self.tracer,
            "pdserve.kv.push",
            span,
            pushed_from,
            now,
            {
                "pdserve.kv.transport": self.config.transport,
                "pdserve.kv.bytes": result.transfer.num_bytes,
                "pdserve.kv.blocks": result.num_blocks_sent,
                "pdserve.kv.pack_s": result.pack_s,
                "pdserve.decode.address": decode_address,
            },
        )
        span.set_attributes(
            {
                "pdserve.cached_tokens": result.num_cached_tokens,
                "pdserve.kv.bytes": result.transfer.num_bytes,
                "pdserve.kv.blocks": result.num_blocks_sent,
            }
        )
        span.end()

    def _rate(self) -> dict[str, int]:
        rate = self.worker.rate.tokens_per_s
        return {"prefill_tokens_per_s": round(rate) if rate is not None else 0}

    async def load(self, target_replica: str | None = None) -> LoadReport:
        load = await super().load(target_replica)
        load["prefill_tokens_per_s"] = self._rate()["prefill_tokens_per_s"]
        return load

    async def index_load(self) -> dict[str, int]:
        pending = 0 if self.fetches is None else self.fetches.receiver.num_pending
        return {**await super().index_load(), **self._rate(), "pending_transfers": pending}

    async def __del__(self) -> None:
        if self.fetches is not None:
            try:
                await self.fetches.receiver.close()
            except Exception:  # shutting down anyway: the rest must still be stopped
                logger.exception("closing the KV receiver failed")
        await self.worker.sender.close()
        if self.worker.ranks is not None:
            await self.worker.ranks.close()
        await self.shutdown()
        tracing.flush()
