"""AsyncEngine: outputs reach the caller in the order the engine produced them."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.outputs import RequestOutput


def output(request_id: str, token: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, [1], [token], "", finished, "length" if finished else None)


class InstantEngine:
    """Steps take no time: the next output races the `start` call's own result."""

    def __init__(self) -> None:
        self.pending: dict[str, list[int]] = {}

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add(self, request_id: str, tokens: list[int]) -> RequestOutput:
        self.pending[request_id] = tokens[1:]
        return output(request_id, tokens[0], finished=False)

    def step(self) -> list[RequestOutput]:
        outs = []
        for request_id, tokens in list(self.pending.items()):
            token = tokens.pop(0)
            if not tokens:
                del self.pending[request_id]
            outs.append(output(request_id, token, finished=not tokens))
        return outs

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)


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
