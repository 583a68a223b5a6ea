"""UCX transport (the `ucxx` package): header, go/no-go ack, raw payload, final ack.

Wire protocol on one UCX endpoint (tag-matched messages, in order), per transfer:

    sender -> receiver   u64 length, then a serialized `TransferHeader`
    receiver -> sender   u64 length, then a `TransferAck`: OK ("go") or the typed refusal
    sender -> receiver   the payload, `payload_bytes` raw bytes in chunks of whole rows
                         (zero-copy: straight from the caller's buffer into the
                         receiver's buffer)
    receiver -> sender   u64 length, then the final `TransferAck` (verified or not)

A refused header is answered at once and no payload follows, so the endpoint stays in step
and can carry the next transfer. A sender keeps a small pool of idle endpoints per
address; a transfer takes one (or connects), so concurrent sends run in parallel, each on
its own endpoint. An endpoint whose transfer failed or timed out is closed, never reused.

Event loops. `ucxx` binds its context (and its request-notifier thread) to one asyncio
loop. This module runs all UCX work on one private loop in a daemon thread, created on
first use and kept for the life of the process, and bridges callers' loops to it; the
receiver's `ReceiverCore` stays on the loop that called `start`. So any number of loops
(one per `asyncio.run`, as in tests) can use UCX one after another or at once.

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
- UCX_RNDV_THRESH=inf: the eager protocol for every size. The receiver posts each
  chunk's receive before it sends "go", so eager data lands in place; rendezvous over
  TCP costs a round trip per fragment and measured at half the throughput for 16 MiB.
- UCXPY_PROGRESS_MODE=thread, UCXPY_ENABLE_PYTHON_FUTURE=1 and
  UCXPY_ENABLE_DELAYED_SUBMISSION=0 (passed to `ucxx.init`, overridable through those
  variables): a progress thread plus a notifier thread wake the loop when a request
  completes, and requests are posted at once rather than handed to the progress thread.
  NOTE: `blocking` mode halves a small message's round trip (40 us against ~350 us)
  and took 16 MiB from 0.5x to 0.85x of raw TCP, but ucxx 0.52 then polls: the UCX
  loop spun a whole core while idle, and in a decode worker that starved the engine
  thread (p99 TPOT 125 ms against 44 ms in thread mode on the `mixed` bench).

Pipelining. The payload goes as up to 16 chunks of whole rows (`row_chunks`); the
receiver hashes each chunk (`BlockHasher`, on a small thread pool: xxhash releases the
GIL) while the next one arrives, so verification costs one chunk's hash after the last
byte instead of the whole payload's.

NOTE: `ucxx`'s Python listener cannot choose its bind address (the C++ builder can, the
binding does not expose it): it listens on every interface, whatever
`ReceiverConfig.host` says. `host` is only the address `start` advertises. Every
transfer still needs the cluster token before a byte of payload is accepted; keep the
port firewalled to the cluster.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
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
from pdserve.protos import kv_transfer_pb2 as pb

T = TypeVar("T")

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
MAX_IDLE_ENDPOINTS = 4  # per address, kept by a sender for reuse
CLOSE_WAIT_S = 2.0  # how long close() waits for connection handlers to wind down


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
        self.ucxx.init(
            progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
            enable_python_future=os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0",
            enable_delayed_submission=os.environ.get("UCXPY_ENABLE_DELAYED_SUBMISSION") == "1",
        )

        # receivers hash arriving chunks here, off the UCX loop (xxhash drops the GIL)
        self.hash_pool = concurrent.futures.ThreadPoolExecutor(2, "pdserve-kv-hash")

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):  # best effort at exit
            self.ucxx.stop_notifier_thread()
        self.hash_pool.shutdown(wait=False, cancel_futures=True)

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


async def _send_msg(ep: Any, data: bytes) -> None:
    await ep.send(np.array([len(data)], dtype=np.uint64))
    if data:  # an all-default protobuf (an OK ack) serializes to nothing
        await ep.send(np.frombuffer(data, dtype=np.uint8))


async def _recv_msg(ep: Any) -> bytes:
    size = np.empty(1, dtype=np.uint64)
    await ep.recv(size)
    num_bytes = int(size[0])
    if num_bytes > MAX_MESSAGE_BYTES:
        raise BadHeaderError(f"message of {num_bytes} bytes > {MAX_MESSAGE_BYTES}")
    data = np.empty(num_bytes, dtype=np.uint8)
    if num_bytes:
        await ep.recv(data)
    return data.tobytes()


def _close_ep(ep: Any) -> None:
    with contextlib.suppress(Exception):  # already broken: nothing more to free
        ep.abort()


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
        self._endpoints: set[Any] = set()  # touched on the UCX loop only
        self._handlers: set[asyncio.Task[None]] = set()
        self.address: str | None = None

    async def start(self) -> str:
        self._core_loop = asyncio.get_running_loop()
        self._runtime = _UcxRuntime.get()
        port = await self._runtime.run(self._listen())
        self.address = f"{self.core.config.host}:{port}"
        return self.address

    async def _listen(self) -> int:
        assert self._runtime is not None
        self._listener = self._runtime.ucxx.create_listener(self._serve, port=self.core.config.port)
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
        for ep in list(self._endpoints):
            _close_ep(ep)  # pending receives end with an error: handlers free their data
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=CLOSE_WAIT_S)

    async def _core(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._core_loop is not None
        return await _call_on(self._core_loop, fn, *args)

    async def _serve(self, ep: Any) -> None:
        """One connection: transfers one after another until the sender hangs up."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._endpoints.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        except Exception:  # a broken connection ends only itself
            pass
        finally:
            self._endpoints.discard(ep)
            self._handlers.discard(task)
            _close_ep(ep)

    async def _serve_one(self, ep: Any) -> bool:
        try:
            raw = await _recv_msg(ep)
        except BadHeaderError:
            return False  # out of step: hang up
        except Exception:  # the sender hung up between transfers
            return False
        try:
            try:
                msg = pb.TransferHeader.FromString(raw)
            except DecodeError as exc:
                raise BadHeaderError(f"undecodable header: {exc}") from exc
            header = TransferHeader.from_proto(msg)
            buffer: np.ndarray = await self._core(self.core.begin, header)
        except TransferError as exc:
            await _send_msg(ep, ack_for(exc).SerializeToString())
            return True
        request_id = header.request_id
        hasher = BlockHasher(header.layout, header.num_blocks)
        chunks = row_chunks(header.layout, header.num_blocks) if buffer.size else []
        rows = buffer.reshape(hasher.num_rows, -1)
        # every chunk's receive is posted before the go: the eager protocol then lands
        # each chunk straight in place (an unexpected one is staged and copied)
        recvs = [asyncio.ensure_future(ep.recv(rows[a:b].reshape(-1))) for a, b in chunks]
        await asyncio.sleep(0)  # let each receive post itself
        try:
            await _send_msg(ep, ack_for(None).SerializeToString())  # go
            for (_, end), recv in zip(chunks, recvs, strict=True):
                await recv
                # hash this chunk while the next one arrives
                await self._loop().run_in_executor(self._hash_pool, hasher.update, buffer, end)
        except BaseException as exc:
            error = TruncatedError(f"stream of {request_id!r} broke: {exc!r}")
            _close_ep(ep)  # ends the posted receives
            _, pending = await asyncio.wait(recvs, timeout=CLOSE_WAIT_S) if recvs else ((), ())
            with contextlib.suppress(Exception):  # core's loop gone: it freed everything
                await self._core(self.core.fail, request_id, error, not pending)
            raise
        try:
            await self._core(self.core.finish, request_id, int(buffer.size), hasher.checksums())
            ack = ack_for(None, int(buffer.size))
        except TransferError as exc:
            ack = ack_for(exc, int(buffer.size))
        await _send_msg(ep, ack.SerializeToString())
        return True

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    @property
    def _hash_pool(self) -> concurrent.futures.Executor:
        assert self._runtime is not None
        return self._runtime.hash_pool


class UcxSender(KVSender):
    def __init__(self) -> None:
        self._runtime: _UcxRuntime | None = None
        self._idle: dict[str, list[Any]] = {}  # address -> idle endpoints (UCX loop only)
        self._busy: set[Any] = set()
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
        ep: Any = None
        try:
            async with asyncio.timeout(max(0.0, deadline - start)):
                ep = await self._take(address, deadline)
                await _send_msg(ep, header.to_proto().SerializeToString())
                go = pb.TransferAck.FromString(await _recv_msg(ep))
                error = error_from_ack(go)
                if error is None:
                    if data.size:  # the receiver's chunks, posted at once, sent in order
                        rows = data.reshape(2 * header.layout.num_layers, -1)
                        chunks = row_chunks(header.layout, header.num_blocks)
                        await asyncio.gather(*(ep.send(rows[a:b].reshape(-1)) for a, b in chunks))
                    error = error_from_ack(pb.TransferAck.FromString(await _recv_msg(ep)))
        except TimeoutError:
            self._discard(ep)
            raise TransferTimeoutError(
                f"push to {address} took over {deadline - start:.3g}s"
            ) from None
        except TransferError:
            self._discard(ep)
            raise
        except BaseException as exc:
            self._discard(ep)
            if isinstance(exc, Exception):
                raise PeerUnavailableError(f"UCX peer {address} failed: {exc!r}") from exc
            raise
        self._release(address, ep)
        if error is not None:
            raise error
        return TransferStats(
            header.request_id, int(data.size), header.num_blocks, time.monotonic() - start
        )

    async def _take(self, address: str, deadline: float) -> Any:
        idle = self._idle.get(address, [])
        while idle:
            ep = idle.pop()
            if not ep.closed:
                self._busy.add(ep)
                return ep
            _close_ep(ep)
        if self._closed:
            raise PeerUnavailableError("sender is closed")
        assert self._runtime is not None
        host, port = _split_address(address)
        connect_s = max(0.1, deadline - time.monotonic())
        try:
            ep = await self._runtime.ucxx.create_endpoint(host, port, connect_timeout=connect_s)
        except TimeoutError as exc:  # ucxx's peer-info exchange timed out: nobody there
            raise PeerUnavailableError(f"no UCX receiver answers at {address}") from exc
        except Exception as exc:
            raise PeerUnavailableError(f"cannot connect to {address}: {exc!r}") from exc
        self._busy.add(ep)
        return ep

    def _release(self, address: str, ep: Any) -> None:
        self._busy.discard(ep)
        idle = self._idle.setdefault(address, [])
        if self._closed or ep.closed or len(idle) >= MAX_IDLE_ENDPOINTS:
            _close_ep(ep)
        else:
            idle.append(ep)

    def _discard(self, ep: Any) -> None:
        if ep is not None:
            self._busy.discard(ep)
            _close_ep(ep)  # its stream state is unknown

    async def close(self) -> None:
        if self._runtime is not None and not self._closed:
            await self._runtime.run(self._close_all())
        self._closed = True

    async def _close_all(self) -> None:
        self._closed = True
        for ep in [ep for eps in self._idle.values() for ep in eps] + list(self._busy):
            _close_ep(ep)
        self._idle.clear()
        self._busy.clear()
