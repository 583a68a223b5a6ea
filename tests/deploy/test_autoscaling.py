"""Each pool scales on its own signal, on a real local Ray cluster (`pdserve up`).

A burst of long prompts must grow the prefill pool and leave decode alone; a burst of
long outputs must grow decode and leave prefill alone; both return to their minimum
afterwards, and requests sent while replicas are removed all complete with the
reference tokens. Replica counts are read where placement reads them: the index,
through `/health`. Throughout, the split holds: no decode worker prefills a prompt
itself, not even when Ray Serve gives a call to another replica than the one placement
chose (a replica being added or removed).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

BLOCK_SIZE = 8
SCALE_DEADLINE_S = 120.0
POOL = {
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 3.0,
    "look_back_period_s": 1.5,
    "metrics_interval_s": 0.25,
}
PREFILL = {**POOL, "target": 128}  # queued prompt tokens per replica
DECODE = {**POOL, "target": 4}  # running sequences per replica


def counts(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
        return dict(json.loads(resp.read())["workers"])


class Load:
    """A closed loop of users, each sending its next request when the last one ends."""

    def __init__(self, url: str, model: str) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0
        )
        self.model = model
        self.results: list[tuple[list[int], list[int]]] = []
        self.errors: list[BaseException] = []

    async def user(self, stop: asyncio.Event, prompts: list[list[int]], max_tokens: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = prompts[i % len(prompts)]
            i += 1
            try:
                out = await self.client.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                self.results.append((prompt, out.choices[0].model_extra["token_ids"]))
            except Exception as exc:  # recorded: the test asserts there are none
                self.errors.append(exc)

    async def until(
        self,
        done: Callable[[], bool],
        users: int,
        prompts: list[list[int]],
        max_tokens: int,
        check: Callable[[], None],
    ) -> float:
        """Run `users` until `done()` (polled with `check()`), at most SCALE_DEADLINE_S."""
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.user(stop, prompts, max_tokens)) for _ in range(users)]
        start = time.monotonic()
        try:
            while not done():
                check()
                assert time.monotonic() - start < SCALE_DEADLINE_S, "did not scale in time"
                await asyncio.sleep(0.25)  # the poll period of an external condition
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return time.monotonic() - start


def test_each_pool_scales_on_its_own_signal(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any
) -> None:
    # Big enough that a 600-token prefill takes tens of ms: with the smallest checkpoint
    # prefill kept up with 8 users and the queue (the prefill signal) often stayed empty.
    model_dir = Path(
        make_checkpoint(
            hidden_size=256, intermediate_size=512, num_layers=4, max_position_embeddings=1024
        )
    )
    rng = random.Random(5)
    long_prompts = [[rng.randrange(5, 512) for _ in range(600)] for _ in range(8)]
    short_prompts = [[rng.randrange(5, 512) for _ in range(6)] for _ in range(8)]
    trickle = short_prompts[:2]
    want = dict(zip(map(tuple, trickle), hf_greedy(model_dir, trickle, 8), strict=True))
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "3"),
        *("--prefill-autoscaling", json.dumps(PREFILL)),
        *("--decode-autoscaling", json.dumps(DECODE)),
    )
    with pdserve_up(model_dir, *flags) as url:
        assert counts(url) == {"prefill": 1, "decode": 1}

        def pool_stays(role: str) -> Callable[[], None]:
            def check() -> None:
                assert counts(url)[role] == 1, f"the {role} pool must not scale"

            return check

        async def scenario() -> Load:
            model = await _model_id(url)
            load = Load(url, model)
            # 1. Long prompts, one output token: prefill work only.
            await load.until(
                lambda: counts(url)["prefill"] == 2, 8, long_prompts, 1, pool_stays("decode")
            )
            # 2. Back to the minimum once the burst is over.
            await load.until(lambda: counts(url)["prefill"] == 1, 0, [], 1, pool_stays("decode"))
            # 3. Short prompts, long outputs: decode work only.
            await load.until(
                lambda: counts(url)["decode"] == 2, 12, short_prompts, 200, pool_stays("prefill")
            )
            # 4. Scale-down under a trickle of requests, none of which may fail.
            load.results.clear()
            await load.until(lambda: counts(url)["decode"] == 1, 2, trickle, 8, lambda: None)
            await load.client.close()
            return load

        load = asyncio.run(scenario())
        assert not load.errors, load.errors[:3]
        assert load.results, "the trickle sent nothing during scale-down"
        assert all(want[tuple(p)] == got for p, got in load.results)
        assert counts(url) == {"prefill": 1, "decode": 1}
        assert api.local_prefills(url) == {}, "a request bypassed the split"


async def _model_id(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        return (await client.models.list()).data[0].id
    finally:
        await client.close()


pytestmark = pytest.mark.timeout(600)
