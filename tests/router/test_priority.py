"""Shedding by priority at the router (router/priority.py), without a cluster.

The real router (the Serve deployment's class, run in this event loop) with the random
model's tokenizer and a real Redis, colocated and with no worker: a streamed request is
admitted once the router has placed it and holds its in-flight slot until the test lets
it go (as the response's end does), so the load at every decision is known exactly and
nothing waits on time. The workers' side (queue order, preemption) is
tests/engine/test_scheduler.py; the prefill-queue bound's is tests/router/test_disagg.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from pdserve.cluster.config import APIKeyDefaults, ClusterConfig
from pdserve.deploy.redis_server import EmbeddedRedis
from pdserve.router import app
from pdserve.router.app import Router
from pdserve.router.priority import inflight_limit, limit_fraction, prefill_queue_bound_s

LIMIT = 10  # max_inflight_requests
HEADROOM = 0.5  # priorities below 1 may fill 5 slots, the others 10
KEY, HIGH_KEY = "sk-plain-0123456789", "sk-high-0123456789"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def make_router(model_dir: Path, redis_url: str, **config: Any) -> Any:
    cfg = ClusterConfig(
        model=str(model_dir),
        mode="colocated",
        redis_url=redis_url,
        max_inflight_requests=LIMIT,
        api_keys=[KEY, HIGH_KEY],
        api_key_defaults={HIGH_KEY: APIKeyDefaults(priority=10)},
        **config,
    ).resolved()
    # Serve's ingress wrapper (its __init__ is a coroutine Serve awaits) around the class:
    # the router's own __init__ is enough here, no ASGI app is served
    wrapper = Router.func_or_class  # type: ignore[attr-defined]
    router = object.__new__(wrapper)
    wrapper.__mro__[1].__init__(router, cfg.model_dump(), None, object())
    return router


async def call(
    router: Any, priority: int | None, key: str = KEY, body_sent: asyncio.Event | None = None
) -> Response:
    """POST one streamed completion; its body arrives after a yield to the loop (so a
    flood's requests interleave while their bodies are read), or once `body_sent` is set."""
    fields: dict[str, Any] = {"model": router.config.model_id, "prompt": "hi", "stream": True}
    if priority is not None:
        fields["priority"] = priority
    body = json.dumps(fields).encode()

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)
        if body_sent is not None:
            await body_sent.wait()
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "query_string": b"",
        "headers": [(b"authorization", f"Bearer {key}".encode())],
    }
    request = Request(scope, receive)
    response: Response = await router._handle_request("completion", request, time.monotonic(), None)
    return response


async def release(response: Response) -> None:
    """End an admitted stream as its response's end would: its slot comes back."""
    await response.body_iterator.aclose()  # type: ignore[attr-defined]
    response._release_slot()  # type: ignore[attr-defined]


def shed_count(router: Any, priority: int) -> float:
    metric = next(iter(router.by_model.values())).core.metrics.shed.labels(
        str(priority), "inflight"
    )
    return float(metric._value.get())


def test_a_high_priority_request_is_never_shed_while_a_low_one_is_admitted(
    random_model_dir: Path, redis_url: str
) -> None:
    async def main() -> None:
        router = make_router(random_model_dir, redis_url, priority_headroom=HEADROOM)
        held: list[Response] = []

        async def wave(priorities: list[int | None], key: str = KEY) -> list[int]:
            responses = await asyncio.gather(*(call(router, p, key) for p in priorities))
            held.extend(r for r in responses if r.status_code == 200)
            for r in responses:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1"
                    assert json.loads(bytes(r.body))["error"]["code"] == "overloaded"
            return [r.status_code for r in responses]

        # a flood of low priority fills only its share of the slots ...
        low = await wave([0] * 20)
        assert low.count(200) == 5 and low.count(429) == 15
        assert router._inflight == 5
        # ... so important requests, mixed into more low ones, all get in
        mixed = [10] * 5 + [0] * 10
        random.Random(0).shuffle(mixed)
        codes = await wave(mixed)  # type: ignore[arg-type]
        assert [c for c, p in zip(codes, mixed, strict=True) if p == 10] == [200] * 5
        assert [c for c, p in zip(codes, mixed, strict=True) if p == 0] == [429] * 10
        assert router._inflight == LIMIT
        # at the full limit every priority is shed; the key's default priority counts
        assert await wave([10, 1000, None], key=HIGH_KEY) == [429] * 3
        assert shed_count(router, 0) == 25 and shed_count(router, 10) == 2
        assert shed_count(router, 1000) == 1
        for response in held[-3:]:  # three slots come back: still none for priority 0
            await release(response)
        del held[-3:]
        assert await wave([0, -5]) == [429, 429]
        assert await wave([None, None, None], key=HIGH_KEY) == [200] * 3  # key default: 10
        for response in held:
            await release(response)
        assert router._inflight == 0
        assert await wave([0] * 5) == [200] * 5  # every slot came back
        for response in held[-5:]:
            await release(response)

    asyncio.run(main())


def test_under_a_random_flood_the_shedding_threshold_rises_with_priority(
    random_model_dir: Path, redis_url: str
) -> None:
    """Requests one at a time at random loads: each priority's admissions happen below
    its threshold and its refusals at or above it, and a higher priority's threshold is
    never the lower; so no important request was refused at a load where a less
    important one got in."""

    async def main() -> None:
        router = make_router(random_model_dir, redis_url, priority_headroom=0.3)
        rng = random.Random(1)
        held: list[Response] = []
        admitted: dict[int, list[int]] = {0: [], 10: []}
        shed: dict[int, list[int]] = {0: [], 10: []}
        for _ in range(300):
            if held and rng.random() < 0.35:
                await release(held.pop(rng.randrange(len(held))))
                continue
            priority = rng.choice([0, 0, 0, 10])
            load = router._inflight
            response = await call(router, priority)
            (admitted if response.status_code == 200 else shed)[priority].append(load)
            if response.status_code == 200:
                held.append(response)
        assert shed[0] and shed[10] and admitted[0] and admitted[10]  # the flood hit both
        assert max(admitted[0]) == 6 and min(shed[0]) == 7  # floor(10 x 0.7)
        assert max(admitted[10]) == 9 and min(shed[10]) == LIMIT
        assert max(admitted[0]) < min(shed[10])
        for response in held:
            await release(response)

    asyncio.run(main())


def test_without_headroom_every_priority_sees_the_whole_limit(
    random_model_dir: Path, redis_url: str
) -> None:
    """The default (headroom 0) is the behaviour before priorities: a flood of the
    default priority gets every slot."""

    async def main() -> None:
        router = make_router(random_model_dir, redis_url)
        responses = [await call(router, None) for _ in range(LIMIT + 1)]
        assert [r.status_code for r in responses] == [200] * LIMIT + [429]
        assert (await call(router, 10)).status_code == 429
        for response in responses[:LIMIT]:
            await release(response)

    asyncio.run(main())


def test_limits_by_priority() -> None:
    cfg = ClusterConfig(
        model="m",
        max_inflight_requests=40,
        max_prefill_queue_s=4.0,
        priority_headroom=0.25,
        priority_reserved_min=5,
    )
    assert [limit_fraction(cfg, p) for p in (-1000, 0, 4, 5, 10, 1000)] == [0.75] * 3 + [1.0] * 3
    assert [inflight_limit(cfg, p) for p in (0, 5)] == [30, 40]
    assert [prefill_queue_bound_s(cfg, p) for p in (0, 5)] == [3.0, 4.0]
    tiny = cfg.model_copy(update={"max_inflight_requests": 1, "priority_headroom": 0.9})
    assert inflight_limit(tiny, 0) == 1  # every priority is served when idle


def test_bodies_that_do_not_come_never_hang_the_others(
    random_model_dir: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As many bodies as slots are read at once; past that a request waits its turn for
    READ_TURN_TIMEOUT_S at most, then gets 429 (never a hang behind slow clients)."""
    monkeypatch.setattr(app, "READ_TURN_TIMEOUT_S", 0.05)

    async def main() -> None:
        router = make_router(random_model_dir, redis_url)
        body_sent = asyncio.Event()
        slow = [asyncio.create_task(call(router, 10, body_sent=body_sent)) for _ in range(LIMIT)]
        for _ in range(100):  # each takes its turn to read at its first step
            if router._reading.locked():
                break
            await asyncio.sleep(0)
        refused = await call(router, 10)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "reading 10 request bodies" in bytes(refused.body).decode()
        body_sent.set()
        responses = await asyncio.gather(*slow)
        assert [r.status_code for r in responses] == [200] * LIMIT
        for response in responses:
            await release(response)
        assert router._inflight == 0 and not router._reading.locked()

    asyncio.run(main())
