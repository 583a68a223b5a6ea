"""The compiled CPU attention kernels (`engine/cpu/kernels.py`) against plain references.

Decode:
The kernel reads K/V in place from their blocks; the reference gathers each sequence's
blocks and runs float32 softmax attention, one sequence at a time. Shapes cover the
vector path (head_dim a multiple of 16, specialised and generic query-group sizes) and
the scalar path (any other head_dim), partial and single-token contexts, block sizes
below and above 16, and 1-3 threads, over caches of the query's dtype and 8-bit ones
(engine/modeling/kv_quant.py: int8 and e4m3 codes, each row with its own scale), which the
reference reads dequantized. The engine-level check runs the same greedy batch through
the cpu and the torch backends.

Prefill: every chunk of a step in one call, each chunk the last positions of its context
(a cached prefix or none), K/V read from shuffled blocks; the reference gathers the blocks
and runs float32 causal attention chunk by chunk. Shapes cover every head_dim the kernel
takes, 1-8 query heads per KV head (row tiles that do and do not fill a 16-row vector),
chunks shorter and longer than a 64-key tile, block sizes 4-32 and 1-3 threads.

Both vector paths: with AVX2 and no AVX-512 the kernels compute in 8-lane halves, elsewhere
in 16-lane vectors. A second build for the path this CPU does not take by default (AVX2's
on an AVX-512 CPU, the 16-lane one on an AVX2 CPU) must give the same outputs, so both
paths run on any x86 machine that runs the suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.llm_engine import make_attention_backend
from pdserve.engine.modeling import kv_quant
from pdserve.engine.modeling.attention import (
    AttentionMetadata,
    CpuAttentionBackend,
    DecodeMeta,
    PrefillBatch,
    PrefillMeta,
    TorchAttentionBackend,
)

KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kernels not built")


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V [KVH, length, D], gathered from its blocks."""
    _, kv_heads, block_size, row = k_cache.shape
    blocks = table[: -(-length // block_size)].long()
    # [blocks, KVH, bs, D] -> [KVH, blocks * bs, D], cut to the context
    k = k_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, row)[:, :length]
    v = v_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, row)[:, :length]
    return k, v


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    if kv_quant.is_quantized(kv_cache_dtype):  # exact in float32: codes x bf16 scales
        k_cache = kv_quant.dequantize(k_cache, kv_cache_dtype, torch.float32)
        v_cache = kv_quant.dequantize(v_cache, kv_cache_dtype, torch.float32)
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    groups = num_heads // kv_heads
    out = torch.empty(batch, num_heads, head_dim)
    for b in range(batch):
        k, v = gather_context(k_cache, v_cache, block_tables[b], int(context_lens[b]))
        qb = q[b].view(kv_heads, groups, head_dim).float()
        weights = torch.softmax(qb @ k.float().transpose(1, 2) * scale, dim=-1)
        out[b] = (weights @ v.float()).reshape(num_heads, head_dim)
    return out


def random_case(
    *,
    dtype: torch.dtype,
    kv_heads: int,
    groups: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    seed: int = 0,
    kv_cache_dtype: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """q, K/V caches (of `dtype`, or 8-bit rows of `kv_cache_dtype`), tables, lengths."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    if kv_quant.is_quantized(kv_cache_dtype):
        # rows of magnitudes 1e-2..1e1, so that a scale read from the wrong row shows
        k_cache, v_cache = (
            kv_quant.quantize(
                torch.randn(shape, generator=gen)
                * torch.logspace(-2, 1, 64)[torch.randint(64, (*shape[:3], 1), generator=gen)],
                kv_cache_dtype,
            )
            for _ in range(2)
        )
    # Each sequence gets distinct blocks in shuffled order; table padding is block 0.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = perm[i * max_blocks : i * max_blocks + used].int()
    q = torch.randn(len(lens), kv_heads * groups, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
LENS = [1, 5, 16, 17, 47, 70, 200]
KV_DTYPES = ["auto", "int8", "fp8"]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("kv_heads", "groups", "head_dim", "block_size"),
    [
        (2, 4, 32, 16),  # the benchmark's tiny model: a specialised vector shape
        (4, 4, 64, 16),  # its mid model
        (1, 8, 128, 8),  # blocks shorter than the 16-row score tiles
        (4, 1, 64, 32),  # MHA, tiles inside a block
        (2, 3, 16, 4),  # generic vector path (3 query heads per KV head, C=1)
        (3, 2, 80, 16),  # head_dim 80: generic vector path
        (2, 2, 24, 16),  # head_dim 24: the scalar path
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_paged_decode_matches_reference(
    dtype: torch.dtype,
    kv_heads: int,
    groups: int,
    head_dim: int,
    block_size: int,
    threads: int,
    kv_dtype: str,
) -> None:
    assert KERNELS is not None
    if dtype not in KERNELS.dtypes:
        pytest.skip(f"{dtype} kernel not built on this architecture")
    assert KERNELS.takes(dtype, kv_dtype)
    q, k_cache, v_cache, tables, lens = random_case(
        dtype=dtype,
        kv_heads=kv_heads,
        groups=groups,
        head_dim=head_dim,
        block_size=block_size,
        lens=LENS,
        kv_cache_dtype=kv_dtype,
    )
    scale = head_dim**-0.5
    out = KERNELS.paged_decode(
        q, k_cache, v_cache, tables, lens, scale, num_threads=threads, kv_cache_dtype=kv_dtype
    )
    expected = reference(q, k_cache, v_cache, tables, lens, scale, kv_dtype)
    assert out.dtype == dtype and out.shape == q.shape
    # 8-bit rows span magnitudes 1e-2..1e1: the output's own rounding is relative
    rtol = TOLERANCE[dtype] if kv_dtype != "auto" else 0
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=rtol)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_decode_does_not_read_past_the_context(kv_dtype: str) -> None:
    # Poison every row beyond each context (rest of its last block, and block 0 that pads
    # the tables) with NaN (an 8-bit row: its scale): any read of one turns the output NaN.
    q, k_cache, v_cache, tables, lens = random_case(
        dtype=torch.float32, kv_heads=2, groups=4, head_dim=32, block_size=16, lens=[3, 20, 33]
    )
    tables[tables == 0] = int(tables.max()) + 1  # keep block 0 for padding only
    k_cache = torch.cat([k_cache, torch.randn(2, *k_cache.shape[1:])])
    v_cache = torch.cat([v_cache, torch.randn(2, *v_cache.shape[1:])])
    poison = torch.zeros(k_cache.shape[:3], dtype=torch.bool)  # [blocks, KVH, bs]
    for b, n in enumerate(lens.tolist()):
        poison[int(tables[b, (n - 1) // 16]), :, n % 16 or 16 :] = True
    poison[0] = True
    if kv_quant.is_quantized(kv_dtype):
        k_cache, v_cache = (
            kv_quant.quantize(k_cache, kv_dtype),
            kv_quant.quantize(v_cache, kv_dtype),
        )
        nan = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
        k_cache[poison, 32:], v_cache[poison, 32:] = nan, nan
    else:
        k_cache[poison], v_cache[poison] = float("nan"), float("nan")
    assert KERNELS is not None
    out = KERNELS.paged_decode(q, k_cache, v_cache, tables, lens, 0.2, kv_cache_dtype=kv_dtype)
    assert not out.isnan().any()
    k_clean, v_clean = k_cache.clone(), v_cache.clone()
    k_clean[poison], v_clean[poison] = 0, 0
    expected = reference(q, k_clean, v_clean, tables, lens, 0.2, kv_dtype)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


@needs_kernels
def test_paged_decode_rejects_bad_input() -> None:
    q, k_cache, v_cache, tables, lens = random_case(
        dtype=torch.float32, kv_heads=2, groups=2, head_dim=32, block_size=16, lens=[5]
    )
    kern = KERNELS
    assert kern is not None
    with pytest.raises(ValueError, match="int32"):
        kern.paged_decode(q, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="share dtype"):
        kern.paged_decode(q, k_cache.bfloat16(), v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        kern.paged_decode(q[:, :3], k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.cat([q, q], dim=-1)[:, :, ::2]  # q's shape, every other element
        kern.paged_decode(strided, k_cache, v_cache, tables, lens, 0.1)
    odd_blocks = k_cache[:, :, :12].contiguous()  # block size 12: not a power of two
    with pytest.raises(ValueError, match="does not take"):
        kern.paged_decode(q, odd_blocks, odd_blocks, tables, lens, 0.1)
    rows = kv_quant.quantize(k_cache, "int8")  # [..., 32 + 2] uint8
    with pytest.raises(ValueError, match="share dtype"):  # 8-bit rows, read as float32
        kern.paged_decode(q, rows, rows, tables, lens, 0.1)
    with pytest.raises(ValueError, match="share dtype"):  # float32 rows, read as 8-bit
        kern.paged_decode(q, k_cache, v_cache, tables, lens, 0.1, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="does not fit"):  # rows without their scale
        cut = rows[..., :32].contiguous()
        kern.paged_decode(q, cut, cut, tables, lens, 0.1, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="does not take"):
        kern.paged_decode(q, rows, rows, tables, lens, 0.1, kv_cache_dtype="int4")


def test_disabled_kernels_fall_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert make_attention_backend("auto", torch.device("cpu")).name == "torch"
        with pytest.raises(RuntimeError, match="C compiler"):
            make_attention_backend("cpu", torch.device("cpu"))
    finally:
        cpu_kernels.load.cache_clear()


def test_missing_compiler_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None  # the build fails: logged, not raised
        assert make_attention_backend("auto", torch.device("cpu")).name == "torch"
    finally:
        cpu_kernels.load.cache_clear()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_backend_tokens_equal_torch_backend(make_checkpoint: Any, dtype: str) -> None:
    model_dir = make_checkpoint(hidden_size=128, num_heads=4, num_kv_heads=2)  # head_dim 32
    prompts = [list(range(10, 10 + n)) for n in (1, 15, 16, 17, 40, 90)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model_dir, dtype=dtype, attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        results[backend] = [out.token_ids for out in llm.generate(prompts, params)]
        llm.engine.block_pool.check_no_leaks()
    if dtype == "float32":
        assert results["cpu"] == results["torch"]
    else:  # bf16 rounds differently in the two kernels: most rows still agree
        same = sum(a == b for a, b in zip(results["cpu"], results["torch"], strict=True))
        assert same >= len(prompts) // 2


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_cpu_backend_decodes_an_8bit_cache_as_the_torch_backend(kv_dtype: str) -> None:
    """Both backends write one decode step's K/V into the same 8-bit cache (the same
    rows, byte for byte) and attend over it: the kernel reads what the torch path
    dequantizes, to float rounding."""
    assert KERNELS is not None
    q, k_cache, v_cache, tables, lens = random_case(
        dtype=torch.float32,
        kv_heads=2,
        groups=2,
        head_dim=32,
        block_size=16,
        lens=LENS,
        kv_cache_dtype=kv_dtype,
    )
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(len(LENS), 2, 32, generator=gen) * 5 for _ in range(2))
    positions = lens.long() - 1  # the new token is each context's last
    slots = tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    decode = DecodeMeta(tables, lens, lens.tolist())
    outs, caches = {}, {}
    for backend in (TorchAttentionBackend(kv_dtype), CpuAttentionBackend(KERNELS, kv_dtype)):
        meta = AttentionMetadata(slots, 0, [], None, decode)
        cache = (k_cache.clone(), v_cache.clone())
        outs[backend.name] = backend.forward(q, k, v, cache, meta, 32**-0.5)
        caches[backend.name] = cache
    assert all(torch.equal(a, b) for a, b in zip(caches["cpu"], caches["torch"], strict=True))
    assert not torch.equal(caches["cpu"][0], k_cache)  # the step wrote its rows
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=2e-5, rtol=1e-5)


@needs_kernels
def test_backend_choice_follows_the_kernel_dtypes() -> None:
    cpu = torch.device("cpu")
    assert make_attention_backend("auto", cpu, torch.bfloat16).name == "cpu"
    for kv_dtype in ("int8", "fp8"):  # the kernel reads 8-bit caches too
        backend = make_attention_backend("auto", cpu, torch.bfloat16, kv_dtype)
        assert backend.name == "cpu" and backend.kv_cache_dtype == kv_dtype
    assert make_attention_backend("auto", cpu, torch.float64).name == "torch"  # not built
    with pytest.raises(ValueError, match="does not take"):
        make_attention_backend("cpu", cpu, torch.float64)


def prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """float32 causal attention of each chunk's rows, the last of its context."""
    groups = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape)
    for i, length in enumerate(context_lens.tolist()):
        a, b = int(starts[i]), int(starts[i + 1])
        k, v = gather_context(k_cache, v_cache, tables[i], length)
        k = k.float().repeat_interleave(groups, 0)  # [H, C, D]
        v = v.float().repeat_interleave(groups, 0)
        scores = q[a:b].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, C]
        hidden = torch.ones(b - a, length, dtype=torch.bool).triu(length - (b - a) + 1)
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[a:b] = (weights @ v).transpose(0, 1)
    return out


def prefill_case(
    *,
    dtype: torch.dtype,
    kv_heads: int,
    groups: int,
    head_dim: int,
    block_size: int,
    chunks: list[tuple[int, int]],  # (new tokens, context length)
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q [T, H, D], K/V caches, block tables, query_start_loc, context lengths."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-length // block_size) for _, length in chunks)
    num_blocks = len(chunks) * max_blocks + 2
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for i, (_, length) in enumerate(chunks):
        used = -(-length // block_size)
        tables[i, :used] = perm[i * max_blocks : i * max_blocks + used].int()
    starts = torch.tensor([0, *torch.tensor([n for n, _ in chunks]).cumsum(0)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * groups, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([length for _, length in chunks], dtype=torch.int32)
    return q, k_cache, v_cache, tables, starts, lens


# a whole prompt (none cached), one token after a long prefix, chunks inside and across
# 64-key tiles, a chunk of one 16-token tile exactly, a long chunk after a prefix
CHUNKS = [(37, 37), (1, 129), (5, 70), (16, 16), (100, 300), (64, 64)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("kv_heads", "groups", "head_dim", "block_size"),
    [
        (2, 4, 32, 16),  # the tiny model
        (4, 4, 64, 16),  # the mid model
        (1, 3, 64, 8),  # 48-row tiles: three 16-row vectors
        (3, 1, 128, 32),  # MHA: a last tile of fewer than 16 rows
        (1, 8, 256, 4),  # the widest head_dim, blocks of 4
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_paged_prefill_matches_reference(
    dtype: torch.dtype,
    kv_heads: int,
    groups: int,
    head_dim: int,
    block_size: int,
    threads: int,
) -> None:
    assert KERNELS is not None
    if dtype not in KERNELS.dtypes:
        pytest.skip(f"{dtype} kernel not built on this architecture")
    assert KERNELS.takes_prefill(dtype, head_dim)
    q, k_cache, v_cache, tables, starts, lens = prefill_case(
        dtype=dtype,
        kv_heads=kv_heads,
        groups=groups,
        head_dim=head_dim,
        block_size=block_size,
        chunks=CHUNKS,
    )
    scale = head_dim**-0.5
    out = KERNELS.paged_prefill(
        q, k_cache, v_cache, tables, starts, lens, scale, num_threads=threads
    )
    expected = prefill_reference(q, k_cache, v_cache, tables, starts, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@needs_kernels
def test_paged_prefill_sees_neither_the_future_nor_past_the_context() -> None:
    """Every cache row a chunk must not see is NaN: the rest of its last block, the table's
    padding (block 0), and, for the first chunk, the positions after its context that a
    later step would fill. Any read of one turns the output NaN."""
    chunks = [(20, 20), (3, 35), (70, 90)]
    q, k_cache, v_cache, tables, starts, lens = prefill_case(
        dtype=torch.float32, kv_heads=2, groups=2, head_dim=32, block_size=16, chunks=chunks
    )
    tables[tables == 0] = int(tables.max()) + 1  # keep block 0 for padding only
    k_cache = torch.cat([k_cache, torch.randn(2, *k_cache.shape[1:])])
    v_cache = torch.cat([v_cache, torch.randn(2, *v_cache.shape[1:])])
    poison = torch.zeros(k_cache.shape[:3], dtype=torch.bool)  # [blocks, KVH, bs]
    for b, n in enumerate(lens.tolist()):
        poison[int(tables[b, (n - 1) // 16]), :, n % 16 or 16 :] = True
    poison[0] = True
    k_cache[poison], v_cache[poison] = float("nan"), float("nan")
    assert KERNELS is not None
    out = KERNELS.paged_prefill(q, k_cache, v_cache, tables, starts, lens, 0.2, num_threads=2)
    assert not out.isnan().any()
    k_clean, v_clean = k_cache.clone(), v_cache.clone()
    k_clean[poison], v_clean[poison] = 0, 0
    expected = prefill_reference(q, k_clean, v_clean, tables, starts, lens, 0.2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    # causality within a chunk: changing the last token's K/V changes only its own row
    last = int(lens[0]) - 1
    k_cache[int(tables[0, last // 16]), :, last % 16] += 1.0
    moved = KERNELS.paged_prefill(q, k_cache, v_cache, tables, starts, lens, 0.2)
    changed = (moved != out).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [last]


@needs_kernels
def test_paged_prefill_rejects_bad_input() -> None:
    q, k_cache, v_cache, tables, starts, lens = prefill_case(
        dtype=torch.float32, kv_heads=2, groups=2, head_dim=32, block_size=16, chunks=[(5, 9)]
    )
    kern = KERNELS
    assert kern is not None
    with pytest.raises(ValueError, match="query_start_loc"):
        kern.paged_prefill(q, k_cache, v_cache, tables, starts.long(), lens, 0.1)
    with pytest.raises(ValueError, match="run from 0"):
        kern.paged_prefill(q[:4], k_cache, v_cache, tables, starts, lens, 0.1)
    with pytest.raises(ValueError, match="block table covers"):
        kern.paged_prefill(q, k_cache, v_cache, tables, starts, lens + 16, 0.1)
    with pytest.raises(ValueError, match="disagree"):
        kern.paged_prefill(q, k_cache, v_cache, tables, starts[:1], lens, 0.1)
    with pytest.raises(ValueError, match="share dtype"):
        kern.paged_prefill(q, k_cache.bfloat16(), v_cache, tables, starts, lens, 0.1)
    with pytest.raises(ValueError, match="out must"):
        kern.paged_prefill(q, k_cache, v_cache, tables, starts, lens, 0.1, out=q.bfloat16())
    odd_blocks = k_cache[:, :, :12].contiguous()  # block size 12: not a power of two
    with pytest.raises(ValueError, match="does not take"):
        kern.paged_prefill(q, odd_blocks, odd_blocks, tables, starts, lens, 0.1)
    with pytest.raises(ValueError, match="does not take"):  # 5 new tokens, a context of 4
        kern.paged_prefill(q, k_cache, v_cache, tables, starts, lens - 5, 0.1)
    assert not kern.takes_prefill(torch.float32, 80)  # head_dim 80: SDPA keeps prefill
    assert not kern.takes_prefill(torch.float32, 64, "int8")  # an 8-bit cache: SDPA too
    with pytest.raises(ValueError, match="does not take"):
        wide = torch.randn(5, 4, 80)
        kern.paged_prefill(wide, k_cache, v_cache, tables, starts, lens, 0.1)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_cpu_backend_prefills_as_the_torch_backend(kv_dtype: str) -> None:
    """One step of two prefill chunks (one with a cached prefix) and two decode rows,
    through both backends over the same cache: the same output to float rounding, the
    same cache bytes, and the kernel took the prefill only where it reads the cache."""
    assert KERNELS is not None
    kv_heads, groups, head_dim, bs = 2, 2, 32, 16
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, starts, lens = prefill_case(
        dtype=torch.float32,
        kv_heads=kv_heads,
        groups=groups,
        head_dim=head_dim,
        block_size=bs,
        chunks=[(21, 21), (9, 40)],
    )
    if kv_quant.is_quantized(kv_dtype):
        k_cache, v_cache = (
            kv_quant.quantize(k_cache, kv_dtype),
            kv_quant.quantize(v_cache, kv_dtype),
        )
    decode_tables = tables.flip(0).contiguous()  # decode rows over the same blocks
    decode_lens = torch.tensor([20, 30], dtype=torch.int32)
    n = int(starts[-1])
    q = torch.cat([q, torch.randn(2, kv_heads * groups, head_dim, generator=gen)])
    k, v = (torch.randn(n + 2, kv_heads, head_dim, generator=gen) for _ in range(2))
    positions = torch.cat(
        [
            torch.arange(int(c) - (int(starts[i + 1]) - int(starts[i])), int(c))
            for i, c in enumerate(lens.tolist())
        ]
        + [decode_lens.long() - 1]
    )
    owner = torch.cat(
        [torch.full((int(starts[i + 1]) - int(starts[i]),), i) for i in range(2)]
        + [torch.tensor([1, 0])]
    )
    table_of = torch.cat([tables, decode_tables])[torch.cat([owner[:n], torch.tensor([2, 3])])]
    slots = table_of.long().gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
    prefills = [
        PrefillMeta(int(starts[i]), int(starts[i + 1] - starts[i]), int(lens[i]), tables[i].long())
        for i in range(2)
    ]
    batch = PrefillBatch(tables, starts, lens)
    decode = DecodeMeta(decode_tables, decode_lens, decode_lens.tolist())
    outs, caches, calls = {}, {}, []
    real = KERNELS.paged_prefill

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    for backend in (TorchAttentionBackend(kv_dtype), CpuAttentionBackend(KERNELS, kv_dtype)):
        meta = AttentionMetadata(
            slots, n, prefills, batch if backend.wants_prefill_batch else None, decode
        )
        cache = (k_cache.clone(), v_cache.clone())
        if isinstance(backend, CpuAttentionBackend):
            backend.kernels = _Spy(KERNELS, counting)
        outs[backend.name] = backend.forward(q, k, v, cache, meta, head_dim**-0.5)
        caches[backend.name] = cache
    assert all(torch.equal(a, b) for a, b in zip(caches["cpu"], caches["torch"], strict=True))
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=2e-5, rtol=1e-5)
    assert len(calls) == (1 if kv_dtype == "auto" else 0)


class _Spy:
    """The kernels with paged_prefill replaced (the rest passed through)."""

    def __init__(self, kernels: Any, paged_prefill: Any) -> None:
        self._kernels = kernels
        self.paged_prefill = paged_prefill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)


def _other_vector_path() -> str | None:
    """The flag that builds the attention kernels' other vector path on this CPU: an
    AVX-512 CPU also runs the AVX2 (8-lane) path, an AVX2 one the generic 16-lane path;
    None elsewhere (no second path to run)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    if "avx512f" in flags:
        return "-mno-avx512f"
    return "-mno-avx2" if "avx2" in flags else None


@pytest.fixture(scope="module")
def other_path() -> Any:
    """The kernels built for the other vector path (module docstring of csrc/paged_decode.h:
    AVX2 computes in 8-lane halves, AVX-512 and the rest in 16-lane vectors)."""
    flag = _other_vector_path()
    if KERNELS is None or flag is None:
        pytest.skip("needs the kernels and an x86 CPU with AVX2 or AVX-512")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "_FLAGS", [*cpu_kernels._FLAGS, flag])
        other = cpu_kernels.build_library(
            cpu_kernels._SOURCES,
            "the other path's kernels",
            "no comparison",
            cpu_kernels.CpuKernels,
        )
    assert other is not None, f"the kernels did not build with {flag}"
    return other


# the 8-lane path sums each lane's terms in the 16-lane path's order; only the softmax's
# vectorised sum may group differently at another vector width (a few float32 ulp)
SAME_PATH_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


@needs_kernels
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("kv_heads", "groups", "head_dim"), [(4, 4, 64), (2, 3, 32), (1, 8, 128), (3, 2, 80)]
)
def test_both_vector_paths_decode_alike(
    other_path: Any, dtype: torch.dtype, kv_dtype: str, kv_heads: int, groups: int, head_dim: int
) -> None:
    assert KERNELS is not None
    case = random_case(
        dtype=dtype,
        kv_heads=kv_heads,
        groups=groups,
        head_dim=head_dim,
        block_size=16,
        lens=LENS,
        kv_cache_dtype=kv_dtype,
    )
    outs = [
        kern.paged_decode(*case, head_dim**-0.5, num_threads=2, kv_cache_dtype=kv_dtype)
        for kern in (KERNELS, other_path)
    ]
    tol = SAME_PATH_TOLERANCE[dtype]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kv_heads", "groups", "head_dim"), [(4, 4, 64), (1, 3, 32), (3, 1, 128)])
def test_both_vector_paths_prefill_alike(
    other_path: Any, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int
) -> None:
    assert KERNELS is not None
    case = prefill_case(
        dtype=dtype,
        kv_heads=kv_heads,
        groups=groups,
        head_dim=head_dim,
        block_size=16,
        chunks=CHUNKS,
    )
    outs = [
        kern.paged_prefill(*case, head_dim**-0.5, num_threads=2) for kern in (KERNELS, other_path)
    ]
    tol = SAME_PATH_TOLERANCE[dtype]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
