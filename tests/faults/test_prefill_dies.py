"""A prefill worker killed while the index still lists it: no request is lost.

Requests placed on the dead worker (its lease has not run out yet) are prefilled by the
other prefill worker or, when the push cannot happen, by their decode worker, which is
told at once instead of waiting out its KV lease. Every request gets the reference
tokens; afterwards nothing is held and no transfer is pending.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import openai

MAX_TOKENS = 6
KV_WAIT_S = 30.0  # long on purpose: a request that waited it out would show


def test_requests_survive_a_dead_prefill_worker(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any
) -> None:
    model_dir = Path(make_checkpoint())
    rng = random.Random(41)
    prompts = [[rng.randrange(5, 512) for _ in range(20 + 7 * i)] for i in range(8)]
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    flags = (
        *("--prefill-replicas", "2", "--decode-replicas", "1", "--replica-cpus", "0"),
        *("--dtype", "float32", "--block-size", "8", "--threads", "1"),
        *("--heartbeat-s", "0.5", "--worker-lease-s", "10"),
        *("--kv-wait-timeout-s", str(KV_WAIT_S)),
    )
    with pdserve_up(model_dir, *flags) as url:
        workers = api.get_json(f"{url}/workers")["workers"]
        victim = next(w for w in workers if w["role"] == "prefill")
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
