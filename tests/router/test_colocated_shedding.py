"""Prefill admission on a real colocated cluster (one decode worker, which prefills).

With an admission bound so small that any queued prompt is past it:

- a long prompt on the idle cluster is served, and teaches the router how fast the
  decode worker prefills (an unmeasured worker is never refused);
- with the decode worker frozen (SIGSTOP), the next long prompt is admitted (nothing is
  queued) and holds its place in the worker's queue; the one after finds the queue past
  the bound: 429 with Retry-After, before anything reaches the worker;
- once the worker resumes, the admitted request returns the reference tokens, and with
  the queue drained a new long prompt is admitted again.

Everything follows from queues and counters, not timing: the frozen worker holds the
queue in place, and each step waits (polling /metrics) for the router to have placed the
previous request.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.router.test_conditional_cluster import (
    LONG,
    MAX_TOKENS,
    POLL_DEADLINE_S,
    answer,
    send,
)

FLAGS = (
    *("--mode", "colocated", "--decode-replicas", "1", "--replica-cpus", "0"),
    *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
    *("--max-prefill-queue-s", "0.000001"),
    # the frozen decode worker keeps its index entry while it is stopped
    *("--worker-lease-s", "30"),
)
PLACED = "pdserve_ttft_breakdown_seconds_count"  # observed once a first attempt is placed


def test_a_colocated_cluster_sheds_past_its_prefill_queue_bound(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, poll: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(67)
    longs = [[rng.randrange(5, 512) for _ in range(LONG)] for _ in range(4)]
    want = hf_greedy(model_dir, [longs[0], longs[1], longs[3]], MAX_TOKENS)
    with pdserve_up(model_dir, *FLAGS) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def placed() -> float:
            return api.metric(url, PLACED, stage="router_queue")

        def shed() -> float:
            return api.metric(url, "pdserve_router_shed_requests_total", reason="prefill_queue")

        # Idle and unmeasured: served, and the router learns the worker's prefill rate.
        assert api.greedy(client, model, longs[0], MAX_TOKENS) == want[0]
        assert shed() == 0

        workers = api.get_json(f"{url}/workers")["workers"]
        (decode,) = [w for w in workers if w["role"] == "decode"]
        gauge = "pdserve_worker_queued_prefill_tokens"

        def queue_empty() -> bool:  # as the index says: a heartbeat may still show a prompt
            return not api.metric(url, gauge, worker=decode["worker_id"], role="decode")

        poll("the heartbeat shows an empty queue", queue_empty, POLL_DEADLINE_S)
        before = placed()
        os.kill(decode["pid"], signal.SIGSTOP)
        try:
            first = send(url, model, longs[1])  # nothing queued: admitted, waits for D
            poll("the first placement", lambda: placed() == before + 1, POLL_DEADLINE_S)
            with pytest.raises(openai.RateLimitError) as refused:
                api.greedy(client, model, longs[2], MAX_TOKENS)
        finally:
            os.kill(decode["pid"], signal.SIGCONT)
        assert refused.value.code == "overloaded"
        assert refused.value.response.headers["retry-after"] == "1"
        assert placed() == before + 1  # the refused request was never placed
        assert answer(first) == want[1]
        assert shed() == 1
        assert api.metric(url, "pdserve_requests_total", endpoint="completions", status="429") == 1

        # The queue drained: admitted again.
        poll("the heartbeat shows an empty queue again", queue_empty, POLL_DEADLINE_S)
        assert api.greedy(client, model, longs[3], MAX_TOKENS) == want[2]
        assert shed() == 1
