"""The decode role as a Ray Serve deployment.

Each replica runs a KV receiver on its own port (announced in the prefix index as its
address), takes requests that wait for their KV under a lease, runs continuous batching
with preemption, and streams outputs back to the router: on the router connection's token
channel (`channels.py`: one Serve stream per router replica, one message per engine step
carrying every request's new tokens), or as a stream of its own per request (`generate`).
A transfer that fails, arrives late or is cancelled by the router makes it prefill the
request locally; colocated mode always does. KV events go to the index.

In disaggregated mode a replica expects KV whenever the router asks, whichever replica
Ray Serve gave the call to (the one placement chose, another if that one was gone or
full, any one when placement had no index): the router learns which replica took the
request and its receiver's address from the "accepted" item, and tells the prefill
worker to push there.

Items are plain dicts, typed in `cluster/messages.py` (the router imports no torch): first
`{"type": "accepted", "kv_expected": bool, "worker_id": str, "address": str}` once the
receiver expects the request (only then may the prefill worker push; `submit` returns
it), then one `{"type": "output", ...}` per step that produced tokens. With `n` > 1
(parallel sampling) each names its choice (`"index"`); its `"finished"` is the whole
request's, its `"finish_reason"` its choice's. When expected KV
was not used, the first output item says why in "local_prefill" (a reason of the router's
`pdserve_decode_local_prefill_total`: "transfer_failed", "kv_late" or what the router
gave `cancel_kv`).

With tracing on (`cluster/tracing.py`), a request that carries the router's W3C carrier
(`trace`) is a `pdserve.decode` span with `pdserve.kv.receive` (the wait for its KV),
`pdserve.decode.queue` (until first scheduled), `pdserve.decode.local_prefill` (when it
prefilled itself) and `pdserve.decode.stream` (first token to the last) children.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.trace import Span, SpanKind

from pdserve.cluster import tracing
from pdserve.cluster.log_once import OncePerCause
from pdserve.cluster.messages import (
    Accepted,
    ChannelHello,
    ErrorItem,
    FirstItemExtras,
    LoadReport,
    OutputItem,
    SubmitReply,
    fetch_id,
)
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.decode_worker.channels import Batch, Channel, Channels
from pdserve.decode_worker.worker import DecodeWorker, choice_index
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.worker.kv_handoff import KVImportError
from pdserve.kv_transfer import make_receiver
from pdserve.kv_transfer.errors import (
    LeaseExpiredError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from pdserve.runtime.fetch_inbox import fetch_outcome
from pdserve.runtime.replica import WorkerReplica

logger = logging.getLogger(__name__)

# A token channel that has carried no request this long ends (the router opens another
# when it needs one): well inside Serve's graceful_shutdown_timeout_s, which a draining
# replica waits for its calls (channels included) to end.
CHANNEL_IDLE_S = 5.0


class DecodeServer(WorkerReplica):
    role = "decode"

    # Ray Serve awaits an async constructor (type checkers want __init__ to be sync).
    # `peers`: when a model's pools are an application of their own (several models,
    # deploy/app.py), the decode pool is its root and gets the prefill pool's handle
    # only so that Serve deploys that pool with it; it is not used.
    async def __init__(self, config: dict[str, Any], *peers: Any) -> None:  # type: ignore[misc]
        super().__init__(config)
        cfg = self.config
        engine = self.engine.engine
        receiver_config = self.receiver_config()
        tls = cfg.transfer_tls()
        receiver = make_receiver(cfg.transport, receiver_config, tls=tls)
        # tensor parallel: every rank receives its own KV heads (runtime/tp_ranks.py)
        ranks = start_ranks = None
        if self.rank_launcher is not None:
            from pdserve.runtime.tp_ranks import RankReceivers

            ranks = RankReceivers(self.rank_launcher.actors, engine.kv_head_ranges())
            start_ranks = functools.partial(ranks.start, cfg.transport, receiver_config, tls)
        self.worker = DecodeWorker(self.engine, receiver, cfg.kv_wait_timeout_s, ranks)
        # request id -> the reason the router gave `cancel_kv` (None until it does), for
        # each request of this replica that expects KV and has not produced a token yet
        self._awaiting_kv: dict[str, str | None] = {}
        self._log = OncePerCause(logger)
        self.channels = Channels()
        self._migrating: set[str] = set()  # requests moved elsewhere by a drain
        self.tracer = tracing.tracer("decode")  # None unless OTEL_* variables ask for it
        await self.load_lora_modules()
        self.address = await self.worker.start(start_ranks)
        await self.join_index(self.address)

    async def channel(
        self, channel_id: str, target_replica: str | None = None
    ) -> AsyncIterator[Batch]:
        """A router connection's token channel (`channels.py`): first a
        `{"type": "channel", "worker_id": ...}` hello, then batches of
        `(request_id, item)` for the requests `submit` started on it."""
        hello: ChannelHello = {"type": "channel", "worker_id": self.worker_id}
        async for batch in self.channels.serve(channel_id, hello, CHANNEL_IDLE_S):
            yield batch

    async def submit(
        self,
        channel_id: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        kv_wait_s: float | None = None,
        worker_id: str | None = None,
        target_replica: str | None = None,
        trace: dict[str, str] | None = None,
        fetch_blocks: int = 0,
    ) -> SubmitReply:
        """Start a request whose outputs go on channel `channel_id`; return the
        "accepted" item (see the module's docstring), or `{"type": "no_channel"}` when
        that channel is not open on this replica or this is not replica `worker_id`
        (the router then opens another and submits again). Items of the request on the
        channel: its outputs, or one `{"type": "error"}` if serving it failed. `trace`:
        the router's W3C carrier (tracing on), the parent of the request's span.
        `fetch_blocks`: the router will have a peer push the prompt's first blocks here
        (a request this replica prefills itself); "fetch_expected" in the reply says
        whether the receiver expects them."""
        channel = self.channels.get(channel_id)
        if channel is None or (worker_id is not None and worker_id != self.worker_id):
            return {"type": "no_channel", "worker_id": self.worker_id}
        if request_id in channel.tasks:
            raise ValueError(f"request {request_id} is running on this channel already")
        accepted = await self._accept(
            request_id, prompt_token_ids, kv_expected, kv_wait_s, params, fetch_blocks
        )
        fetch = fetch_blocks if accepted.get("fetch_expected") else 0
        channel.tasks[request_id] = asyncio.create_task(
            self._run(
                channel,
                request_id,
                prompt_token_ids,
                params,
                accepted["kv_expected"],
                kv_wait_s,
                trace,
                fetch,
            )
        )
        return accepted

    async def abort(
        self, channel_id: str, request_id: str, target_replica: str | None = None
    ) -> bool:
        """Stop a request started by `submit` (its client went away); False if it was
        not running here."""
        channel = self.channels.get(channel_id)
        task = channel.tasks.get(request_id) if channel is not None else None
        if task is None:
            return False
        task.cancel()
        return True

    async def _run(
        self,
        channel: Channel,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool,
        kv_wait_s: float | None,
        trace: dict[str, str] | None = None,
        fetch_blocks: int = 0,
    ) -> None:
        try:
            async for item in self._outputs(
                request_id, prompt_token_ids, params, kv_expected, kv_wait_s, trace, fetch_blocks
            ):
                channel.put(request_id, item)
        except asyncio.CancelledError:
            # aborted (by the router, or its channel closed): the engine stream ended; or
            # moved by this replica's drain: the router resumes it elsewhere
            if request_id in self._migrating:
                channel.put(request_id, _migrate_item(self.worker_id))
        except Exception as exc:  # reaches the router, which resumes it elsewhere...
            error: ErrorItem = {"type": "error", "message": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, InvalidRequestError) and not isinstance(exc, KVImportError):
                # ...unless the engine refused the request itself (say, its LoRA adapter
                # was unloaded meanwhile): every attempt would be refused alike
                logger.warning("%s: refused by the engine: %s", request_id, exc)
                error = {"type": "error", "message": str(exc), "invalid": True}
            else:
                logger.exception("%s: serving the request failed", request_id)
            channel.put(request_id, error)
        finally:
            self._migrating.discard(request_id)
            self._release(request_id, kv_expected, fetch_blocks > 0)
            channel.tasks.pop(request_id, None)

    def begin_drain(self, deadline: float) -> None:
        """Leaving the pool (cluster/drain.py): at `deadline` the requests still running
        on the channels move to other decode workers (a `migrate` error item each)."""
        super().begin_drain(deadline)
        loop = asyncio.get_running_loop()
        loop.call_later(max(deadline - time.time(), 0.0), self._migrate)

    def _migrate(self) -> None:
        tasks = {rid: t for c in self.channels.open_channels() for rid, t in c.tasks.items()}
        if tasks:
            logger.info("%s: drain deadline: moving %d requests", self.worker_id, len(tasks))
        for request_id, task in tasks.items():
            self._migrating.add(request_id)
            task.cancel()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        target_replica: str | None = None,
        kv_wait_s: float | None = None,
        trace: dict[str, str] | None = None,
    ) -> AsyncIterator[Accepted | OutputItem]:
        """One request as a stream of its own: the "accepted" item, then its outputs.

        The router uses channels (`submit`); this is the per-request form of the same
        call (a Serve stream per request, as benchmarks/router_overhead.py measures).
        `kv_expected`, `kv_wait_s`, `trace`: as `submit`'s.
        """
        accepted = await self._accept(request_id, prompt_token_ids, kv_expected, kv_wait_s, params)
        try:
            yield accepted
            async for item in self._outputs(
                request_id, prompt_token_ids, params, accepted["kv_expected"], kv_wait_s, trace
            ):
                yield item
        finally:
            self._release(request_id, accepted["kv_expected"])

    async def _accept(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        kv_expected: bool,
        kv_wait_s: float | None,
        params: SamplingParams | None = None,
        fetch_blocks: int = 0,
    ) -> Accepted:
        """Take a request: with `kv_expected` (disaggregated mode) the receiver expects
        its KV from now on, for `kv_wait_s` (the router derives it from its estimate of the
        prefill; at most `kv_wait_timeout_s`, which is also the wait without it), hashed
        in the request's namespace (its `params`' cache salt and LoRA adapter).

        This replica takes the KV even when it is not the one placement chose (the
        `target_replica` the request router reads): the router pushes to the address
        returned here, so the split happens whoever serves.
        """
        kv_expected = kv_expected and self.config.mode == "disagg"
        salt, lora = (None, None) if params is None else (params.cache_salt, params.lora)
        if kv_expected:
            try:
                await self.worker.expect_kv_all(request_id, prompt_token_ids, kv_wait_s, salt, lora)
            except TransferError as exc:  # e.g. the id is expected here already
                why = "%s: cannot take KV here (%r); prefilling locally"
                self._log.log("not_target", why, request_id, exc)
                kv_expected = False
        if kv_expected:
            self._awaiting_kv[request_id] = None
        accepted: Accepted = {
            "type": "accepted",
            "kv_expected": kv_expected,
            "worker_id": self.worker_id,
            "address": self.address,
        }
        if fetch_blocks > 0 and not kv_expected:
            try:
                self.worker.expect_fetch(
                    request_id, prompt_token_ids, fetch_blocks, kv_wait_s, salt, lora
                )
            except TransferError as exc:
                self._log.log("fetch_refused", "%s: cannot take a fetch (%r)", request_id, exc)
            else:
                self._awaiting_kv[fetch_id(request_id)] = None
                accepted["fetch_expected"] = True
        return accepted

    async def _outputs(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool,
        kv_wait_s: float | None,
        trace: dict[str, str] | None = None,
        fetch_blocks: int = 0,
    ) -> AsyncIterator[OutputItem]:
        info: dict[str, Any] = {}
        first = True
        span: Span | None = None
        if trace is not None and self.tracer is not None:
            span = tracing.start(
                self.tracer,
                "pdserve.decode",
                tracing.parent(trace),
                kind=SpanKind.SERVER,
                attributes={
                    "pdserve.request_id": request_id,
                    "pdserve.decode.worker_id": self.worker_id,
                    "gen_ai.request.model": self.config.model_id,
                    "pdserve.prompt_tokens": len(prompt_token_ids),
                    "pdserve.kv_expected": kv_expected,
                },
            )
        started = time.monotonic()
        first_item: OutputItem | None = None
        last: OutputItem | None = None
        first_s = started
        # parallel sampling: every item names its choice ("index"); "finished" says the
        # whole request is (each choice's own end is its "finish_reason")
        running = set(range(params.n))
        try:
            async for out in self.worker.generate(
                request_id, prompt_token_ids, params, kv_expected, info, kv_wait_s, fetch_blocks
            ):
                item = _output_item(out)
                if params.n > 1:
                    index = choice_index(request_id, out.request_id)
                    if out.finished:
                        running.discard(index)
                    item["index"], item["finished"] = index, not running
                if first:
                    item.update(_first_item_extras(out, info, self.config.block_size))
                    if kv_expected and not info.get("kv_used"):
                        item["local_prefill"] = self._local_prefill_reason(request_id, info)
                    if fetch_blocks:
                        item["fetch"] = self._fetch_outcome(request_id, info)
                        item["fetched_blocks"] = int(info.get("fetched_blocks", 0))
                    first = False
                    if span is not None:
                        first_s, first_item = time.monotonic(), item
                if out.finished:
                    await self.flush_events()
                if span is not None:
                    last = item
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            if span is not None:
                span.set_attribute("pdserve.cancelled", True)
            raise
        except Exception as exc:
            if span is not None:
                tracing.fail(span, exc)
            raise
        finally:
            if span is not None:
                self._trace(span, kv_expected, info, started, first_s, first_item, last)

    def _trace(
        self,
        span: Span,
        kv_expected: bool,
        info: dict[str, Any],
        started: float,
        first_s: float,
        first_item: OutputItem | None,
        last: OutputItem | None,
    ) -> None:
        """A request's stages as children of its span, from the times `_outputs` kept."""
        assert self.tracer is not None
        end = time.monotonic()
        ready = info.get("ready_s", started)
        if kv_expected:
            attrs: dict[str, Any] = {"pdserve.kv.used": bool(info.get("kv_used"))}
            if "kv_bytes" in info:
                attrs["pdserve.kv.bytes"] = info["kv_bytes"]
                attrs["pdserve.kv.blocks"] = info["kv_blocks"]
            if info.get("kv_error") is not None:
                attrs["pdserve.kv.error"] = type(info["kv_error"]).__name__
            tracing.record(self.tracer, "pdserve.kv.receive", span, started, ready, attrs)
        if first_item is not None and last is not None:
            scheduled = min(ready + first_item.get("decode_queue_s", 0.0), first_s)
            if first_item.get("kv_used"):
                scheduled = first_s  # the imported request's first token is prefill's
            tracing.record(self.tracer, "pdserve.decode.queue", span, ready, scheduled)
            if not first_item.get("kv_used"):
                tracing.record(
                    self.tracer, "pdserve.decode.local_prefill", span, scheduled, first_s
                )
            span.add_event("first_token", timestamp=tracing.epoch_ns(first_s))
            stream_attrs: dict[str, Any] = {
                "gen_ai.usage.output_tokens": last.get("num_output_tokens", 0),
            }
            if last.get("finish_reason") is not None:
                stream_attrs["gen_ai.response.finish_reasons"] = [last["finish_reason"]]
            tracing.record(self.tracer, "pdserve.decode.stream", span, first_s, end, stream_attrs)
            span.set_attributes(
                {
                    "pdserve.kv.used": bool(first_item.get("kv_used")),
                    "pdserve.cached_tokens": first_item.get("num_cached_tokens", 0),
                    **stream_attrs,
                }
            )
            if first_item.get("local_prefill"):
                span.set_attribute("pdserve.local_prefill_reason", first_item["local_prefill"])
        span.end()

    def _release(self, request_id: str, kv_expected: bool, fetch: bool = False) -> None:
        self._awaiting_kv.pop(request_id, None)
        if kv_expected:
            self.worker.cancel_kv(request_id)  # idempotent; frees late KV
        if fetch:
            self._awaiting_kv.pop(fetch_id(request_id), None)
            self.worker.receiver.cancel(fetch_id(request_id))

    def _fetch_outcome(self, request_id: str, info: dict[str, Any]) -> str:
        """What became of a peer fetch: "used", or why not (`pdserve_kv_fetch_total`)."""
        outcome = fetch_outcome(info, self._awaiting_kv.get(fetch_id(request_id)))
        if outcome not in ("used", "already_held"):
            self._log.log(
                f"fetch_{outcome}",
                "%s: fetched prefix not used (%s: %r); computed here",
                request_id,
                outcome,
                info.get("fetch_error"),
            )
        return outcome

    def _local_prefill_reason(self, request_id: str, info: dict[str, Any]) -> str:
        """Why expected KV was not used (a label of the router's local-prefill counter)."""
        error = info.get("kv_error")
        cancelled = self._awaiting_kv.get(request_id)
        if isinstance(error, UnknownRequestError) and cancelled is not None:
            reason = cancelled  # the router's cancel_kv ended the wait
        elif isinstance(error, TransferTimeoutError | LeaseExpiredError):
            reason = "kv_late"
        else:  # the push broke, failed its checks, or its KV could not be imported
            reason = "transfer_failed"
        self._log.log(
            reason,
            "%s: expected KV not used (%s: %r); prefilled on this decode worker",
            request_id,
            reason,
            error,
        )
        return reason

    async def cancel_kv(
        self, request_id: str, reason: str = "prefill_failed", target_replica: str | None = None
    ) -> str:
        """The prefill for `request_id` failed (`reason`, a local-prefill counter label):
        stop waiting and prefill locally now. Returns this replica's id, so the router
        sees whether the call reached the replica that waits."""
        if request_id in self._awaiting_kv:
            self._awaiting_kv[request_id] = reason
        self.worker.cancel_kv(request_id)
        return self.worker_id

    async def index_load(self) -> dict[str, int]:
        return {**await super().index_load(), "pending_transfers": self.worker.receiver.num_pending}

    async def load(self, target_replica: str | None = None) -> LoadReport:
        load = await super().load(target_replica)
        load["pending_transfers"] = self.worker.receiver.num_pending
        load["local_prefill_fallbacks"] = self.worker.num_local_fallbacks
        return load

    async def __del__(self) -> None:
        try:
            await self.worker.close()
        except Exception:  # shutting down anyway: the rest must still be stopped
            logger.exception("closing the KV receiver failed")
        await self.shutdown()
        tracing.flush()


def _migrate_item(worker_id: str) -> ErrorItem:
    message = f"decode worker {worker_id} left its pool (drain deadline passed)"
    return {"type": "error", "message": message, "migrate": True}


def _output_item(out: RequestOutput) -> OutputItem:
    item: OutputItem = {
        "type": "output",
        "token_ids": out.new_token_ids,
        "text": out.new_text,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "num_output_tokens": len(out.token_ids),
    }
    if out.logprobs is not None:
        new = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]
        item["logprobs"] = [(lp.token_id, lp.logprob, list(lp.top)) for lp in new]
    return item


def _first_item_extras(
    out: RequestOutput, info: dict[str, Any], block_size: int
) -> FirstItemExtras:
    now = time.monotonic()
    ready = info.get("ready_s", now)
    if info.get("kv_used"):
        # Prompt blocks this worker already held (not sent); prefill happened elsewhere.
        cached, queue_s, compute_s = info["first_block"] * block_size, now - ready, 0.0
    else:
        scheduled = out.first_scheduled_s or ready
        cached = out.num_cached_tokens
        queue_s, compute_s = max(scheduled - ready, 0.0), max(now - scheduled, 0.0)
    return {
        "kv_used": bool(info.get("kv_used")),
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": cached,
        "decode_queue_s": queue_s,
        "local_prefill_s": compute_s,
    }
