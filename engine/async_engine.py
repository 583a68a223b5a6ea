"""An `LLMEngine` driven by its own thread, with an asyncio front for the workers.

The model step is CPU/GPU-heavy and must never run on an event loop (STYLE.md, habit 8).
One engine thread owns the `LLMEngine`: between steps it applies queued commands (add,
abort, export, ...) and after each step hands every request's output to the event loop
that asked for it. Callers await results; nothing here blocks a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput

T = TypeVar("T")
_IDLE_WAIT_S = 1.0  # how often an idle engine thread re-checks for shutdown


class EngineClosedError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # -- the event-loop side ------------------------------------------------------

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
    ) -> AsyncIterator[RequestOutput]:
        """Register a stream, run `start(engine)` (which adds the request), yield outputs.

        `start` may return a first output itself (a prefilled request's first token);
        `on_started` then runs on the caller's loop (e.g. to release a KV buffer).
        Leaving the iteration early aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        finished = False

        def start_and_queue_first(engine: LLMEngine) -> None:
            first = start(engine)
            if first is not None:
                # Queued from the engine thread, so it precedes the next step's output
                # (both travel through call_soon_threadsafe, which keeps their order).
                loop.call_soon_threadsafe(queue.put_nowait, first)

        try:
            await self.call(start_and_queue_first)
            if on_started is not None:
                on_started()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(lambda: self.engine.abort([request_id]))

    @property
    def closed(self) -> bool:
        """The engine thread has stopped (closed, or a step raised)."""
        return self._closed

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

    def _run(self) -> None:
        try:
            while not self._closed:
                self._apply_commands()
                if self.engine.has_unfinished:
                    self._dispatch(self.engine.step())
                else:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
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

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, queue = target
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        for loop, queue in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, exc)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
