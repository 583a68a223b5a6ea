"""Peer fetch, engine side: a prefix's KV exported by the engine that holds it and
imported by one that does not, whose tokens must be those of computing the prompt
(transformers'), in float32 and with 8-bit caches, from the holder's pool or its tier."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.engine_config import EngineConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.worker.kv_handoff import KVImportError

MAX_TOKENS = 6
BLOCK = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Any) -> Path:
    return make_checkpoint(hidden_size=128, num_heads=4, num_kv_heads=2)


def _engine(checkpoint: Path, kv_dtype: str = "auto", **extra: Any) -> LLMEngine:
    config = EngineConfig(
        dtype="float32",
        kv_cache_dtype=kv_dtype,
        block_size=BLOCK,
        attention_backend="torch",
        **{"num_kv_blocks": 64, **extra},
    )
    return LLMEngine(checkpoint, config)


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy request run to its end."""
    engine.add_request(request_id, prompt, GREEDY)
    tokens, cached = [], 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens, cached = out.token_ids, max(cached, out.num_cached_tokens)
    return tokens, cached


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_fetched_prefix_gives_the_tokens_of_computing_it(
    checkpoint: Path, hf_greedy: Any, kv_dtype: str
) -> None:
    history = _prompt(1, 41)  # a conversation so far: 10 full blocks
    turn = history + _prompt(2, 9)  # its next turn
    quantized = {} if kv_dtype == "auto" else {"kv_cache_dtype": kv_dtype}
    reference = hf_greedy(checkpoint, [turn], MAX_TOKENS, **quantized)[0]
    holder, receiver = _engine(checkpoint, kv_dtype), _engine(checkpoint, kv_dtype)
    _run(holder, "earlier", history)
    num_blocks = (len(turn) - 1) // BLOCK  # what a lookup could use of the new turn: 12
    export = holder.export_prefix("f", turn, num_blocks)
    assert export is not None and len(export.block_hashes) == 10  # all the holder has
    written = receiver.import_prefix(turn, export.wait(), 0, export.block_hashes)
    export.release()
    assert written == 10
    tokens, cached = _run(receiver, "r", turn)
    assert tokens == reference
    assert cached == 40  # the fetched blocks were the prefix-cache hit
    holder.block_pool.check_no_leaks()
    receiver.block_pool.check_no_leaks()


def test_a_fetch_carries_only_the_blocks_past_what_the_receiver_holds(
    checkpoint: Path, hf_greedy: Any
) -> None:
    history = _prompt(3, 48)
    turn = history + _prompt(4, 5)
    reference = hf_greedy(checkpoint, [turn], MAX_TOKENS)[0]
    holder, receiver = _engine(checkpoint), _engine(checkpoint)
    _run(holder, "earlier", [*history, 9, 9])
    _run(receiver, "older", [*history[:20], 7])  # the receiver has the first 5 blocks
    export = holder.export_prefix("f", turn, 12, first_block=5)
    assert export is not None and export.first_block == 5 and export.wait().shape[2] == 7
    assert receiver.import_prefix(turn, export.wait(), 5, export.block_hashes) == 7
    export.release()
    tokens, cached = _run(receiver, "r", turn)
    assert (tokens, cached) == (reference, 48)


def test_the_holder_exports_from_its_tier(checkpoint: Path, hf_greedy: Any) -> None:
    """Blocks evicted to the holder's host tier are promoted and sent all the same."""
    history = _prompt(5, 40)
    turn = history + _prompt(6, 7)
    reference = hf_greedy(checkpoint, [turn], MAX_TOKENS)[0]
    holder = _engine(checkpoint, num_kv_blocks=16, kv_host_gib=0.001)
    receiver = _engine(checkpoint)
    _run(holder, "earlier", [*history, 5])
    for i in range(3):  # others push the history's blocks out of the pool, into the tier
        _run(holder, f"other{i}", _prompt(10 + i, 44))
    assert holder.load()["kv_host_demoted_blocks"] >= 10
    hits = holder.load()["kv_host_hit_blocks"]
    export = holder.export_prefix("f", turn, 10)
    assert export is not None and len(export.block_hashes) == 10
    assert holder.load()["kv_host_hit_blocks"] > hits
    receiver.import_prefix(turn, export.wait(), 0, export.block_hashes)
    export.release()
    assert _run(receiver, "r", turn) == (reference, 40)
    holder.block_pool.check_no_leaks()


def test_what_does_not_fit_is_refused_and_nothing_is_held(checkpoint: Path) -> None:
    holder, receiver = _engine(checkpoint), _engine(checkpoint)
    turn = _prompt(7, 30)
    assert holder.export_prefix("f", turn, 7) is None  # it holds nothing of it
    _run(holder, "earlier", turn)
    export = holder.export_prefix("f", turn, 7)
    assert export is not None
    payload, hashes = export.wait(), export.block_hashes
    other = _prompt(8, 30)
    with pytest.raises(KVImportError, match="not this prompt's prefix"):
        receiver.import_prefix(other, payload, 0, hashes)
    with pytest.raises(KVImportError, match="blocks"):
        receiver.import_prefix(turn, payload[:, :, :3], 0, hashes)
    with pytest.raises(KVImportError, match="cached here"):  # it lacks blocks 0..1
        receiver.import_prefix(turn, payload[:, :, 2:], 2, hashes[2:])
    export.release()
    assert receiver.block_pool.num_free_blocks == 64
    receiver.block_pool.check_no_leaks()
    holder.block_pool.check_no_leaks()


def test_a_fetched_prefix_is_held_for_its_request_until_admitted(
    checkpoint: Path, hf_greedy: Any
) -> None:
    """Imported for a request, the prefix stays referenced (nothing can evict it) until
    that request is admitted; one whose request never comes is let go at the next step."""
    history = _prompt(21, 40)
    turn = [*history, *_prompt(22, 7)]
    reference = hf_greedy(checkpoint, [turn], MAX_TOKENS)[0]
    holder, receiver = _engine(checkpoint), _engine(checkpoint)
    _run(holder, "earlier", [*history, 5])
    export = holder.export_prefix("f", turn, 10)
    assert export is not None
    payload, hashes = export.wait(), export.block_hashes
    free = receiver.block_pool.num_free_blocks
    assert receiver.import_prefix(turn, payload, 0, hashes, for_request="r") == 10
    assert receiver.block_pool.num_free_blocks == free - 10  # referenced: not evictable
    assert _run(receiver, "r", turn) == (reference, 40)
    receiver.import_prefix(turn, payload, 0, hashes, for_request="ghost")
    assert receiver.block_pool.num_free_blocks == free - 10
    _run(receiver, "other", _prompt(23, 9))  # a step: the ghost's hold ends
    assert receiver.block_pool.num_free_blocks == free
    export.release()
    receiver.block_pool.check_no_leaks()
