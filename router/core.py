"""The router's request path, independent of HTTP (docs/architecture.md, "Request path").

`RouterCore.generate` takes a tokenized, validated request and yields the decode
worker's output items. In between: a prefix match (from the router's in-memory view of
the index, or a Redis round trip), joint placement of P and D, and dual dispatch: D is
called first (a submit on this router's token channel to D, `channels.py`, on which D
streams the outputs of all this router's requests) and once it confirms that its
receiver expects the request (and says which replica took the call and where its
receiver listens), P is told to prefill and push the blocks D lacks there. A prefill
failure reaches D at once (`cancel_kv`), which then prefills locally. Redis being down
never fails a request, nor bypasses the split: Ray Serve then picks D and P, and P
pushes every block to whichever D took it.

Between placement and dispatch, conditional disaggregation (`disagg.py`) decides per
request whether P prefills (remote) or D does (local), from time estimates of both; each
decision is counted by reason (`pdserve_disagg_decisions_total`). Past capacity (every
option's queue longer than `max_prefill_queue_s`) a request is refused with `Overloaded`
(HTTP 429) before anything is sent to a worker: `start` places the first attempt before
the HTTP response begins. Colocated mode is admitted the same way, its options being the
decode workers (each prefills its own prompts): when the chosen one's queue is past the
bound the least-queued one takes the request, and when every one is past it, 429. A
remote request's decode worker waits for its KV as long as the estimate says
(`kv_wait_s`), not a fixed time.

Every prompt a decode worker prefills itself in disaggregated mode is counted with its
reason (`pdserve_decode_local_prefill_total{reason}`, see `metrics.py`); each reason but
the policy's own choice (`policy`) is logged once per process at warning level. Plain
Python: the worker handles are duck-typed Ray Serve handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, cast

from opentelemetry.trace import Span, SpanKind, Tracer
from redis.exceptions import RedisError

from pdserve.cluster import tracing
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.log_once import OncePerCause
from pdserve.cluster.messages import (
    Accepted,
    DecodeHandle,
    FetchAccepted,
    FetchReport,
    LoadReport,
    LoRAReply,
    OutputItem,
    PrefillHandle,
    PrefillReport,
    WorkerHandle,
    WorkerState,
    fetch_id,
)
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.common.hashing import (
    BlockHash,
    hash_block_chain,
    hash_namespace,
    request_namespace,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer.errors import TransferError
from pdserve.router.channels import ChannelStream, DecodeChannels, Migrated, RequestRefused
from pdserve.router.disagg import (
    Decision,
    Option,
    RateBook,
    SpillBudget,
    decide,
    kv_wait_s,
    past_bound,
)
from pdserve.router.fetch import Fetch, choose_fetch
from pdserve.router.load import Hold, LoadBook
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Choice, Placer, tier_cost_s
from pdserve.router.planner_loop import TrafficCounts
from pdserve.router.prefix_cache import CachedTokens
from pdserve.router.priority import prefill_queue_bound_s
from pdserve.router.request_router import DEPARTURES
from pdserve.router.serve_calls import cancelling
from pdserve.router.timeline import RouterTimeline

logger = logging.getLogger(__name__)

_INDEX_TIMEOUT_S = 0.5  # placement never waits longer than this for Redis
_STATE_TIMEOUT_S = 5.0
_STATE_CALLS = 64  # `/workers`: calls to workers at once
# An adapter's load reads its folder and copies its weights: seconds for large ones.
LORA_CALL_TIMEOUT_S = 120.0


class UpstreamError(RuntimeError):
    """No worker could serve the request (all failed, none live, or one stalled)."""


class Overloaded(UpstreamError):
    """Past capacity: every place to prefill the prompt has too much work queued (429)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(UpstreamError):
    """The cluster is stopping: the request is refused, or its grace ran out (draining.py)."""

    code = "shutting_down"


class Refused(UpstreamError):
    """The engine refused the request itself (say, its LoRA adapter was unloaded since
    the router looked): no resume would serve it, the client gets a 400."""

    code = "invalid_request"
    status_code = 400


class _DecodeFailed(UpstreamError):
    """The decode worker serving a stream died or broke it, or moved it as it left its
    pool (`migrated`): the request can resume."""

    worker_id: str | None = None
    migrated = False


class Placed(NamedTuple):
    """What placement chose; `indexed` is False when the index did not answer.

    remote / local: the estimates of prefilling on the chosen prefill / decode worker
    (None where none was chosen); decode_running: sequences on the chosen decode worker.
    least_queued (colocated mode): the decode worker with the shortest measured prefill
    queue and its estimate, the admission's alternative to an over-queued choice.
    """

    prefill: Choice | None
    decode: Choice | None
    indexed: bool
    remote: Option | None = None
    local: Option | None = None
    decode_running: int = 0
    least_queued: tuple[Choice, Option] | None = None
    # every live worker's hit on the prompt, either pool (peer fetch, router/fetch.py)
    matches: Mapping[str, MatchResult] | None = None


class Route:
    """One attempt's placement and decision, and the queue tokens it reserves.

    The reservation (prompt tokens counted as queued on the worker that prefills it,
    until that prefill is done) is taken when the decision is made, before any await,
    so that the next request's estimate already sees it.
    """

    def __init__(
        self,
        placed: Placed,
        decision: Decision | None,
        kv_wait_s: float | None,
        fetch: Fetch | None = None,
    ):
        self.placed = placed
        self.decision = decision
        self.kv_wait_s = kv_wait_s
        self.fetch = fetch  # the prefix the chosen decode worker gets from a peer
        self.prefill_fetch: Fetch | None = None  # the prefix the prefill worker gets so
        self.prefill_fetch_wait_s: float | None = None
        self._held: dict[str, Hold] = {}

    def hold(self, what: str, counter: Counter[str], worker_id: str, tokens: int) -> None:
        """Count `tokens` as queued on `worker_id` in `counter` (a `LoadBook`'s) until
        `release`; nothing when there is nothing to compute."""
        if tokens > 0:
            self._held[what] = Hold(counter, worker_id, tokens)

    def release(self, what: str | None = None) -> None:
        """Give back one reservation ("prefill" or "local"), or all; idempotent."""
        for key in [what] if what is not None else list(self._held):
            held = self._held.pop(key, None)
            if held is not None:
                held.release()


def _is_transfer_error(exc: BaseException) -> bool:
    """The prefill call failed in the push (a typed transfer error), not in the prefill.

    Ray re-raises a replica's exception as a subclass of both RayTaskError and the
    original class; `cause` is checked too in case the class could not be combined.
    """
    return isinstance(exc, TransferError) or isinstance(getattr(exc, "cause", None), TransferError)


class PrefixMatcher(Protocol):
    """What placement asks of the prefix index (`PrefixIndex`, `IndexFollower`)."""

    async def match(
        self, block_hashes: Sequence[BlockHash], role: str | None = None
    ) -> dict[str, MatchResult]: ...

    async def live_workers(self, role: str | None = None) -> list[WorkerInfo]: ...


class RouterCore:
    """Places and dispatches requests; records their metrics.

    Args:
        config: The cluster's configuration (resolved: max_model_len is set).
        prefill: Handle of the prefill deployment (None in colocated mode).
        decode: Handle of the decode deployment.
        index: The prefix index: Redis's (`PrefixIndex`) or this process's view of it
            (`IndexFollower`).
        tracer: The router's tracer (`cluster/tracing.py`), None when tracing is off.
    """

    def __init__(
        self,
        config: ClusterConfig,
        prefill: PrefillHandle | None,
        decode: DecodeHandle,
        index: PrefixMatcher,
        tracer: Tracer | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.tracer = tracer
        self.prefill = prefill if config.mode == "disagg" else None
        self.decode = decode
        self.index = index
        self.namespace = hash_namespace(config.model_id)
        self.placer = Placer(config.placement, config.weights, config.block_size)
        # a router serving several models shares one registry: this model's labelled view
        self.metrics = (metrics or RouterMetrics()).for_model(config.model_id)
        # every worker's load, its heartbeat's and what this router has in flight there
        self.load = LoadBook()
        self.traffic = TrafficCounts()  # what it served: the planner's input
        # PDSERVE_TIMELINE_DIR: each request's stages, for benchmarks/timeline.py
        self.timeline = RouterTimeline.from_env(config.model_id)
        self.rates = RateBook()
        self.spills = SpillBudget.from_config(config)  # D's time for `prefill_busy` spills
        # one token channel per decode replica in use (channels.py)
        self.channels = DecodeChannels(
            decode, config.first_token_timeout_s, self._live_decode_ids, config.heartbeat_s
        )
        self.index_available = True
        self._log = OncePerCause(logger)
        self.stopping: str | None = None  # why, once the cluster stops (`stop`)

    @property
    def inflight_prefill_tokens(self) -> Counter[str]:
        """Prompt tokens this router sent to each prefill worker, not yet prefilled."""
        return self.load.prefill_tokens

    @property
    def inflight_local_tokens(self) -> Counter[str]:
        """Prompt tokens this router left to each decode worker to prefill."""
        return self.load.local_tokens

    @property
    def inflight_decode(self) -> Counter[str]:
        """Streams this router has open on each decode worker."""
        return self.load.decode_streams

    def stop(self, reason: str) -> None:
        """End every request in flight with `ShuttingDown(reason)` and take no more (the
        cluster stops: router/draining.py). Their decode channels close, so the decode
        replicas, whose stop waits for them, can stop too."""
        self.stopping = reason
        self.channels.stop(lambda: ShuttingDown(reason))

    async def live_workers(self) -> list[WorkerInfo]:
        return await asyncio.wait_for(self.index.live_workers(), _INDEX_TIMEOUT_S)

    async def broadcast_lora(
        self, load: bool, name: str, path: str | None = None
    ) -> tuple[list[WorkerInfo], list[LoRAReply]]:
        """`load_lora(name, path)` (or `unload_lora(name)`) on every live worker of both
        pools at once: the workers asked and each one's reply (a call that failed or did
        not answer within LORA_CALL_TIMEOUT_S is a reply with its error)."""
        workers = await self.live_workers()

        async def call(w: WorkerInfo) -> LoRAReply:
            handle: WorkerHandle | None = self.decode if w.role == "decode" else self.prefill
            if handle is None:
                return {"worker_id": w.worker_id, "error": "no handle for its pool"}
            method = handle.load_lora if load else handle.unload_lora
            args = (name, path) if load else (name,)
            try:
                reply: LoRAReply = await asyncio.wait_for(
                    method.remote(*args, target_replica=w.worker_id), LORA_CALL_TIMEOUT_S
                )
            except Exception as exc:  # a dead replica, a timeout: Ray's error types
                error = f"worker {w.worker_id} did not answer: {exc!r}"
                return {"worker_id": w.worker_id, "error": error, "unreachable": True}
            return reply

        return workers, list(await asyncio.gather(*(call(w) for w in workers)))

    async def _live_decode_ids(self) -> set[str] | None:
        """Decode workers the index holds live; None when it cannot say (Redis down)."""
        try:
            return {w.worker_id for w in await self.live_workers() if w.role == "decode"}
        except (RedisError, OSError, TimeoutError):
            return None

    async def worker_states(self, workers: list[WorkerInfo]) -> list[WorkerState]:
        """Ask each worker for its live state; a worker that does not answer is marked so."""

        async def ask(w: WorkerInfo) -> WorkerState:
            handle: DecodeHandle | PrefillHandle | None
            handle = self.decode if w.role == "decode" else self.prefill
            base: WorkerState = {"worker_id": w.worker_id, "role": w.role, "address": w.address}
            if handle is None:
                return {**base, "error": "no handle for this role"}
            try:
                state: LoadReport = await asyncio.wait_for(
                    handle.load.remote(target_replica=w.worker_id), _STATE_TIMEOUT_S
                )
            except Exception as exc:
                return {**base, "error": repr(exc)}
            # answered_by differs from worker_id when the worker is gone and another
            # replica of its pool took the call; the report's keys, then the index's
            return cast(WorkerState, {**state, **base, "answered_by": state.get("worker_id")})

        # concurrently, at most _STATE_CALLS at once: each call is a Serve request of its
        # own (router/serve_calls.py), so they do not collide in Serve's request router
        limit = asyncio.Semaphore(_STATE_CALLS)

        async def bounded(w: WorkerInfo) -> WorkerState:
            async with limit:
                return await ask(w)

        return list(await asyncio.gather(*(bounded(w) for w in workers)))

    async def place(
        self,
        prompt_ids: list[int],
        exclude: set[str] | frozenset[str] = frozenset(),
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> Placed:
        """The prefill and decode workers for a prompt (None where there is none).

        `exclude`: workers not to choose (one that just failed this request). Without
        the index (Redis down or slow) nobody is chosen and `indexed` is False: Serve
        then picks the replicas, and the split still happens (see `_attempt`).
        `cache_salt`: the request's; its prompt's blocks are looked up in that namespace.
        """
        namespace = self.namespace
        if cache_salt is not None or lora is not None:
            namespace = request_namespace(self.config.model_id, cache_salt, lora)
        hashes = hash_block_chain(prompt_ids, self.config.block_size, namespace)
        try:
            matches = await asyncio.wait_for(self.index.match(hashes), _INDEX_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            if self.index_available:
                logger.warning("prefix index unreachable (%s): Serve places requests", exc)
            self.index_available = False
            return Placed(None, None, indexed=False)
        self.index_available = True
        # a shortlisted match (cluster/index_follower.py) names every live worker apart
        self.rates.forget_except(getattr(matches, "live", matches))
        self.spills.forget_except(getattr(matches, "live", matches))
        by_role: dict[str, dict[str, MatchResult]] = {"prefill": {}, "decode": {}}
        for worker_id, m in matches.items():
            # nor one leaving its pool (router/departures.py), until its entry goes
            if worker_id not in exclude and worker_id not in DEPARTURES.seen:
                by_role.setdefault(m.worker.role, {})[worker_id] = m
        holds = None if lora is None else partial(self.load.holds_lora, lora=lora)
        local_rates = {w: self.rates.local_rate(w, None) for w in by_role["decode"]}
        decode = self.placer.choose_decode(
            by_role["decode"], self.load.decode_streams, holds, local_rates
        )
        if decode is not None:
            self._count_hits("decode", by_role["decode"][decode.worker_id])
        n = len(prompt_ids)
        if self.prefill is None:
            return self._place_colocated(decode, by_role["decode"], n)
        rates = self.rates.prefill_rates(by_role["prefill"])
        prefill = self.placer.choose_prefill(
            by_role["prefill"], n, self.load.prefill_tokens, rates, holds
        )
        if prefill is not None:
            self._count_hits("prefill", by_role["prefill"][prefill.worker_id])
        remote = local = None
        running = 0
        if decode is not None:
            d = by_role["decode"][decode.worker_id]
            known = [r for r in rates.values() if r is not None]
            local = Option(
                decode.worker_id,
                self.placer.uncached_tokens(d, n),
                self.load.local_queue(d),
                self.rates.local_rate(decode.worker_id, sum(known) / len(known) if known else None),
                extra_s=tier_cost_s(d),
            )
            running = self.load.running(d)
        if prefill is not None:
            m = by_role["prefill"][prefill.worker_id]
            # the blocks the push would carry (see `_attempt`: D's held prefix is skipped)
            last_block = (n - 1) // self.config.block_size
            skipped = min(decode.matched_blocks, last_block) if decode is not None else 0
            remote = Option(
                prefill.worker_id,
                self.placer.uncached_tokens(m, n),
                self.load.prefill_queue(m),
                rates[prefill.worker_id],
                extra_s=self.rates.push_s(last_block + 1 - skipped) + tier_cost_s(m),
            )
        everyone = {**by_role["prefill"], **by_role["decode"]}
        return Placed(prefill, decode, True, remote, local, running, matches=everyone)

    def _place_colocated(
        self, decode: Choice | None, matches: dict[str, MatchResult], n: int
    ) -> Placed:
        """Colocated placement: the chosen decode worker, and the estimates of prefilling
        the prompt there and on the least-queued one (rates: what this router measured
        of each one's prefills, else the mean of those it measured)."""
        if decode is None:
            return Placed(None, None, indexed=True)
        rates = {w: self.rates.local_rate(w, None) for w in matches}
        known = [r for r in rates.values() if r is not None]
        pool_rate = sum(known) / len(known) if known else None
        options = {
            w: Option(
                w,
                self.placer.uncached_tokens(m, n),
                self.load.local_queue(m),
                pool_rate if rates[w] is None else rates[w],
                extra_s=tier_cost_s(m),
            )
            for w, m in matches.items()
        }
        measured = [o for o in options.values() if o.queue_s is not None]
        least = None
        if measured:
            o = min(measured, key=lambda o: (o.queue_s, o.worker_id))
            m = matches[o.worker_id]
            least = (Choice(o.worker_id, m.worker.address, m.matched_blocks), o)
        running = self.load.running(matches[decode.worker_id])
        return Placed(None, decode, True, None, options[decode.worker_id], running, least, matches)

    def _route_colocated(
        self, placed: Placed, resume: bool, bound_s: float, num_prompt_tokens: int
    ) -> Route:
        """Admit a colocated attempt (see the module's docstring) and reserve its place
        in the chosen decode worker's prefill queue."""
        local = placed.local
        if not resume and local is not None and past_bound(local.queue_s, bound_s):
            least = placed.least_queued
            if least is None or past_bound(least[1].queue_s, bound_s):
                excess = (least[1].queue_s if least else local.queue_s) or 0.0
                raise Overloaded(
                    f"the cluster is past its prefill capacity: every decode worker has "
                    f"more than {bound_s:g}s of prompts queued; retry later",
                    retry_after_s=max(1, math.ceil(excess - bound_s)),
                )
            placed = placed._replace(decode=least[0], local=least[1])
            local = least[1]
        route = Route(placed, None, None)
        self._hold_local(route, local, num_prompt_tokens)
        return route

    def _hold_local(self, route: Route, local: Option | None, num_prompt_tokens: int) -> None:
        """A prompt the chosen decode worker prefills: plan its peer fetch, if any (and
        the wait for it: as for a remote prefill's KV, from what computing the blocks
        would take), and reserve the rest in that worker's prefill queue."""
        if local is None:
            return
        fetch = self._plan_fetch(route.placed, local, num_prompt_tokens)
        tokens = local.uncached_tokens
        if fetch is not None:
            route.fetch = fetch
            route.kv_wait_s = self._fetch_wait_s(fetch) or route.kv_wait_s
            fetched = (fetch.num_blocks - fetch.first_block) * self.config.block_size
            tokens = max(tokens - fetched, 1)  # the fetched blocks are not computed there
        route.hold("local", self.load.local_tokens, local.worker_id, tokens)

    def _hold_remote(self, route: Route, remote: Option, num_prompt_tokens: int) -> None:
        """A prompt the chosen prefill worker prefills: plan its peer fetch, if any (a
        worker holding more of the prompt, busy elsewhere), and reserve the rest in
        that worker's queue."""
        fetch = self._plan_fetch(route.placed, remote, num_prompt_tokens)
        tokens = remote.uncached_tokens
        if fetch is not None:
            route.prefill_fetch = fetch
            wait = route.prefill_fetch_wait_s = self._fetch_wait_s(fetch)
            fetched = (fetch.num_blocks - fetch.first_block) * self.config.block_size
            tokens = max(tokens - fetched, 1)
            if route.kv_wait_s is not None:  # the prefill starts once the fetch is in
                fetch_s = self.config.kv_wait_timeout_s if wait is None else wait
                route.kv_wait_s = min(route.kv_wait_s + fetch_s, self.config.kv_wait_timeout_s)
        route.hold("prefill", self.load.prefill_tokens, remote.worker_id, tokens)

    def _plan_fetch(self, placed: Placed, where: Option, num_prompt_tokens: int) -> Fetch | None:
        """The peer fetch for a prompt computed at `where` (router/fetch.py), or None."""
        if placed.matches is None:
            return None
        return choose_fetch(
            where.worker_id,
            placed.matches,
            num_prompt_tokens,
            self.config.block_size,
            self.config.kv_fetch_min_blocks,
            where.tokens_per_s,
            self.rates.fetch_rate(time.monotonic()),
        )

    def _fetch_wait_s(self, fetch: Fetch) -> float | None:
        """How long the receiver waits for a fetch: as for a remote prefill's KV, from
        what computing the blocks would take (None: not measured, the worker's own)."""
        if fetch.compute_s is None:
            return None
        cfg = self.config
        return min(
            cfg.kv_wait_factor * fetch.compute_s + cfg.kv_wait_floor_s, cfg.kv_wait_timeout_s
        )

    async def route(
        self,
        prompt_ids: list[int],
        exclude: set[str],
        resume: bool,
        cache_salt: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> Route:
        """Place an attempt, decide where its prompt is prefilled, reserve that queue.

        Raises:
            Overloaded: every option's queue is past `max_prefill_queue_s`, or the share
                of it `priority` sees (priority.py; never for a resumed stream: its
                client already has tokens).
        """
        if self.stopping is not None:
            raise ShuttingDown(self.stopping)
        placed = await self.place(prompt_ids, exclude, cache_salt, lora)
        bound = prefill_queue_bound_s(self.config, priority)
        if self.prefill is None:  # colocated: D prefills, nothing to decide
            return self._route_colocated(placed, resume, bound, len(prompt_ids))
        decision = self._decide(placed, resume, bound)
        self.metrics.disagg_decisions.labels(decision.where, decision.reason).inc()
        if decision.saved_s > 0:
            self.metrics.disagg_saved.labels(decision.reason).inc(decision.saved_s)
        if decision.where == "shed":
            raise Overloaded(
                f"the cluster is past its prefill capacity: every worker that could "
                f"prefill this prompt has more than {bound:g}s of work queued; retry later",
                retry_after_s=max(1, math.ceil(decision.retry_after_s)),
            )
        route = Route(placed, decision, kv_wait_s(self.config, decision))
        if decision.where == "remote" and placed.remote is not None:
            self._hold_remote(route, placed.remote, len(prompt_ids))
        elif decision.where == "local":
            self._hold_local(route, placed.local, len(prompt_ids))
        return route

    async def _traced_route(
        self,
        span: Span,
        prompt_ids: list[int],
        exclude: set[str],
        attempt: int,
        cache_salt: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> Route:
        """`route`, as a placement span (child of the request's `span`)."""
        assert self.tracer is not None
        s = tracing.start(
            self.tracer, "pdserve.placement", span, attributes={"pdserve.attempt": attempt}
        )
        try:
            route = await self.route(prompt_ids, exclude, attempt > 0, cache_salt, priority, lora)
        except BaseException as exc:
            tracing.fail(s, exc)
            s.end()
            raise
        placed, decision = route.placed, route.decision
        attrs: dict[str, Any] = {"pdserve.placement.indexed": placed.indexed}
        if placed.prefill is not None:
            attrs["pdserve.prefill.worker_id"] = placed.prefill.worker_id
        if placed.decode is not None:
            attrs["pdserve.decode.worker_id"] = placed.decode.worker_id
            attrs["pdserve.decode.matched_blocks"] = placed.decode.matched_blocks
        if decision is not None:
            attrs["pdserve.disagg.where"] = decision.where
            attrs["pdserve.disagg.reason"] = decision.reason
        s.set_attributes(attrs)
        s.end()
        return route

    def _decide(self, placed: Placed, resume: bool, bound_s: float) -> Decision:
        if resume:  # the tokens so far are known: D prefills them
            return Decision("local", "resume")
        if not placed.indexed:  # Serve picks both; the split still happens
            return Decision("remote", "unplaced")
        now, local = time.monotonic(), placed.local
        room = 0.0 if local is None else self.spills.room_s(local.worker_id, now)
        decision = decide(
            self.config,
            placed.remote,
            local,
            placed.decode_running,
            max_queue_s=bound_s,
            spill_room_s=room,
        )
        if decision.reason == "prefill_busy" and local is not None and local.own_s is not None:
            self.spills.take(local.worker_id, local.own_s, now)
        return decision

    async def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        span: Span | None = None,
    ) -> AsyncIterator[OutputItem]:
        """`generate`, with the first attempt placed and admitted before this returns.

        `span`: the request's span (tracing on): placement and each attempt are its
        children, and the workers' spans children of the attempt's.

        Raises:
            Overloaded: the request is refused (the HTTP layer answers 429 before any
                byte of a response); nothing was sent to a worker.
        """
        items = self._generate(request_id, prompt_ids, params, arrival_s, True, span)
        try:
            await anext(items)  # the "placed" marker (None): admitted, queue reserved
        except BaseException:
            await items.aclose()
            raise
        return cast(AsyncIterator[OutputItem], items)  # outputs only from here on

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        span: Span | None = None,
    ) -> AsyncIterator[OutputItem]:
        """Yield the decode worker's output items for one request.

        If the decode worker dies mid-stream, stalls longer than `stall_timeout_s`
        between tokens, or leaves the index while its channel is silent (a node cut off
        from the network: `channels.DecodeChannels._watch`), the request resumes on
        another one: it prefills the prompt plus the tokens already streamed and goes on
        from there, so the client sees no gap and no duplicate (greedy and seeded
        sampling give the same tokens; sampling is keyed by position). At most
        `max_resumes` times.

        Raises:
            UpstreamError: the request could not be served (no worker, every attempt
                failed, or no first token within `first_token_timeout_s`). Nothing is
                left running on workers.
        """
        # aclosing: a client that closes this stream closes the attempt at once (its
        # cleanup aborts D and cancels P before aclose returns), not at garbage collection
        items = self._generate(request_id, prompt_ids, params, arrival_s, False, span)
        async with contextlib.aclosing(items):
            async for item in items:
                if item is not None:  # never: no marker unless announced
                    yield item

    async def _generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        announce: bool,
        span: Span | None = None,
    ) -> AsyncGenerator[OutputItem | None, None]:
        """`generate`; with `announce`, first None once admitted (the "placed" marker)."""
        generated: list[int] = []
        emitted = False  # n > 1: some choice's item went out (then no resume)
        failed: set[str] = set()
        salt, lora = params.cache_salt, params.lora
        cached = CachedTokens(len(prompt_ids))  # usage: prompt tokens a prefix cache served
        for attempt in range(self.config.max_resumes + 1):
            if generated:
                remaining = params.max_tokens - len(generated)
                if remaining <= 0:
                    return
                attempt_params = dataclasses.replace(params, max_tokens=remaining)
            else:
                attempt_params = params
            attempt_id = request_id if attempt == 0 else f"{request_id}-resume{attempt}"
            if span is None:
                route = await self.route(
                    prompt_ids + generated, failed, attempt > 0, salt, params.priority, lora
                )
            else:
                route = await self._traced_route(
                    span, prompt_ids + generated, failed, attempt, salt, params.priority, lora
                )
            try:
                if announce and attempt == 0:
                    yield None
                outputs = self._attempt(
                    attempt_id,
                    prompt_ids + generated,
                    attempt_params,
                    arrival_s,
                    first=not generated,
                    route=route,
                    span=span,
                    attempt=attempt,
                    cached=cached,
                )
                async with contextlib.aclosing(outputs):
                    async for item in outputs:
                        if params.n == 1:
                            generated += item["token_ids"]
                        else:
                            emitted = True
                        item["cached_tokens"] = cached.value
                        yield item
                return
            except _DecodeFailed as exc:
                if self.stopping is not None:  # the cluster stops: nowhere to resume
                    raise ShuttingDown(self.stopping) from exc
                failed.add(exc.worker_id or "")
                if emitted:  # n choices part-streamed: no resume (docs/architecture.md)
                    raise UpstreamError(f"{exc} (parallel sampling does not resume)") from exc
                if attempt == self.config.max_resumes:
                    raise UpstreamError(f"{exc} (after {attempt} resumes)") from exc
                self.metrics.resumes.inc()
                if exc.migrated:
                    self.metrics.drain_migrations.inc()
                logger.warning(
                    "%s: %s after %d tokens; resuming on another decode worker",
                    request_id,
                    exc,
                    len(generated),
                )
            finally:
                route.release()

    async def _attempt(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        first: bool,
        route: Route,
        span: Span | None = None,
        attempt: int = 0,
        cached: CachedTokens | None = None,
    ) -> AsyncGenerator[OutputItem, None]:
        """One dual dispatch of a routed attempt; raises _DecodeFailed if D dies.

        With the request's `span` (tracing on), the attempt is a `pdserve.dispatch` span
        whose W3C carrier goes with the calls to D and P (their spans' parent).
        `cached`: told the first item and the prefill's report, when this attempt
        produces the request's first token (usage's cached tokens).
        """
        p, d = route.placed.prefill, route.placed.decode
        # Why D prefills this attempt itself by the router's own decision (None: it asks
        # for KV; colocated mode counts nothing, every prefill happens on D there).
        decision = route.decision
        local_reason = decision.local_prefill_reason if decision is not None else None
        want_kv = self.prefill is not None and local_reason is None
        if first:
            self.metrics.ttft_stage.labels("router_queue").observe(time.monotonic() - arrival_s)
        if self.timeline is not None:
            n = len(prompt_ids)
            self.timeline.dispatched(request_id, arrival_s, attempt, n, p, d, decision)
        d_target = d.worker_id if d is not None else None
        inflight_at = d_target
        self.load.stream_opened(inflight_at, params.lora)
        dispatch: Span | None = None
        trace: dict[str, str] | None = None
        if span is not None and self.tracer is not None:
            dispatch = tracing.start(
                self.tracer,
                "pdserve.dispatch",
                span,
                kind=SpanKind.CLIENT,
                attributes={
                    "pdserve.request_id": request_id,
                    "pdserve.attempt": attempt,
                    "pdserve.prompt_tokens": len(prompt_ids),
                    "pdserve.kv_wanted": want_kv,
                },
            )
            trace = tracing.carrier(dispatch)
        fetch = route.fetch if d is not None and not want_kv else None
        stream = ChannelStream(
            self.channels,
            request_id,
            d_target,
            prompt_ids,
            params,
            want_kv,
            route.kv_wait_s,
            trace=trace,
            fetch_blocks=fetch.num_blocks if fetch is not None else 0,
        )
        prefill_task: asyncio.Task[None] | None = None
        fetch_task: asyncio.Task[None] | None = None
        report: dict[str, Any] = {}  # the PrefillReport, when its call returns
        finished = False
        counted = False  # this attempt's local prefill (if any) is counted
        produced = 0  # tokens this attempt streamed
        serving = d_target
        try:
            accepted = await self._accepted(stream, self.config.first_token_timeout_s)
            serving = accepted.get("worker_id") or d_target
            self._count_placement("decode", d_target, serving)
            if serving != inflight_at:  # Serve gave the call to another replica
                self.load.stream_closed(inflight_at, params.lora)
                inflight_at = serving
                self.load.stream_opened(inflight_at, params.lora)
            kv_expected = bool(accepted["kv_expected"])
            if fetch is not None and not accepted.get("fetch_expected"):
                self.metrics.fetches.labels("refused").inc()
            elif fetch is not None and serving == fetch.holder:
                # Serve gave the request to the holder itself: it has the blocks already
                why = "already_held"
                fetch_task = asyncio.create_task(
                    self._cancel_kv(fetch_id(request_id), why, serving)
                )
            elif fetch is not None:
                if d is not None and serving != d.worker_id:
                    fetch = fetch._replace(first_block=0)  # Serve gave it to another replica
                fetch_task = asyncio.create_task(
                    self._fetch(request_id, prompt_ids, params, fetch, accepted["address"], serving)
                )
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
                        request_id,
                        prompt_ids,
                        params,
                        p,
                        accepted["address"],
                        first_block,
                        serving,
                        route,
                        trace,
                        report,
                    )
                )
            else:
                route.release("prefill")  # no prefill worker is called for it
            timeout, what = self.config.first_token_timeout_s, "first token"
            while not finished:
                item = await self._output(stream, timeout, what)
                if not counted:
                    counted = True
                    if "fetch" in item:
                        self.metrics.fetches.labels(item["fetch"]).inc()
                        self.metrics.fetch_blocks.inc(item.get("fetched_blocks", 0))
                    route.release("local")  # D prefilled it (if it had to)
                    self._learn_local_rate(serving, item)
                    reason = local_reason
                    if kv_expected and not item.get("kv_used"):
                        reason = item.get("local_prefill") or "transfer_failed"
                    if reason is not None:
                        self._count_local_prefill(request_id, serving, reason)
                if first:
                    if self.timeline is not None:
                        self.timeline.first(request_id, serving, item)
                    if cached is not None:
                        cached.first_item(item, report)
                    self._record_first(item, arrival_s, decision)
                    if span is not None:
                        ttft = time.monotonic() - arrival_s
                        span.add_event("first_token", {"pdserve.ttft_s": ttft})
                    first = False
                timeout, what = self.config.stall_timeout_s, "token"
                finished = item["finished"]
                produced += len(item["token_ids"])
                if finished and self.timeline is not None:
                    self.timeline.done(request_id, produced)
                if finished and prefill_task is not None:
                    # The push ended before D's first token; wait for P's report so
                    # that metrics and the index are current when the client sees the end.
                    await self._await_prefill_report(request_id, prefill_task)
                yield item
        except _DecodeFailed as exc:
            exc.worker_id = serving
            if dispatch is not None:
                tracing.fail(dispatch, exc)
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the client went away
            raise
        except Exception as exc:
            if dispatch is not None:
                tracing.fail(dispatch, exc)
            raise
        finally:
            if dispatch is not None:
                self._end_dispatch(dispatch, p, d, serving, local_reason, finished)
            self.load.stream_closed(inflight_at, params.lora)
            if not finished:
                stream.cancel()
            if fetch_task is not None and not fetch_task.done():
                if finished:  # the holder's report (bytes, the push's rate) is due now
                    await asyncio.wait([fetch_task], timeout=self.config.transfer_timeout_s)
                fetch_task.cancel()
                await asyncio.wait([fetch_task])
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
                # asyncio.wait: never raises the task's error, and lets our own
                # cancellation (a client that went away) go on propagating
                await asyncio.wait([prefill_task])
                if not prefill_task.cancelled() and prefill_task.exception() is not None:
                    logger.error(
                        "%s: prefill task failed", request_id, exc_info=prefill_task.exception()
                    )

    @staticmethod
    def _end_dispatch(
        span: Span,
        p: Choice | None,
        d: Choice | None,
        serving: str | None,
        local_reason: str | None,
        finished: bool,
    ) -> None:
        attrs: dict[str, Any] = {"pdserve.finished": finished}
        if p is not None:
            attrs["pdserve.prefill.worker_id"] = p.worker_id
        if d is not None:
            attrs["pdserve.decode.chosen_worker_id"] = d.worker_id
        if serving is not None:
            attrs["pdserve.decode.worker_id"] = serving
        if local_reason is not None:
            attrs["pdserve.local_prefill_reason"] = local_reason
        span.set_attributes(attrs)
        span.end()

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

    def _count_hits(self, role: str, m: MatchResult) -> None:
        """The chosen worker's hit on the prompt, by the tier it holds each block in."""
        if m.matched_blocks:
            hits = self.metrics.placement_hits
            hits.labels(role, "device").inc(m.matched_blocks - m.host_blocks - m.disk_blocks)
            hits.labels(role, "host").inc(m.host_blocks)
            hits.labels(role, "disk").inc(m.disk_blocks)

    def _count_placement(self, role: str, chosen: str | None, served: str | None) -> None:
        """Count the replica that served; an override when Serve did not use the choice."""
        if served is not None:
            self.metrics.placements.labels(role, served).inc()
        if chosen is not None and served != chosen:
            self.metrics.placement_overrides.labels(role).inc()

    def _learn_local_rate(self, worker_id: str | None, item: OutputItem) -> None:
        """A decode worker's local prefill: how fast it prefills (conditional decisions)."""
        compute_s = item.get("local_prefill_s") or 0.0
        if worker_id is None or item.get("kv_used") or compute_s <= 0:
            return
        tokens = item.get("num_prompt_tokens", 0) - item.get("num_cached_tokens", 0)
        self.rates.local_done(worker_id, tokens, compute_s, time.monotonic())

    def _count_local_prefill(self, request_id: str, worker_id: str | None, reason: str) -> None:
        self.metrics.local_prefills.labels(reason).inc()
        if reason == "policy":  # the router's own choice, counted by why in the decisions
            return
        self._log.log(
            reason,
            "%s: decode worker %s prefilled the prompt itself (%s)",
            request_id,
            worker_id,
            reason,
        )

    async def _accepted(self, stream: ChannelStream, timeout_s: float) -> Accepted:
        """The stream's first item: `ChannelStream` returns it only once accepted."""
        return cast(Accepted, await self._next(stream, timeout_s, "accepted"))

    async def _output(self, stream: ChannelStream, timeout_s: float, what: str) -> OutputItem:
        """Every later item (an error item raises in `ChannelStream`)."""
        return cast(OutputItem, await self._next(stream, timeout_s, what))

    async def _next(
        self, stream: ChannelStream, timeout_s: float, what: str
    ) -> Accepted | OutputItem:
        try:
            # asyncio.timeout, not wait_for: wait_for wraps every item's await in a new
            # task, and this runs once per message of every stream
            async with asyncio.timeout(timeout_s):
                return await stream.__anext__()
        except TimeoutError as exc:
            why = f"no {what} from the decode worker within {timeout_s:g}s"
            if what == "token":  # it streamed, then stalled: resumable like a failure
                raise _DecodeFailed(why) from exc
            raise UpstreamError(why) from exc
        except StopAsyncIteration as exc:
            raise _DecodeFailed("the decode worker ended the stream early") from exc
        except RequestRefused as exc:
            raise Refused(str(exc)) from exc
        except Migrated as exc:
            failed = _DecodeFailed(str(exc))
            failed.migrated = True
            raise failed from exc
        except (asyncio.CancelledError, ShuttingDown):
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
        route: Route,
        trace: dict[str, str] | None = None,
        report: dict[str, Any] | None = None,
    ) -> None:
        """Run the prefill half of dual dispatch; on failure free D to prefill locally.

        `p`: the chosen prefill worker, or None (no index: Serve picks one). The KV goes
        to `decode_address`, the receiver of `decode_worker`, the replica serving D.
        The route's reservation of P's queue ends with the call. `report`: filled with
        the worker's result (its prefix-cache hit: usage's cached tokens).
        """
        assert self.prefill is not None  # disaggregated mode
        p_target = p.worker_id if p is not None else None
        # the carrier only when tracing: the workers' signatures stay optional
        extra: dict[str, Any] = {} if trace is None else {"trace": trace}
        fetch = route.prefill_fetch
        if fetch is not None and p_target is not None:
            fetched = await self._prefill_fetch(
                request_id, prompt_ids, params, fetch, route.prefill_fetch_wait_s, p_target
            )
            if fetched:
                extra.update(fetch_blocks=fetch.num_blocks, fetch_wait_s=route.prefill_fetch_wait_s)
        try:
            # cancelled with this request (its client went away): stop the prefill too
            result: PrefillReport = await cancelling(
                self.prefill.prefill.remote(
                    request_id,
                    prompt_ids,
                    params,
                    decode_address,
                    first_block=first_block,
                    target_replica=p_target,
                    **extra,
                )
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
            route.release("prefill")
        if "fetch" in result:
            self.metrics.fetches.labels(result["fetch"]).inc()
            self.metrics.fetch_blocks.inc(result.get("fetched_blocks", 0))
        if report is not None:
            report.update(result)
        served = result.get("worker_id") or p_target
        self._count_placement("prefill", p_target, served)
        push_s = result["pack_s"] + result["transfer_s"]
        if served is not None:
            computed = result["num_prompt_tokens"] - result["num_cached_tokens"]
            end_s = time.monotonic() - push_s  # when its prefill ended, about
            self.rates.prefill_done(served, computed, result["compute_s"], end_s)
        self.rates.push_done(push_s, result["num_blocks_sent"])
        if self.timeline is not None:
            self.timeline.prefilled(request_id, served, result, push_s)
        m = self.metrics
        self.traffic.remote_computed += result["num_prompt_tokens"] - result["num_cached_tokens"]
        m.prompt_tokens.labels("prefill").inc(result["num_prompt_tokens"])
        m.hit_tokens.labels("prefill").inc(result["num_cached_tokens"])
        m.transfer_bytes.inc(result["transfer_bytes"])
        m.transfer_blocks.inc(result["num_blocks_sent"])
        m.transfer_seconds.inc(result["transfer_s"])
        m.ttft_stage.labels("prefill_queue").observe(result["queue_s"])
        m.ttft_stage.labels("prefill_compute").observe(result["compute_s"])
        m.ttft_stage.labels("transfer").observe(result["pack_s"] + result["transfer_s"])

    async def _prefill_fetch(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        fetch: Fetch,
        wait_s: float | None,
        p_target: str,
    ) -> bool:
        """Have the chosen prefill worker expect the prefix `fetch` names and its holder
        push it there, before the prefill call (which would wait for it anyway). True
        when the prefill worker expects it (the push done, or failed and the worker told
        why); False (counted `refused`) when it would not: the prompt is then computed
        there whole.

        The push is awaited before the prefill call is made, not beside it. (Beside it,
        the push sometimes never reached its replica: both calls had the client
        request's Serve id, which Serve's request router cannot tell apart; each call
        has its own now, router/serve_calls.py, but the order stays: the prefill call
        would only wait for the push.) The wait is bounded by the fetch's own; past it
        the push is abandoned and the prefill worker told (`late`)."""
        assert self.prefill is not None
        try:
            accepted: FetchAccepted = await asyncio.wait_for(
                self.prefill.expect_fetch.remote(
                    request_id,
                    prompt_ids,
                    fetch.num_blocks,
                    wait_s,
                    params.cache_salt,
                    params.lora,
                    target_replica=p_target,
                ),
                _STATE_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead replica, an older one: Ray's error types
            logger.debug("%s: prefill worker %s takes no fetch (%r)", request_id, p_target, exc)
            accepted = {"worker_id": "", "address": "", "fetch_expected": False}
        if not accepted["fetch_expected"]:
            self.metrics.fetches.labels("refused").inc()
            return False
        push = asyncio.create_task(
            self._fetch(
                request_id, prompt_ids, params, fetch, accepted["address"], p_target, "prefill"
            )
        )
        limit = self.config.kv_wait_timeout_s if wait_s is None else wait_s
        done, _ = await asyncio.wait([push], timeout=limit)
        if not done:
            push.cancel()
            await asyncio.wait([push])
            await self._cancel_kv(fetch_id(request_id), "late", p_target, "prefill")
        return True

    async def _fetch(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        fetch: Fetch,
        address: str,
        receiver: str | None,
        receiver_role: str = "decode",
    ) -> None:
        """Have `fetch.holder` push the prefix to `address` (the receiver of replica
        `receiver` of `receiver_role`'s pool, which expects it); on failure tell the
        receiver to stop waiting and compute the prompt now (the outcome it reports says
        why)."""
        fid = fetch_id(request_id)
        try:
            holder = self.prefill if fetch.holder_role == "prefill" else self.decode
            assert holder is not None
            # a push nobody waits for any more (the request ended, late) stops
            result: FetchReport = await asyncio.wait_for(
                cancelling(
                    holder.push_prefix.remote(
                        fid,
                        prompt_ids,
                        fetch.num_blocks,
                        fetch.first_block,
                        address,
                        params.cache_salt,
                        target_replica=fetch.holder,
                        **({} if params.lora is None else {"lora": params.lora}),
                    )
                ),
                self.config.transfer_timeout_s + _STATE_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Ray's error types wrap the holder's
            reason = "not_held" if "NotHeldError" in repr(exc) else "holder_failed"
            self._log.log(
                f"fetch: {reason}",
                "%s: the prefix fetch from %s failed (%s: %r); %s computes it",
                request_id,
                fetch.holder,
                reason,
                exc,
                receiver,
            )
            await self._cancel_kv(fid, reason, receiver, receiver_role)
            return
        if receiver is not None:
            seconds, blocks = result["seconds"], result["num_blocks"]
            self.rates.fetch_done(fetch.holder, receiver, seconds, blocks, time.monotonic())
        self.metrics.fetch_bytes.inc(result["num_bytes"])

    async def _cancel_kv(
        self, request_id: str, reason: str, worker_id: str | None, role: str = "decode"
    ) -> None:
        """Tell the worker (of `role`'s pool) waiting for `request_id`'s KV to compute
        the prompt now."""
        pool = self.prefill if role == "prefill" else self.decode
        assert pool is not None
        try:
            reached = await asyncio.wait_for(
                pool.cancel_kv.remote(request_id, reason, target_replica=worker_id),
                _STATE_TIMEOUT_S,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dead replica, a timeout: Ray's error types
            self._log.log(
                "cancel_kv failed",
                "%s: could not tell decode worker %s to stop waiting for KV (%r); it "
                "prefills once its KV wait has passed",
                request_id,
                worker_id,
                exc,
            )
            return
        if reached != worker_id:
            self._log.log(
                "cancel_kv elsewhere",
                "%s: cancel_kv reached %s, not %s (Serve routed it elsewhere); %s prefills "
                "once its KV wait has passed",
                request_id,
                reached,
                worker_id,
                worker_id,
            )

    def _record_first(
        self, item: OutputItem, arrival_s: float, decision: Decision | None = None
    ) -> None:
        m = self.metrics
        m.ttft.observe(time.monotonic() - arrival_s)
        prompt = item.get("num_prompt_tokens", 0)
        self.traffic.requests += 1
        self.traffic.prompt_tokens += prompt
        if not item.get("kv_used"):  # prefilled on the decode worker
            computed = max(prompt - item.get("num_cached_tokens", 0), 0)
            # by the policy's choice (a short prompt: colocated, or conditional
            # disaggregation's), or because the prefill pool was busy or failed: work the
            # prefill pool was meant for, which the planner must not take for less demand
            if self.prefill is None or (decision is not None and decision.reason == "short_prompt"):
                self.traffic.local_computed += computed
            else:
                self.traffic.spilled_computed += computed
        m.prompt_tokens.labels("decode").inc(item.get("num_prompt_tokens", 0))
        m.hit_tokens.labels("decode").inc(item.get("num_cached_tokens", 0))
        m.ttft_stage.labels("decode_queue").observe(item.get("decode_queue_s", 0.0))
        if not item.get("kv_used") and item.get("local_prefill_s"):
            m.ttft_stage.labels("prefill_compute").observe(item["local_prefill_s"])
