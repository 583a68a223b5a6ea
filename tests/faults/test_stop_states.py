"""Every stop of `pdserve up` stops: SIGINT and SIGTERM end it within 30 s in each state,
and leave no process of its session (Ray, Redis, workers).

The states (docs/failures.md, "Stopping"): while starting (the demo model training),
while replicas wait for resources no node has (also: they are named, on the terminal and
in /health), while serving streams (one longer than its grace ends with an error event;
tests/faults/test_graceful_shutdown.py lets one finish), after a worker died, and a
second Ctrl-C. Ready and idle is every other cluster test's teardown
(conftest.start_cluster: SIGTERM within STOP_LIMIT_S). `serve run` on the Serve config
has the same states in tests/deploy/test_manifests.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.demo.model import CACHE_DIR_ENV

STOP_LIMIT_S = 30.0
START_TIMEOUT_S = 240.0
UP = [sys.executable, "-m", "pdserve.deploy.cli", "up"]


def _health(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, model: str) -> tuple[int, Any]:
    """POST a one-token completion: (status, (body, Retry-After) or the body)."""
    body = json.dumps({"model": model, "prompt": "The", "max_tokens": 1}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, (json.loads(exc.read()), exc.headers.get("Retry-After"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_demo_model_trains(
    sig: signal.Signals, stoppable: Any, tmp_path: Path, free_cluster_port: Any
) -> None:
    """The demo model trains in `pdserve up` itself before anything else starts; a stop
    there ends it (130) and leaves neither a half-written model nor a lock behind."""
    cache = tmp_path / "cache"
    up = stoppable([*UP, "--port", str(free_cluster_port())], env={CACHE_DIR_ENV: str(cache)})
    up.wait_for("step ", START_TIMEOUT_S)  # training's progress: it is under way
    code, elapsed = up.stop(sig)
    assert code == 130, up.tail()
    assert "stopped before the cluster was ready" in up.tail()
    assert elapsed < STOP_LIMIT_S
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert not [name for name in left if not name.endswith(".lock")], left


def test_replicas_no_node_can_hold_are_named_and_the_stop_still_stops(
    stoppable: Any, random_model_dir: Path, free_cluster_port: Any, poll: Any
) -> None:
    """Replicas asking for a resource no node has: `pdserve up` names each deployment,
    what one replica asks for and what the cluster has (and /health says the same)
    instead of waiting in silence; Ctrl-C then stops it (Redis too: it is no longer in
    the terminal's process group)."""
    port = free_cluster_port()
    flags = ["--model", str(random_model_dir), "--port", str(port), "--replica-cpus", "0.5"]
    flags += ["--prefill-tp", "2", "--prefill-resources", '{"pdserve_test_pool": 1}']
    flags += ["--decode-resources", '{"pdserve_test_pool": 1}']
    up = stoppable([*UP, *flags])
    started = time.monotonic()
    prefill = up.wait_for("Prefill (application pdserve) cannot be scheduled", 120.0)
    decode = up.wait_for("Decode (application pdserve) cannot be scheduled", 60.0)
    assert time.monotonic() - started < 60.0
    assert "placement group of 2 bundles ({CPU 0.5, pdserve_test_pool 1} each)" in prefill
    assert "0 of 0 pdserve_test_pool free" in prefill
    assert "asks for CPU 0.5, pdserve_test_pool 1" in decode
    url = f"http://127.0.0.1:{port}"

    def both_named() -> Any:  # the router's report is refreshed every few seconds
        status, body = _health(url)
        named = {u["deployment"] for u in body.get("unscheduled", [])}
        return (status, body) if named == {"Prefill", "Decode"} else None

    status, body = poll("/health naming both pools unschedulable", both_named, 60.0, 0.5)
    assert status == 503, body
    code, elapsed = up.stop(signal.SIGINT)
    assert code == 130, up.tail()
    assert elapsed < STOP_LIMIT_S


def test_a_stream_longer_than_its_grace_ends_with_an_error_event(
    stoppable: Any, make_checkpoint: Any, free_cluster_port: Any
) -> None:
    """After the stop, new requests get 503 `shutting_down`; a stream still running when
    its grace ends gets an error event (`shutting_down`) and `[DONE]`, never a cut
    connection; and the whole stop takes less than 30 s."""
    model_dir = Path(make_checkpoint(max_position_embeddings=8192))
    port = free_cluster_port()
    flags = ["--model", str(model_dir), "--port", str(port), "--replica-cpus", "0"]
    flags += ["--dtype", "float32", "--shutdown-grace-s", "3", "--disagg-policy", "always"]
    up = stoppable([*UP, *flags])
    url = up.wait_for("pdserve ready at ", START_TIMEOUT_S).split()[-1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = [random.Random(5).randrange(5, 512) for _ in range(16)]
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=8000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    refused: Any = None
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            received += 1
            if received == 5:
                started = time.monotonic()
                up.proc.send_signal(signal.SIGINT)
            if received > 5 and refused is None:
                # a new request while the stream drains: refused, with Retry-After (on a
                # connection of its own: a pooled idle one may meet the server's
                # keep-alive timeout, which is not what this asks)
                status, refused = _post(f"{url}/v1/completions", model)
                if status != 503:
                    refused = None  # the drain had not begun yet
    assert not isinstance(caught.value, openai.APIConnectionError), "the stream was cut"
    assert caught.value.body is not None and caught.value.body["code"] == "shutting_down"
    assert refused is not None and refused[0]["error"]["code"] == "shutting_down", refused
    assert refused[1], "a refusal says when to retry"
    code, elapsed = up.wait_stopped(started)
    assert code == 0, up.tail()
    assert elapsed < STOP_LIMIT_S


def test_a_stop_after_a_worker_died(
    stoppable: Any, api: Any, random_model_dir: Path, free_cluster_port: Any, poll: Any
) -> None:
    flags = ["--model", str(random_model_dir), "--port", str(free_cluster_port())]
    flags += ["--replica-cpus", "0", "--heartbeat-s", "0.5", "--worker-lease-s", "3"]
    up = stoppable([*UP, *flags])
    url = up.wait_for("pdserve ready at ", START_TIMEOUT_S).split()[-1]
    (decode,) = [w for w in api.get_json(f"{url}/workers")["workers"] if w["role"] == "decode"]
    os.kill(decode["pid"], signal.SIGKILL)
    poll(  # its lease lapses (Serve may start its successor meanwhile, under another id)
        "the dead worker leaves the index",
        lambda: (
            decode["worker_id"]
            not in {w["worker_id"] for w in api.get_json(f"{url}/workers")["workers"]}
        ),
        60.0,
    )
    code, elapsed = up.stop(signal.SIGTERM)
    assert code == 0, up.tail()
    assert elapsed < STOP_LIMIT_S


def test_a_second_ctrl_c_stops_at_once(
    stoppable: Any, make_checkpoint: Any, free_cluster_port: Any
) -> None:
    """With a long grace and a stream running, the first Ctrl-C would wait; the second
    kills everything pdserve up started and exits (130) at once."""
    model_dir = Path(make_checkpoint(max_position_embeddings=8192))
    flags = ["--model", str(model_dir), "--port", str(free_cluster_port())]
    flags += ["--replica-cpus", "0", "--dtype", "float32", "--shutdown-grace-s", "120"]
    up = stoppable([*UP, *flags])
    url = up.wait_for("pdserve ready at ", START_TIMEOUT_S).split()[-1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(
        model=client.models.list().data[0].id, prompt="The river", max_tokens=8000,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    up.proc.send_signal(signal.SIGINT)
    up.wait_for("SIGINT: stopping", 30.0)
    next(chunks)  # still streaming: the first Ctrl-C drains
    code, elapsed = up.stop(signal.SIGINT, within_s=10.0)
    assert code == 130, up.tail()
    assert "SIGINT again: killing everything pdserve up started" in up.tail()
    assert elapsed < 10.0
