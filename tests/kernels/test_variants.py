"""The launchers' variants: per-step sizes pick among a few buckets and never make a new
variant on their own (kernels/_variants.py).

A key is what Triton's JIT keys its compiled kernels by (constexprs, dtypes, options and
its own specialisation of ints and pointers), computed the same way under the
interpreter as on a GPU: the key counts here are the compiles a GPU would do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from pdserve.kernels import _variants
from pdserve.kernels._variants import VariantKey, VariantRegistry, warmup_plan
from pdserve.kernels.int8_linear import _tile, int8_linear, row_buckets
from pdserve.kernels.kv_pack import kv_pack, kv_unpack
from pdserve.kernels.paged_decode_attention import (
    _auto_num_splits,
    paged_decode_attention,
    split_shapes,
)
from pdserve.kernels.paged_prefill_attention import (
    _block_m,
    paged_prefill_attention,
    query_len_buckets,
)
from pdserve.kernels.reshape_and_cache import reshape_and_cache
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary_embedding import rotary_embedding

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> VariantRegistry:
    fresh = VariantRegistry()
    monkeypatch.setattr(_variants, "REGISTRY", fresh)
    return fresh


def _kernels(registry: VariantRegistry) -> list[str]:
    return sorted(key.kernel for key in registry.seen())


def _cache(device: str) -> torch.Tensor:
    return torch.randn(4, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=device)


def test_block_table_widths_and_batch_sizes_share_a_decode_variant(
    registry: VariantRegistry, device: str
) -> None:
    """Widths of 1 (Triton would make it a constant), 16 (divisible) and 17 (neither)."""
    k_cache, v_cache = _cache(device), _cache(device)
    for batch in (1, 3):
        for width in (1, 16, 17):
            q = torch.randn(batch, HEADS, HEAD_DIM, device=device)
            tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
            lens = torch.full((batch,), 5, dtype=torch.int32, device=device)
            paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=1)
    assert _kernels(registry) == ["_paged_decode_kernel"]


def test_block_table_widths_and_query_lengths_share_a_prefill_variant(
    registry: VariantRegistry, device: str
) -> None:
    k_cache, v_cache = _cache(device), _cache(device)
    for query_lens in ([3], [9, 1]):  # both within one query tile
        for width in (1, 16, 17):
            num_seqs = len(query_lens)
            q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=device)
            tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
            starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
            lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
            paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    assert _kernels(registry) == ["_paged_prefill_kernel"]


@pytest.mark.parametrize(
    ("dtype", "rows", "variants"),
    [(torch.float32, (1, 16, 17, 65), 1), (torch.float16, (1, 16, 17), 2)],
    ids=["fp32", "fp16"],
)
def test_int8_row_counts_make_a_variant_per_tile_only(
    registry: VariantRegistry, device: str, dtype: torch.dtype, rows: tuple[int, ...], variants: int
) -> None:
    """fp32 has one tile; fp16's first two take up to 16 rows, then up to 64."""
    weight = torch.randint(-127, 128, (32, 48), dtype=torch.int8, device=device)
    scales = torch.rand(32, device=device, dtype=dtype)
    for m in rows:
        int8_linear(torch.randn(m, 48, device=device, dtype=dtype), weight, scales)
    assert _kernels(registry) == ["_int8_linear_kernel"] * variants


def test_packed_block_counts_share_a_variant_each_way(
    registry: VariantRegistry, device: str
) -> None:
    kv_cache = torch.randn(2, 2, 20, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=device)
    for n in (1, 16, 17):
        ids = torch.arange(n)
        kv_unpack(kv_pack(kv_cache, ids), kv_cache, ids)
    assert _kernels(registry) == ["_kv_pack_kernel"] * 2


def test_a_specialisation_that_remains_makes_a_variant(
    registry: VariantRegistry, device: str
) -> None:
    """The keys see what Triton still specialises: a row stride of 72 (not a multiple
    of 16) against the contiguous 64."""
    weight = torch.randn(64, device=device)
    rms_norm(torch.randn(3, 64, device=device), weight, 1e-6)
    rms_norm(torch.randn(3, 72, device=device)[:, :64], weight, 1e-6)
    rms_norm(torch.randn(5, 64, device=device), weight, 1e-6)
    assert _kernels(registry) == ["_rms_norm_kernel"] * 2


def test_keys_are_tritons_own_specialisation(
    monkeypatch: pytest.MonkeyPatch, registry: VariantRegistry, device: str
) -> None:
    """Every launcher's key against the specialisation Triton's JIT computes for the same
    launch (its binder, built as `JITFunction.run` builds it; no GPU needed)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    checked = set()
    variant_key = _variants.variant_key

    def checking(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> VariantKey:
        key = variant_key(kernel, args, kwargs)
        jit = JITFunction(
            kernel.fn,
            do_not_specialize=_option(kernel, "do_not_specialize"),
            do_not_specialize_on_alignment=_option(kernel, "do_not_specialize_on_alignment"),
        )
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _, specs, options = binder(*args, **kwargs)
        assert key.specs == tuple(specs) and dict(key.options) == options
        checked.add(key.kernel)
        return key

    monkeypatch.setattr(_variants, "variant_key", checking)
    _launch_every_kernel(device)
    assert checked == {
        "_int8_linear_kernel",
        "_kv_pack_kernel",
        "_paged_decode_kernel",
        "_paged_prefill_kernel",
        "_reduce_splits_kernel",
        "_reshape_and_cache_kernel",
        "_rms_norm_kernel",
        "_rotary_embedding_kernel",
    }


def _option(kernel: Any, name: str) -> Any:
    """A `triton.jit` option as a JITFunction keeps it, or the interpreter's function."""
    value = getattr(kernel, name, None)
    return value if value is not None else kernel.kwargs.get(name)


def _launch_every_kernel(device: str) -> None:
    k_cache, v_cache = _cache(device), _cache(device)
    tokens = 3
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=device)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device)
    tables = torch.zeros(1, 17, dtype=torch.int32, device=device)
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    paged_decode_attention(q[:1], k_cache, v_cache, tables, lens, 0.25, num_splits=2)
    slots = torch.tensor([0, -1, 5], device=device)
    reshape_and_cache(k, k, k_cache, v_cache, slots)
    cos = torch.randn(8, HEAD_DIM, device=device)
    rotary_embedding(torch.arange(tokens, device=device), q, k, cos, cos)
    x = torch.randn(tokens, 64, device=device)
    rms_norm(x, torch.randn(64, device=device), 1e-6, x)
    weight = torch.randint(-127, 128, (32, 64), dtype=torch.int8, device=device)
    int8_linear(x, weight, torch.rand(32, device=device))
    kv_cache = torch.randn(2, 2, 4, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device=device)
    ids = torch.tensor([2, 0])
    kv_unpack(kv_pack(kv_cache, ids), kv_cache, ids)


@pytest.mark.parametrize(("num_kv_heads", "block_size"), [(1, 16), (2, 16), (8, 512)])
@pytest.mark.parametrize("max_rows", [40, None])
def test_auto_splits_are_few_and_split_shapes_reach_each(
    num_kv_heads: int, block_size: int, max_rows: int | None
) -> None:
    max_blocks = 300
    picked = {
        _auto_num_splits(rows * num_kv_heads, width * block_size, CPU)
        for rows in range(1, 41 if max_rows else 200)
        for width in range(1, max_blocks + 1)
    }
    assert picked <= {1, 2, 4, 8, 16, 32}
    shapes = split_shapes(num_kv_heads, block_size, max_blocks, max_rows, CPU)
    assert set(shapes) == picked
    for splits, (rows, width) in shapes.items():
        assert 1 <= width <= max_blocks and (max_rows is None or rows <= max_rows)
        assert _auto_num_splits(rows * num_kv_heads, width * block_size, CPU) == splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_query_tiles_and_int8_tiles_are_few_and_their_buckets_reach_each(
    dtype: torch.dtype,
) -> None:
    def reach(pick: Callable[[int], object], buckets: tuple[int, ...]) -> None:
        every = {pick(n) for n in range(1, 300)}
        assert len(every) <= 3
        assert {pick(n) for n in buckets} == every

    reach(lambda n: _block_m(n, dtype), query_len_buckets(dtype))
    reach(lambda n: _tile(n, dtype), row_buckets(dtype))


def test_warmup_plan_keeps_to_the_step_budget() -> None:
    def plan(budget: int | None) -> _variants.WarmupPlan:
        return warmup_plan(
            dtype=torch.bfloat16,
            num_kv_heads=2,
            block_size=16,
            max_model_len=4096,
            device=CPU,
            max_step_tokens=budget,
        )

    # 1-16, 17-32 and 33-64 query rows pick the query tiles, 1-16, 17-64, 65- the int8 ones
    assert plan(None).prefill_lens == (1, 17, 33, 65)
    assert plan(20).prefill_lens == (1, 17)
    # a decode row is a token of the step too: 20 rows at most
    assert all(rows <= 20 for rows, _ in plan(20).decode_shapes)
    assert plan(None).decode_shapes == tuple(
        split_shapes(2, 16, 256, None, CPU)[s] for s in (1, 2, 4, 8)
    )
