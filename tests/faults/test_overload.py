"""A flood of requests: bounded admission, 429s with Retry-After, no leak, bounded memory.

The router admits at most `--max-inflight-requests` at a time; beyond that it answers
429 with `Retry-After` at once (never queues without bound). Clients that hang up
mid-stream cancel their requests on the workers. Afterwards nothing is in flight,
nothing is held on any worker, and the router's memory has not grown with the flood.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

LIMIT = 16
FLOOD = 400
RSS_GROWTH_LIMIT_MIB = 64.0


def router_rss_mib(session: int | None) -> float:
    """Resident memory of the (single) router replica process of this test's cluster
    (of the session `pdserve up` started: another cluster may run beside it)."""
    assert session is not None
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.getsid(int(proc.name)) != session:
                continue
            if b"ServeReplica:pdserve:Router" not in (proc / "cmdline").read_bytes():
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no router replica process found")


async def one(session: aiohttp.ClientSession, url: str, kind: str) -> str:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": "The river",
        "ignore_eos": True,
        "return_token_ids": True,
    }
    body |= {"max_tokens": 8} if kind == "plain" else {"max_tokens": 32, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status == 429:
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
            return "429"
        assert resp.status == 200, await resp.text()
        if kind == "plain":
            assert (await resp.json())["usage"]["completion_tokens"] == 8
            return "ok"
        tokens, done = 0, False
        async for raw in resp.content:
            if raw.startswith(b"data: "):
                if kind == "hangup":
                    return "hung up"  # leaving the block closes the connection
                if raw.strip() == b"data: [DONE]":
                    done = True
                else:  # a chunk may carry several tokens (streams coalesce under load)
                    tokens += len(json.loads(raw[len(b"data: ") :])["choices"][0]["token_ids"])
        assert (tokens, done) == (32, True)
        return "ok"


async def flood(url: str) -> Counter[str]:
    kinds = ["plain", "stream", "stream", "hangup"]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(one(session, url, kinds[i % 4]) for i in range(FLOOD))), 300
        )
    return Counter(outcomes)


def test_a_flood_is_shed_with_429_and_leaves_nothing_behind(
    api: Any, make_checkpoint: Any, pdserve_up: Any
) -> None:
    model_dir = Path(make_checkpoint())
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--threads", "1", "--served-model-name", "m"),
        *("--max-inflight-requests", str(LIMIT)),
    )
    with pdserve_up(model_dir, *flags) as url:
        asyncio.run(flood(url))  # warm-up: the router's caches and pools reach size
        rss_before = router_rss_mib(url.session)
        aborted_before = sum(w["aborted"] for w in api.get_json(f"{url}/workers")["workers"])
        outcomes = asyncio.run(flood(url))
        assert set(outcomes) <= {"ok", "429", "hung up"}, outcomes
        assert outcomes["429"] > 0 and outcomes["ok"] > 0, outcomes
        assert router_rss_mib(url.session) - rss_before < RSS_GROWTH_LIMIT_MIB
        assert api.metric(url, "pdserve_router_inflight_requests") == 0
        workers = api.get_json(f"{url}/workers")["workers"]
        for w in workers:
            assert (w["running"], w["waiting"], w["kv_blocks_used"]) == (0, 0, 0), w
            assert w.get("pending_transfers", 0) == 0, w
        # Requests whose clients hung up before their last token were aborted, not run on.
        assert sum(w["aborted"] for w in workers) > aborted_before
        assert api.local_prefills(url) == {}, "the flood must not bypass the split"
