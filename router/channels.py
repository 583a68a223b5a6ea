"""Router side of the token channels (decode_worker/channels.py).

Each router replica keeps one channel to each decode replica it sends requests to: a
long-lived Ray Serve streaming call on which the decode replica returns the outputs of
all of this router's requests, everything ready at once in one message. A request is
started with a plain `submit` call naming the channel; its items then arrive on its own
queue here. `ChannelStream` gives one request's items the shape of a Serve stream
(`__anext__`, `cancel`), so the request path reads them as it read a stream per request.

A channel that breaks (its decode replica died) fails every request on it at once, each
with `ChannelError`; the request path resumes them on other workers. A channel the decode
replica ended because it was idle is reopened when next needed. A request whose client
goes away is aborted on the decode replica (`abort`), never left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from pdserve.cluster.messages import (
    Accepted,
    ChannelHello,
    DecodeHandle,
    OutputItem,
    StreamItem,
    SubmitReply,
)
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_ABORT_TIMEOUT_S = 5.0
_SUBMIT_TRIES = 3  # a channel can end (idle) just as a request is submitted on it


class ChannelError(RuntimeError):
    """The channel broke, or the decode replica failed the request on it."""


class Migrated(ChannelError):
    """The decode replica left its pool and moved the request (a `migrate` error item,
    cluster/drain.py): it resumes elsewhere."""


class RequestRefused(ChannelError):
    """The decode replica's engine refused the request itself (an `invalid` error item)."""


class Connection:
    """One open channel: to decode replica `worker_id`, with a queue per request."""

    def __init__(self, channel_id: str, worker_id: str, stream: Any) -> None:
        self.channel_id = channel_id
        self.worker_id = worker_id
        self.stream = stream
        # per request: its items, or the error that ended its channel
        self.queues: dict[str, asyncio.Queue[StreamItem | BaseException]] = {}
        self.alive = True
        self.accepting = True  # new requests may be submitted on it
        self.reader: asyncio.Task[None] | None = None
        self.last_message_s = time.monotonic()
        self.broken_because: str | None = None  # set when the router gives up on it


class DecodeChannels:
    """This router replica's channels to the decode pool, by decode replica id.

    Args:
        decode: Handle of the decode deployment.
        open_timeout_s: How long opening a channel may take (its first message).
    """

    def __init__(
        self,
        decode: DecodeHandle,
        open_timeout_s: float,
        live_ids: Callable[[], Awaitable[set[str] | None]] | None = None,
        check_s: float = 1.0,
    ) -> None:
        self.decode = decode
        self.open_timeout_s = open_timeout_s
        # The decode workers the prefix index holds live (None: it cannot tell), asked
        # every `check_s` while channels are open (see `_watch`).
        self._live_ids = live_ids
        self._check_s = check_s
        self._watcher: asyncio.Task[None] | None = None
        self._prefix = f"router-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()
        self._conns: dict[str, Connection] = {}
        self._opening: dict[str, asyncio.Task[Connection]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._stopped: Callable[[], BaseException] | None = None  # `stop`ped: the error
        self._stopping = asyncio.Event()

    @property
    def num_open(self) -> int:
        return len(self._conns)

    async def connect(self, target: str | None) -> Connection:
        """A channel to decode replica `target` (if None, to the replica Serve picks for
        this call; the returned connection says which). Opening one costs a round trip;
        requests after the first reuse it."""
        if self._stopped is not None:
            raise self._stopped()
        if target is None:
            # No placement (the index is down): Serve picks the replica for each request,
            # as it spreads them; the channel to the one it picked is reused.
            return await self._open(None)
        conn = self._conns.get(target)
        if conn is not None and conn.accepting:
            return conn
        task = self._opening.get(target)
        if task is None:
            task = asyncio.create_task(self._open(target))
            self._opening[target] = task
            task.add_done_callback(lambda t: self._forget_opening(target, t))
        # shield: one waiter's cancellation must not cancel the others' open
        return await self.unless_stopped(asyncio.shield(task))

    async def unless_stopped(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, unless `stop` comes first: then raise its error (a call to a
        pool that is stopping too may never be answered)."""
        if self._stopped is not None:
            raise self._stopped()
        call = asyncio.ensure_future(awaitable)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({call, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not call.done():
                call.cancel()
        if call.done() and not call.cancelled():
            return call.result()
        assert self._stopped is not None
        raise self._stopped()

    def _forget_opening(self, target: str, task: asyncio.Task[Connection]) -> None:
        if self._opening.get(target) is task:
            del self._opening[target]
        if not task.cancelled():
            task.exception()  # retrieved: each waiter got it already

    async def _open(self, target: str | None) -> Connection:
        channel_id = f"{self._prefix}-{next(self._ids)}"
        stream = self.decode.options(stream=True).channel.remote(channel_id, target_replica=target)
        try:
            async with asyncio.timeout(self.open_timeout_s):
                hello: ChannelHello = (await stream.__anext__())[0][1]
        except BaseException:
            stream.cancel()
            raise
        worker_id = hello["worker_id"]
        existing = self._conns.get(worker_id)
        if existing is not None and existing.accepting:
            stream.cancel()  # opened twice at once (two targets that were one replica)
            return existing
        conn = Connection(channel_id, worker_id, stream)
        self._conns[worker_id] = conn
        conn.reader = asyncio.create_task(self._read(conn))
        if self._live_ids is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch())
        return conn

    async def _watch(self) -> None:
        """Give up on channels to decode workers that left the index and went silent.

        A decode node cut off from the network keeps its processes: its channel neither
        delivers nor breaks (no reset crosses a cut link), and Ray's node-failure
        detection does not end a stream already open. The worker's lease in the index
        lapses instead (it cannot renew it), so a channel whose worker is no longer live
        there, with requests waiting and nothing received for a check period, is broken
        here: its requests fail with ChannelError and resume elsewhere. A worker that only
        lost Redis keeps streaming, and so keeps its channel. Runs while channels are
        open; an index that cannot answer (None) breaks nothing.
        """
        assert self._live_ids is not None
        while self._conns:
            await asyncio.sleep(self._check_s)
            try:
                live = await self._live_ids()
            except Exception as exc:  # the index is down: no verdict
                logger.debug("channel watch: index unavailable (%r)", exc)
                continue
            if live is None:
                continue
            now = time.monotonic()
            for conn in list(self._conns.values()):
                silent_s = now - conn.last_message_s
                if conn.worker_id in live or not conn.queues or silent_s < self._check_s:
                    continue
                logger.warning(
                    "decode worker %s left the index and sent nothing for %.1f s: "
                    "its %d requests resume elsewhere",
                    conn.worker_id,
                    silent_s,
                    len(conn.queues),
                )
                conn.broken_because = "the decode worker left the index (its lease lapsed)"
                if conn.reader is not None:
                    conn.reader.cancel()
                conn.stream.cancel()

    async def _read(self, conn: Connection) -> None:
        why = "the decode worker closed the channel"
        try:
            while True:
                batch = await conn.stream.__anext__()
                conn.last_message_s = time.monotonic()
                for request_id, item in batch:
                    queue = conn.queues.get(request_id)
                    if queue is not None:  # None: the request was cancelled here
                        queue.put_nowait(item)
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            why = conn.broken_because or "the router closed the channel"
            if conn.broken_because is None:
                raise
        except Exception as exc:  # a dead replica: Ray's error types
            why = f"the decode worker failed: {type(exc).__name__}"
            if self._stopped is None:  # else: closed here, on purpose
                logger.warning("channel to decode worker %s broke: %r", conn.worker_id, exc)
        finally:
            conn.alive = conn.accepting = False
            if self._conns.get(conn.worker_id) is conn:
                del self._conns[conn.worker_id]
            for queue in conn.queues.values():
                queue.put_nowait(ChannelError(why))

    def abort(self, conn: Connection, request_id: str) -> None:
        """Stop `request_id` on `conn`'s replica, without waiting."""
        if conn.alive:
            self._spawn(self._abort(conn, request_id))

    def abort_when_accepted(self, conn: Connection, request_id: str, reply: Any) -> None:
        """A submit whose caller went away: abort the request once the reply says it runs."""
        self._spawn(self._abort_when_accepted(conn, request_id, reply))

    async def _abort(self, conn: Connection, request_id: str) -> None:
        try:
            async with asyncio.timeout(_ABORT_TIMEOUT_S):
                await self.decode.abort.remote(
                    conn.channel_id, request_id, target_replica=conn.worker_id
                )
        except Exception as exc:  # the replica died (its requests with it), or is stuck
            logger.debug("%s: abort on %s failed: %r", request_id, conn.worker_id, exc)

    async def _abort_when_accepted(self, conn: Connection, request_id: str, reply: Any) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_ABORT_TIMEOUT_S):
                if (await reply).get("type") == "accepted":
                    await self._abort(conn, request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stop(self, error: Callable[[], BaseException]) -> None:
        """For good: every request on a channel gets an `error()` as its next item, every
        channel closes, and a request submitted later raises one."""
        self._stopped = error
        self._stopping.set()
        for conn in self._conns.values():
            for queue in conn.queues.values():
                queue.put_nowait(error())
        self.close()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for conn in list(self._conns.values()):
            if conn.reader is not None:
                conn.reader.cancel()
            conn.stream.cancel()


class ChannelStream:
    """One request on a channel, read like a Serve stream of its own: the first
    `__anext__` submits it and returns the "accepted" item, later ones its outputs.
    `cancel()` stops it on the decode replica unless it finished."""

    def __init__(
        self,
        channels: DecodeChannels,
        request_id: str,
        target: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool,
        kv_wait_s: float | None,
        trace: dict[str, str] | None = None,
        fetch_blocks: int = 0,
    ) -> None:
        self._channels = channels
        self._request_id = request_id
        self._target = target
        self._args = (prompt_token_ids, params)
        self._kwargs: dict[str, Any] = {"kv_expected": kv_expected, "kv_wait_s": kv_wait_s}
        if trace is not None:  # tracing on: the W3C carrier of the router's span
            self._kwargs["trace"] = trace
        if fetch_blocks:  # a peer pushes the prompt's first blocks (router/fetch.py)
            self._kwargs["fetch_blocks"] = fetch_blocks
        self._conn: Connection | None = None
        self._queue: asyncio.Queue[StreamItem | BaseException] | None = None
        self._finished = False

    async def __anext__(self) -> Accepted | OutputItem:
        """The decode worker's `Accepted` first (submitting the request), then the
        request's output items; its error item or a broken channel raise ChannelError."""
        if self._queue is None:
            return await self._submit()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.get("type") == "error":
            if item.get("invalid"):
                raise RequestRefused(str(item.get("message")))
            if item.get("migrate"):
                raise Migrated(str(item.get("message")))
            raise ChannelError(f"the decode worker failed the request: {item.get('message')}")
        if item.get("finished"):
            self._finished = True
            self._unregister()
        return cast(OutputItem, dict(item))

    async def _submit(self) -> Accepted:
        channels, request_id = self._channels, self._request_id
        for _ in range(_SUBMIT_TRIES):
            conn = await channels.connect(self._target)
            queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
            conn.queues[request_id] = queue  # before the submit: no item can be missed
            reply = channels.decode.submit.remote(
                conn.channel_id,
                request_id,
                *self._args,
                worker_id=conn.worker_id,
                target_replica=conn.worker_id,
                **self._kwargs,
            )
            try:
                accepted: SubmitReply = dict(await channels.unless_stopped(reply))  # type: ignore[assignment]
            except asyncio.CancelledError:
                conn.queues.pop(request_id, None)
                channels.abort_when_accepted(conn, request_id, reply)
                raise
            except BaseException:
                conn.queues.pop(request_id, None)
                raise
            if accepted.get("type") == "accepted":
                self._conn, self._queue = conn, queue
                return cast(Accepted, accepted)
            # the channel is not open there (it ended idle, or Serve gave the call to
            # another replica): submit on a channel opened now
            conn.queues.pop(request_id, None)
            conn.accepting = False
        raise ChannelError(f"no decode worker took {request_id} on a channel")

    def _unregister(self) -> None:
        if self._conn is not None:
            self._conn.queues.pop(self._request_id, None)

    def cancel(self) -> None:
        self._unregister()
        if self._conn is not None and not self._finished:
            self._channels.abort(self._conn, self._request_id)
