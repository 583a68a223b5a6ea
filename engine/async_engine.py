"""An `LLMEngine` driven by its own thread, with an asyncio front for the workers.

The model step is CPU/GPU-heavy and must never run on an event loop (STYLE.md, habit 8).
One engine thread owns the `LLMEngine`: between steps it applies queued commands (add,
abort, export, ...) and after each step hands every request's output to the event loop
that asked for it. Callers await results; nothing here blocks a loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

from pdserve.common.kv_events import KVEvent
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput, merge_outputs

T = TypeVar("T")
_IDLE_WAIT_S = 1.0  # how often an idle engine thread re-checks for shutdown


class EngineClosedError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine | Callable[[], LLMEngine], hold_above_streams: int | None = None
    ) -> None:
        """`engine`: the engine, or a function that builds it. A serving process passes
        the function: the engine is then built on the engine thread itself, and that
        thread is the only one in the process that ever runs torch's OpenMP work.

        Why it matters (libgomp, torch's OpenMP runtime on Linux): each thread that
        starts a parallel region keeps a team of worker threads of its own, and once a
        process holds more OpenMP threads than CPUs, every team waits with a 100-spin
        throttle instead of spinning (pdserve's `GOMP_SPINCOUNT`): the engine's workers
        then sleep and are woken through the kernel between every two of a step's ~100
        parallel regions. An engine built on one thread and stepped on another made two
        teams: the mid model's decode step at batch 5 took 17.3 ms instead of 13.5, with
        ~90 sleeps a step (docs/measurements.md, "One OpenMP team per process").

        `hold_above_streams`: while more coalescing streams than this are open, each of
        their outputs after the first waits for the request's next step and goes merged
        with it (None: never; see `_dispatch`)."""
        make = engine if callable(engine) and not isinstance(engine, LLMEngine) else None
        self.engine: LLMEngine  # set here, or by the engine thread before __init__ returns
        if make is None:
            self.engine = cast(LLMEngine, engine)  # an LLMEngine (or a test's fake)
        self.hold_above_streams = hold_above_streams
        self._coalescing: set[str] = set()  # streams opened with coalesce=True
        # request id -> its output held back one step (engine thread only)
        self._held: dict[str, RequestOutput] = {}
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        # KV events, moved here by the engine thread after every command batch and step,
        # before that step's outputs go out: once a caller has seen an output, the
        # events it caused can be drained without waiting for the engine thread
        self._events: collections.deque[KVEvent] = collections.deque()
        self._on_finish: dict[str, Callable[[LLMEngine], Any]] = {}  # engine thread reads
        self._finish_results: dict[str, Any] = {}
        self._ids = itertools.count()
        self._step_started: float | None = None  # monotonic; set by the engine thread
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(make,), name="pdserve-engine", daemon=True
        )
        self._thread.start()
        if make is not None:
            # as long as building takes (a large checkpoint loads for minutes), while the
            # thread lives: it sets the event however the build ends
            while not self._built.wait(_IDLE_WAIT_S):
                if not self._thread.is_alive():
                    raise EngineClosedError("the engine thread died while building the engine")
            if self._build_error is not None:
                raise self._build_error

    # -- the event-loop side ------------------------------------------------------

    def step_running_s(self) -> float:
        """Seconds the engine thread has been in its current step (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps; return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, raised there
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._post(command)
        return await future

    async def stream(
        self,
        request_id: str,
        start: Callable[[LLMEngine], RequestOutput | None],
        on_started: Callable[[], None] | None = None,
        on_finish: Callable[[LLMEngine], Any] | None = None,
        coalesce: bool = False,
        choices: Sequence[str] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Register a stream, run `start(engine)` (which adds the request), yield outputs.

        `start` may return a first output itself (a prefilled request's first token);
        `on_started` then runs on the caller's loop (e.g. to release a KV buffer).
        `on_finish(engine)` runs on the engine thread right after the step that finished
        the request, before any other step (a prefill exports its KV there rather than
        waiting for a step boundary); `take_finish_result` returns what it returned.
        Leaving the iteration early aborts the request and frees its blocks.

        `coalesce`: when the caller falls behind (several outputs of the request already
        queued when it asks for the next), they come as one merged output. Nothing is
        ever held back waiting for a later one: an output alone in the queue goes at once.

        `choices`: parallel sampling's other requests (forked by `start`): their outputs
        come on this stream too (each output names its request), which ends when all
        have finished; leaving early aborts those unfinished. Never coalesced.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        ids = [request_id, *choices]
        for rid in ids:
            self._streams[rid] = (loop, queue)
        coalesce = coalesce and not choices
        unfinished = set(ids)
        if coalesce:
            self._coalescing.add(request_id)
        if on_finish is not None:
            self._on_finish[request_id] = on_finish
        finished = False

        def start_and_queue_first(engine: LLMEngine) -> None:
            first = start(engine)
            if first is not None and first.finished:
                self._run_on_finish(first.request_id)
            if first is not None:
                # Queued from the engine thread, so it precedes the next step's output
                # (both travel through call_soon_threadsafe, which keeps their order).
                loop.call_soon_threadsafe(queue.put_nowait, first)

        try:
            await self.call(start_and_queue_first)
            if on_started is not None:
                on_started()
            pending: Any = None  # an error found while coalescing, raised next
            while not finished:
                item = await queue.get() if pending is None else pending
                pending = None
                if isinstance(item, BaseException):
                    raise item
                while coalesce and not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    item = merge_outputs(item, later)
                if item.finished:
                    unfinished.discard(item.request_id)
                finished = not unfinished
                yield item
        finally:
            for rid in ids:
                self._streams.pop(rid, None)
            self._coalescing.discard(request_id)
            self._on_finish.pop(request_id, None)
            if not finished:
                self._finish_results.pop(request_id, None)
                left = sorted(unfinished)
                self._post(lambda: self.engine.abort(left))

    def take_finish_result(self, request_id: str) -> Any:
        """What the stream's `on_finish` returned (or raised: raised here), once."""
        result = self._finish_results.pop(request_id)
        if isinstance(result, BaseException):
            raise result
        return result

    def submit(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run `fn(engine)` on the engine thread between two steps, without waiting."""
        self._post(lambda: fn(self.engine))

    @property
    def closed(self) -> bool:
        """The engine thread has stopped (closed, or a step raised)."""
        return self._closed

    def drain_kv_events(self) -> list[KVEvent]:
        """The block pool's events so far, in order (any thread; never waits a step)."""
        events: list[KVEvent] = []
        with contextlib.suppress(IndexError):
            while True:
                events.append(self._events.popleft())
        return events

    async def kv_snapshot(self) -> list[KVEvent]:
        """Every cached block as STORED events; pending events are dropped (between steps)."""

        def snapshot(engine: LLMEngine) -> list[KVEvent]:
            self._events.clear()
            return engine.kv_snapshot()

        return await self.call(snapshot)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def close(self) -> None:
        """Stop the engine thread; open streams end with EngineClosedError."""
        self._closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)

    # -- the engine thread ----------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    def _run(self, make: Callable[[], LLMEngine] | None) -> None:
        if make is not None:
            try:
                self.engine = make()
            except BaseException as exc:  # raised by __init__, in the caller's thread
                self._build_error = exc
                self._closed = True
                return
            finally:
                self._built.set()
        try:
            while not self._closed:
                self._apply_commands()
                self._events.extend(self.engine.drain_kv_events())
                if self.engine.has_unfinished:
                    self._step_started = time.monotonic()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self._step_started = None
                    self._events.extend(self.engine.drain_kv_events())
                    self._dispatch(outputs)
                elif self._held:  # their requests ended without a step (aborted)
                    self._dispatch([])
                else:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
            # a clean stop, between steps: what the pool caches goes to a disk tier (never
            # after a broken step, whose blocks may be registered but not computed)
            self.engine.flush_kv_tiers()
        except Exception as exc:  # a broken step must reach every waiting client
            self._fail_all(exc)
            raise
        finally:
            self._closed = True
            self._fail_all(EngineClosedError("the engine stopped"))

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            command()

    def _run_on_finish(self, request_id: str) -> None:
        hook = self._on_finish.pop(request_id, None)
        if hook is not None:
            try:
                self._finish_results[request_id] = hook(self.engine)
            except Exception as exc:  # handed to the caller by take_finish_result
                self._finish_results[request_id] = exc

    def _hold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to deliver now; under load some wait one step (`_held`).

        With more than `hold_above_streams` coalescing streams open, a stream's output that
        is neither its first nor its last waits for the request's next step and then goes
        merged with that one: one message per two tokens through the decode replica's
        stream, the router and the proxy. Never longer than one step: an output held in
        the previous step goes now, whether or not its request produced another.
        """
        held, self._held = self._held, {}
        hold = (
            self.hold_above_streams is not None and len(self._coalescing) > self.hold_above_streams
        )
        deliver = []
        for out in outputs:
            earlier = held.pop(out.request_id, None)
            if earlier is not None:
                deliver.append(merge_outputs(earlier, out))
            elif (
                hold
                and not out.finished
                and out.request_id in self._coalescing
                and len(out.token_ids) > len(out.new_token_ids)  # not the first
            ):
                self._held[out.request_id] = out
            else:
                deliver.append(out)
        deliver.extend(held.values())  # held last step, nothing new since: go now
        return deliver

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each caller's loop per step, not one per output (a step of 64
        # streams made 64 self-pipe writes and 64 loop callbacks).
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for out in self._hold(outputs):
            if out.finished:
                self._run_on_finish(out.request_id)
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, queue = target
                batches.setdefault(loop, []).append((queue, out))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        for loop, queue in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, exc)


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
