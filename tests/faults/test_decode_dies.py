"""A decode worker killed mid-stream: the stream resumes elsewhere, tokens exact.

Real cluster (`pdserve up`, 1 prefill + 2 decode workers), a tiny float32 checkpoint,
the official client. The replica serving a long greedy stream is SIGKILLed after a few
tokens; the client must receive exactly `transformers`' greedy tokens, with no gap and
no duplicate, and afterwards no KV block may be referenced and no transfer pending. The
only prompt a decode worker prefilled itself is the resumed one (it prefills the tokens
streamed so far on purpose).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 600


def test_a_stream_survives_its_decode_worker_dying(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any
) -> None:
    model_dir = Path(make_checkpoint(max_position_embeddings=1024))
    rng = random.Random(11)
    prompt = [rng.randrange(5, 512) for _ in range(40)]
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)
    flags = (
        *("--prefill-replicas", "1", "--decode-replicas", "2", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "3"),
    )
    with pdserve_up(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = api.greedy_stream(client, client.models.list().data[0].id, prompt, MAX_TOKENS)
        got: list[int] = []
        killed, killed_at = None, 0
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if killed is None and len(got) >= 8:
                busy = [w for w in api.own_workers(url) if w["running"]]
                who = [(w["worker_id"], w["role"], w["pid"], w["running"]) for w in busy]
                assert len(busy) == 1 and busy[0]["role"] == "decode", who
                killed, killed_at = busy[0], len(got)
                os.kill(killed["pid"], signal.SIGKILL)
        assert killed is not None
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        assert got == want, (
            f"the resumed stream must continue exactly where it broke: {len(got)} tokens"
            f" of {len(want)}, first difference at {first} (killed after {killed_at})"
        )
        resumes = api.metric(url, "pdserve_decode_resumes_total")
        assert (resumes, api.local_prefills(url)) == (1.0, {"resume": 1.0})
        for w in api.own_workers(url):
            if w["worker_id"] != killed["worker_id"]:
                assert (w["running"], w["kv_blocks_used"]) == (0, 0), w
                assert w.get("pending_transfers", 0) == 0, w
