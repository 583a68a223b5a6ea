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

With tracing on (`cluster/tracing.py`), a call that carries the router's W3C carrier
(`trace`) is a `pdserve.prefill` span with `pdserve.prefill.queue`,
`pdserve.prefill.compute` and `pdserve.kv.push` children.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Span, SpanKind

from pdserve.cluster import tracing
from pdserve.cluster.messages import LoadReport, PrefillReport
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer import make_sender
from pdserve.kv_transfer.base import KVSender
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.runtime.replica import WorkerReplica


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
        self.worker = PrefillWorker(
            self.engine,
            make_sender(cfg.transport, tls=cfg.transfer_tls()),
            cfg.cluster_token,
            transfer_timeout_s=cfg.transfer_timeout_s,
            lease_ms=int(cfg.kv_wait_timeout_s * 1000),
            ranks=ranks,
        )
        await self.load_lora_modules()
        # Measured before joining: the router never sees this worker without a rate.
        await self.worker.warm_up(min(cfg.max_num_batched_tokens, 512))
        self.tracer = tracing.tracer("prefill")  # None unless OTEL_* variables ask for it
        await self.join_index("")

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
    ) -> PrefillReport:
        """Prefill and push to `decode_address`; returns timings and transfer figures.

        `trace`: the router's W3C carrier (tracing on), the parent of this call's spans.

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
        try:
            result = await self.worker.prefill(
                request_id, prompt_token_ids, params, decode_address, first_block
            )
            done = time.monotonic()  # the push's end (before the events' flush)
        except BaseException as exc:
            if span is not None:
                tracing.fail(span, exc)
                span.end()
            raise
        finally:
            await self.flush_events()
        if span is not None:
            self._trace(span, result, arrived, done, decode_address)
        return {
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

    async def index_load(self) -> dict[str, int]:
        return {**await super().index_load(), **self._rate()}

    async def load(self, target_replica: str | None = None) -> LoadReport:
        load = await super().load(target_replica)
        load["prefill_tokens_per_s"] = self._rate()["prefill_tokens_per_s"]
        return load

    async def __del__(self) -> None:
        await self.worker.sender.close()
        if self.worker.ranks is not None:
            await self.worker.ranks.close()
        await self.shutdown()
        tracing.flush()
