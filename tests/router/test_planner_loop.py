"""The planner at work (router/planner_loop.py) against a real redis-server: two routers
publish what they served, one leads and decides from both, the counts go to the scaler
(recorded here), and the decision is a metric and a state `/workers` reads."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from pdserve.benchmarks.bench_report import parse_scrape, sample
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.deploy.redis_server import EmbeddedRedis
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner_loop import PlannerLoop, TrafficCounts, read_state

pytestmark = pytest.mark.redis  # a real redis-server: the cluster tier


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


# 5 ms a step, 0.5 ms a decode row, 0.25 ms a prompt token (engine `step_*` gauges)
GAUGES = {"step_fixed_us": 5000, "step_row_us": 500, "step_context_ps": 100_000}
WORKERS = [
    WorkerInfo("p1", "prefill", "", 1, {**GAUGES, "step_prefill_token_ns": 250_000}),
    WorkerInfo("d1", "decode", "", 1, {**GAUGES, "kv_blocks_total": 4096}),
]


def test_one_router_leads_and_sizes_the_pools_from_every_routers_traffic(
    redis_url: str, demo_model_dir: Any
) -> None:
    config = ClusterConfig(
        model=str(demo_model_dir),
        mode="disagg",
        prefill_replicas=1,
        decode_replicas=1,
        slo_ttft_ms=2000,
        slo_itl_ms=20,
        planner={"interval_s": 1.0, "hold_s": 0.0, "horizon_s": 0.0, "prefill_max": 8},
    )
    scaled: list[tuple[str, str, int]] = []
    now = [1000.0]
    metrics = RouterMetrics().for_model(config.model_id)

    async def live() -> list[WorkerInfo]:
        return WORKERS

    def loop(router_id: str, client: aioredis.Redis, counts: TrafficCounts) -> PlannerLoop:
        async def scale(pool: str, n: int) -> None:
            scaled.append((router_id, pool, n))

        return PlannerLoop(
            config, counts, client, router_id, live, scale, metrics, clock=lambda: now[0]
        )

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await client.flushall()
        a_counts, b_counts = TrafficCounts(), TrafficCounts()
        a, b = loop("a", client, a_counts), loop("b", client, b_counts)
        try:
            assert await a.tick() is None  # leads, but no window yet: nothing decided
            assert await b.tick() is None  # not the leader
            assert await a.tick() is None  # now it has seen both routers' counts
            # 10 s of 4 requests/s of 2048-token prompts, 16 tokens out: half each
            for counts in (a_counts, b_counts):
                counts.requests += 20
                counts.prompt_tokens += 20 * 2048
                counts.completed += 20
                counts.output_tokens += 20 * 16
                counts.remote_computed += 20 * 2048
            now[0] += 10.0
            assert await b.tick() is None
            state = await a.tick()
            assert state is not None and state["leader"] == "a"
            assert state["observed"]["rate"] == pytest.approx(4.0, rel=0.01)
            assert state["observed"]["prompt_tokens"] == pytest.approx(2048)
            prefill = state["targets"]["prefill"]
            assert prefill > 1 and scaled == [("a", "prefill", prefill)]
            assert state["actual"] == {"prefill": 1, "decode": 1}
            assert {c["replicas"] for c in state["candidates"]["prefill"]} == set(range(1, 9))
            assert await read_state(client, config.model_id) == state
            scrape = parse_scrape(metrics.render([]).decode())
            target = "pdserve_planner_target_replicas"
            assert sample(scrape, target, model=config.model_id, pool="prefill") == prefill
            rate = sample(scrape, "pdserve_planner_request_rate", kind="observed")
            assert rate == pytest.approx(4.0, rel=0.01)
            ups = sample(scrape, "pdserve_planner_decisions_total", pool="prefill", direction="up")
            assert ups == 1
            # the traffic shifts to long outputs: the prefill pool gives replicas back
            for counts in (a_counts, b_counts):
                counts.requests += 20
                counts.prompt_tokens += 20 * 128
                counts.completed += 20
                counts.output_tokens += 20 * 1024
                counts.remote_computed += 20 * 128
            now[0] += 10.0
            await b.tick()
            shifted = await a.tick()
            assert shifted is not None
            assert shifted["targets"]["prefill"] < prefill
            assert shifted["targets"]["decode"] > 1
            assert ("a", "decode", shifted["targets"]["decode"]) in scaled
            assert all(router == "a" for router, _, _ in scaled)  # one leader acts
        finally:
            await client.aclose()

    asyncio.run(run())
