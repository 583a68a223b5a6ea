"""Faults only several hosts can have: a prefill node cut mid-transfer and brought back,
a decode node that loses Redis but keeps its Ray link, a decode node cut mid-stream.

Four namespace hosts (head: Ray head, Redis on an address of its own, router; one prefill
node; two decode nodes), started as an operator starts them (`pdserve.benchmarks.netns`),
one cluster for the three faults, in turn:

1. The prefill node's link is slowed (a token bucket) so that a 1,000-token prompt's KV
   takes seconds to cross, and cut once its bytes are flowing. The request must still get
   `transformers`' tokens (its decode worker prefills it itself once the prefill call
   fails); the prefill worker must leave placement within its lease + 1 s; with no
   prefill node, requests are served by local prefill ("no_prefill_worker"). The node
   then comes back as an operator brings a host back (`ray start` again): Serve places
   the prefill replica there, it registers anew, and requests are split again.
2. A decode node loses Redis (a blackhole route to Redis's address) while streaming: the
   stream completes over its Ray link; the worker leaves placement within lease + 1 s,
   requests go to the other decode node meanwhile; when Redis is back it registers with a
   new generation and receives traffic again (its cached prefix draws a request there).
3. The decode node serving a long greedy stream loses its link while its processes keep
   running: the router resumes the stream on the other decode node (exactly
   `transformers`' tokens); the partitioned worker leaves placement within lease + 1 s;
   when the link comes back the cut node's old state does not serve (Ray declared the
   node dead, so its raylet and replicas exit) while the cluster serves on.

Afterwards no worker holds a KV block or a pending transfer.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.benchmarks.netns import start_cluster, watch_leaving

LEASE_S = 3.0
HEARTBEAT_S = 0.5
# Ray's own failure detection, shortened so that a cut node is declared dead in ~2 s
RAY_HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}
# The request cut mid-push ends only when the router stops waiting for the prefill
# worker's report (its call to the cut node's replica does not fail within the default
# 30 s); the cut push never needs long, nor do the unshaped ones
TRANSFER_TIMEOUT_S = 8.0
CUT_TOKENS = 800  # streams long enough to act on while they run
STREAM_TOKENS = 800


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(max_position_embeddings=1024))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def workers(url: str, role: str | None = None) -> list[dict[str, Any]]:
    return [
        w
        for w in get_json(f"{url}/workers")["workers"]
        if "error" not in w and (role is None or w["role"] == role)
    ]


def live(url: str, role: str) -> int:
    """Live workers of a pool, as `/health` says (503 while a pool has none)."""
    try:
        health = get_json(f"{url}/health")
    except urllib.error.HTTPError as exc:
        health = json.loads(exc.read())
    return int(health["workers"].get(role, 0))


def placed(url: str, worker_id: str) -> float:
    return sample(scrape_metrics(url), "pdserve_placements_total", role="decode", worker=worker_id)


def test_faults_only_several_hosts_have(
    make_topology: Any, model_dir: Path, hf_greedy: Any, tmp_path: Path, api: Any, poll: Any
) -> None:
    import openai

    long_prompt = [5 + (17 * j) % 500 for j in range(1000)]
    shared = [7 + (29 * j) % 500 for j in range(64)]
    stream_prompt = [*shared, 11, 12, 13]
    short = [[*shared, 20 + i] for i in range(2)] + [[40 + (3 * j) % 400 for j in range(30)]]
    cut_prompt = [5 + (13 * j) % 500 for j in range(40)]
    (want_long,) = hf_greedy(model_dir, [long_prompt], 16)
    (want_cut,) = hf_greedy(model_dir, [cut_prompt], CUT_TOKENS)
    (want_stream,) = hf_greedy(model_dir, [stream_prompt], STREAM_TOKENS)
    want_short = hf_greedy(model_dir, short, 16)
    # the stream's own prompt and first 100 tokens: cached on the worker that streamed it
    # alone (the other decode node gets `shared` only), so placement sends it there
    again = [*stream_prompt, *want_stream[:100]]
    (want_again,) = hf_greedy(model_dir, [again], 16)
    with make_topology(4) as topo:
        pools = ["router", "prefill", "decode", "decode"]
        flags = ["--dtype", "float32", "--disagg-policy", "always", "--block-size", "8"]
        flags += ["--heartbeat-s", str(HEARTBEAT_S), "--worker-lease-s", str(LEASE_S)]
        flags += ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
        url = start_cluster(topo, model_dir, "grpc", pools, tmp_path, flags, RAY_HEALTH)
        by_address = {n.address: n for n in topo.nodes}
        prefill_node = topo.nodes[1]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(prompt: list[int], n: int = 16) -> list[int]:
            return list(api.greedy(client, model, prompt, n))

        # -- 1. the prefill node, cut while its KV push is on the wire --------------------
        (old_prefill,) = workers(url, "prefill")
        # ~2 MiB of KV: ~2 s on the wire (a small burst: the bucket must not let it all go)
        topo.shape(prefill_node, "8mbit", "100us", burst="32kb")
        _, sent_before = prefill_node.rx_tx_bytes()
        result: dict[str, Any] = {}

        def long_request() -> None:
            try:
                result["tokens"] = complete(long_prompt)
            except Exception as exc:  # reported by the assertion below
                result["error"] = exc

        thread = threading.Thread(target=long_request)
        thread.start()
        poll(
            "the KV push is on the wire",
            lambda: prefill_node.rx_tx_bytes()[1] - sent_before > 300_000,
            60,
        )
        topo.cut(prefill_node)
        gone = watch_leaving(topo.redis_url, model, old_prefill["worker_id"], LEASE_S)
        thread.join(120)
        assert not thread.is_alive(), "the request cut mid-transfer never ended"
        assert result.get("tokens") == want_long[:16], result
        local = api.local_prefills(url)
        assert sum(local.values()) == 1, local  # its decode worker prefilled it
        assert set(local) <= {"prefill_failed", "transfer_failed", "kv_late"}, local
        left_s = gone.result(timeout=LEASE_S + 15)
        print(f"cut prefill worker left placement {left_s:.2f} s after the cut")
        assert left_s <= LEASE_S + 1.0, f"left placement after {left_s:.1f} s"
        assert live(url, "prefill") == 0
        # no prefill node: served all the same, by local prefill, and said so
        assert complete(short[2]) == want_short[2]
        assert api.local_prefills(url).get("no_prefill_worker") == 1.0

        # the node comes back as an operator brings a host back
        topo.heal(prefill_node)
        topo.unshape(prefill_node)
        topo.rejoin(prefill_node)

        # Settled: one prefill worker, a new one. The cut node's old replica may reach the
        # index for a moment after the heal (its raylet is told the node died and kills it
        # only once it reconnects), so its id is waited out, not taken for the new one.
        def replaced() -> bool:
            ids = [w["worker_id"] for w in workers(url, "prefill")]
            return len(ids) == 1 and ids[0] != old_prefill["worker_id"]

        poll("a new prefill worker registers", replaced, 180)
        blocks = api.metric(url, "pdserve_kv_transfer_blocks_total")
        local_before = sum(api.local_prefills(url).values())
        assert complete(short[0]) == want_short[0]
        assert api.metric(url, "pdserve_kv_transfer_blocks_total") > blocks, "split again"
        assert sum(api.local_prefills(url).values()) == local_before

        # -- 2. a decode node loses Redis mid-stream, keeps its Ray link ------------------
        stream = api.greedy_stream(client, model, stream_prompt, STREAM_TOKENS)
        got: list[int] = []
        victim = None
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if victim is None and len(got) >= 8:
                (victim,) = [w for w in workers(url, "decode") if w["running"]]
                node = by_address[re.sub(r":\d+$", "", victim["address"])]
                topo.cut_redis(node)
                gone = watch_leaving(topo.redis_url, model, victim["worker_id"], LEASE_S)
        assert victim is not None
        assert got == want_stream, "the stream must finish over the Ray link"
        resumed = api.metric(url, "pdserve_decode_resumes_total")
        assert resumed == 0, "a worker that only lost Redis keeps its channel"
        left_s = gone.result(timeout=LEASE_S + 15)
        print(f"decode worker without Redis left placement {left_s:.2f} s after the cut")
        assert left_s <= LEASE_S + 1.0, f"left placement after {left_s:.1f} s"
        # meanwhile its cached prefix draws nothing there: the other decode node serves
        before = placed(url, victim["worker_id"])
        assert complete(short[1]) == want_short[1]
        assert placed(url, victim["worker_id"]) == before
        # Redis back: it registers anew (a new generation) and serves again
        topo.restore_redis(node)

        def registered_anew() -> bool:
            mine = [w for w in workers(url, "decode") if w["worker_id"] == victim["worker_id"]]
            return bool(mine) and mine[0]["generation"] > victim["generation"]

        poll("the decode worker registers with a new generation", registered_anew, 30)
        poll("it is live again", lambda: live(url, "decode") == 2, 30)
        assert complete(again) == want_again  # its cached prefix draws it
        assert placed(url, victim["worker_id"]) == before + 1

        # -- 3. a decode node cut off mid-stream, its processes running -----------------
        stream = api.greedy_stream(client, model, cut_prompt, CUT_TOKENS)
        got = []
        cut_worker: dict[str, Any] | None = None
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if cut_worker is None and len(got) >= 8:
                (cut_worker,) = [w for w in workers(url, "decode") if w["running"]]
                node = by_address[re.sub(r":\d+$", "", cut_worker["address"])]
                topo.cut(node)
                # watch the index from the cut on, while the stream goes on resuming
                gone = watch_leaving(topo.redis_url, model, cut_worker["worker_id"], LEASE_S)
        assert cut_worker is not None
        assert got == want_cut, "the resumed stream must continue exactly where it broke"
        assert api.metric(url, "pdserve_decode_resumes_total") == 1.0
        # the partitioned worker leaves placement within its lease (+ 1 s): the index
        # placement reads, watched directly (the router's HTTP path would add its own
        # latency on a loaded machine)
        left_s = gone.result(timeout=LEASE_S + 15)
        print(f"cut decode worker left placement {left_s:.2f} s after the cut")
        assert left_s <= LEASE_S + 1.0, f"left placement after {left_s:.1f} s"
        assert live(url, "decode") == 1
        # the link comes back: the old node's state must not serve again. Either Ray has
        # declared the node dead (its raylet and replicas exit), or the worker registers
        # anew, with a new generation, from its current state; the cluster serves on
        topo.heal(node)
        for _ in range(3):
            assert complete(cut_prompt) == want_cut[:16]

        def settled() -> str | None:
            listed = get_json(f"{url}/workers")["workers"]
            mine = [w for w in listed if w["worker_id"] == cut_worker["worker_id"]]
            if not mine:
                return "gone"
            if "error" not in mine[0] and mine[0]["generation"] > cut_worker["generation"]:
                return "registered anew"
            return None

        poll("the cut worker is gone or registered anew", settled, 30)
        print(f"cut decode worker after the link came back: {settled()}")

        for w in workers(url):
            assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
            assert w.get("pending_transfers", 0) == 0, w
