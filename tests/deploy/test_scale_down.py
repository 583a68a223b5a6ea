"""A pool scaled down under load loses nothing (cluster/drain.py): `pdserve up` with
three decode workers and the external scaler, sixteen greedy streams running, then
`pdserve scale decode 1`. Nothing is killed: Serve stops two replicas, the router sees
them go and tells them to drain; each leaves the index at once, lets its streams run
for `--drain-deadline-s`, then moves those still running to the worker that stays,
which resumes them from the tokens already streamed. Every stream must end with
exactly `transformers`' tokens; the two drain notices are counted."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from json import loads
from pathlib import Path
from typing import Any

import openai
import pytest
import ray

from pdserve.deploy.app import APP_NAME
from pdserve.deploy.cli import join_cluster
from pdserve.router.models import DECODE_DEPLOYMENT
from pdserve.router.scaler import set_replicas

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'

STREAMS = 16
# long enough that every stream still runs when the last one's first token came (on a
# busy 2-core host that can take seconds) and outlasts the notice and the deadline
TOKENS = 3500
DEADLINE_S = 0.5
FLAGS = (
    *("--mode", "colocated", "--decode-replicas", "3", "--external-scaler"),
    *("--drain-deadline-s", str(DEADLINE_S), "--dtype", "float32", "--block-size", "16"),
    # the worker that stays holds every stream's KV (16 x 3,505 tokens in 4,096 blocks of
    # 16): with a quarter of that (CI, 2026-12-06) it re-prefilled the resumed streams
    # by preempting each other, and 6 resumed submits saw no "accepted" within 120 s
    *("--replica-cpus", "0", "--threads", "1", "--num-kv-blocks", "4096"),
    *("--max-num-seqs", "32"),
)


def _decode_workers(url: str) -> dict[str, int]:
    """Each live decode worker's running requests (`/workers`)."""
    with urllib.request.urlopen(f"{url}/workers", timeout=30) as resp:
        workers = loads(resp.read())["workers"]
    return {w["worker_id"]: w.get("running", 0) for w in workers if w["role"] == "decode"}


def test_scaling_the_decode_pool_from_3_to_1_under_16_streams_loses_none(
    make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, api: Any, poll: Any
) -> None:
    model = Path(make_checkpoint(max_position_embeddings=4096, hidden_size=128, num_layers=4))
    prompts = [[7 + i, 40 + 3 * i, 9, 200 + i, 11 + 2 * i] for i in range(STREAMS)]
    with pdserve_up(model, *FLAGS) as url:
        assert url.ray_address
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
        name = client.models.list().data[0].id
        poll("three decode workers", lambda: len(_decode_workers(url)) == 3, 60)
        before = set(_decode_workers(url))
        # a driver of the cluster, joined before the streams start: the scale-down then
        # comes at once (`pdserve scale` joins the cluster first, seconds)
        join_cluster(url.ray_address)
        try:
            got, errors, running = _scale_down_under_streams(api, client, name, prompts)
        finally:
            ray.shutdown()
        assert not errors, errors
        # held to transformers by one forward pass each (`generate`: 90 s more)
        want = hf_greedy(model, prompts, TOKENS, candidates=got)
        assert got == want
        # most streams still ran when the scale-down came, on two workers at least: of
        # the two that left, one had streams
        assert sum(running.values()) >= STREAMS // 2, running
        assert sum(n > 0 for n in running.values()) >= 2, running
        (stays,) = _decode_workers(url)
        assert stays in before
        assert api.metric(url, "pdserve_drain_notices_total", role="decode") == 2
        # Streams still running at the deadline moved (a migrate item each; counted as
        # resumes too). Serve may stop a replica before its deadline (it does not count
        # the channels' requests as the replica's): the replica then waits for them
        # itself, or, stopped anyway, its streams resume as after a failure. Either way
        # none is lost (above); at most one resume each.
        migrated = api.metric(url, "pdserve_drain_migrations_total")
        assert migrated <= api.metric(url, "pdserve_decode_resumes_total") <= STREAMS
        # the pool that stays serves on, and grows again with `pdserve scale`
        assert api.greedy(client, name, prompts[0], 8) == want[0][:8]
        scale = subprocess.run(
            [sys.executable, "-m", "pdserve.deploy.cli", "scale", "decode", "2",
             "--address", url.ray_address],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert scale.returncode == 0, scale.stderr
        poll("a second decode worker", lambda: len(_decode_workers(url)) == 2, 120)


def _scale_down_under_streams(
    api: Any, client: openai.OpenAI, name: str, prompts: list[list[int]]
) -> tuple[list[list[int]], list[BaseException], dict[str, int]]:
    """Start the streams; once each has its first token, scale the decode pool to 1;
    return every stream's tokens, the errors, and the workers' running requests when
    the scale-down came."""
    got: list[list[int]] = [[] for _ in range(STREAMS)]
    errors: list[BaseException] = []
    started = threading.Barrier(STREAMS + 1, timeout=120)
    url = str(client.base_url).removesuffix("/v1/")

    def stream(i: int) -> None:
        try:
            for n, chunk in enumerate(api.greedy_stream(client, name, prompts[i], TOKENS)):
                got[i] += chunk.choices[0].model_extra["token_ids"]
                if n == 0:
                    started.wait()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token: all sixteen run
    running = _decode_workers(url)
    set_replicas(APP_NAME, DECODE_DEPLOYMENT, 1)  # what `pdserve scale` calls
    for t in threads:
        t.join(timeout=300)
    return got, errors, running
