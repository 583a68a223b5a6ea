"""Every Triton kernel against its torch reference at realistic shapes, with speed.

    python -m pdserve.benchmarks.kernels_gpu            # on a CUDA machine, bf16
    python -m pdserve.benchmarks.kernels_gpu --smoke    # tiny shapes, CPU interpreter, fp32

On CUDA it checks each kernel against its `ref_*` (bf16; batch 1-256, context 512-32k,
head_dim 128), and reports, in one run:
- `paged_decode_attention` and `kv_pack`: achieved bandwidth (bytes read + written / time)
  as a fraction of the device's copy bandwidth measured here (`dst.copy_(src)`, counted
  the same way). Target: decode >= 80% at batch >= 32, context >= 4k.
- `paged_prefill_attention`: TFLOP/s against `scaled_dot_product_attention` on the same
  data, unpaged and contiguous (causal FLOPs counted alike). Target: >= 0.8x of SDPA.
One summary line per kernel; the whole run stays well inside 10 minutes.
`--smoke` only proves the script's code paths (CPU numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
HEAD_DIM = 128
NUM_HEADS, NUM_KV_HEADS = 32, 8  # Llama-3-8B's attention shape


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: torch.dtype
    smoke: bool

    def shapes(self, full: list[int], smoke: list[int]) -> list[int]:
        return smoke if self.smoke else full


def timed(fn: Callable[[], object], setup: Setup) -> float:
    """Seconds per call: triton's do_bench on CUDA; one call in the smoke run (the CPU
    interpreter, whose numbers mean nothing: repeats would only prove the path again)."""
    if setup.device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100)) / 1e3
    repeat = 1 if setup.smoke else 3
    if not setup.smoke:
        fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(setup: Setup) -> float:
    """Bytes moved per second (read + written) by a plain device copy."""
    num_bytes = (1 << 30) if not setup.smoke else (8 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=setup.device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), setup)


def paged_cache(num_tokens: int, setup: Setup, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A shuffled paged K/V cache holding `num_tokens` tokens, and its block order."""
    gen = torch.Generator(device=setup.device).manual_seed(seed)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k = torch.randn(shape, generator=gen, device=setup.device).to(setup.dtype)
    v = torch.randn(shape, generator=gen, device=setup.device).to(setup.dtype)
    order = torch.randperm(num_blocks, generator=gen, device=setup.device).to(torch.int32)
    return k, v, order


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _decode_case(batch: int, context: int, setup: Setup, copy_bw: float) -> tuple[float, float]:
    """(max error vs the reference or 0 when skipped, bandwidth as a fraction of copy)."""
    from pdserve.kernels.paged_decode_attention import (
        paged_decode_attention,
        ref_paged_decode_attention,
    )

    blocks_per_seq = -(-context // BLOCK_SIZE)
    k, v, order = paged_cache(batch * blocks_per_seq * BLOCK_SIZE, setup)
    tables = order.view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=setup.device).to(setup.dtype)
    scale = HEAD_DIM**-0.5

    def run() -> torch.Tensor:
        return paged_decode_attention(q, k, v, tables, lens, scale)

    err = 0.0
    if context <= 4096:  # the reference gathers per sequence: slow past that
        err = max_err(run(), ref_paged_decode_attention(q, k, v, tables, lens, scale))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k.element_size()
    return err, kv_bytes / timed(run, setup) / copy_bw


def bench_decode(setup: Setup, copy_bw: float) -> str:
    worst, lines = 0.0, []
    for batch in setup.shapes([1, 32, 256], [1, 3]):
        for context in setup.shapes([512, 4096, 32768], [40, 100]):
            if batch * context > (1 << 21):  # keep the cache under ~8 GiB
                continue
            err, frac = _decode_case(batch, context, setup, copy_bw)
            worst = max(worst, err)
            lines.append(f"B={batch} ctx={context}: {frac:.0%}")
    return f"paged_decode_attention: max err {worst:.2e}; bandwidth / copy: " + ", ".join(lines)


def _prefill_case(num_seqs: int, seq_len: int, setup: Setup) -> str:
    import torch.nn.functional as F

    from pdserve.kernels.paged_prefill_attention import (
        paged_prefill_attention,
        ref_paged_prefill_attention,
    )

    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    k, v, order = paged_cache(num_seqs * blocks_per_seq * BLOCK_SIZE, setup)
    tables = order.view(num_seqs, blocks_per_seq)
    q = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, device=setup.device)
    q = q.to(setup.dtype)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=setup.device) * seq_len
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=setup.device)
    scale = HEAD_DIM**-0.5

    def ours() -> torch.Tensor:
        return paged_prefill_attention(q, k, v, tables, starts, lens, scale, seq_len)

    err = max_err(ours(), ref_paged_prefill_attention(q, k, v, tables, starts, lens, scale))

    # The same data, unpaged and contiguous, for SDPA: [S, KVH, L, D].
    def dense(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache[tables.long()].permute(0, 2, 1, 3, 4)  # [S, KVH, nb, bs, D]
        return blocks.reshape(num_seqs, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :seq_len].contiguous()

    dense_q = q.view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    dense_k, dense_v = dense(k), dense(v)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True
        )

    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * seq_len * seq_len / 2  # causal half
    t_ours, t_sdpa = timed(ours, setup), timed(sdpa, setup)
    return (
        f"L={seq_len}: {flops / t_ours / 1e12:.2f} TFLOP/s = {t_sdpa / t_ours:.2f}x SDPA "
        f"(err {err:.1e})"
    )


def bench_prefill(setup: Setup) -> str:
    num_seqs = setup.shapes([4], [2])[0]
    cases = [_prefill_case(num_seqs, n, setup) for n in setup.shapes([1024, 4096], [24])]
    return "paged_prefill_attention: " + "; ".join(cases)


def bench_kv_pack(setup: Setup, copy_bw: float) -> str:
    from pdserve.kernels.kv_pack import kv_pack, kv_unpack, ref_kv_pack

    num_layers = setup.shapes([32], [2])[0]
    num_blocks = setup.shapes([128], [4])[0]  # 2,048 tokens of Llama-3-8B: 256 MiB
    shape = (num_layers, 2, 2 * num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    cache = torch.randn(shape, device=setup.device).to(setup.dtype)
    ids = torch.randperm(2 * num_blocks, device=setup.device)[:num_blocks].to(torch.int32)
    buffer = kv_pack(cache, ids)
    exact = torch.equal(buffer, ref_kv_pack(cache, ids))
    other = torch.zeros_like(cache)
    kv_unpack(buffer, other, ids)
    exact = exact and torch.equal(other[:, :, ids.long()], cache[:, :, ids.long()])
    moved = 2 * buffer.numel() * buffer.element_size()
    t_pack = timed(lambda: kv_pack(cache, ids, out=buffer), setup)
    t_unpack = timed(lambda: kv_unpack(buffer, other, ids), setup)
    return (
        f"kv_pack: byte-exact {exact}; {buffer.numel() * buffer.element_size() >> 20} MiB, "
        f"pack {moved / t_pack / copy_bw:.0%} / unpack {moved / t_unpack / copy_bw:.0%} of copy"
    )


def bench_small_kernels(setup: Setup) -> str:
    from pdserve.engine.model_config import RopeConfig
    from pdserve.engine.rotary import cos_sin_cache
    from pdserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache
    from pdserve.kernels.rms_norm import ref_rms_norm, rms_norm
    from pdserve.kernels.rotary_embedding import ref_rotary_embedding, rotary_embedding

    dev, dt = setup.device, setup.dtype
    tokens = setup.shapes([4096], [20])[0]
    hidden = setup.shapes([4096], [96])[0]
    x = torch.randn(tokens, hidden, device=dev).to(dt)
    w = torch.randn(hidden, device=dev).to(dt)
    normed, ref_normed = rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5)
    assert isinstance(normed, torch.Tensor) and isinstance(ref_normed, torch.Tensor)
    norm_err = max_err(normed, ref_normed)
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
    cos, sin = cos_sin_cache(rope, HEAD_DIM, 8192, dt)
    cos, sin = cos.to(dev), sin.to(dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, device=dev).to(dt)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=dev).to(dt)
    rq, rk = rotary_embedding(pos, q, k, cos, sin)
    eq, ek = ref_rotary_embedding(pos, q, k, cos, sin)
    rope_err = max(max_err(rq, eq), max_err(rk, ek))
    k_cache, v_cache, _ = paged_cache(2 * tokens, setup)
    k2, v2 = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(2 * tokens, device=dev)[:tokens]
    reshape_and_cache(k, k, k_cache, v_cache, slots)
    ref_reshape_and_cache(k, k, k2, v2, slots)
    cache_ok = torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    return (
        f"rms_norm: max err {norm_err:.1e}; rotary_embedding (llama3): max err {rope_err:.1e}; "
        f"reshape_and_cache: exact {cache_ok}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import
        setup = Setup("cpu", torch.float32, smoke=True)
    elif not torch.cuda.is_available():
        print("kernels_gpu: needs a CUDA device (or --smoke on the CPU)", file=sys.stderr)
        return 2
    else:
        setup = Setup("cuda", torch.bfloat16, smoke=False)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(setup)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + written)")
    print(bench_decode(setup, copy_bw))
    print(bench_prefill(setup))
    print(bench_kv_pack(setup, copy_bw))
    print(bench_small_kernels(setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
