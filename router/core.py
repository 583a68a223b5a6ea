"""The router's request path, independent of HTTP (docs/architecture.md, "Request path").

`RouterCore.generate` takes a tokenized, validated request and yields the decode
worker's output items. In between: one index round trip (every live worker's matched
prefix), joint placement of P and D, and dual dispatch: D is called first (a streaming
call) and once it confirms that its receiver expects the request, P is told to prefill
and push the blocks D lacks. A prefill failure reaches D at once (`cancel_kv`), which
then prefills locally. Redis being down degrades placement to load-only; it never fails
a request. Plain Python: the worker handles are duck-typed Ray Serve handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import MatchResult, PrefixIndex, WorkerInfo
from pdserve.engine.hashing import hash_block_chain, hash_namespace
from pdserve.engine.sampling_params import SamplingParams
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
    ) -> tuple[Choice | None, Choice | None]:
        """(prefill choice or None, decode choice or None) for a prompt.

        `exclude`: workers not to choose (one that just failed this request).
        """
        hashes = hash_block_chain(prompt_ids, self.config.block_size, self.namespace)
        try:
            matches = await asyncio.wait_for(self.index.match(hashes), _INDEX_TIMEOUT_S)
            self.index_available = True
        except (RedisError, OSError, TimeoutError) as exc:
            if self.index_available:
                logger.warning("prefix index unreachable (%s): load-only placement", exc)
            self.index_available = False
            matches = {}
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
        return prefill, decode

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
        p, d = await self.place(prompt_ids, exclude)
        if not allow_prefill_worker:
            p = None  # a resume prefills on D itself: the tokens so far are already known
        kv_expected = p is not None and d is not None
        if first:
            self.metrics.ttft_stage.labels("router_queue").observe(time.monotonic() - arrival_s)
        d_target = d.worker_id if d is not None else None
        if d_target is not None:
            self.metrics.placements.labels("decode", d_target).inc()
            self.inflight_decode[d_target] += 1
        stream = self.decode.options(stream=True).generate.remote(
            request_id, prompt_ids, params, kv_expected=kv_expected, target_replica=d_target
        )
        prefill_task: asyncio.Task[None] | None = None
        finished = False
        serving = d_target
        try:
            accepted = await self._next(stream, self.config.first_token_timeout_s, "accepted")
            serving = accepted.get("worker_id", d_target)
            if accepted["kv_expected"]:
                assert p is not None and d is not None
                prefill_task = asyncio.create_task(
                    self._prefill(request_id, prompt_ids, params, p, d)
                )
            timeout = self.config.first_token_timeout_s
            while not finished:
                item = await self._next(stream, timeout, "token")
                if first:
                    self._record_first(item, arrival_s)
                    if accepted["kv_expected"] and not item.get("kv_used"):
                        self.metrics.local_fallbacks.inc()
                    first = False
                timeout = self.config.stall_timeout_s
                finished = item["finished"]
                if finished and prefill_task is not None:
                    # The push ended before D's first token; wait for P's report so
                    # that metrics and the index are current when the client sees the end.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            asyncio.shield(prefill_task), self.config.transfer_timeout_s
                        )
                yield item
        except _DecodeFailed as exc:
            exc.worker_id = serving
            raise
        finally:
            if d_target is not None:
                self.inflight_decode[d_target] -= 1
                if self.inflight_decode[d_target] <= 0:
                    del self.inflight_decode[d_target]
            if not finished:
                stream.cancel()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await prefill_task

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
        p: Choice,
        d: Choice,
    ) -> None:
        """Run the prefill half of dual dispatch; on failure free D to prefill locally."""
        self.metrics.placements.labels("prefill", p.worker_id).inc()
        self.inflight_prefill_tokens[p.worker_id] += len(prompt_ids)
        try:
            result = await self.prefill.prefill.remote(  # type: ignore[union-attr]
                request_id,
                prompt_ids,
                params,
                d.address,
                # The block holding the last prompt token is always sent: D needs it
                # to decode even when it holds every full block of the prompt.
                first_block=min(d.matched_blocks, (len(prompt_ids) - 1) // self.config.block_size),
                target_replica=p.worker_id,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning(
                "%s: prefill or push failed (%r); decode prefills locally", request_id, exc
            )
            self.metrics.transfers_failed.inc()
            with contextlib.suppress(Exception):
                await self.decode.cancel_kv.remote(request_id, target_replica=d.worker_id)
            return
        finally:
            self.inflight_prefill_tokens[p.worker_id] -= len(prompt_ids)
            if self.inflight_prefill_tokens[p.worker_id] <= 0:
                del self.inflight_prefill_tokens[p.worker_id]
        m = self.metrics
        m.prompt_tokens.labels("prefill").inc(result["num_prompt_tokens"])
        m.hit_tokens.labels("prefill").inc(result["num_cached_tokens"])
        m.transfer_bytes.inc(result["transfer_bytes"])
        m.transfer_blocks.inc(result["num_blocks_sent"])
        m.transfer_seconds.inc(result["transfer_s"])
        m.ttft_stage.labels("prefill_queue").observe(result["queue_s"])
        m.ttft_stage.labels("prefill_compute").observe(result["compute_s"])
        m.ttft_stage.labels("transfer").observe(result["pack_s"] + result["transfer_s"])

    def _record_first(self, item: dict[str, Any], arrival_s: float) -> None:
        m = self.metrics
        m.ttft.observe(time.monotonic() - arrival_s)
        m.prompt_tokens.labels("decode").inc(item.get("num_prompt_tokens", 0))
        m.hit_tokens.labels("decode").inc(item.get("num_cached_tokens", 0))
        m.ttft_stage.labels("decode_queue").observe(item.get("decode_queue_s", 0.0))
        if not item.get("kv_used") and item.get("local_prefill_s"):
            m.ttft_stage.labels("prefill_compute").observe(item["local_prefill_s"])
