"""The 8-bit KV cache (engine/modeling/kv_quant.py): its format, and an engine serving it exactly.

The reference is `transformers` with every K and V rounded through the same format before
attention (`hf_greedy(..., kv_cache_dtype=...)`): greedy tokens must equal it in float32,
whatever the chunking, prefix caching, backend or handoff, because a row's codes depend on
that row alone.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.modeling import kv_quant
from pdserve.engine.worker.kv_handoff import KVImportError

MAX_TOKENS = 16
KV_DTYPES = ["int8", "fp8"]


def _prompts(seed: int = 0) -> list[list[int]]:
    """5 prompts; three share a 40-token prefix (prefix-cache hits at block 16)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731 - skip specials
    shared = ids(40)
    return [shared + ids(9), shared + ids(1), shared + ids(30), ids(3), ids(70)]


# -- the format --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rows_hold_codes_then_a_bf16_scale_and_round_within_the_grid(kv_dtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-4, 3, 7).view(7, 1, 1)
    rows = kv_quant.quantize(x, kv_dtype)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, 66)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()  # [7, 3, 1]
    amax = x.abs().amax(-1, keepdim=True)
    # the scale is max|x| / QMAX to bfloat16's precision
    torch.testing.assert_close(scale, amax / kv_quant.qmax(kv_dtype), rtol=2**-8, atol=0)
    back = kv_quant.dequantize(rows, kv_dtype, torch.float32)
    err = (back - x).abs()
    if kv_dtype == "int8":  # half a step, plus the clamp of a bf16-rounded scale
        assert (err <= scale * 0.5 + amax * 2**-8).all()
    else:  # e4m3: 3 mantissa bits, relative to the value (normal range of the codes)
        assert (err <= x.abs() * 2**-4 + scale * 2**-7).all()
    # rounding is idempotent: a dequantized row quantizes to the same bytes
    assert torch.equal(kv_quant.quantize(back, kv_dtype), rows)
    # a zero row stays zero, with a finite scale
    zero = kv_quant.fake_quantize(torch.zeros(2, 64), kv_dtype)
    assert torch.equal(zero, torch.zeros(2, 64))


# -- an engine with an 8-bit cache ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Any) -> Path:
    return make_checkpoint(hidden_size=128, num_heads=4, num_kv_heads=2)  # head_dim 32


@pytest.fixture(scope="module")
def references(checkpoint: Path, hf_greedy: Any) -> dict[str, list[list[int]]]:
    return {d: hf_greedy(checkpoint, _prompts(), MAX_TOKENS, kv_cache_dtype=d) for d in KV_DTYPES}


MODES: dict[str, dict[str, Any]] = {
    "torch": {"attention_backend": "torch"},
    "cpu-kernel": {"attention_backend": "auto"},
    "chunked": {"attention_backend": "torch", "max_num_batched_tokens": 8, "block_size": 4},
    # rejected proposals' rows are rewritten; each row's scale is its own, so the tokens hold
    "speculative": {"attention_backend": "torch", "speculative": "ngram:k=3,n=1,adaptive=off"},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_tokens_equal_transformers_with_the_same_rounding(
    checkpoint: Path, references: dict[str, list[list[int]]], kv_dtype: str, mode: str
) -> None:
    llm = LLM(checkpoint, dtype="float32", kv_cache_dtype=kv_dtype, **MODES[mode])
    if mode == "cpu-kernel" and cpu_kernels.load() is not None:  # it reads 8-bit rows
        assert llm.engine.runner.backend.name == "cpu"
    cache = llm.engine.runner.kv_cache
    assert cache.dtype == torch.uint8 and cache.shape[-1] == 32 + 2
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == references[kv_dtype]
    if mode != "chunked":  # prompts 1 and 2 reuse prompt 0's two full blocks
        assert [o.num_cached_tokens for o in outs[:3]] == [0, 32, 32]
    if mode == "speculative":
        stats = llm.engine.spec_stats()
        assert stats.proposed_tokens > stats.accepted_tokens  # rejected rows were rewritten
    llm.engine.block_pool.check_no_leaks()


def test_the_rounding_is_what_changes_the_tokens(
    checkpoint: Path, references: dict[str, list[list[int]]], hf_greedy: Any
) -> None:
    """The references are not the unrounded model's tokens (else the tests above would
    pass with no quantization at all), and an unquantized engine matches the unrounded one."""
    plain = hf_greedy(checkpoint, _prompts(), MAX_TOKENS)
    assert plain != references["int8"] and plain != references["fp8"]
    llm = LLM(checkpoint, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(_prompts(), params)] == plain


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_cache_bytes_do_not_depend_on_chunking(checkpoint: Path, kv_dtype: str) -> None:
    """A prompt's blocks hold the same bytes prefilled in one step or in chunks of 5."""
    prompt = _prompts()[4]  # 70 tokens: 4 full blocks of 16
    exports = []
    for budget in (2048, 5):
        engine = _engine(checkpoint, kv_dtype, max_num_batched_tokens=budget)
        _prefill(engine, "r", prompt)
        export = engine.export_kv("r")
        exports.append(export.wait().clone())
        export.release()
        engine.release_kv("r")
        if budget == 5:
            assert engine.scheduler.stats.num_chunked_prefill_steps > 0
    assert exports[0].dtype == torch.uint8 and torch.equal(exports[0], exports[1])


def _engine(checkpoint: Path, kv_dtype: str, **config: Any) -> LLMEngine:
    return LLMEngine(
        checkpoint,
        EngineConfig(dtype="float32", kv_cache_dtype=kv_dtype, num_kv_blocks=64, **config),
    )


def _prefill(engine: LLMEngine, rid: str, prompt: list[int]) -> int:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first = []
    while engine.has_unfinished:
        first += [o.token_ids[0] for o in engine.step() if o.request_id == rid and o.finished]
    return first[0]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_handoff_ships_the_8bit_blocks_and_decodes_the_reference(
    checkpoint: Path, references: dict[str, list[list[int]]], kv_dtype: str
) -> None:
    """Prefill on one engine, decode on another: the payload is the 8-bit rows (34 bytes
    per token and head here, against 128 in float32), and the tokens are the reference."""
    p_eng, d_eng = _engine(checkpoint, kv_dtype), _engine(checkpoint, kv_dtype)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = _prompts()[4]
    first = _prefill(p_eng, "r", prompt)
    export = p_eng.export_kv("r")
    payload = export.wait()
    assert payload.dtype == torch.uint8 and payload.shape[-1] == 34
    d_eng.add_prefilled_request("r", prompt, first, params, payload)
    export.release()
    p_eng.release_kv("r")
    tokens: list[int] = []
    while d_eng.has_unfinished:
        tokens = next((o.token_ids for o in d_eng.step() if o.finished), tokens)
    assert tokens == references[kv_dtype][4]
    # a decode engine with an unquantized cache refuses the payload and holds nothing
    # (int8 against fp8 rows, the same bytes per row, is refused by the transfer's layout,
    # which names the format: tests/kv_transfer)
    other = _engine(checkpoint, "auto")
    first = _prefill(p_eng, "s", prompt)
    export = p_eng.export_kv("s")
    with pytest.raises(KVImportError):
        other.add_prefilled_request("s", prompt, first, params, export.wait())
    other.block_pool.check_no_leaks()
    export.release()
    p_eng.release_kv("s")
    for eng in (p_eng, d_eng):
        eng.block_pool.check_no_leaks()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_same_memory_holds_about_twice_the_blocks(checkpoint: Path, kv_dtype: str) -> None:
    plain = LLM(checkpoint, dtype="bfloat16", kv_cache_memory_gb=0.01).engine
    eight = LLM(checkpoint, dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype=kv_dtype)
    ratio = eight.engine.num_kv_blocks / plain.num_kv_blocks
    assert ratio == pytest.approx(64 / 34, rel=0.01)  # bf16 row 2 x 32 bytes, 8-bit 32 + 2
