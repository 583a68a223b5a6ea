"""AsyncEngine: outputs reach the caller in the order the engine produced them."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.outputs import RequestOutput


def output(request_id: str, token: int, finished: bool) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput(request_id, [1], [token], "", finished, reason, new_token_ids=[token])


class InstantEngine:
    """Steps take no time: the next output races the `start` call's own result."""

    def __init__(self) -> None:
        self.pending: dict[str, list[int]] = {}
        self.events: list[Any] = []  # stands in for the block pool's KV events
        self.num_steps = 0
        self.finished_at: dict[str, int] = {}
        self.step_s = 0.0  # modelled compute time of a step

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add(self, request_id: str, tokens: list[int]) -> RequestOutput:
        self.pending[request_id] = tokens[1:]
        return output(request_id, tokens[0], finished=False)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        self.num_steps += 1
        outs = []
        for request_id, tokens in list(self.pending.items()):
            token = tokens.pop(0)
            if not tokens:
                del self.pending[request_id]
                self.finished_at[request_id] = self.num_steps
            outs.append(output(request_id, token, finished=not tokens))
            self.events.append((request_id, token))
        return outs

    def drain_kv_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    def flush_kv_tiers(self) -> None:
        """No KV tiers here (AsyncEngine calls it at a clean stop)."""


def test_a_started_requests_first_output_comes_before_the_next_steps() -> None:
    async def run() -> list[list[int]]:
        engine: Any = InstantEngine()
        aengine = AsyncEngine(engine)
        try:
            got = []
            for i in range(50):
                rid, tokens = f"r{i}", [10, 11, 12, 13]
                stream = aengine.stream(rid, lambda e, r=rid, t=tokens: e.add(r, t))
                got.append([out.token_ids[0] async for out in stream])
            return got
        finally:
            await aengine.close()

    assert asyncio.run(run()) == [[10, 11, 12, 13]] * 50


def test_a_finished_outputs_events_are_drainable_without_waiting_for_a_step() -> None:
    # A worker publishes a request's KV events when its last output arrives; they must
    # already be there, without a round trip through the (maybe busy) engine thread.
    async def run() -> list[bool]:
        engine: Any = InstantEngine()
        aengine = AsyncEngine(engine)
        seen = []
        try:
            for i in range(50):
                rid, tokens = f"r{i}", [10, 11, 12, 13]
                async for out in aengine.stream(rid, lambda e, r=rid, t=tokens: e.add(r, t)):
                    if out.finished:
                        seen.append((rid, 13) in aengine.drain_kv_events())
            return seen
        finally:
            await aengine.close()

    assert asyncio.run(run()) == [True] * 50


def test_on_finish_runs_right_after_the_finishing_step_and_returns_its_result() -> None:
    # A prefill exports its KV in `on_finish`: between the step that finished it and
    # the next one, so the export never waits behind another request's step. Another
    # request keeps the engine stepping meanwhile, so a late hook would see more steps.
    async def run() -> tuple[list[bool], str]:
        engine: Any = InstantEngine()
        engine.step_s = 0.001
        aengine = AsyncEngine(engine)
        await aengine.call(lambda e: e.add("busy", list(range(100_000))))  # no stream
        got = []
        try:
            for i in range(20):
                rid = f"r{i}"
                stream = aengine.stream(
                    rid,
                    lambda e, r=rid: e.add(r, [10, 11, 12, 13]),
                    on_finish=lambda e: e.num_steps,
                )
                async for _ in stream:
                    pass
                got.append(aengine.take_finish_result(rid) == engine.finished_at[rid])

            def fail(e: Any) -> None:
                raise ValueError("export failed")

            async for _ in aengine.stream("bad", lambda e: e.add("bad", [1, 2]), on_finish=fail):
                pass
            try:
                aengine.take_finish_result("bad")
            except ValueError as exc:
                return got, str(exc)
            return got, "no error"
        finally:
            await aengine.call(lambda e: e.abort(["busy"]))
            await aengine.close()

    got, error = asyncio.run(run())
    assert got == [True] * 20
    assert error == "export failed"


def test_a_stream_that_falls_behind_gets_its_queued_outputs_as_one() -> None:
    """coalesce=True: outputs already queued come merged; nothing waits for a later one."""

    async def run(coalesce: bool) -> tuple[list[int], list[list[int]], bool]:
        aengine = AsyncEngine(InstantEngine())  # type: ignore[arg-type]
        try:
            stream = aengine.stream(
                "r", lambda e: e.add("r", list(range(10, 20))), coalesce=coalesce
            ).__aiter__()
            first = await stream.__anext__()  # the start's own output, at once
            # The reader is away while the engine finishes the request: a command runs
            # between steps, after the previous step's outputs were queued here.
            while await aengine.call(lambda e: e.has_unfinished):
                pass
            rest = [out async for out in stream]
            return first.new_token_ids, [out.new_token_ids for out in rest], rest[-1].finished
        finally:
            await aengine.close()

    first, rest, finished = asyncio.run(run(coalesce=True))
    assert first == [10]
    assert rest == [list(range(11, 20))]
    assert finished
    first, rest, _ = asyncio.run(run(coalesce=False))
    assert rest == [[t] for t in range(11, 20)]


def test_under_load_tokens_after_the_first_go_two_per_message_held_at_most_one_step() -> None:
    def out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
        reason = "length" if finished else None
        return RequestOutput(rid, [1], tokens, "", finished, reason, new_token_ids=tokens[-1:])

    async def run() -> list[list[tuple[str, list[int]]]]:
        aengine = AsyncEngine(InstantEngine(), hold_above_streams=1)  # type: ignore[arg-type]
        try:
            aengine._coalescing.update({"a", "b"})  # two coalescing streams: above 1
            steps = [
                [out("a", [1]), out("b", [5])],  # first outputs: never held
                [out("a", [1, 2]), out("b", [5, 6])],  # held
                [out("a", [1, 2, 3])],  # a: merged with its held one; b: nothing new
                [out("a", [1, 2, 3, 4], finished=True), out("b", [5, 6, 7])],
                [],
            ]
            delivered = []
            for step in steps:
                got = aengine._hold(step)
                delivered.append(sorted((o.request_id, o.new_token_ids) for o in got))
            return delivered
        finally:
            await aengine.close()

    assert asyncio.run(run()) == [
        [("a", [1]), ("b", [5])],
        [],
        [("a", [2, 3]), ("b", [6])],  # b's held token goes after one step regardless
        [("a", [4])],  # the last output is never held
        [("b", [7])],
    ]


def test_an_engine_built_on_the_engine_thread_serves_and_a_failed_build_raises() -> None:
    """AsyncEngine(factory): the factory runs on the engine thread (its OpenMP team is
    the process's only one); its error reaches the caller, and no thread is left."""
    built_on: list[str] = []

    def make() -> InstantEngine:
        built_on.append(threading.current_thread().name)
        return InstantEngine()

    aengine = AsyncEngine(make)  # type: ignore[arg-type]
    assert built_on == ["pdserve-engine"]
    assert isinstance(aengine.engine, InstantEngine)

    async def one() -> list[int]:
        start = lambda e: e.add("r", [4, 5])  # noqa: E731
        tokens = [t async for out in aengine.stream("r", start) for t in out.new_token_ids]
        await aengine.close()
        return tokens

    assert asyncio.run(one()) == [4, 5]

    def broken() -> InstantEngine:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        AsyncEngine(broken)  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name == "pdserve-engine"]
