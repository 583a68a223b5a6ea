"""UCX transport (the `ucxx` package): header and payload at once, one ack at the end.

Wire protocol on one UCX endpoint (tag-matched messages, in order), per transfer:

    sender -> receiver   a control frame holding the serialized `TransferHeader`,
                         then at once the payload: `payload_bytes` raw bytes in chunks
                         of whole rows (`row_chunks`), straight from the caller's buffer
    receiver -> sender   a control frame holding the `TransferAck`: the typed refusal
                         right after the header, or the verdict once every block's
                         checksum was checked

A control frame is one message of at most `CONTROL_BYTES`: a u64 length, then that many
bytes; a longer one (a header with thousands of blocks) spills its tail into a second
message of exact size. Each side posts a `CONTROL_BYTES` receive for it, so a frame costs
one message, not a length and then a body.

There is no go/no-go round trip before the payload: the payload is already on its way
while the receiver checks the header (UCX holds what arrives before the receives are
posted). A receiver that refuses a header it could parse answers at once, then receives
and drops the payload the header announced, so the endpoint stays in step and carries
the next transfer; the sender waits for its sends to finish before it reports the
refusal. A header that does not parse, or that announces more than the receiver would
ever take (`max_payload_bytes`), is refused and the connection hung up.

A sender keeps a small pool of idle endpoints per address; a transfer takes one (or
connects), so concurrent sends run in parallel, each on its own endpoint. An endpoint
whose transfer failed or timed out is closed, never reused.

Event loops and progress. `ucxx` binds its context to one asyncio loop. This module
runs all UCX work on one private loop in a daemon thread, created on first use and kept
for the life of the process, and bridges callers' loops to it; the receiver's
`ReceiverCore` stays on the loop that called `start`. So any number of loops (one per
`asyncio.run`, as in tests) can use UCX one after another or at once. That loop's
thread is also the only one that progresses the UCX worker (`_Progress`): it sleeps in
epoll on the worker's event fd, progresses when it fires, and settles the requests that
completed, with no progress or notifier thread. A receiver thus costs one thread and no
CPU while idle, and a completion wakes no other thread.

Environment (read by UCX once, when this module first initialises `ucxx`; every value
is a default that the operator's own environment overrides):

- UCX_TLS=tcp,sm,self: TCP between hosts (a listener needs `tcp`); shared memory and
  `self` for peers on one host where UCX can use them.
- UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE=2m: the TCP transport's segment (default
  8 KiB); large segments roughly triple throughput for multi-MiB payloads.
- UCX_TCP_SNDBUF / UCX_TCP_RCVBUF=8m: kernel socket buffers for the same reason.
- UCX_RNDV_FRAG_MEM_TYPE=host: `ucxx` defaults rendezvous fragments to CUDA memory,
  which a CPU-only host lacks.
- UCX_WARN_UNUSED_ENV_VARS=n: quiet UCX's warning about variables it does not use.
- UCX_RNDV_THRESH=inf: the eager protocol for every size. Over TCP, rendezvous costs
  a handshake per chunk; with this module's few multi-MiB messages it measured slower
  (256 MiB: 3.4-3.8 GB/s against 4.2-4.3 eager; 16 MiB: about the same).

NOTE on ucxx's own progress modes (0.52), measured on a 2-core host: `thread` mode
moved 16 MiB at ~2 GB/s against ~4 GB/s here, because every completion went from
ucxx's progress thread to its notifier thread to the loop, and while the data copies
kept both cores busy each hop waited for a time slice (up to 5 ms). Its `blocking`
mode never re-arms the worker and awaits requests by polling, so an idle process spun a
whole core; in a decode worker that starved the engine thread (p99 TPOT 125 ms against
44 ms). `_Progress` is the blocking mode done by the book, which is why this module
reaches into ucxx below its Endpoint API (`_Endpoint`).

Pipelining. The receiver hashes each chunk (`BlockHasher`) as soon as it is in, while
the next one arrives, so verification costs one chunk's hash after the last byte
instead of the whole payload's.

Bind address. The receiver's listener binds `ReceiverConfig.host` only (0.0.0.0 for
every interface). `ucxx`'s Python listener cannot choose its address (the C++ builder
can, the binding does not expose it), so `ucx_listener` creates it below that API. UCX's
TCP transport also opens a listening socket per network device it uses, on that
device's address and a random port, for its own connection set-up; `UCX_NET_DEVICES`
(e.g. `lo` or `eth0`) limits those to the devices named. Every transfer still needs the
cluster token before its payload is kept, and UCX has no TLS: keep the ports firewalled
to the cluster.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import DecodeError

from pdserve.kv_transfer.base import (
    BlockHasher,
    KVReceiver,
    KVSender,
    Payload,
    ReceiverConfig,
    ReceiverCore,
    TransferHeader,
    TransferStats,
    as_bytes,
    row_chunks,
)
from pdserve.kv_transfer.errors import (
    BadHeaderError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
    TruncatedError,
    ack_for,
    error_from_ack,
)
from pdserve.kv_transfer.ucx_listener import create_listener
from pdserve.protos import kv_transfer_pb2 as pb

T = TypeVar("T")
logger = logging.getLogger(__name__)

UCX_ENV_DEFAULTS = {
    "UCX_TLS": "tcp,sm,self",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
    "UCX_TCP_SNDBUF": "8m",
    "UCX_TCP_RCVBUF": "8m",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_RNDV_THRESH": "inf",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
MAX_MESSAGE_BYTES = 64 << 20  # a header or an ack larger than this is refused
CONTROL_BYTES = 64 << 10  # a control frame up to this size is one message
_LENGTH = struct.Struct("<Q")
MAX_IDLE_ENDPOINTS = 4  # per address, kept by a sender for reuse
CLOSE_WAIT_S = 2.0  # how long close() waits for connection handlers to wind down
SAFETY_PROGRESS_S = 0.1  # progress at least this often while requests are outstanding


class _Progress:
    """Progresses the UCX worker on the UCX loop's own thread; nothing else does.

    The worker's event fd is a reader on the loop: each wake-up progresses the worker,
    settles the futures of the requests that completed, and re-arms the worker. An idle
    process sleeps in epoll (no thread spins), and a completion wakes no other thread.
    (ucxx's `thread` mode hands each completion from a progress thread to a notifier
    thread to the loop: three threads per process on the data path, and on a busy
    2-core host each hop waited for a time slice, up to 5 ms.) While requests are
    outstanding a slow timer progresses too, in case a wake-up is ever missed.
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, version: str) -> None:
        self.worker = worker
        self.loop = loop
        self.version = version
        worker.init_blocking_progress_mode()
        loop.add_reader(worker.epoll_file_descriptor, self.run)
        # request -> (its future, its endpoint); a request stays here until UCX is done
        # with it, even if its waiter gave up, so its buffer's owner can tell when
        self._waiting: dict[Any, tuple[asyncio.Future[None], _Endpoint]] = {}
        self._scheduled = False
        self._safety: asyncio.TimerHandle | None = None

    def track(self, request: Any, owner: _Endpoint) -> asyncio.Future[None]:
        """A future that ends when `request` (a ucxx request of `owner`) does."""
        future: asyncio.Future[None] = self.loop.create_future()
        if request.completed:
            _settle(request, future)
            return future
        self._waiting[request] = (future, owner)
        owner.outstanding += 1
        self.kick()  # the post may have queued work only progress pushes out
        return future

    def kick(self) -> None:
        """Progress soon (after the callbacks already due)."""
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self._scheduled = False
        while True:
            self.worker.progress()
            for request in [r for r in self._waiting if r.completed]:
                future, owner = self._waiting.pop(request)
                _settle(request, future)
                owner.request_done()
            if self.worker.arm():  # nothing left to do: sleep until the fd fires
                break
        if self._safety is not None:
            self._safety.cancel()
            self._safety = None
        if self._waiting:
            self._safety = self.loop.call_later(SAFETY_PROGRESS_S, self.run)


def _settle(request: Any, future: asyncio.Future[None]) -> None:
    if future.done():
        return
    try:
        request.check_error()
    except Exception as exc:  # UCXCanceled, UCXError, a truncated message...
        future.set_exception(exc)
    else:
        future.set_result(None)


class _Endpoint:
    """A ucxx endpoint whose tag messages complete through `_Progress`."""

    def __init__(self, ep: Any, progress: _Progress) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self.ep = ep
        self._progress = progress
        self.outstanding = 0  # requests UCX is not done with
        self._settled: asyncio.Future[None] | None = None
        self._array = Array
        tags = getattr(ep, "_tags", None)
        if not isinstance(tags, dict) or not hasattr(ep, "_ep"):
            raise RuntimeError(
                f"ucxx {self._progress.version} changed its Endpoint internals, which this "
                "module uses (see pyproject.toml for the ucxx it supports)"
            )
        # the tags ucxx's own Endpoint.send/recv use (agreed with the peer at connect)
        self._send_tag = Tag(tags["msg_send"])
        self._recv_tag = Tag(tags["msg_recv"])
        self._recv_mask = TagMaskFull

    @property
    def closed(self) -> bool:
        return bool(self.ep.closed)

    def _check(self) -> None:
        self.ep._ep.raise_on_error()
        if self.ep.closed:
            raise PeerUnavailableError("UCX endpoint closed")

    def send(self, buffer: np.ndarray) -> asyncio.Future[None]:
        """Send `buffer` as one message; UCX reads it until the future ends."""
        self._check()
        request = self.ep._ep.tag_send(self._array(buffer), self._send_tag)
        return self._progress.track(request, self)

    def recv(self, buffer: np.ndarray) -> asyncio.Future[None]:
        """Receive one message into `buffer` (a shorter one lands in its head)."""
        self._check()
        request = self.ep._ep.tag_recv(self._array(buffer), self._recv_tag, self._recv_mask)
        return self._progress.track(request, self)

    def request_done(self) -> None:
        self.outstanding -= 1
        if not self.outstanding and self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    def close(self) -> None:
        """Close the endpoint at once; its requests end (cancelled) on the next progress."""
        try:
            self.ep.abort()
        except Exception as exc:  # already broken: nothing more to free
            logger.debug("UCX endpoint abort: %r", exc)
        self._progress.kick()

    async def abort(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Close the endpoint, ending its requests; True once UCX is done with every
        buffer they named (within `timeout_s`), so those buffers may be reused."""
        self.close()
        if not self.outstanding:
            return True
        self._settled = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._settled), timeout_s)
        except TimeoutError:
            return False
        return True


class _UcxRuntime:
    """The process's single UCX context, on a private event loop in a daemon thread."""

    _instance: _UcxRuntime | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import ucxx  # UCX reads the environment set just above

        self.ucxx: Any = ucxx
        self.loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(
            target=self._run, args=(ready,), name="pdserve-ucx", daemon=True
        )
        self.thread.start()
        ready.result(timeout=60)
        # ucxx's notifier thread is not a daemon: stop it before the interpreter joins it
        register = getattr(threading, "_register_atexit", atexit.register)
        register(self._shutdown)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._init())
        except BaseException as exc:  # handed to the starting thread
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self.loop.run_forever()

    async def _init(self) -> None:
        from ucxx._lib_async import application_context
        from ucxx.core import _get_ctx

        loop = asyncio.get_running_loop()
        # NOTE: ucxx starts its own progress task for a loop it has none for; a
        # placeholder for this loop keeps it from doing so (its `blocking` task never
        # re-arms the worker and so spins; see _Progress). No python futures: no
        # notifier thread either.
        application_context.ProgressTasks[loop] = None
        self.ucxx.init(
            progress_mode="blocking", enable_python_future=False, enable_delayed_submission=False
        )
        self.progress = _Progress(_get_ctx().worker, loop, str(self.ucxx.__version__))
        application_context.ProgressTasks[loop] = self.progress

    def _shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self.loop.call_soon_threadsafe(self.loop.stop)

    @classmethod
    def get(cls) -> _UcxRuntime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the UCX loop; await it from the caller's loop."""
        return await asyncio.wrap_future(self.submit(coro))


async def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> T:
    """Call `fn(*args)` on `loop` (the ReceiverCore's) from the UCX loop."""

    async def call() -> T:
        return fn(*args)

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))


def _frames(data: bytes) -> list[np.ndarray]:
    """`data` as a control frame: one message, or two when it does not fit in one."""
    frame = np.frombuffer(_LENGTH.pack(len(data)) + data, dtype=np.uint8)
    if frame.size <= CONTROL_BYTES:
        return [frame]
    return [frame[:CONTROL_BYTES], frame[CONTROL_BYTES:]]


async def _send_control(ep: _Endpoint, data: bytes) -> None:
    for message in _frames(data):
        await ep.send(message)


async def _recv_control(ep: _Endpoint) -> bytes:
    """One control frame's bytes; BadHeaderError if it announces too many."""
    first = np.empty(CONTROL_BYTES, dtype=np.uint8)
    await ep.recv(first)  # a shorter message lands in its head
    (num_bytes,) = _LENGTH.unpack_from(first.data)
    if num_bytes > MAX_MESSAGE_BYTES:
        raise BadHeaderError(f"message of {num_bytes} bytes > {MAX_MESSAGE_BYTES}")
    end = _LENGTH.size + num_bytes
    if end <= CONTROL_BYTES:
        return first[_LENGTH.size : end].tobytes()
    rest = np.empty(end - CONTROL_BYTES, dtype=np.uint8)
    await ep.recv(rest)
    return first[_LENGTH.size :].tobytes() + rest.tobytes()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (a request ended by closing its endpoint)."""
    if not future.cancelled():
        future.exception()


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise PeerUnavailableError(f"bad UCX address {address!r} (want host:port)")
    return host.strip("[]"), int(port)


class UcxReceiver(KVReceiver):
    def __init__(self, config: ReceiverConfig) -> None:
        self.core = ReceiverCore(config)
        self._runtime: _UcxRuntime | None = None
        self._core_loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None
        self._conn_handler: Any = None  # kept alive while the listener may call it
        self._endpoints: set[_Endpoint] = set()  # touched on the UCX loop only
        self._handlers: set[asyncio.Task[None]] = set()
        self.address: str | None = None

    async def start(self) -> str:
        self._core_loop = asyncio.get_running_loop()
        self._runtime = _UcxRuntime.get()
        port = await self._runtime.run(self._listen())
        self.address = f"{self.core.config.host}:{port}"
        return self.address

    async def _listen(self) -> int:
        from ucxx.core import _get_ctx

        self._listener, self._conn_handler = create_listener(
            _get_ctx(), self._serve, self.core.config.host, self.core.config.port
        )
        return int(self._listener.port)

    async def close(self) -> None:
        if self._runtime is not None:
            await self._runtime.run(self._shutdown())
            self._runtime = None
        self.address = None
        self.core.cancel_all()

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self._conn_handler = None  # UCX no longer calls it: the listener is gone
        for ep in list(self._endpoints):
            ep.close()  # pending receives end with an error: handlers free their data
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=CLOSE_WAIT_S)

    async def _core(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._core_loop is not None
        return await _call_on(self._core_loop, fn, *args)

    async def _serve(self, ucxx_ep: Any) -> None:
        """One connection: transfers one after another until the sender hangs up."""
        task = asyncio.current_task()
        assert task is not None and self._runtime is not None
        ep = _Endpoint(ucxx_ep, self._runtime.progress)
        self._handlers.add(task)
        self._endpoints.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        except Exception as exc:  # a broken connection ends only itself
            logger.warning("UCX connection broke (a transfer on it failed): %r", exc)
        finally:
            self._endpoints.discard(ep)
            self._handlers.discard(task)
            ep.close()

    async def _serve_one(self, ep: _Endpoint) -> bool:
        """One transfer; False when the connection should end."""
        try:
            raw = await _recv_control(ep)
        except Exception as exc:  # the sender hung up between transfers, or is out of step
            logger.debug("UCX connection ends: %r", exc)
            return False
        try:
            try:
                header = TransferHeader.from_proto(pb.TransferHeader.FromString(raw))
            except DecodeError as exc:
                raise BadHeaderError(f"undecodable header: {exc}") from exc
        except TransferError as exc:  # nothing says how much payload follows: hang up
            await _send_control(ep, ack_for(exc).SerializeToString())
            return False
        try:
            self.core.check(header)  # token, layout, size: no request state needed
        except TransferError as exc:
            await _send_control(ep, ack_for(exc).SerializeToString())
            return await self._drain(ep, header)
        # The payload is already on its way: post its receives before anything else (UCX
        # holds what arrives unmatched, and copies it out later), then ask the core
        # whether it wants it. A refused payload still lands, and goes back to the pool.
        buffer = self.core.pool.take(header.payload_bytes)
        hasher = BlockHasher(header.layout, header.num_blocks)
        chunks = row_chunks(header.layout, header.num_blocks) if buffer.size else []
        rows = buffer.reshape(hasher.num_rows, -1)
        recvs = [ep.recv(rows[a:b].reshape(-1)) for a, b in chunks]
        request_id = header.request_id
        try:
            await self._core(self.core.begin, header, buffer)
        except TransferError as exc:
            await _send_control(ep, ack_for(exc).SerializeToString())
            return await self._drop(ep, header, recvs, buffer)
        except BaseException:  # the core's loop is gone: so is the receiver
            await self._abandon(ep, recvs)
            raise
        try:
            async with asyncio.timeout(self._lease_s(header)):
                for (_, end), recv in zip(chunks, recvs, strict=True):
                    await recv
                    hasher.update(buffer, end)  # this chunk, while the next one arrives
        except BaseException as exc:
            why = "no whole payload within the lease" if isinstance(exc, TimeoutError) else exc
            error = TruncatedError(f"stream of {request_id!r} broke: {why!r}")
            clean = await self._abandon(ep, recvs)
            try:
                await self._core(self.core.fail, header, error, clean)
            except Exception as fail_exc:  # core's loop gone: it freed everything
                logger.debug("UCX: receiver gone while failing %r: %r", request_id, fail_exc)
            raise
        try:
            await self._core(self.core.finish, header, int(buffer.size), hasher.checksums())
            ack = ack_for(None, int(buffer.size))
        except TransferError as exc:
            ack = ack_for(exc, int(buffer.size))
        await _send_control(ep, ack.SerializeToString())
        return True

    @staticmethod
    async def _abandon(ep: _Endpoint, recvs: list[asyncio.Future[None]]) -> bool:
        """Close `ep`, ending its posted receives; True if UCX let go of their buffer in
        time (it may then be reused)."""
        for recv in recvs:
            recv.add_done_callback(_retrieve)
        return await ep.abort()

    async def _drain(self, ep: _Endpoint, header: TransferHeader) -> bool:
        """Receive and drop the payload of a header refused before any receive was
        posted, chunk by chunk into one scratch buffer, so the endpoint stays in step;
        False (hang up) if it is more than this receiver would ever take, or does not
        arrive within the lease."""
        if header.payload_bytes > self.core.config.max_payload_bytes:
            return False
        chunks = row_chunks(header.layout, header.num_blocks) if header.payload_bytes else []
        row_bytes = header.payload_bytes // (2 * header.layout.num_layers)
        scratch = np.empty(max(((b - a) * row_bytes for a, b in chunks), default=0), np.uint8)
        try:
            async with asyncio.timeout(self._lease_s(header)):
                for a, b in chunks:  # UCX holds what arrives before its receive is posted
                    await ep.recv(scratch[: (b - a) * row_bytes])
        except Exception as exc:
            logger.warning("UCX: refused payload of %r did not arrive: %r", header.request_id, exc)
            await ep.abort()
            return False
        return True

    async def _drop(
        self,
        ep: _Endpoint,
        header: TransferHeader,
        recvs: list[asyncio.Future[None]],
        buffer: np.ndarray,
    ) -> bool:
        """Let the receives already posted into `buffer` (a pool buffer) for a refused
        payload complete, then give the buffer back; False (hang up) if they do not
        within the lease."""
        try:
            async with asyncio.timeout(self._lease_s(header)):
                for recv in recvs:
                    await recv
        except Exception as exc:
            logger.warning("UCX: refused payload of %r did not arrive: %r", header.request_id, exc)
            if await self._abandon(ep, recvs):
                self.core.pool.give(buffer)
            return False
        self.core.pool.give(buffer)
        return True

    def _lease_s(self, header: TransferHeader) -> float:
        return min(header.lease_ms / 1000, self.core.config.max_lease_s)


class UcxSender(KVSender):
    def __init__(self) -> None:
        self._runtime: _UcxRuntime | None = None
        self._idle: dict[str, list[_Endpoint]] = {}  # address -> idle (UCX loop only)
        self._busy: set[_Endpoint] = set()
        self._closed = False

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> TransferStats:
        data = as_bytes(payload)
        if data.size != header.payload_bytes:
            raise TruncatedError(
                f"payload has {data.size} bytes, header says {header.payload_bytes}"
            )
        if self._runtime is None:
            self._runtime = _UcxRuntime.get()
        deadline = time.monotonic() + timeout_s
        future = self._runtime.submit(self._send(address, header, data, deadline))
        try:
            # the UCX side keeps the deadline itself (and closes the endpoint in time);
            # this bound only guards against a stuck UCX loop
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + 0.25)
        except TimeoutError:
            raise TransferTimeoutError(f"push to {address} took over {timeout_s}s") from None

    async def _send(
        self, address: str, header: TransferHeader, data: np.ndarray, deadline: float
    ) -> TransferStats:
        start = time.monotonic()
        ep: _Endpoint | None = None
        try:
            async with asyncio.timeout(max(0.0, deadline - start)):
                ep = await self._take(address, deadline)
                acked = asyncio.ensure_future(_recv_control(ep))  # posted before any send
                acked.add_done_callback(_retrieve)
                messages = _frames(header.to_proto().SerializeToString())
                if data.size:
                    rows = data.reshape(2 * header.layout.num_layers, -1)
                    chunks = row_chunks(header.layout, header.num_blocks)
                    messages += [rows[a:b].reshape(-1) for a, b in chunks]
                # in order: the header, then the payload right behind it
                sends = [ep.send(m) for m in messages]
                for sent in sends:
                    sent.add_done_callback(_retrieve)
                error = error_from_ack(pb.TransferAck.FromString(await acked))
                try:
                    for sent in sends:
                        await sent
                except Exception:
                    if error is None:
                        raise
                    # refused, and the receiver hung up rather than take the payload
                    await self._discard(ep)
                    ep = None
        except TimeoutError:
            await self._discard(ep)
            raise TransferTimeoutError(
                f"push to {address} took over {deadline - start:.3g}s"
            ) from None
        except TransferError:
            await self._discard(ep)
            raise
        except BaseException as exc:
            await self._discard(ep)
            if isinstance(exc, Exception):
                raise PeerUnavailableError(f"UCX peer {address} failed: {exc!r}") from exc
            raise
        if ep is not None:
            self._release(address, ep)
        if error is not None:
            raise error
        return TransferStats(
            header.request_id, int(data.size), header.num_blocks, time.monotonic() - start
        )

    async def _take(self, address: str, deadline: float) -> _Endpoint:
        idle = self._idle.get(address, [])
        while idle:
            ep = idle.pop()
            if not ep.closed:
                self._busy.add(ep)
                return ep
            ep.close()
        if self._closed:
            raise PeerUnavailableError("sender is closed")
        assert self._runtime is not None
        host, port = _split_address(address)
        connect_s = max(0.1, deadline - time.monotonic())
        try:
            ucxx_ep = await self._runtime.ucxx.create_endpoint(
                host, port, connect_timeout=connect_s
            )
        except TimeoutError as exc:  # ucxx's peer-info exchange timed out: nobody there
            raise PeerUnavailableError(f"no UCX receiver answers at {address}") from exc
        except Exception as exc:
            raise PeerUnavailableError(f"cannot connect to {address}: {exc!r}") from exc
        ep = _Endpoint(ucxx_ep, self._runtime.progress)
        self._busy.add(ep)
        return ep

    def _release(self, address: str, ep: _Endpoint) -> None:
        self._busy.discard(ep)
        idle = self._idle.setdefault(address, [])
        if self._closed or ep.closed or len(idle) >= MAX_IDLE_ENDPOINTS:
            ep.close()
        else:
            idle.append(ep)

    async def _discard(self, ep: _Endpoint | None) -> None:
        """Close an endpoint whose stream state is unknown, and wait (bounded) until UCX
        no longer reads the caller's payload."""
        if ep is not None:
            self._busy.discard(ep)
            await ep.abort()

    async def close(self) -> None:
        if self._runtime is not None and not self._closed:
            await self._runtime.run(self._close_all())
        self._closed = True

    async def _close_all(self) -> None:
        self._closed = True
        for ep in [ep for eps in self._idle.values() for ep in eps] + list(self._busy):
            ep.close()
        self._idle.clear()
        self._busy.clear()
