"""The KV handoff in parts: KV heads split the way tensor-parallel ranks own them.

A tensor-parallel decode replica's ranks each receive their own KV heads; a prefill
replica's ranks each send theirs (runtime/tp_ranks.py). The engine side of that is
`export_kv(..., ranges)` (one part per receiving rank's heads) and
`add_prefilled_request` with parts: here on one-rank engines, so the arithmetic is
checked without processes: tokens equal the colocated engine's whatever the split, a
replicated head goes once, and parts that do not tile the heads are refused, holding
nothing.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.worker.kv_handoff import KVImportError, export_ranges

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=64))


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def test_export_ranges_cut_each_ranks_overlap_once() -> None:
    # prefill TP=1 (heads 0-4) to a decode replica of 2 ranks
    assert export_ranges((0, 4), True, [(0, 2), (2, 4)]) == [(0, 2), (2, 4)]
    # prefill rank holding heads 2-4, to one receiver of all heads, or to 4 ranks
    assert export_ranges((2, 4), True, None) == [(2, 4)]
    assert export_ranges((2, 4), True, [(0, 1), (1, 2), (2, 3), (3, 4)]) == [(2, 3), (3, 4)]
    # decode ranks replicating a head own equal ranges: each distinct range is packed once
    assert export_ranges((0, 2), True, [(0, 1), (0, 1), (1, 2), (1, 2)]) == [(0, 1), (1, 2)]
    # a replicated prefill head: only its lowest rank sends it
    assert export_ranges((1, 2), False, [(0, 2)]) == []


@pytest.mark.parametrize("ranges", [[(0, 1), (1, 2)], [(0, 2)], None])
def test_parts_tokens_equal_colocated(model_dir: Path, ranges: Any) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(3, 512) for _ in range(23)]
    colocated = engine(model_dir)
    colocated.add_request("r", prompt, GREEDY)
    expected = run_to_end(colocated)["r"]

    p_eng, d_eng = engine(model_dir), engine(model_dir)
    p_eng.add_request("r", prompt, PREFILL, hold_kv=True)
    (first,) = run_to_end(p_eng)["r"]
    export = p_eng.export_kv("r", 0, ranges)
    parts = export.wait_parts()
    assert [r for r, _ in parts] == (ranges or [(0, 2)])
    for (start, end), tensor in parts:  # [layers, 2, blocks, heads of the part, ...]
        assert tensor.shape[2] == 6 and tensor.shape[3] == end - start
    if len(parts) > 1:  # the parts are the whole export's heads, byte for byte
        whole = p_eng.export_kv("r", 0).wait()
        assert torch.equal(torch.cat([t for _, t in parts], dim=3), whole)
    out = d_eng.add_prefilled_request("r", prompt, first, GREEDY, parts)
    export.release()
    p_eng.release_kv("r")
    assert out.token_ids == [first]
    assert run_to_end(d_eng)["r"] == expected
    d_eng.block_pool.check_no_leaks()
    p_eng.block_pool.check_no_leaks()


def test_parts_that_do_not_tile_the_heads_are_refused(model_dir: Path) -> None:
    p_eng, d_eng = engine(model_dir), engine(model_dir)
    prompt = list(range(5, 22))
    p_eng.add_request("r", prompt, PREFILL, hold_kv=True)
    (first,) = run_to_end(p_eng)["r"]
    (lo, low), (_, high) = p_eng.export_kv("r", 0, [(0, 1), (1, 2)]).wait_parts()
    p_eng.release_kv("r")
    with pytest.raises(KVImportError, match="do not cover"):
        d_eng.add_prefilled_request("r", prompt, first, GREEDY, [(lo, low)])
    with pytest.raises(KVImportError, match="do not tile"):
        d_eng.add_prefilled_request("r", prompt, first, GREEDY, [(lo, low), (lo, low)])
    with pytest.raises(KVImportError, match="is not 5 blocks"):  # a part of the wrong width
        d_eng.add_prefilled_request("r", prompt, first, GREEDY, [((0, 1), high[:, :, :, :0])])
    assert not d_eng.has_unfinished
    d_eng.block_pool.check_no_leaks()
