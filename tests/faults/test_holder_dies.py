"""A prefix's holder killed in the middle of a peer fetch: the receiver computes the
prompt at once, with the reference tokens, and the router counts why.

Real cluster (`pdserve up`, colocated, two decode workers, round-robin placement, gRPC),
a tiny float32 checkpoint, the official client. A conversation's history is served by
one worker (the holder); the holder is then frozen (SIGSTOP), so that the next turn,
placed on the other worker, waits there for the history's blocks while the holder's push
hangs. Once the receiver expects them, the holder is killed (SIGKILL): its push call
fails, the router tells the receiver to stop waiting (`cancel_kv`), and the turn is
computed where it is. Its tokens are `transformers'`; `pdserve_kv_fetch_total` says
`holder_failed`, not `late` (the receiver did not wait its KV wait out); afterwards the
receiver holds no block and expects no transfer.

(The same failure with each side in one process: tests/decode_worker/test_peer_fetch.py
and tests/router/test_fetch.py.)
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from pdserve.router.metrics import FETCH_OUTCOMES

MAX_TOKENS = 6
BLOCK = 8
HISTORY = 160  # 20 blocks
KV_WAIT_S = 60.0  # long on purpose: a turn that waited it out would say `late`
POLL_DEADLINE_S = 30.0
FLAGS = (
    *("--mode", "colocated", "--decode-replicas", "2", "--replica-cpus", "0"),
    *("--dtype", "float32", "--block-size", str(BLOCK), "--threads", "1"),
    *("--placement", "round-robin", "--router-index", "redis", "--transport", "grpc"),
    *("--heartbeat-s", "0.5", "--worker-lease-s", "20"),
    # a fetch's wait is what computing its blocks would take plus this floor: here the
    # whole KV wait, so that the receiver still waits when the holder is killed
    *("--kv-wait-timeout-s", str(int(KV_WAIT_S)), "--kv-wait-floor-s", str(int(KV_WAIT_S))),
)


def test_a_holder_killed_mid_fetch_leaves_the_receiver_computing_the_prompt(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, poll: Any
) -> None:
    model_dir = Path(make_checkpoint(max_position_embeddings=1024))
    rng = random.Random(97)
    history = [rng.randrange(5, 512) for _ in range(HISTORY)]
    turn = [*history, *(rng.randrange(5, 512) for _ in range(11))]
    want_history, want_turn = hf_greedy(model_dir, [history, turn], MAX_TOKENS)
    with pdserve_up(model_dir, *FLAGS) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def own_states() -> dict[str, Any]:
            own = {w["worker_id"]: w for w in api.own_workers(url)}
            return own if len(own) == 2 else {}

        workers = poll("both workers answer for themselves", own_states, POLL_DEADLINE_S)

        def served_by(worker_id: str) -> float:
            return api.metric(url, "pdserve_placements_total", role="decode", worker=worker_id)

        before = {w: served_by(w) for w in workers}
        assert api.greedy(client, model, history, MAX_TOKENS) == want_history
        (holder,) = [w for w in workers if served_by(w) > before[w]]
        (receiver,) = [w for w in workers if w != holder]

        def pending() -> float:
            return api.metric(
                url, "pdserve_worker_pending_transfers", worker=receiver, role="decode"
            )

        os.kill(workers[holder]["pid"], signal.SIGSTOP)  # its push cannot start now
        with ThreadPoolExecutor(1) as pool:
            # round-robin: the turn goes to the receiver, which lacks the history
            answer = pool.submit(api.greedy, client, model, turn, MAX_TOKENS)
            try:
                poll("the receiver expects the history's blocks", lambda: pending() == 1,
                     POLL_DEADLINE_S)  # fmt: skip
            finally:
                os.kill(workers[holder]["pid"], signal.SIGKILL)
            assert answer.result(timeout=KV_WAIT_S) == want_turn

        counts = {o: api.metric(url, "pdserve_kv_fetch_total", outcome=o) for o in FETCH_OUTCOMES}
        assert {o: v for o, v in counts.items() if v} == {"holder_failed": 1.0}, counts
        assert api.metric(url, "pdserve_kv_fetch_blocks_total") == 0

        def receiver_idle() -> bool:
            states = {w["worker_id"]: w for w in api.get_json(f"{url}/workers")["workers"]}
            r = states.get(receiver, {})
            return (r.get("running"), r.get("kv_blocks_used"), r.get("pending_transfers")) == (
                0,
                0,
                0,
            )

        poll("the receiver holds nothing and expects nothing", receiver_idle, POLL_DEADLINE_S)
