"""A non-driver rank of a tensor-parallel decode replica killed mid-stream.

Real cluster (`pdserve up`, 1 prefill worker, 2 decode replicas of TP=2 each), a tiny
float32 checkpoint, the official client. Rank 1 of the replica serving a long greedy
stream is SIGKILLed after a few tokens: the replica's next collective fails at once (the
peer's socket closed; a stalled rank would fail it within distributed_timeout_s), its
engine stops and fails its streams, the replica leaves the index, and the router resumes
the stream on the other replica. The client must receive exactly `transformers`' greedy
tokens, and afterwards no surviving worker holds a KV block or a pending transfer.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 300


def test_a_stream_survives_a_rank_of_its_decode_replica_dying(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any
) -> None:
    model_dir = Path(make_checkpoint(num_heads=4, num_kv_heads=2, max_position_embeddings=1024))
    rng = random.Random(12)
    prompt = [rng.randrange(5, 512) for _ in range(40)]
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)
    flags = (
        *("--mode", "disagg", "--transport", "grpc", "--decode-tp", "2"),
        *("--prefill-replicas", "1", "--decode-replicas", "2", "--replica-cpus", "0.1"),
        *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "3"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = api.greedy_stream(client, client.models.list().data[0].id, prompt, MAX_TOKENS)
        got: list[int] = []
        killed = None
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if killed is None and len(got) >= 8:
                busy = [w for w in api.get_json(f"{url}/workers")["workers"] if w["running"]]
                assert len(busy) == 1 and busy[0]["role"] == "decode", busy
                killed = busy[0]
                ranks = killed["tensor_parallel"]["ranks"]
                assert ranks[1]["pid"] != killed["pid"], "rank 1 is a process of its own"
                os.kill(ranks[1]["pid"], signal.SIGKILL)
        assert killed is not None
        assert got == want, "the resumed stream must continue exactly where it broke"
        assert api.metric(url, "pdserve_decode_resumes_total") == 1.0
        assert api.local_prefills(url) == {"resume": 1.0}
        assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0  # the split happened
        for w in api.get_json(f"{url}/workers")["workers"]:
            if w["worker_id"] != killed["worker_id"] and "error" not in w:
                assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
                assert w.get("pending_transfers", 0) == 0, w
