"""In-process stand-ins for the router's collaborators: no Ray, no Redis.

- `FakeDecode`: a decode replica's channel calls (`channel`, `submit`, `abort`,
  `cancel_kv`; `push_prefix` as a peer fetch's holder), built on the real
  `decode_worker.channels.Channels`; the test plays the engine (`emit`, or items
  scripted per request before it is submitted).
- `FakeHandle`: a decode deployment handle over such replicas, as Ray Serve routes calls:
  to the target replica, or spread over the replicas without one.
- `FakePrefill`: a prefill deployment handle whose `prefill` call records its arguments
  and returns a report shaped as the prefill worker's (prefill_worker/deployment.py); it
  can hold the call until released, or fail it.
- `FakeIndex`: the prefix index as `RouterCore` reads it (`match`, `live_workers`), with
  real `WorkerInfo`/`MatchResult` objects whose load and matched blocks each test sets.

`log`: a list the fakes share, in which each call appends `(what, worker_id, request_id)`,
so that a test sees the order of the calls across the pools.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.decode_worker.channels import Batch, Channels

TIMEOUT_S = 10.0

Log = list[tuple[str, str, str]]


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (the suite has no async plugin);
    its arguments (parameters, fixtures) are passed on."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


async def eventually(
    what: str, condition: Callable[[], bool], timeout_s: float = TIMEOUT_S
) -> None:
    """Wait (yielding to the loop) until `condition()` holds; fail after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"never happened within {timeout_s:g}s: {what}") from None


class FakeDecode:
    """A decode replica's channel calls; `emit` plays an engine step.

    `script[request_id]`: items put on the request's stream as soon as it is submitted
    (the rest, if any, come from `emit`). `takes_kv`: whether it expects KV when asked.
    `broken`: set, every channel to this replica breaks (the replica died).
    """

    def __init__(
        self,
        worker_id: str = "d0",
        idle_s: float = 60.0,
        address: str | None = None,
        takes_kv: bool = True,
        log: Log | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.idle_s = idle_s
        self.address = address or f"{worker_id}.kv:7000"
        self.takes_kv = takes_kv
        self.log = log if log is not None else []
        self.channels = Channels()
        self.batches_sent: list[Batch] = []
        self.submitted: list[str] = []
        self.submits: dict[str, dict[str, Any]] = {}  # request id -> the call's arguments
        self.aborted: list[str] = []
        self.kv_cancelled: list[tuple[str, str]] = []  # (request id, reason)
        self.pushes: list[dict[str, Any]] = []  # push_prefix calls (as a fetch's holder)
        self.push_error: BaseException | None = None  # each push_prefix raises it
        self.running: dict[str, asyncio.Queue[Any]] = {}
        self.script: dict[str, list[dict[str, Any]]] = {}
        self.broken = asyncio.Event()

    async def channel(
        self, channel_id: str, target_replica: str | None = None
    ) -> AsyncIterator[Batch]:
        hello: Any = {"type": "channel", "worker_id": self.worker_id}
        async for batch in self.channels.serve(channel_id, hello, self.idle_s):
            if batch[0][0]:  # not the hello
                self.batches_sent.append(batch)
            yield batch

    async def submit(
        self,
        channel_id: str,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        params: Any = None,
        *,
        kv_expected: bool = False,
        kv_wait_s: float | None = None,
        worker_id: str | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        channel = self.channels.get(channel_id)
        if channel is None or (worker_id is not None and worker_id != self.worker_id):
            return {"type": "no_channel", "worker_id": self.worker_id}
        self.log.append(("submit", self.worker_id, request_id))
        self.submitted.append(request_id)
        kv_expected = kv_expected and self.takes_kv
        self.submits[request_id] = {
            "prompt_token_ids": prompt_token_ids,
            "params": params,
            "kv_expected": kv_expected,
            "kv_wait_s": kv_wait_s,
            **kw,
        }
        items: asyncio.Queue[Any] = asyncio.Queue()
        for item in self.script.pop(request_id, []):
            items.put_nowait(item)
        self.running[request_id] = items

        async def run() -> None:
            try:
                while True:
                    item = await items.get()
                    channel.put(request_id, item)
                    if item.get("finished") or item.get("type") == "error":
                        return
            finally:
                channel.tasks.pop(request_id, None)
                self.running.pop(request_id, None)

        channel.tasks[request_id] = asyncio.create_task(run())
        accepted = {
            "type": "accepted",
            "worker_id": self.worker_id,
            "kv_expected": kv_expected,
            "address": self.address,
        }
        if kw.get("fetch_blocks"):
            accepted["fetch_expected"] = True
        return accepted

    async def push_prefix(
        self,
        fetch: str,
        prompt_token_ids: list[int],
        num_blocks: int,
        first_block: int,
        address: str,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> dict[str, Any]:
        """As the decode worker's, a fetch's holder: push the prefix to `address`."""
        self.log.append(("push_prefix", self.worker_id, fetch))
        self.pushes.append(
            {"fetch": fetch, "num_blocks": num_blocks, "first_block": first_block, "to": address}
        )
        if self.push_error is not None:
            raise self.push_error
        blocks = num_blocks - first_block
        return {
            "worker_id": self.worker_id,
            "num_blocks": blocks,
            "num_bytes": 4096 * blocks,
            "seconds": 0.001 * blocks,
        }

    async def abort(self, channel_id: str, request_id: str, **kw: Any) -> bool:
        self.log.append(("abort", self.worker_id, request_id))
        self.aborted.append(request_id)
        channel = self.channels.get(channel_id)
        task = channel.tasks.get(request_id) if channel is not None else None
        if task is not None:
            task.cancel()
        return task is not None

    async def cancel_kv(self, request_id: str, reason: str = "prefill_failed") -> str:
        """As the decode worker's: stop waiting for the KV; returns this replica's id."""
        self.log.append(("cancel_kv", self.worker_id, request_id))
        self.kv_cancelled.append((request_id, reason))
        return self.worker_id

    def emit(self, request_id: str, token: int, finished: bool = False, **extra: Any) -> None:
        self.running[request_id].put_nowait(output(token, finished, **extra))


def output(token: int, finished: bool = False, **extra: Any) -> dict[str, Any]:
    """One output item of a decode worker (`extra`: e.g. the first item's kv_used)."""
    return {
        "type": "output",
        "token_ids": [token],
        "text": "",
        "finished": finished,
        "finish_reason": "length" if finished else None,
        "num_output_tokens": 1,
        **extra,
    }


class FakeStream:
    """A Serve streaming response over an async generator run in this loop; it breaks
    (ConnectionError, as a dead replica's) once any of the `broken` events is set."""

    def __init__(self, agen: AsyncIterator[Any], *broken: asyncio.Event) -> None:
        self._agen = agen
        self._broken = broken
        self._pending: asyncio.Future[Any] | None = None
        self._closing: asyncio.Future[Any] | None = None

    async def __anext__(self) -> Any:
        nxt = self._pending = asyncio.ensure_future(self._agen.__anext__())
        broke = {asyncio.ensure_future(b.wait()) for b in self._broken}
        done, _ = await asyncio.wait({nxt, *broke}, return_when=asyncio.FIRST_COMPLETED)
        for b in broke:
            b.cancel()
        if nxt in done:
            return nxt.result()
        nxt.cancel()
        raise ConnectionError("the replica died")

    def cancel(self) -> None:
        """As Serve cancels the replica's call: the generator stops where it waits."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        else:
            self._closing = asyncio.ensure_future(self._agen.aclose())  # type: ignore[attr-defined]


class FakeCall:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self._handle, self._name = handle, name

    def remote(self, *args: Any, target_replica: str | None = None, **kw: Any) -> Any:
        handle = self._handle
        replica = handle.route(target_replica)
        fn = getattr(replica, self._name)
        if self._name == "channel":
            handle.opened += 1
            stream = fn(*args, target_replica=target_replica, **kw)
            return FakeStream(stream, handle.broken, replica.broken)
        return asyncio.ensure_future(fn(*args, **kw))


class FakeHandle:
    """A decode deployment handle: a call goes to its target replica if that one lives."""

    def __init__(self, *replicas: FakeDecode) -> None:
        self.replicas = {r.worker_id: r for r in replicas}
        self.broken = asyncio.Event()
        self.opened = 0
        self.spread = 0

    def route(self, target: str | None) -> FakeDecode:
        if target in self.replicas:
            return self.replicas[target]
        self.spread += 1  # no target: Serve spreads calls over the replicas
        return list(self.replicas.values())[self.spread % len(self.replicas)]

    def options(self, stream: bool = False) -> FakeHandle:
        return self

    def __getattr__(self, name: str) -> FakeCall:
        return FakeCall(self, name)


class _PrefillMethod:
    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kw: Any) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self._fn(*args, **kw))


class FakePrefill:
    """A prefill deployment handle: `prefill.remote(...)` records the call and returns
    the worker's report (prefill_worker/deployment.py's keys).

    `hold`: when set to an event, each call waits for it (a prefill still running).
    `error`: when set, each call raises it (after the hold, if any).
    """

    def __init__(self, worker_id: str = "p0", log: Log | None = None) -> None:
        self.worker_id = worker_id
        self.log = log if log is not None else []
        self.calls: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.hold: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.blocks_sent = 5
        self.block_bytes = 4096
        self.pushes: list[dict[str, Any]] = []  # push_prefix calls (as a fetch's holder)
        self.address = f"{worker_id}.kv:7000"  # its receiver, for peer fetches
        self.fetches: dict[str, int] = {}  # expect_fetch calls: request id -> blocks
        self.fetch_cancels: list[tuple[str, str]] = []  # cancel_kv calls (id, reason)

    @property
    def prefill(self) -> _PrefillMethod:
        return _PrefillMethod(self._prefill)

    @property
    def expect_fetch(self) -> _PrefillMethod:
        return _PrefillMethod(self._expect_fetch)

    @property
    def cancel_kv(self) -> _PrefillMethod:
        return _PrefillMethod(self._cancel_kv)

    async def _expect_fetch(
        self, request_id: str, prompt_token_ids: list[int], num_blocks: int,
        wait_s: float | None = None, cache_salt: str | None = None, lora: str | None = None,
        target_replica: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        self.log.append(("expect_fetch", self.worker_id, request_id))
        self.fetches[request_id] = num_blocks
        return {"worker_id": self.worker_id, "address": self.address, "fetch_expected": True}

    async def _cancel_kv(
        self, request_id: str, reason: str = "", target_replica: str | None = None
    ) -> str:
        self.fetch_cancels.append((request_id, reason))
        return self.worker_id

    @property
    def push_prefix(self) -> _PrefillMethod:
        """As a peer fetch's holder: what it prefilled, pushed to a decode worker."""
        return _PrefillMethod(self._push_prefix)

    async def _push_prefix(
        self, fetch: str, prompt_token_ids: list[int], num_blocks: int, first_block: int,
        address: str, cache_salt: str | None = None, target_replica: str | None = None,
        lora: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        self.log.append(("push_prefix", self.worker_id, fetch))
        self.pushes.append({"fetch": fetch, "num_blocks": num_blocks, "to": address})
        blocks = num_blocks - first_block
        return {"worker_id": self.worker_id, "num_blocks": blocks, "num_bytes": 4096 * blocks,
                "seconds": 0.001 * blocks}  # fmt: skip

    async def _prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        decode_address: str,
        first_block: int = 0,
        target_replica: str | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        self.log.append(("prefill", self.worker_id, request_id))
        self.calls.append(
            {
                "request_id": request_id,
                "prompt_token_ids": prompt_token_ids,
                "params": params,
                "decode_address": decode_address,
                "first_block": first_block,
                "target_replica": target_replica,
                **kw,
            }
        )
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        if self.error is not None:
            raise self.error
        report = self.report(prompt_token_ids)
        if kw.get("fetch_blocks"):  # the fetch came (a test that spoils it says so)
            cancelled = [reason for r, reason in self.fetch_cancels if r == f"{request_id}#fetch"]
            if cancelled:
                report.update(fetch=cancelled[0], fetched_blocks=0)
            else:
                report.update(fetch="used", fetched_blocks=kw["fetch_blocks"])
                report["num_cached_tokens"] = kw["fetch_blocks"] * 16
        return report

    def report(self, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "first_token": 1,
            "num_prompt_tokens": len(prompt_token_ids),
            "num_cached_tokens": 0,
            "num_blocks_sent": self.blocks_sent,
            "transfer_bytes": self.blocks_sent * self.block_bytes,
            "transfer_s": 0.002,
            "queue_s": 0.001,
            "compute_s": 0.01,
            "pack_s": 0.001,
        }


class FakeIndex:
    """The prefix index as the router reads it: every live worker with its load (its
    heartbeat gauges) and how many leading blocks of any prompt it holds."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.matched: dict[str, int] = {}

    def add(
        self,
        worker_id: str,
        role: str,
        address: str | None = None,
        matched_blocks: int = 0,
        **load: int,
    ) -> None:
        address = address or f"{worker_id}.kv:7000"
        self.workers[worker_id] = WorkerInfo(worker_id, role, address, 1, dict(load))
        self.matched[worker_id] = matched_blocks

    async def match(
        self, block_hashes: Sequence[bytes], role: str | None = None
    ) -> dict[str, MatchResult]:
        return {
            w: MatchResult(info, min(self.matched[w], len(block_hashes)))
            for w, info in sorted(self.workers.items())
            if role is None or info.role == role
        }

    async def live_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return [m.worker for m in (await self.match([], role)).values()]
