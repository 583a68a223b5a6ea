"""Every Triton kernel against its float32 torch reference at realistic shapes, with speed.

    python -m pdserve.benchmarks.kernels_gpu            # on a CUDA machine, bf16
    python -m pdserve.benchmarks.kernels_gpu --smoke    # tiny shapes, CPU interpreter, fp32

Correctness (`Suite.correct`, one line per kernel, each ok or FAIL): every kernel runs in
bf16 and is compared with its `ref_*` fed float32 copies of the same (bf16-rounded)
inputs, so the reference is the exact float32 result and the error is the kernel's own
rounding. The measure is the normalised max error, max|out - ref| / max|ref|, bounded by a
tolerance per kernel (the `*_TOL` constants, in units of bf16's epsilon, 2^-7: each bound
is about 3x the worst error a torch emulation of the kernel's roundings gives at these
shapes). Pure copies stay byte-exact: kv_pack / kv_unpack, reshape_and_cache (8-bit rows
too, against kv_quant.quantize), and rotary_embedding is also bit-equal to its reference
in the same dtype (its docstring's promise).

Speed (`Suite.speed`): achieved bandwidth (bytes read + written / time) as a fraction of
the device's copy bandwidth measured here (`dst.copy_(src)`, counted the same way), and
prefill TFLOP/s against `scaled_dot_product_attention` on the same data. Judged target:
`paged_decode_attention` >= DECODE_BANDWIDTH_TARGET of copy at batch >= 32 and context
>= 4k (the shapes below include them); the rest is reported.

Each kernel's first call is timed apart (`Suite.first_calls`): on a cold Triton cache it
is the compile. `--smoke` runs the same code in float32 (bf16 in the interpreter is not
what a GPU computes), tiny shapes, numbers meaningless; the float32 tolerances apply.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from pdserve.benchmarks.machine import print_machine

BLOCK_SIZE = 16
HEAD_DIM = 128
NUM_HEADS, NUM_KV_HEADS = 32, 8  # Llama-3-8B's attention shape
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps: one rounding is at most half of it

T = TypeVar("T")


@dataclass(frozen=True)
class Tolerance:
    """Bound on max|out - ref| / max|ref| by the kernel's dtype (float32 only in smoke,
    where it bounds the interpreter's IEEE fp32 arithmetic against the reference's)."""

    bf16: float
    fp32: float

    def of(self, dtype: torch.dtype) -> float:
        return self.fp32 if dtype == torch.float32 else self.bf16


FP32_TOL = 1e-5
# Emulated worst bf16 errors at these shapes: decode 0.45 eps (0.62 with 8-bit K/V: the
# probabilities times each token's V scale round to bf16), prefill 0.33, rms_norm 0.57,
# rotary 0.87 (its bf16 cos/sin tables round too), int8_linear 0.36 (one output rounding).
DECODE_ATTENTION_TOL = Tolerance(bf16=2 * BF16_EPS, fp32=FP32_TOL)
KV8_DECODE_ATTENTION_TOL = Tolerance(bf16=2 * BF16_EPS, fp32=FP32_TOL)
PREFILL_ATTENTION_TOL = Tolerance(bf16=2 * BF16_EPS, fp32=FP32_TOL)
RMS_NORM_TOL = Tolerance(bf16=2 * BF16_EPS, fp32=FP32_TOL)
ROTARY_TOL = Tolerance(bf16=3 * BF16_EPS, fp32=FP32_TOL)
INT8_LINEAR_TOL = Tolerance(bf16=BF16_EPS, fp32=FP32_TOL)
DECODE_BANDWIDTH_TARGET = 0.80  # of copy, at batch >= 32 and context >= 4k (H200)
REFERENCE_MAX_CONTEXT = 4096  # the decode reference gathers per sequence: slow past that
KV8_FORMATS = ("int8", "fp8")


@dataclass(frozen=True)
class Line:
    """One kernel's summary: whether it met its bar, and the text that says so."""

    ok: bool
    text: str


@dataclass
class Suite:
    """Where the kernels run, and what they showed so far."""

    device: str
    dtype: torch.dtype
    smoke: bool
    correct: list[Line] = field(default_factory=list)
    speed: list[Line] = field(default_factory=list)
    first_calls: dict[str, float] = field(default_factory=dict)  # kernel -> seconds

    def shapes(self, full: list[int], smoke: list[int]) -> list[int]:
        return smoke if self.smoke else full

    def first(self, kernel: str, fn: Callable[[], T]) -> T:
        """`fn()`, timed (to the device's end) if it is `kernel`'s first call here."""
        start = time.perf_counter()
        out = fn()
        synchronize(self.device)
        self.first_calls.setdefault(kernel, time.perf_counter() - start)
        return out

    def check(self, name: str, err: float, tol: Tolerance, extra: str = "") -> None:
        """A line for `name`: its normalised max error against the float32 reference."""
        bound = tol.of(self.dtype)
        ok = err <= bound
        verdict = "<=" if ok else "EXCEEDS"
        self.correct.append(Line(ok, f"{name}: err {err:.1e} {verdict} {bound:.1e}{extra}"))

    def exact(self, name: str, equal: bool) -> None:
        self.correct.append(Line(equal, f"{name}: {'byte-exact' if equal else 'DIFFERS'}"))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], suite: Suite) -> float:
    """Seconds per call: triton's do_bench on CUDA; one call in the smoke run (the CPU
    interpreter, whose numbers mean nothing: repeats would only prove the path again)."""
    if suite.device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100)) / 1e3
    repeat = 1 if suite.smoke else 3
    if not suite.smoke:
        fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(suite: Suite) -> float:
    """Bytes moved per second (read + written) by a plain device copy."""
    num_bytes = (1 << 30) if not suite.smoke else (8 << 20)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=suite.device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), suite)


def randn(*shape: int, suite: Suite, gen: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=suite.device).to(suite.dtype)


def paged_cache(num_tokens: int, suite: Suite, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A shuffled paged K/V cache holding `num_tokens` tokens, and its block order."""
    gen = torch.Generator(device=suite.device).manual_seed(seed)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k, v = randn(*shape, suite=suite, gen=gen), randn(*shape, suite=suite, gen=gen)
    order = torch.randperm(num_blocks, generator=gen, device=suite.device).to(torch.int32)
    return k, v, order


def norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|: the error in units of the result's scale."""
    scale = float(ref.float().abs().max())
    return float((out.float() - ref.float()).abs().max()) / max(scale, 1e-30)


# -- paged decode attention ---------------------------------------------------------------


@dataclass(frozen=True)
class DecodeInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    scale: float = HEAD_DIM**-0.5


def decode_inputs(batch: int, context: int, suite: Suite) -> DecodeInputs:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    k, v, order = paged_cache(batch * blocks_per_seq * BLOCK_SIZE, suite)
    lens = torch.full((batch,), context, dtype=torch.int32, device=suite.device)
    q = randn(batch, NUM_HEADS, HEAD_DIM, suite=suite)
    return DecodeInputs(q, k, v, order.view(batch, blocks_per_seq), lens)


def _decode_case(batch: int, context: int, suite: Suite, copy_bw: float) -> float | None:
    """Checks one shape's speed; returns its error (None past the reference's reach)."""
    from pdserve.kernels.paged_decode_attention import (
        paged_decode_attention,
        ref_paged_decode_attention,
    )

    x = decode_inputs(batch, context, suite)

    def run() -> torch.Tensor:
        return paged_decode_attention(x.q, x.k, x.v, x.tables, x.lens, x.scale)

    out = suite.first("paged_decode_attention", run)
    err = None
    if context <= REFERENCE_MAX_CONTEXT:
        ref = ref_paged_decode_attention(x.q.float(), x.k, x.v, x.tables, x.lens, x.scale)
        err = norm_err(out, ref)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * x.k.element_size()
    frac = kv_bytes / timed(run, suite) / copy_bw
    judged = not suite.smoke and batch >= 32 and context >= 4096
    ok = frac >= DECODE_BANDWIDTH_TARGET or not judged
    mark = "" if not judged else (" (target met)" if ok else " (MISSED target)")
    suite.speed.append(Line(ok, f"decode attention B={batch} ctx={context}: {frac:.0%}{mark}"))
    return err


def bench_decode(suite: Suite, copy_bw: float) -> None:
    errors = []
    for batch in suite.shapes([1, 32, 256], [1, 3]):
        for context in suite.shapes([512, 4096, 32768], [40, 100]):
            if batch * context > (1 << 21):  # keep the cache under ~8 GiB
                continue
            err = _decode_case(batch, context, suite, copy_bw)
            if err is not None:
                errors.append(err)
    suite.check("paged_decode_attention", max(errors), DECODE_ATTENTION_TOL)


def bench_decode_kv8(suite: Suite, copy_bw: float) -> None:
    """Decode attention over an 8-bit cache against the reference over its dequantized
    values: the same model an 8-bit cache serves (engine/modeling/kv_quant.py)."""
    from pdserve.engine.modeling import kv_quant
    from pdserve.kernels.paged_decode_attention import (
        paged_decode_attention,
        ref_paged_decode_attention,
    )

    batch, context = suite.shapes([32, 4096], [3, 40])
    x = decode_inputs(batch, context, suite)
    for fmt in KV8_FORMATS:
        k8, v8 = kv_quant.quantize(x.k, fmt), kv_quant.quantize(x.v, fmt)
        k32 = kv_quant.dequantize(k8, fmt, torch.float32)
        v32 = kv_quant.dequantize(v8, fmt, torch.float32)

        def run(k8: torch.Tensor = k8, v8: torch.Tensor = v8, fmt: str = fmt) -> torch.Tensor:
            return paged_decode_attention(
                x.q, k8, v8, x.tables, x.lens, x.scale, kv_cache_dtype=fmt
            )

        out = suite.first(f"paged_decode_attention[{fmt}]", run)
        ref = ref_paged_decode_attention(x.q.float(), k32, v32, x.tables, x.lens, x.scale)
        frac = 2 * k8.numel() / timed(run, suite) / copy_bw
        suite.check(
            f"paged_decode_attention[kv {fmt}]",
            norm_err(out, ref),
            KV8_DECODE_ATTENTION_TOL,
            f" ({frac:.0%} of copy at B={batch} ctx={context})",
        )


# -- paged prefill attention --------------------------------------------------------------


def _prefill_case(num_seqs: int, seq_len: int, query_len: int, suite: Suite) -> float:
    """Error of the new `query_len` tokens of each `seq_len`-token sequence (a later chunk
    of a chunked prefill, or a prefix hit, when shorter); reports speed for whole ones."""
    from pdserve.kernels.paged_prefill_attention import (
        paged_prefill_attention,
        ref_paged_prefill_attention,
    )

    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    k, v, order = paged_cache(num_seqs * blocks_per_seq * BLOCK_SIZE, suite)
    tables = order.view(num_seqs, blocks_per_seq)
    q = randn(num_seqs * query_len, NUM_HEADS, HEAD_DIM, suite=suite)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=suite.device) * query_len
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=suite.device)
    scale = HEAD_DIM**-0.5

    def ours() -> torch.Tensor:
        return paged_prefill_attention(q, k, v, tables, starts, lens, scale, query_len)

    out = suite.first("paged_prefill_attention", ours)
    err = norm_err(out, ref_paged_prefill_attention(q.float(), k, v, tables, starts, lens, scale))
    if query_len == seq_len:
        suite.speed.append(_prefill_speed(ours, q, k, v, tables, suite))
    return err


def _prefill_speed(
    ours: Callable[[], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    suite: Suite,
) -> Line:
    """TFLOP/s against SDPA on the same data, unpaged and contiguous (reported only)."""
    import torch.nn.functional as F

    num_seqs = tables.shape[0]
    seq_len = q.shape[0] // num_seqs

    def dense(cache: torch.Tensor) -> torch.Tensor:  # -> [S, KVH, L, D]
        blocks = cache[tables.long()].permute(0, 2, 1, 3, 4)  # [S, KVH, nb, bs, D]
        return blocks.reshape(num_seqs, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :seq_len].contiguous()

    dense_q = q.view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    dense_k, dense_v = dense(k), dense(v)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, scale=HEAD_DIM**-0.5, enable_gqa=True
        )

    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * seq_len * seq_len / 2  # causal half
    t_ours, t_sdpa = timed(ours, suite), timed(sdpa, suite)
    text = f"prefill attention L={seq_len}: {flops / t_ours / 1e12:.2f} TFLOP/s"
    return Line(True, f"{text} = {t_sdpa / t_ours:.2f}x SDPA")


def bench_prefill(suite: Suite) -> None:
    num_seqs = suite.shapes([4], [2])[0]
    errors = [_prefill_case(num_seqs, n, n, suite) for n in suite.shapes([1024, 4096], [24])]
    chunked = suite.shapes([2048], [40])[0]
    errors.append(_prefill_case(num_seqs, chunked, chunked // 4, suite))
    suite.check("paged_prefill_attention", max(errors), PREFILL_ATTENTION_TOL)


# -- byte-exact copies --------------------------------------------------------------------


def bench_kv_pack(suite: Suite, copy_bw: float) -> None:
    from pdserve.kernels.kv_pack import kv_pack, kv_unpack, ref_kv_pack

    num_layers = suite.shapes([32], [2])[0]
    num_blocks = suite.shapes([128], [4])[0]  # 2,048 tokens of Llama-3-8B: 256 MiB
    shape = (num_layers, 2, 2 * num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    cache = randn(*shape, suite=suite)
    ids = torch.randperm(2 * num_blocks, device=suite.device)[:num_blocks].to(torch.int32)
    buffer = suite.first("kv_pack", lambda: kv_pack(cache, ids))
    suite.exact("kv_pack", torch.equal(buffer, ref_kv_pack(cache, ids)))
    other = torch.zeros_like(cache)
    suite.first("kv_unpack", lambda: kv_unpack(buffer, other, ids))
    suite.exact("kv_unpack", torch.equal(other[:, :, ids.long()], cache[:, :, ids.long()]))
    moved = 2 * buffer.numel() * buffer.element_size()
    t_pack = timed(lambda: kv_pack(cache, ids, out=buffer), suite)
    t_unpack = timed(lambda: kv_unpack(buffer, other, ids), suite)
    suite.speed.append(
        Line(
            True,
            f"kv_pack {buffer.numel() * buffer.element_size() >> 20} MiB: pack "
            f"{moved / t_pack / copy_bw:.0%} / unpack {moved / t_unpack / copy_bw:.0%} of copy",
        )
    )


def bench_reshape_and_cache(suite: Suite) -> None:
    """The cache writes, in the model's dtype and as 8-bit rows, byte for byte."""
    from pdserve.engine.modeling import kv_quant
    from pdserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

    tokens = suite.shapes([4096], [20])[0]
    k = randn(tokens, NUM_KV_HEADS, HEAD_DIM, suite=suite)
    v = randn(tokens, NUM_KV_HEADS, HEAD_DIM, suite=suite)
    slots = torch.randperm(2 * tokens, device=suite.device)[:tokens]
    slots[::7] = -1  # padding rows: nothing written for them
    k_cache, v_cache, _ = paged_cache(2 * tokens, suite)
    k2, v2 = k_cache.clone(), v_cache.clone()
    suite.first("reshape_and_cache", lambda: reshape_and_cache(k, v, k_cache, v_cache, slots))
    ref_reshape_and_cache(k, v, k2, v2, slots)
    suite.exact("reshape_and_cache", torch.equal(k_cache, k2) and torch.equal(v_cache, v2))
    for fmt in KV8_FORMATS:
        rows = kv_quant.quantize(k_cache, fmt)  # any rows: the slots written are compared
        kc, vc = rows.clone(), rows.clone()
        kr, vr = rows.clone(), rows.clone()
        reshape_and_cache(k, v, kc, vc, slots, kv_cache_dtype=fmt)
        ref_reshape_and_cache(k, v, kr, vr, slots, partial(kv_quant.quantize, kv_cache_dtype=fmt))
        equal = torch.equal(kc, kr) and torch.equal(vc, vr)
        suite.exact(f"reshape_and_cache[kv {fmt}]", equal)


# -- small kernels ------------------------------------------------------------------------


def bench_rms_norm(suite: Suite) -> None:
    from pdserve.kernels.rms_norm import ref_rms_norm, rms_norm

    tokens, hidden = suite.shapes([4096, 4096], [20, 96])
    x, residual = randn(tokens, hidden, suite=suite), randn(tokens, hidden, suite=suite)
    w = randn(hidden, suite=suite)
    out = suite.first("rms_norm", lambda: rms_norm(x, w, 1e-5))
    ref = ref_rms_norm(x.float(), w.float(), 1e-5)
    fused = rms_norm(x, w, 1e-5, residual)
    fused_ref = ref_rms_norm(x.float(), w.float(), 1e-5, residual.float())
    assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
    assert isinstance(fused, tuple) and isinstance(fused_ref, tuple)
    pairs = [(out, ref), *zip(fused, fused_ref, strict=True)]
    err = max(norm_err(a, b) for a, b in pairs)
    suite.check("rms_norm (+ residual)", err, RMS_NORM_TOL)


def bench_rotary(suite: Suite) -> None:
    from pdserve.common.model_config import RopeConfig
    from pdserve.engine.modeling.rotary import cos_sin_cache
    from pdserve.kernels.rotary_embedding import ref_rotary_embedding, rotary_embedding

    dev = suite.device
    tokens, max_pos = suite.shapes([4096, 8192], [20, 64])
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
    # made here in float32 and moved explicitly: the kernel reads the tables on its device
    cos32, sin32 = (t.to(dev) for t in cos_sin_cache(rope, HEAD_DIM, max_pos, torch.float32))
    cos, sin = cos32.to(suite.dtype), sin32.to(suite.dtype)
    pos = torch.randint(0, max_pos, (tokens,), device=dev)
    q = randn(tokens, NUM_HEADS, HEAD_DIM, suite=suite)
    k = randn(tokens, NUM_KV_HEADS, HEAD_DIM, suite=suite)
    rq, rk = suite.first("rotary_embedding", lambda: rotary_embedding(pos, q, k, cos, sin))
    fq, fk = ref_rotary_embedding(pos, q.float(), k.float(), cos32, sin32)
    eq, ek = ref_rotary_embedding(pos, q, k, cos, sin)
    same = torch.equal(rq, eq) and torch.equal(rk, ek)
    err = max(norm_err(rq, fq), norm_err(rk, fk))
    suite.check("rotary_embedding (llama3)", err, ROTARY_TOL)
    suite.correct.append(
        Line(same, f"rotary_embedding: {'bit-equal' if same else 'NOT bit-equal'} to its ref")
    )


def bench_int8_linear(suite: Suite, copy_bw: float) -> None:
    """Decode (1 row) and prefill (512 rows) shapes of Llama-3-8B's gate projection."""
    from pdserve.kernels.int8_linear import int8_linear, ref_int8_linear

    out_features, in_features = suite.shapes([14336, 4096], [80, 96])
    gen = torch.Generator(device=suite.device).manual_seed(1)
    weight = torch.randint(
        -127, 128, (out_features, in_features), generator=gen, device=suite.device
    ).to(torch.int8)
    scales = torch.rand(out_features, generator=gen, device=suite.device) / 127
    bias = randn(out_features, suite=suite, gen=gen)
    errors = []
    for rows in suite.shapes([1, 512], [1, 20]):
        x = randn(rows, in_features, suite=suite, gen=gen)

        def run(x: torch.Tensor = x) -> torch.Tensor:
            return int8_linear(x, weight, scales, bias)

        out = suite.first("int8_linear", run)
        errors.append(norm_err(out, ref_int8_linear(x.float(), weight, scales, bias.float())))
        if rows == 1:
            frac = weight.numel() / timed(run, suite) / copy_bw
            suite.speed.append(Line(True, f"int8_linear M=1: weight read at {frac:.0%} of copy"))
    suite.check("int8_linear", max(errors), INT8_LINEAR_TOL)


def run_suite(suite: Suite) -> float:
    """Every kernel's lines into `suite`; returns the copy bandwidth (bytes/s)."""
    copy_bw = copy_bandwidth(suite)
    bench_decode(suite, copy_bw)
    bench_decode_kv8(suite, copy_bw)
    bench_prefill(suite)
    bench_kv_pack(suite, copy_bw)
    bench_reshape_and_cache(suite)
    bench_rms_norm(suite)
    bench_rotary(suite)
    bench_int8_linear(suite, copy_bw)
    return copy_bw


def main() -> int:
    print_machine()  # the CPU and its flags, with every figure
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import
        suite = Suite("cpu", torch.float32, smoke=True)
    elif not torch.cuda.is_available():
        print("kernels_gpu: needs a CUDA device (or --smoke on the CPU)", file=sys.stderr)
        return 2
    else:
        suite = Suite("cuda", torch.bfloat16, smoke=False)
    torch.manual_seed(0)
    copy_bw = run_suite(suite)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + written)")
    for line in suite.correct + suite.speed:
        print(f"{'ok  ' if line.ok else 'FAIL'} {line.text}")
    firsts = ", ".join(f"{name} {s:.1f} s" for name, s in suite.first_calls.items())
    print(f"first calls (compile on a cold Triton cache): {firsts}")
    return 0 if all(line.ok for line in suite.correct + suite.speed) else 1


if __name__ == "__main__":
    sys.exit(main())
