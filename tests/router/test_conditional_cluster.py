"""Conditional disaggregation and admission on a real cluster (1 prefill, 1 decode worker).

The default policy (conditional), with an admission bound so small that any queued
prefill work is past it:

- a short prompt is prefilled by the decode worker: a policy decision (`short_prompt`),
  counted as the local-prefill reason `policy`, never as a failure's;
- a long prompt on the idle cluster is split: its KV crosses, decode prefills nothing;
- with the decode worker frozen (SIGSTOP), a long request waits for it while holding its
  place in the prefill worker's queue; the next long prompt goes to the decode worker
  (`faster`: it has nothing queued), and the one after finds both queues past the
  bound: 429 with Retry-After, before anything reaches a worker. Once the decode worker
  resumes, both admitted requests return the reference tokens, the first through the
  split.

Everything here follows from queues and counters, not from timing: the frozen worker
holds the queues in place, and each step waits (polling /metrics) for the heartbeats to
show empty queues, then for the router to have decided the previous request.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.benchmarks.bench_report import scrape_metrics

MAX_TOKENS = 6
LONG = 120  # tokens: far past local_prefill_max_tokens (32), and measured (>= 64)
POLL_DEADLINE_S = 30.0
FLAGS = (
    *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
    *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
    *("--disagg-policy", "conditional", "--max-prefill-queue-s", "0.000001"),
    # the second long prompt finds one request on the decode worker (the first, waiting
    # for its KV): let a worker running one take a prompt it finishes sooner
    *("--local-prefill-max-running", "1"),
    # the frozen decode worker keeps its index entry; admitted KV is waited for at length
    *("--worker-lease-s", "30", "--kv-wait-floor-s", "10"),
)


def decisions(url: str) -> Counter[tuple[str, str]]:
    """`pdserve_disagg_decisions_total` by (where, reason), pairs at 0 left out."""
    return Counter(
        {
            (dict(labels)["where"], dict(labels)["reason"]): value
            for (name, labels), value in scrape_metrics(url).items()
            if name == "pdserve_disagg_decisions_total" and value
        }
    )


def body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def send(url: str, model: str, prompt: list[int]) -> http.client.HTTPConnection:
    """Send a completion request without waiting for its answer (`answer` reads it)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body(model, prompt)), headers)
    return conn


def answer(conn: http.client.HTTPConnection) -> list[int]:
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, payload
    return list(payload["choices"][0]["token_ids"])


def test_conditional_decisions_the_split_and_shedding(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, poll: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(61)
    short = [rng.randrange(5, 512) for _ in range(12)]
    longs = [[rng.randrange(5, 512) for _ in range(LONG)] for _ in range(4)]
    want = hf_greedy(model_dir, [short, *longs[:3]], MAX_TOKENS)
    with pdserve_up(model_dir, *FLAGS) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        start = decisions(url)  # `pdserve up`'s readiness probe is a short prompt too
        local0 = api.local_prefills(url)
        assert set(local0) <= {"policy"}, local0

        def new_decisions() -> Counter[tuple[str, str]]:
            return decisions(url) - start

        def new_local_prefills() -> dict[str, float]:
            now = api.local_prefills(url)
            return {k: v - local0.get(k, 0) for k, v in now.items() if v != local0.get(k, 0)}

        # A short prompt: the decode worker prefills it, by the policy's decision.
        assert api.greedy(client, model, short, MAX_TOKENS) == want[0]
        assert new_decisions() == {("local", "short_prompt"): 1}
        assert new_local_prefills() == {"policy": 1}

        # A long prompt on an idle cluster: split, its KV crosses.
        blocks0 = api.metric(url, "pdserve_kv_transfer_blocks_total")
        assert api.greedy(client, model, longs[0], MAX_TOKENS) == want[1]
        assert new_decisions() == {("local", "short_prompt"): 1, ("remote", "prefill_idle"): 1}
        blocks1 = api.metric(url, "pdserve_kv_transfer_blocks_total")
        assert blocks1 >= blocks0 + LONG // 8
        assert new_local_prefills() == {"policy": 1}

        workers = api.get_json(f"{url}/workers")["workers"]
        decode = next(w for w in workers if w["role"] == "decode")

        def queues_empty() -> bool:  # as the index says: a heartbeat may still show a prompt
            gauge = "pdserve_worker_queued_prefill_tokens"
            return not any(
                api.metric(url, gauge, worker=w["worker_id"], role=w["role"]) for w in workers
            )

        poll("the heartbeats show empty queues", queues_empty, POLL_DEADLINE_S)
        os.kill(decode["pid"], signal.SIGSTOP)
        try:
            first = send(url, model, longs[1])  # P is idle: remote, and it waits for D
            poll(
                "the first decision",
                lambda: new_decisions()["remote", "prefill_idle"] == 2,
                POLL_DEADLINE_S,
            )
            second = send(url, model, longs[2])  # P has the first's tokens queued, D none
            poll(
                "the second decision",
                lambda: new_decisions()["local", "faster"] == 1,
                POLL_DEADLINE_S,
            )
            with pytest.raises(openai.RateLimitError) as shed:
                api.greedy(client, model, longs[3], MAX_TOKENS)
        finally:
            os.kill(decode["pid"], signal.SIGCONT)
        assert shed.value.response.headers["retry-after"] == "1"
        assert shed.value.code == "overloaded"
        assert answer(first) == want[2]
        assert answer(second) == want[3]
        assert new_decisions() == {
            ("local", "short_prompt"): 1,
            ("remote", "prefill_idle"): 2,
            ("local", "faster"): 1,
            ("shed", "over_capacity"): 1,
        }
        # the first crossed as KV; the decode worker prefilled only what policy chose
        assert api.metric(url, "pdserve_kv_transfer_blocks_total") >= blocks1 + LONG // 8
        assert new_local_prefills() == {"policy": 2}
        shed_count = api.metric(url, "pdserve_requests_total", endpoint="completions", status="429")
        assert shed_count == 1
