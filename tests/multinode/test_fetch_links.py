"""Peer fetch across real links: a colocated cluster of a head (router, Redis) and two
decode nodes, each a network namespace of its own (conftest.py), the KV crossing from
one decode node to the other over its veth.

Each conversation's history is served, then its next turn; round-robin placement puts
the two on different workers, so the turn's worker lacks the history that the other
holds. Whether it fetches it is the router's measured choice (router/fetch.py): a push
sooner than computing is fetched, a slower one is not. On plain links every turn after
the first fetches; with both decode links shaped to a trickle (`tc`, a token bucket),
the first fetches are measured slow and the later turns compute their history instead.
Tokens are the reference either way.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.benchmarks.netns import start_cluster

MAX_TOKENS = 4
HISTORY = 512  # 32 blocks of 16: 512 KiB of KV with this checkpoint
CONVERSATIONS = 6


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    # 1 KiB of KV per token (2 layers, 1 KV head of 64, float32) but ~6 M multiply-adds
    # per token to compute it: on a plain veth a block's push is far sooner than its
    # computation, on a 4 Mbit/s link far later
    return Path(
        make_checkpoint(
            hidden_size=512,
            num_layers=2,
            num_heads=8,
            num_kv_heads=1,
            intermediate_size=1376,
            max_position_embeddings=1024,
        )
    )


def fetch_counts(url: str) -> dict[str, float]:
    metrics = scrape_metrics(url)
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in metrics.items()
        if name == "pdserve_kv_fetch_total" and value
    }


@pytest.mark.parametrize("link", ["plain", "slow"])
def test_placement_fetches_over_a_fast_link_and_computes_over_a_slow_one(
    make_topology: Any, model_dir: Path, hf_greedy: Any, tmp_path: Path, link: str
) -> None:
    import openai

    rng = random.Random(97)
    histories = [[rng.randrange(5, 500) for _ in range(HISTORY)] for _ in range(CONVERSATIONS)]
    turns = [[*h, *(rng.randrange(5, 500) for _ in range(7))] for h in histories]
    prompts = [p for pair in zip(histories, turns, strict=True) for p in pair]
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    with make_topology(3) as topo:
        decode_nodes = topo.nodes[1:]
        flags = [
            *("--mode", "colocated", "--placement", "round-robin", "--router-index", "redis"),
            *("--dtype", "float32", "--threads", "1"),
        ]
        url = start_cluster(
            topo, model_dir, "grpc", ["router", "decode", "decode"], tmp_path, flags
        )
        if link == "slow":
            for node in decode_nodes:  # each holder's pushes leave through its egress
                topo.shape(node, rate="4mbit", delay="0ms", burst="32kb")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        extra = {"ignore_eos": True, "return_token_ids": True}
        got = []
        for history, turn in zip(histories, turns, strict=True):
            for prompt in (history, turn):
                out = client.completions.create(
                    model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body=extra,
                )  # fmt: skip
                got.append(list(out.choices[0].model_extra["token_ids"]))
        assert got == want
        counts = fetch_counts(url)
        used = counts.get("used", 0)
        moved = sample(scrape_metrics(url), "pdserve_kv_fetch_bytes_total")
        print(f"{link}: fetches {counts}, bytes {moved:.0f}")
        assert set(counts) <= {"used", "already_held"}, counts  # nothing failed
        if link == "plain":
            # the turns placed away from their history fetched it, also once the rate was
            # measured (the third fetch and on), but for any that Serve gave to the holder
            # itself after all (`already_held`: right after start-up it may not route a
            # call to the replica named, as often as twice in a run)
            assert used >= 3, counts
        else:
            # the first push between the two workers opened their connection (not a
            # rate: router/disagg.py, `fetch_done`); the second was measured slow, and
            # the turns after it computed their history
            assert used <= 2, counts
        # every fetch used was pushed in full, and its report reached the router (none
        # for a request Serve gave to the holder itself: `already_held`, nothing pushed)
        assert moved == used * HISTORY * 1024, (moved, counts)
