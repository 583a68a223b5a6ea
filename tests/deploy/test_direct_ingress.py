"""Direct ingress (`pdserve up`'s default): each router replica is an HTTP endpoint.

`--router-replicas 2` on `--port P`: P and P + 1 both serve the API, each from a router
replica of its own (each counts only the requests sent to it: no proxy spreads them),
with exactly `transformers`' greedy tokens, streamed and not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 6


def test_every_router_replica_serves_http_on_its_own_port(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, free_cluster_port: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(5)
    prompt = [rng.randrange(5, 512) for _ in range(12)]
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)
    port = free_cluster_port(2)  # P and P + 1, outside the ephemeral range
    flags = (
        *("--mode", "colocated", "--router-replicas", "2", "--port", str(port)),
        *("--dtype", "float32", "--replica-cpus", "0", "--threads", "1"),
    )
    with pdserve_up(model_dir, *flags) as url:
        assert url.endswith(f":{port}")
        second = f"http://127.0.0.1:{port + 1}"
        for base in (url, second):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            assert api.greedy(client, model, prompt, MAX_TOKENS) == want, base
            streamed: list[int] = []
            for chunk in api.greedy_stream(client, model, prompt, MAX_TOKENS):
                streamed += chunk.choices[0].model_extra["token_ids"]
            assert streamed == want, base
        # the second endpoint's replica saw only its own two requests (the first one's
        # also served the readiness probe): each port is a router replica, no proxy
        ok = {"endpoint": "completions", "status": "200"}
        assert api.metric(second, "pdserve_requests_total", **ok) == 2.0
        assert api.metric(url, "pdserve_requests_total", **ok) == 3.0
