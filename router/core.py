"""The router's request path, independent of HTTP (docs/architecture.md, "Request path").

`RouterCore.generate` takes a tokenized, validated request and yields the decode
worker's output items. In between: one index round trip (every live worker's matched
prefix), joint placement of P and D, and dual dispatch: D is called first (a streaming
call) and once it confirms that its receiver expects the request (and says which replica
took the call and where its receiver listens), P is told to prefill and push the blocks
D lacks there. A prefill failure reaches D at once (`cancel_kv`), which then prefills
locally. Redis being down never fails a request, nor bypasses the split: Ray Serve then
picks D and P, and P pushes every block to whichever D took the request.

Every prompt a decode worker prefills itself in disaggregated mode is counted with its
reason (`pdserve_decode_local_prefill_total{reason}`, see `metrics.py`); each reason is
logged once per process at warning level. Plain Python: the worker handles are
duck-typed Ray Serve handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.log_once import OncePerCause
from pdserve.cluster.prefix_index import MatchResult, PrefixIndex, WorkerInfo
from pdserve.engine.hashing import hash_block_chain, hash_namespace
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.errors import TransferError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Choice, Placer

logger = logging.getLogger(__name__)

_INDEX_TIMEOUT_S = 0.5  # placement never waits longer than this for Redis
_STATE_TIMEOUT_S = 5.0


class UpstreamError(RuntimeError):
    """No worker could serve the request (all failed, none live, or one stalled)."""


class _DecodeFailed(UpstreamError):
    """The decode worker serving a stream died or broke it: the request can resume."""

    worker_id: str | None = None


class Placed(NamedTuple):
    """What placement chose; `indexed` is False when the index did not answer."""

    prefill: Choice | None
    decode: Choice | None
    indexed: bool


def _is_transfer_error(exc: BaseException) -> bool:
    """The prefill call failed in the push (a typed transfer error), not in the prefill.

    Ray re-raises a replica's exception as a subclass of both RayTaskError and the
    original class; `cause` is checked too in case the class could not be combined.
    """
    return isinstance(exc, TransferError) or isinstance(getattr(exc, "cause", None), TransferError)


class RouterCore:
    """Places and dispatches requests; records their metrics.

    Args:
        config: The cluster's configuration (resolved: max_model_len is set).
        prefill: Handle of the prefill deployment (None in colocated mode).
        decode: Handle of the decode deployment.
        index: The prefix index client.
    """

    def __init__(
        self, config: ClusterConfig, prefill: Any | None, decode: Any, index: PrefixIndex
    ) -> None:
        self.config = config
        self.prefill = prefill if config.mode == "disagg" else None
        self.decode = decode
        self.index = index
        self.namespace = hash_namespace(config.model_id)
        self.placer = Placer(config.placement, config.weights, config.block_size)
        self.metrics = RouterMetrics()
        self.inflight_prefill_tokens: Counter[str] = Counter()
        self.inflight_decode: Counter[str] = Counter()
        self.index_available = True
        self._log = OncePerCause(logger)

    async def live_workers(self) -> list[WorkerInfo]:
        return await asyncio.wait_for(self.index.live_workers(), _INDEX_TIMEOUT_S)

    async def worker_states(self, workers: list[WorkerInfo]) -> list[dict[str, Any]]:
        """Ask each worker for its live state; a worker that does not answer is marked so."""

        async def ask(w: WorkerInfo) -> dict[str, Any]:
            handle = self.decode if w.role == "decode" else self.prefill
            base = {"worker_id": w.worker_id, "role": w.role, "address": w.address}
            if handle is None:
                return {**base, "error": "no handle for this role"}
            try:
                state = await asyncio.wait_for(
                    handle.load.remote(target_replica=w.worker_id), _STATE_TIMEOUT_S
                )
            except Exception as exc:
                return {**base, "error": repr(exc)}
            # answered_by differs from worker_id when the worker is gone and another
            # replica of its pool took the call.
            return {**state, **base, "answered_by": state.get("worker_id")}

        # NOTE: one at a time, on purpose. Calls made while serving one HTTP request share
        # its Serve request id, and Ray Serve 2.60's request router indexes requests that
        # wait for a replica by that id: concurrent calls to one deployment from one
        # request collide there and some are never routed (seen as timeouts).
        return [await ask(w) for w in workers]

    async def place(
        self, prompt_ids: list[int], exclude: set[str] | frozenset[str] = frozenset()
    ) -> Placed:
        """The prefill and decode workers for a prompt (None where there is none).

        `exclude`: workers not to choose (one that just failed this request). Without
        the index (Redis down or slow) nobody is chosen and `indexed` is False: Serve
        then picks the replicas, and the split still happens (see `_attempt`).
        """
        hashes = hash_block_chain(prompt_ids, self.config.block_size, self.namespace)
        try:
            matches = await asyncio.wait_for(self.index.match(hashes), _INDEX_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            if self.index_available:
                logger.warning("prefix index unreachable (%s): Serve places requests", exc)
            self.index_available = False
            return Placed(None, None, indexed=False)
        self.index_available = True
        by_role: dict[str, dict[str, MatchResult]] = {"prefill": {}, "decode": {}}
        for worker_id, m in matches.items():
            if worker_id not in exclude:
                by_role.setdefault(m.worker.role, {})[worker_id] = m
        decode = self.placer.choose_decode(by_role["decode"], self.inflight_decode)
        prefill = None
        if self.prefill is not None:
            prefill = self.placer.choose_prefill(
                by_role["prefill"], len(prompt_ids), self.inflight_prefill_tokens
            )
        return Placed(prefill, decode, indexed=True)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield the decode worker's output items for one request.

        If the decode worker dies mid-stream, the request resumes on another one: it
        prefills the prompt plus the tokens already streamed and goes on from there, so
        the client sees no gap and no duplicate (greedy and seeded sampling give the same
        tokens; sampling is keyed by position). At most `max_resumes` times.

        Raises:
            UpstreamError: the request could not be served (no worker, every attempt
                failed, no first token within `first_token_timeout_s`, or a stall between
                tokens longer than `stall_timeout_s`). Nothing is left running on workers.
        """
        generated: list[int] = []
        failed: set[str] = set()
        for attempt in range(self.config.max_resumes + 1):
            if generated:
                remaining = params.max_tokens - len(generated)
                if remaining <= 0:
                    return
                attempt_params = dataclasses.replace(params, max_tokens=remaining)
            else:
                attempt_params = params
            attempt_id = request_id if attempt == 0 else f"{request_id}-resume{attempt}"
            try:
                async for item in self._attempt(
                    attempt_id,
                    prompt_ids + generated,
                    attempt_params,
                    arrival_s,
                    first=not generated,
                    exclude=failed,
                    allow_prefill_worker=attempt == 0,
                ):
                    generated += item["token_ids"]
                    yield item
                return
            except _DecodeFailed as exc:
                failed.add(exc.worker_id or "")
                if attempt == self.config.max_resumes:
                    raise UpstreamError(f"{exc} (after {attempt} resumes)") from exc
                self.metrics.resumes.inc()
                logger.warning(
                    "%s: %s after %d tokens; resuming on another decode worker",
                    request_id,
                    exc,
                    len(generated),
                )

    async def _attempt(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        first: bool,
        exclude: set[str],
        allow_prefill_worker: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """One placement and dual dispatch; raises _DecodeFailed if D dies."""
        placed = await self.place(prompt_ids, exclude)
        p, d = placed.prefill, placed.decode
        # Why D prefills this attempt itself by the router's own decision (None: it asks
        # for KV; colocated mode counts nothing, every prefill happens on D there).
        local_reason: str | None = None
        if self.prefill is not None:
            if not allow_prefill_worker:
                local_reason = "resume"  # the tokens so far are known: D prefills them
            elif p is None and placed.indexed:
                local_reason = "no_prefill_worker"
        want_kv = self.prefill is not None and local_reason is None
        if first:
            self.metrics.ttft_stage.labels("router_queue").observe(time.monotonic() - arrival_s)
        d_target = d.worker_id if d is not None else None
        inflight_at = d_target
        if inflight_at is not None:
            self.inflight_decode[inflight_at] += 1
        stream = self.decode.options(stream=True).generate.remote(
            request_id, prompt_ids, params, kv_expected=want_kv, target_replica=d_target
        )
        prefill_task: asyncio.Task[None] | None = None
        finished = False
        counted = False  # this attempt's local prefill (if any) is counted
        serving = d_target
        try:
            accepted = await self._next(stream, self.config.first_token_timeout_s, "accepted")
            serving = accepted.get("worker_id") or d_target
            self._count_placement("decode", d_target, serving)
            if serving != inflight_at:  # Serve gave the call to another replica
                self._untrack_decode(inflight_at)
                inflight_at = serving
                if inflight_at is not None:
                    self.inflight_decode[inflight_at] += 1
            kv_expected = bool(accepted["kv_expected"])
            if want_kv and not kv_expected:
                local_reason = "not_target"  # the replica that took it would not take KV
            if kv_expected:
                # Blocks D already holds are not sent, if D is the one the index matched;
                # the block holding the last prompt token is always sent: D needs it to
                # decode even when it holds every full block of the prompt.
                first_block = 0
                if d is not None and serving == d.worker_id:
                    last_block = (len(prompt_ids) - 1) // self.config.block_size
                    first_block = min(d.matched_blocks, last_block)
                prefill_task = asyncio.create_task(
                    self._prefill(
                        request_id, prompt_ids, params, p, accepted["address"], first_block, serving
                    )
                )
            timeout = self.config.first_token_timeout_s
            while not finished:
                item = await self._next(stream, timeout, "token")
                if not counted:
                    counted = True
                    reason = local_reason
                    if kv_expected and not item.get("kv_used"):
                        reason = item.get("local_prefill") or "transfer_failed"
                    if reason is not None:
                        self._count_local_prefill(request_id, serving, reason)
                if first:
                    self._record_first(item, arrival_s)
                    first = False
                timeout = self.config.stall_timeout_s
                finished = item["finished"]
                if finished and prefill_task is not None:
                    # The push ended before D's first token; wait for P's report so
                    # that metrics and the index are current when the client sees the end.
                    await self._await_prefill_report(request_id, prefill_task)
                yield item
        except _DecodeFailed as exc:
            exc.worker_id = serving
            raise
        finally:
            self._untrack_decode(inflight_at)
            if not finished:
                stream.cancel()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
                # asyncio.wait: never raises the task's error, and lets our own
                # cancellation (a client that went away) go on propagating
                await asyncio.wait([prefill_task])
                if not prefill_task.cancelled() and prefill_task.exception() is not None:
                    logger.error(
                        "%s: prefill task failed", request_id, exc_info=prefill_task.exception()
                    )

    async def _await_prefill_report(self, request_id: str, task: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.transfer_timeout_s)
        except TimeoutError:
            logger.warning(
                "%s: no report from the prefill worker within %gs; its metrics are missing",
                request_id,
                self.config.transfer_timeout_s,
            )
        except Exception:  # _prefill handles the call's errors: this is a bug, not a failure
            logger.exception("%s: prefill task failed", request_id)

    def _untrack_decode(self, worker_id: str | None) -> None:
        if worker_id is not None:
            self.inflight_decode[worker_id] -= 1
            if self.inflight_decode[worker_id] <= 0:
                del self.inflight_decode[worker_id]

    def _count_placement(self, role: str, chosen: str | None, served: str | None) -> None:
        """Count the replica that served; an override when Serve did not use the choice."""
        if served is not None:
            self.metrics.placements.labels(role, served).inc()
        if chosen is not None and served != chosen:
            self.metrics.placement_overrides.labels(role).inc()

    def _count_local_prefill(self, request_id: str, worker_id: str | None, reason: str) -> None:
        self.metrics.local_prefills.labels(reason).inc()
        self._log.log(
            reason,
            "%s: decode worker %s prefilled the prompt itself (%s)",
            request_id,
            worker_id,
            reason,
        )

    async def _next(self, stream: Any, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            return dict(await asyncio.wait_for(stream.__anext__(), timeout_s))
        except TimeoutError as exc:
            raise UpstreamError(f"no {what} from the decode worker within {timeout_s:g}s") from exc
        except StopAsyncIteration as exc:
            raise _DecodeFailed("the decode worker ended the stream early") from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead replica, a failed call: Ray's error types
            logger.warning("decode call failed: %r", exc)
            raise _DecodeFailed(f"the decode worker failed: {type(exc).__name__}") from exc

    async def _prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        p: Choice | None,
        decode_address: str,
        first_block: int,
        decode_worker: str | None,
    ) -> None:
        """Run the prefill half of dual dispatch; on failure free D to prefill locally.

        `p`: the chosen prefill worker, or None (no index: Serve picks one). The KV goes
        to `decode_address`, the receiver of `decode_worker`, the replica serving D.
        """
        p_target = p.worker_id if p is not None else None
        if p_target is not None:
            self.inflight_prefill_tokens[p_target] += len(prompt_ids)
        try:
            result = await self.prefill.prefill.remote(  # type: ignore[union-attr]
                request_id,
                prompt_ids,
                params,
                decode_address,
                first_block=first_block,
                target_replica=p_target,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Ray's error types wrap the worker's
            reason = "transfer_failed" if _is_transfer_error(exc) else "prefill_failed"
            self._log.log(
                f"prefill call: {reason}",
                "%s: prefill or push failed (%s: %r); decode prefills locally",
                request_id,
                reason,
                exc,
            )
            self.metrics.transfers_failed.inc()
            await self._cancel_kv(request_id, reason, decode_worker)
            return
        finally:
            if p_target is not None:
                self.inflight_prefill_tokens[p_target] -= len(prompt_ids)
                if self.inflight_prefill_tokens[p_target] <= 0:
                    del self.inflight_prefill_tokens[p_target]
        self._count_placement("prefill", p_target, result.get("worker_id") or p_target)
        m = self.metrics
        m.prompt_tokens.labels("prefill").inc(result["num_prompt_tokens"])
        m.hit_tokens.labels("prefill").inc(result["num_cached_tokens"])
        m.transfer_bytes.inc(result["transfer_bytes"])
        m.transfer_blocks.inc(result["num_blocks_sent"])
        m.transfer_seconds.inc(result["transfer_s"])
        m.ttft_stage.labels("prefill_queue").observe(result["queue_s"])
        m.ttft_stage.labels("prefill_compute").observe(result["compute_s"])
        m.ttft_stage.labels("transfer").observe(result["pack_s"] + result["transfer_s"])

    async def _cancel_kv(self, request_id: str, reason: str, worker_id: str | None) -> None:
        """Tell the decode worker waiting for `request_id`'s KV to prefill it now."""
        try:
            reached = await asyncio.wait_for(
                self.decode.cancel_kv.remote(request_id, reason, target_replica=worker_id),
                _STATE_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead replica, a timeout: Ray's error types
            self._log.log(
                "cancel_kv failed",
                "%s: could not tell decode worker %s to stop waiting for KV (%r); it "
                "prefills once kv_wait_timeout_s has passed",
                request_id,
                worker_id,
                exc,
            )
            return
        if reached != worker_id:
            self._log.log(
                "cancel_kv elsewhere",
                "%s: cancel_kv reached %s, not %s (Serve routed it elsewhere); %s prefills "
                "once kv_wait_timeout_s has passed",
                request_id,
                reached,
                worker_id,
                worker_id,
            )

    def _record_first(self, item: dict[str, Any], arrival_s: float) -> None:
        m = self.metrics
        m.ttft.observe(time.monotonic() - arrival_s)
        m.prompt_tokens.labels("decode").inc(item.get("num_prompt_tokens", 0))
        m.hit_tokens.labels("decode").inc(item.get("num_cached_tokens", 0))
        m.ttft_stage.labels("decode_queue").observe(item.get("decode_queue_s", 0.0))
        if not item.get("kv_used") and item.get("local_prefill_s"):
            m.ttft_stage.labels("prefill_compute").observe(item["local_prefill_s"])
