"""Prefill workers that stall or die: no request is lost, no decode worker waits it out.

One cluster (2 prefill workers, 1 decode worker that would wait 30 s for pushed KV):

- Both prefill workers are frozen (SIGSTOP) while a client's request waits for its KV,
  and the client goes away: the decode worker must stop waiting and free everything at
  once, not when its KV wait runs out.
- A prefill worker is killed while the index still lists it: requests placed on it are
  prefilled by the other prefill worker or, when the push cannot happen, by their decode
  worker, which is told at once instead of waiting out its KV lease. Every request gets
  the reference tokens; afterwards nothing is held and no transfer is pending.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

MAX_TOKENS = 6
KV_WAIT_S = 30.0  # long on purpose: a request that waited it out would show
POLL_DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def cluster(make_checkpoint: Any, pdserve_up: Any) -> Iterator[tuple[str, Path]]:
    model_dir = Path(make_checkpoint())
    flags = (
        *("--prefill-replicas", "2", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "10"),
        # A KV wait is kv_wait_factor x the estimate + the floor, at most the timeout:
        # here every wait is the whole KV_WAIT_S. (With the default 2 s floor a tiny
        # prompt's wait is ~2 s: a poll on a busy CI machine missed that window.)
        *("--kv-wait-timeout-s", str(KV_WAIT_S), "--kv-wait-floor-s", str(KV_WAIT_S)),
    )
    with pdserve_up(model_dir, *flags) as url:
        yield url, model_dir


def all_workers(api: Any, url: str, poll: Any) -> list[dict[str, Any]]:
    """The three workers, once each answers for itself (`Api.own_workers`): a test that
    signals a pid must have each worker's own."""

    def listed() -> list[dict[str, Any]] | None:
        workers: list[dict[str, Any]] = api.own_workers(url)
        return workers if len(workers) == 3 else None

    result: list[dict[str, Any]] = poll("every worker answers for itself", listed, POLL_DEADLINE_S)
    return result


def test_a_client_gone_before_its_kv_frees_the_decode_worker_at_once(
    api: Any, cluster: tuple[str, Path], poll: Any
) -> None:
    url, _ = cluster
    workers = all_workers(api, url, poll)
    decode = next(w for w in workers if w["role"] == "decode")
    prefill = [w for w in workers if w["role"] == "prefill"]

    def gauge(name: str) -> float:  # heartbeat gauges: /metrics asks no (frozen) worker
        return float(api.metric(url, name, worker=decode["worker_id"], role="decode"))

    # Before the prefill workers freeze, the router must place on them: a request whose
    # KV crossed says so. (Right after the cluster starts, the router's view of the index
    # may not list them yet; its requests were then prefilled on decode, and the frozen
    # workers never awaited: CI saw "the decode worker expects the KV: not within 20 s".)
    model = api.get_json(f"{url}/v1/models")["data"][0]["id"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    crossed = api.metric(url, "pdserve_kv_transfer_blocks_total")

    def placed_on_prefill() -> bool:
        client.completions.create(model=model, prompt=[4, 5, 6, 7] * 5, max_tokens=1)
        return api.metric(url, "pdserve_kv_transfer_blocks_total") > crossed

    poll("a request's KV crossed from a prefill worker", placed_on_prefill, POLL_DEADLINE_S)
    local_before = api.local_prefills(url)

    for w in prefill:
        os.kill(w["pid"], signal.SIGSTOP)  # no KV can come now
    try:
        parts = urllib.parse.urlsplit(url)
        for stream in (True, False):
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
            prompt = [5 + stream, 6, 7, 8, 9] * 4
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream}
            headers = {"Content-Type": "application/json"}
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            poll(
                "the decode worker expects the KV",
                lambda: gauge("pdserve_worker_pending_transfers") == 1,
                POLL_DEADLINE_S,
            )
            conn.close()  # the client goes away before its KV arrived
            start = time.monotonic()
            poll(
                "the decode worker stops waiting",
                lambda: gauge("pdserve_worker_pending_transfers") == 0,
                POLL_DEADLINE_S,
            )
            took = time.monotonic() - start
            assert took < KV_WAIT_S / 3, f"decode waited {took:.1f}s for cancelled KV ({stream=})"
            assert (gauge("pdserve_worker_running"), gauge("pdserve_worker_waiting")) == (0, 0)
    finally:
        for w in prefill:
            os.kill(w["pid"], signal.SIGCONT)

    def idle() -> bool:
        states = api.get_json(f"{url}/workers")["workers"]
        return len(states) == 3 and all(
            "error" not in w
            and (w["running"], w["waiting"], w["kv_blocks_used"]) == (0, 0, 0)
            and w.get("pending_transfers", 0) == 0
            for w in states
        )

    poll("every worker idle after the prefill workers resume", idle, 60.0)
    cancelled_prefilled = api.local_prefills(url) != local_before
    assert not cancelled_prefilled, "the cancelled request was never prefilled on decode"


def test_requests_survive_a_dead_prefill_worker(
    api: Any, cluster: tuple[str, Path], hf_greedy: Any, poll: Any
) -> None:
    url, model_dir = cluster
    rng = random.Random(41)
    prompts = [[rng.randrange(5, 512) for _ in range(20 + 7 * i)] for i in range(8)]
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    victim = next(w for w in all_workers(api, url, poll) if w["role"] == "prefill")
    os.kill(victim["pid"], signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt, ref in zip(prompts, want, strict=True):
        start = time.monotonic()
        assert api.greedy(client, model, prompt, MAX_TOKENS) == ref
        assert time.monotonic() - start < KV_WAIT_S / 2, "decode waited out its lease"
    for w in api.get_json(f"{url}/workers")["workers"]:
        if w["worker_id"] == victim["worker_id"]:
            continue  # still listed until its lease ends; another replica answers
        assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
        assert w.get("pending_transfers", 0) == 0, w
    # The only local prefills: requests whose prefill call went to the dead worker.
    local = api.local_prefills(url)
    assert set(local) <= {"prefill_failed"}, local
    assert sum(local.values()) <= len(prompts)
