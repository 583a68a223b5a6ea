"""Peer fetch on a real cluster: two decode workers, `pdserve up`, colocated,
disaggregated with prompts the router leaves to the decode workers, and disaggregated
with every prompt prefilled by one of two prefill workers, which fetches.

A conversation's history is served by one worker; its next turns are placed round-robin,
so one lands on the other worker, which does not hold the history. The holder pushes
the history's blocks there over the KV transport (gRPC or UCX): the turn's tokens are
the reference, its usage counts the fetched blocks as cached, and the router's counters
say the fetch was used. (A holder that fails mid-fetch: tests/decode_worker/
test_peer_fetch.py and tests/router/test_fetch.py, each side on its own.)

The router matches prompts in Redis itself (`--router-index redis`): a worker's blocks
are in the index before the response that made them ends, so the next turn's placement
sees them without waiting.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.router.metrics import FETCH_OUTCOMES

MAX_TOKENS = 6
BLOCK = 8
HISTORY = 160  # 20 blocks
FLAGS = (
    *("--decode-replicas", "2", "--replica-cpus", "0"),
    *("--dtype", "float32", "--block-size", str(BLOCK), "--threads", "1"),
    *("--placement", "round-robin", "--router-index", "redis"),
    *("--kv-wait-timeout-s", "10"),
)
MODES = {
    "colocated": ("--mode", "colocated"),
    # every prompt here is short enough for the decode worker: the router leaves each to
    # the decode worker it places it on, which prefills it (fetching what it can)
    "disagg": (
        *("--mode", "disagg", "--prefill-replicas", "1"),
        *("--disagg-policy", "conditional", "--local-prefill-max-tokens", "400"),
    ),
    # every prompt goes to the prefill pool, round-robin over two prefill workers: the
    # turn's prefill worker lacks the history that the other one (and a decode worker)
    # holds, and fetches it before it prefills the rest
    "disagg-prefill": (
        *("--mode", "disagg", "--prefill-replicas", "2", "--disagg-policy", "always"),
    ),
}


def fetches(api: Any, url: str) -> dict[str, float]:
    return {
        outcome: api.metric(url, "pdserve_kv_fetch_total", outcome=outcome)
        for outcome in FETCH_OUTCOMES
    }


@pytest.mark.parametrize(
    ("mode", "transport"),
    [
        ("colocated", "grpc"),
        ("colocated", "ucx"),
        ("disagg", "grpc"),
        ("disagg-prefill", "ucx"),
        ("disagg-prefill", "grpc"),
    ],
)
def test_a_turn_placed_away_from_its_history_fetches_it(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, mode: str, transport: str
) -> None:
    model_dir = Path(make_checkpoint(max_position_embeddings=1024))
    rng = random.Random(83)
    history = [rng.randrange(5, 512) for _ in range(HISTORY)]
    turns = [[*history, *(rng.randrange(5, 512) for _ in range(9 + i))] for i in range(8)]
    want = hf_greedy(model_dir, [history, *turns], MAX_TOKENS)
    with pdserve_up(model_dir, *FLAGS, *MODES[mode], "--transport", transport) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert api.greedy(client, model, history, MAX_TOKENS) == want[0]

        # Round-robin over two workers: of two turns, one goes to the worker without the
        # history, which fetches it. (Right after start-up Serve may still give a call
        # to the other replica than the chosen one, `pdserve_placement_overrides_total`:
        # that turn computes its prompt where it lands; then the next turns go on.)
        for i, turn in enumerate(turns):
            out = client.completions.create(
                model=model, prompt=turn, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert list(out.choices[0].model_extra["token_ids"]) == want[1 + i]
            if fetches(api, url)["used"]:
                # served from the whole history: the blocks it fetched
                assert out.usage is not None and out.usage.prompt_tokens_details is not None
                assert out.usage.prompt_tokens_details.cached_tokens == HISTORY
                break
        counts = fetches(api, url)
        assert counts["used"] == 1, counts
        assert api.metric(url, "pdserve_kv_fetch_blocks_total") == HISTORY // BLOCK
        assert api.metric(url, "pdserve_kv_fetch_bytes_total") > 0
        failed = {k: v for k, v in counts.items() if k not in ("used", "already_held") and v}
        assert not failed, counts
        if mode == "disagg-prefill":  # the split happened for every request
            assert api.local_prefills(url) == {}
            assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0
