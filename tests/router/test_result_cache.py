"""The result cache against a real redis-server: keys, bounds, checkpoints, failures.

The cluster half (a hit reaches no worker, streamed and not) is in
tests/deploy/test_cluster.py (`test_result_cache_answers_repeats_without_a_worker`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from pdserve.benchmarks.bench_report import parse_scrape, sample
from pdserve.cluster.config import ClusterConfig
from pdserve.common.grammar import GrammarSpec
from pdserve.common.sampling_params import SamplingParams
from pdserve.deploy.redis_server import EmbeddedRedis, free_port
from pdserve.router import result_cache as rc
from pdserve.router.metrics import RouterMetrics
from pdserve.router.result_cache import INDEX_KEY, CachePlan, ResultCache

PROMPT = [5, 17, 99, 3, 250, 7]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=7)


def items(tokens: list[int], finish: str | None = "length") -> list[dict[str, Any]]:
    """Output items as a decode worker streams them (the last carries the finish)."""
    out = []
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        item = {"type": "output", "token_ids": [t], "text": f"<{t}>", "num_output_tokens": i + 1}
        item["finish_reason"] = finish if last else None
        item["logprobs"] = [(t, -0.5 * i, [(t, -0.5 * i), (t + 1, -2.0)])]
        out.append(item)
    return out


async def stream(xs: list[dict[str, Any]], fail_after: int | None = None) -> AsyncIterator[Any]:
    for i, x in enumerate(xs):
        if i == fail_after:
            raise RuntimeError("the decode worker died")
        yield x


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def db(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as client:
        client.flushall()
        yield client


def make_cache(url: str, identity: str = "model-a", **kw: Any) -> ResultCache:
    args: dict[str, Any] = {"ttl_s": 60.0, "max_entries": 100, "max_entry_bytes": 1 << 20}
    args.update(kw)
    metrics = RouterMetrics().for_model("m")
    return ResultCache(aioredis.Redis.from_url(url), identity, metrics=metrics, **args)


def counted(cache: ResultCache, name: str, **labels: str) -> float:
    return sample(parse_scrape(cache.metrics.render([]).decode()), name, **labels)


async def serve(cache: ResultCache, plan: CachePlan, xs: list[dict[str, Any]]) -> list[Any]:
    """What the router does: the stored items on a hit, else the workers' (recorded)."""
    hit = await cache.replay(plan)
    source = hit if hit is not None else cache.record(plan, stream(xs))
    return [item async for item in source]


def test_parallel_choices_replay_with_their_index(redis_url: str, db: redis.Redis) -> None:
    """An n > 1 result's items name their choice: a replay keeps each one's index."""

    async def run() -> None:
        cache = make_cache(redis_url)
        seeded = dataclasses.replace(SEEDED, n=2)
        mixed = [{**item, "index": i % 2} for i, item in enumerate(items([1, 2, 3, 4]))]
        await serve(cache, cache.plan(PROMPT, seeded, None, {}), mixed)
        replayed = await serve(cache, cache.plan(PROMPT, seeded, None, {}), [])
        assert [(i["index"], i["token_ids"]) for i in replayed] == [
            (0, [1]),
            (1, [2]),
            (0, [3]),
            (1, [4]),
        ]

    asyncio.run(run())


def test_a_repeat_is_answered_from_the_cache_and_anything_changed_misses(
    redis_url: str, db: redis.Redis
) -> None:
    async def run() -> None:
        cache = make_cache(redis_url)

        def plan(
            p: SamplingParams = GREEDY, prompt: list[int] = PROMPT, salt: str | None = None
        ) -> CachePlan:
            return cache.plan(prompt, p, salt, {})

        first = plan()
        got = await serve(cache, first, items([11, 12, 13, 14]))
        assert first.status == "miss" and [i["token_ids"] for i in got] == [[11], [12], [13], [14]]
        again = plan()
        replayed = await serve(cache, again, items([99, 99, 99, 99]))  # never used: a hit
        assert again.status == "hit"
        fields = ("token_ids", "text", "finish_reason")
        assert [{k: i[k] for k in fields} for i in replayed] == [
            {k: i[k] for k in fields} for i in got
        ]
        assert [i["logprobs"] for i in replayed] == [
            [[t, lp, [list(a) for a in top]] for t, lp, top in i["logprobs"]] for i in got
        ]
        # Seeded sampling is cached too, by its seed.
        seeded = plan(SEEDED)
        await serve(cache, seeded, items([21, 22, 23, 24]))
        assert seeded.status == "miss"
        assert (await cache.replay(plan(SEEDED))) is not None
        # Anything that changes the output misses: each field, the prompt, the salt.
        changed = {
            "seed": dataclasses.replace(SEEDED, seed=8),
            "temperature": dataclasses.replace(SEEDED, temperature=0.7),
            "top_p": dataclasses.replace(SEEDED, top_p=0.8),
            "top_k": dataclasses.replace(SEEDED, top_k=5),
            "max_tokens": dataclasses.replace(GREEDY, max_tokens=5),
            "stop": dataclasses.replace(GREEDY, stop=("x",)),
            "stop_token_ids": dataclasses.replace(GREEDY, stop_token_ids=(3,)),
            "ignore_eos": dataclasses.replace(GREEDY, ignore_eos=False),
            "logprobs": dataclasses.replace(GREEDY, logprobs=2),
            "skip_special_tokens": dataclasses.replace(GREEDY, skip_special_tokens=False),
            "greedy seed": dataclasses.replace(GREEDY, seed=1),
            "cache_salt": dataclasses.replace(GREEDY, cache_salt="tenant-b"),
            "lora": dataclasses.replace(GREEDY, lora="adapter-a"),
            "n": dataclasses.replace(GREEDY, n=2),
            "grammar": dataclasses.replace(GREEDY, grammar=GrammarSpec("regex", "[a-z]+")),
        }
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        # priority orders the queues, never the tokens: the one field outside the key
        assert names <= set(changed) | {"seed", "temperature", "priority"}, "a field missed"
        urgent = plan(dataclasses.replace(GREEDY, priority=10))
        assert await cache.replay(urgent) is not None, "a priority changed the key"
        for what, params in changed.items():
            p = plan(params)
            assert p.key is not None and await cache.replay(p) is None, what
            assert p.status == "miss", what
        assert await cache.replay(plan(prompt=[*PROMPT, 1])) is None
        assert await cache.replay(plan(salt="tenant-a")) is None
        assert counted(cache, "pdserve_result_cache_hits_total") == 3
        assert counted(cache, "pdserve_result_cache_stores_total", result="stored") == 2

    asyncio.run(run())


def test_only_determined_requests_and_opt_outs(redis_url: str, db: redis.Redis) -> None:
    cache = make_cache(redis_url)
    sampled = SamplingParams(max_tokens=4, temperature=0.8)  # no seed: not replayable
    assert cache.plan(PROMPT, sampled, None, {}).key is None
    assert cache.plan(PROMPT, dataclasses.replace(sampled, top_k=1), None, {}).key is not None
    assert rc.cache_directives({}) == (True, True)
    assert rc.cache_directives({"cache-control": "no-store"}) == (False, False)
    assert rc.cache_directives({"cache-control": "max-age=0, No-Cache"}) == (False, True)
    assert rc.cache_directives({}, body_opt_in=False) == (False, False)
    assert cache.plan(PROMPT, GREEDY, None, {"cache-control": "no-store"}).key is None

    async def run() -> None:
        no_cache = cache.plan(PROMPT, GREEDY, None, {"cache-control": "no-cache"})
        await serve(cache, no_cache, items([1, 2, 3, 4]))
        assert no_cache.status == "bypass"  # not read, but stored: the next one hits
        hit = cache.plan(PROMPT, GREEDY, None, {})
        assert await cache.replay(hit) is not None and hit.status == "hit"
        assert await cache.replay(cache.plan(PROMPT, GREEDY, None, {}, False)) is None

    asyncio.run(run())


def test_errors_cancelled_and_unfinished_outputs_are_never_stored(
    redis_url: str, db: redis.Redis
) -> None:
    async def run() -> None:
        cache = make_cache(redis_url)
        plan = cache.plan(PROMPT, GREEDY, None, {})
        with pytest.raises(RuntimeError):
            [x async for x in cache.record(plan, stream(items([1, 2, 3]), fail_after=2))]
        assert db.get(plan.key) is None  # type: ignore[arg-type]
        gone = cache.record(plan, stream(items([1, 2, 3, 4])))  # the client went away
        await anext(gone)
        await gone.aclose()
        assert db.get(plan.key) is None  # type: ignore[arg-type]
        for finish in (None, "abort"):  # truncated (a resume budget spent) or aborted
            [x async for x in cache.record(plan, stream(items([1, 2], finish)))]
            assert db.get(plan.key) is None, finish  # type: ignore[arg-type]
        big = make_cache(redis_url, max_entry_bytes=1024)
        [x async for x in big.record(plan, stream(items(list(range(40)))))]
        assert db.get(plan.key) is None  # type: ignore[arg-type]
        assert counted(big, "pdserve_result_cache_stores_total", result="too_large") == 1
        [x async for x in cache.record(plan, stream(items([1, 2], "stop")))]
        assert db.get(plan.key) is not None  # type: ignore[arg-type]

    asyncio.run(run())


def test_entries_expire_by_ttl_and_the_size_bound_holds(redis_url: str, db: redis.Redis) -> None:
    async def run() -> None:
        # Two router replicas (two clients) share one bound of 3 entries.
        a = make_cache(redis_url, ttl_s=30.0, max_entries=3)
        b = make_cache(redis_url, ttl_s=30.0, max_entries=3)
        keys = [rc.request_key("model-a", [i + 1], GREEDY) for i in range(6)]
        for i, key in enumerate(keys):
            assert await (a if i % 2 else b).store(key, items([i]))
            assert 0 < db.pttl(key) <= 30_000  # Redis expires every entry
            assert db.zcard(INDEX_KEY) == min(i + 1, 3)
        assert [db.exists(k) for k in keys] == [0, 0, 0, 1, 1, 1], "the oldest go first"
        assert set(db.zrange(INDEX_KEY, 0, -1)) == {k.encode() for k in keys[3:]}
        # TTL: a short one; the entry and its index member go (polled, bounded).
        short = make_cache(redis_url, ttl_s=0.3, max_entries=3)
        key = rc.request_key("model-a", [99], GREEDY)
        assert await short.store(key, items([1]))
        assert 0 < db.pttl(key) <= 300
        assert await short.replay(CachePlan(key, True, True)) is not None
        deadline = time.monotonic() + 5.0
        while db.exists(key) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling Redis, bounded: not a synchronisation
        assert not db.exists(key), "the entry outlived its TTL"
        assert await short.replay(CachePlan(key, True, True)) is None
        later = rc.request_key("model-a", [100], GREEDY)
        assert await short.store(later, items([1]))
        assert db.zscore(INDEX_KEY, key) is None, "an expired entry stays indexed"

    asyncio.run(run())


def test_redis_down_skips_the_cache_quickly(db: redis.Redis) -> None:
    async def run() -> None:
        cache = make_cache(f"redis://127.0.0.1:{free_port()}/0")  # nobody listens
        plan = cache.plan(PROMPT, GREEDY, None, {})
        start = time.monotonic()
        got = await serve(cache, plan, items([1, 2, 3, 4]))
        assert time.monotonic() - start < 2 * rc.TIMEOUT_S + 1.0
        assert [i["token_ids"] for i in got] == [[1], [2], [3], [4]]
        assert plan.status == "bypass" and not plan.write
        assert counted(cache, "pdserve_result_cache_errors_total") == 1

    asyncio.run(run())


def test_a_changed_checkpoint_misses_a_copy_hits(
    redis_url: str, db: redis.Redis, make_checkpoint: Any, tmp_path: Path
) -> None:
    """A router restarted on another checkpoint (same served name, same shapes) never
    finds the old results; one restarted on a byte-identical copy does."""
    old = make_checkpoint(seed=0)
    new = make_checkpoint(seed=1)  # retrained: same config, tokenizer, shapes
    copy = tmp_path / "copy"
    shutil.copytree(old, copy)

    def router_cache(folder: Path, **kw: Any) -> ResultCache:
        cfg = ClusterConfig(
            model=str(folder), served_model_name="m", redis_url=redis_url, **kw
        ).model_copy(update={"result_cache_ttl_s": 60.0})
        metrics = RouterMetrics().for_model("m")
        cache = ResultCache.from_config(cfg, aioredis.Redis.from_url(redis_url), metrics)
        assert cache is not None
        return cache

    async def run() -> None:
        first = router_cache(old)
        plan = first.plan(PROMPT, GREEDY, None, {})
        await serve(first, plan, items([1, 2, 3, 4]))
        assert plan.status == "miss"
        restarted = router_cache(copy)
        assert await restarted.replay(restarted.plan(PROMPT, GREEDY, None, {})) is not None
        for changed in (router_cache(new), router_cache(old, dtype="bfloat16")):
            assert await changed.replay(changed.plan(PROMPT, GREEDY, None, {})) is None

    asyncio.run(run())
    assert ClusterConfig(model=str(old)).result_cache_ttl_s is None, "off by default"


def test_large_checkpoints_are_sampled_per_tensor(
    make_checkpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above WHOLE_FILE_BYTES a safetensors file is hashed by header and windows of each
    tensor: one changed tensor changes the fingerprint, a copy keeps it."""
    import json
    import struct

    import numpy as np

    monkeypatch.setattr(rc, "WHOLE_FILE_BYTES", 0)  # every file takes the sampled path
    src = make_checkpoint(seed=0)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    assert rc.model_fingerprint(a) == rc.model_fingerprint(b) == rc.model_fingerprint(src)
    data = bytearray((b / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in sorted(header) if k.endswith("up_proj.weight"))
    begin, end = (8 + n + o for o in header[name]["data_offsets"])
    assert header[name]["dtype"] == "F32" and end - begin > 3 * 4096  # windows, not whole
    values = np.frombuffer(bytes(data[begin:end]), dtype=np.float32)
    data[begin:end] = (values * 1.001).astype(np.float32).tobytes()  # a fine-tune, in place
    (b / "model.safetensors").write_bytes(bytes(data))
    assert rc.model_fingerprint(a) != rc.model_fingerprint(b)
