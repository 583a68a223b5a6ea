"""Linear layers whose weights are prepacked for oneDNN on CPU (bfloat16 and float32).

`F.linear` on a bf16 CPU tensor re-lays the weight out on every call; a decode step
(one row per sequence) then runs at a third of memory bandwidth. oneDNN's blocked
layout, packed once at load, streams the weight at full speed. In float32, `F.linear`
(MKL) ran the mid model's linears at about 50 GFLOP/s for a batch of 33 rows, the
packed weights at about 100 (and 2.6x faster on 2 threads); measured in the same
process, 5 linears of hidden 1024: 57.8 ms against 30.0 ms. Results agree with
`F.linear` to float rounding (the fp32 token-exactness tests run through this path).
float16 and CUDA keep `F.linear`.

A CPU without bfloat16 instructions (AVX2 only: no AVX512-BF16, no AMX) has no oneDNN
bf16 matmul, and `F.linear` in bf16 there widens and multiplies element by element: on a
2-core AVX2 EPYC, 11 GFLOP/s against 45 for float32, the mid model's 512-token prompt
took 10 s (47 tok/s). There a bf16 `Linear` runs the C kernel `cpu_bf16`
(`csrc/bf16_linear.c`): the weight stays bf16, packed for it at load, and is widened in
registers; x is widened, the float32 sums rounded back to bf16: what a native bf16
matmul computes (bf16 operands, float32 sums, a bf16 result), in another summation
order. Where the kernel is not built (no compiler, `PDSERVE_CPU_KERNELS=0`), the weight
is held widened to float32 and packed for oneDNN instead (`widened`): as fast for a
prefill, but a decode step reads twice the bytes, which is also what it costs in memory
(same layer, 2 threads: 4.7x bf16 `F.linear`'s speed at 512 rows, 1.8x at 10, 0.7x at 1).

`Int8Linear` holds a weight quantized to int8 with one scale per output row
(`EngineConfig.quantization="int8"`, the transformer blocks' projections): a decode
step, bound by memory bandwidth, reads half the weight bytes of bf16 and a quarter of
fp32's. Its matmul reads the int8 weight as is, never a dequantized copy: on CPU the C
kernel `cpu_int8` (`csrc/int8_linear.c`, the weight packed for it at load) where it
compiles vectorised, else `torch.ops.aten._weight_int8pack_mm` (also on devices other
than CUDA); the Triton kernel `kernels/int8_linear.py` on CUDA, where torch's CUDA
version of that op is a reference kernel (one thread per output element, the weight rows
read uncoalesced). An engine on the Triton attention backend off CUDA (CPU under
`TRITON_INTERPRET=1`: tests of the whole Triton path) runs the Triton kernel too
(`Int8Linear.on_triton`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.engine.cpu import bf16 as cpu_bf16
from pdserve.engine.cpu import int8 as cpu_int8

logger = logging.getLogger(__name__)


def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype `weight` is packed for oneDNN in, or None where it stays unpacked."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None
    if weight.dtype == torch.float32:
        return torch.float32
    if weight.dtype == torch.bfloat16:
        if cpu_has_bf16_matmul():
            return torch.bfloat16
        _log_widening()
        return torch.float32
    return None


def _bf16_kernel(weight: torch.Tensor) -> cpu_bf16.Bf16CpuKernel | None:
    """The C kernel for a bf16 CPU weight where oneDNN has no bf16 matmul, else None."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or cpu_has_bf16_matmul():
        return None
    kernel = cpu_bf16.load()
    if kernel is None or not kernel.vectorised:
        return None
    _log_kernel()
    return kernel


@functools.cache
def _log_kernel() -> None:
    logger.info(
        "this CPU has no bfloat16 matmul (no AVX512-BF16 or AMX): bf16 linears run the"
        " AVX2 kernel of engine/cpu/csrc/bf16_linear.c (bf16 weights widened in registers)"
    )


@functools.cache
def _log_widening() -> None:
    logger.info(
        "this CPU has no bfloat16 matmul (no AVX512-BF16 or AMX): bf16 linear weights are"
        " held widened to float32 (twice their memory, about 4x faster prefill)"
    )


class Linear:
    """y = x @ weight.T + bias for x [T, in_features], the weight in the model's dtype.

    On a CPU without bf16 matmul (module docstring) a bf16 weight runs the C kernel
    (`kernel`, the weight in its layout in `packed`), or, without it, is held in float32
    (`widened`); x and the result stay bf16 either way.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.widened = False
        self.kernel = _bf16_kernel(weight)
        if self.kernel is not None:
            self.packed = self.kernel.pack(weight)
            self.weight = None
            if bias is not None:  # added to the float32 sums, before the rounding
                self.bias = bias.float()
            return
        pack_dtype = _pack_dtype(weight)
        if pack_dtype is not None:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(pack_dtype), None)
            except RuntimeError as exc:  # an older oneDNN or an exotic CPU: stay unpacked
                logger.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
            else:
                self.weight = None
                self.widened = pack_dtype != weight.dtype
                if self.widened and bias is not None:
                    self.bias = bias.to(pack_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            assert self.packed is not None
            if x.dtype == torch.bfloat16:  # the model's own dtype: one call, no conversions
                return self.kernel.linear_bf16(x, self.packed, self.out_features, self.bias)
            y = self.kernel.linear(x, self.packed, self.out_features)
            if self.bias is not None:
                y += self.bias
            return y.to(x.dtype)
        if self.packed is not None:
            if self.widened:
                y = torch.ops.mkldnn._linear_pointwise(
                    x.float(), self.packed, self.bias, "none", [], ""
                )
                return y.to(x.dtype)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight as held (packed or not) and of the bias."""
        return _nbytes(self._held()) + _nbytes(self.bias)

    @property
    def row_bytes(self) -> int:
        """Bytes of one output row: its weights and its bias element."""
        bias_bytes = 0 if self.bias is None else self.bias.element_size()
        return self.in_features * self._held().element_size() + bias_bytes

    def _held(self) -> torch.Tensor:
        weight = self.packed if self.packed is not None else self.weight
        assert weight is not None
        return weight


# Symmetric int8: -128 stays unused, so that q and -q are both representable.
INT8_MAX = 127
# `_weight_int8pack_mm`'s bf16 CPU kernel reads a row 16 values at a time (AVX-512; 8
# with AVX2 and on Arm) with aligned loads and no tail: rows of any other length read past
# their end (wrong sums) and an unaligned x faults (seen with torch 2.13 on AVX-512).
# So x and the weight go in zero-padded to a multiple of 16 columns, contiguous and
# 64-byte aligned (the CPU allocator's alignment): `_for_cpu_op`.
_CPU_ROW_MULTIPLE = 16
_CPU_ALIGN_BYTES = 64


class Int8Weight(NamedTuple):
    weight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], the float weight's dtype


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of `weight` [out, in], round to nearest.

    scale = max|w| / 127 per row, computed in float32 and stored in the weight's dtype
    (the CPU kernel takes scales in the activations' dtype); q = round(w / scale) against
    the stored scale, so that q * scale is exactly what the matmul multiplies by, and
    |w - q * scale| <= scale / 2 for every element. An all-zero row gets scale 0, q 0.
    """
    w = weight.float()
    row_max = w.abs().amax(dim=1)
    scales = (row_max / INT8_MAX).to(weight.dtype)
    # Rounded to its dtype, a scale may fall below max / 127, and the row's largest values
    # clamp at 127: by less than half a step, unless the rounding was coarse (float16's
    # subnormal scales, below 6e-5); those take the next value up instead.
    low = scales.float() * (INT8_MAX + 0.5) < row_max
    scales = torch.where(low, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    divisor = scales.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    q = (w / divisor[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX)
    return Int8Weight(q.to(torch.int8), scales)


def dequantize_int8(weight: Int8Weight) -> torch.Tensor:
    """The float32 weight [out, in] that `quantize_int8`'s result stands for."""
    return weight.weight.float() * weight.scales.float()[:, None]


class Int8Linear:
    """`Linear`'s y = x @ W.T + bias with W = weight * scales[:, None] held as int8 rows and
    one scale per row (`quantize_int8`); x and the result in the scales' dtype, the bias
    too. The float weight is not kept.

    On CPU the C kernel (`cpu_int8`) runs it where it compiles vectorised (AVX-512), on
    a weight packed for it (`weight` then holds that layout; `int8_weight` gives the rows
    back): on 1 Zen 4 core the mid model's projections ran at 2-3x the packed bf16
    `Linear`'s speed at 1 row and about level at 32. Elsewhere torch's op: vectorised on
    x86 for bfloat16 only (float32 and float16 run its scalar fallback), and
    compute-bound (it widens and scales every weight before the FMA): 0.96x of the bf16
    `Linear` at 1 row and 0.37x at 32 on that core. Either is deterministic on CPU and
    each output row depends on its input row alone (the sum over K runs the same way
    whatever the batch).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        triton: bool = False,
    ) -> None:
        """`triton`: the Triton kernel on any device (off CUDA it runs only in Triton's
        interpreter); raises ImportError without Triton. Otherwise the device chooses."""
        self.out_features, self.in_features = weight.shape
        self.scales = scales
        self.bias = bias
        on_triton = triton or weight.device.type == "cuda"
        self._kernel = _triton_kernel(required=triton) if on_triton else None
        self._cpu = _cpu_kernel(scales) if weight.device.type == "cpu" and not triton else None
        # Which matmul runs: "c" (cpu_int8), "triton" or "torch" (torch's op).
        self.backend = "c" if self._cpu else "triton" if self._kernel else "torch"
        if self._cpu is not None:
            self.weight = self._cpu.pack(weight)
            self._row_len = self.weight.shape[1] * cpu_int8.COLS
        else:
            self.weight = weight if self._kernel is not None else _for_cpu_op(weight)
            self._row_len = self.weight.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """The int8 layer of the float `weight` [out, in] (`quantize_int8`)."""
        return cls(*quantize_int8(weight), bias)

    def on_triton(self) -> Int8Linear:
        """This layer's int8 rows, scales and bias multiplied by the Triton kernel."""
        if self.backend == "triton":
            return self
        weight, scales = self.int8_weight()
        # the torch op's rows are padded: the kernel takes any width, so the copy drops it
        return Int8Linear(weight.contiguous(), scales, self.bias, triton=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel(x, self.weight, self.scales, self.bias)
        if self._cpu is not None:
            y = self._cpu.linear(x, self.weight, self.scales, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(_for_cpu_op(x), self.weight, self.scales)
        return y if self.bias is None else y.add_(self.bias)

    def int8_weight(self) -> Int8Weight:
        """The int8 rows [out, in] and scales this layer multiplies by, whatever the
        layout it holds them in."""
        if self._cpu is not None:
            weight = self._cpu.unpack(self.weight, self.out_features, self.in_features)
        else:
            weight = self.weight[:, : self.in_features]
        return Int8Weight(weight, self.scales)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the int8 weight as held (padding included), the scales and the bias."""
        return _nbytes(self.weight) + _nbytes(self.scales) + _nbytes(self.bias)

    @property
    def row_bytes(self) -> int:
        """Bytes of one output row: its int8 weights, its scale and its bias element."""
        bias_bytes = 0 if self.bias is None else self.bias.element_size()
        return self._row_len + self.scales.element_size() + bias_bytes


# What the transformer blocks' projections are, with and without quantization.
LinearLayer = Linear | Int8Linear
_Int8Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def _triton_kernel(required: bool) -> _Int8Kernel | None:
    """The Triton kernel, imported only where it runs (a CPU install has no Triton).
    Unless `required`, a missing Triton leaves torch's own op (on CUDA: correct, slow)."""
    try:
        from pdserve.kernels.int8_linear import int8_linear
    except ImportError as exc:
        if required:
            raise
        logger.warning("Triton unavailable (%s): int8 linears use torch's reference kernel", exc)
        return None
    return int8_linear


def _cpu_kernel(scales: torch.Tensor) -> cpu_int8.Int8CpuKernel | None:
    """The C kernel where it is vectorised here and takes the scales' dtype, else None
    (torch's op)."""
    kernel = cpu_int8.load()
    if kernel is None or not kernel.vectorised or scales.dtype not in kernel.dtypes:
        return None
    return kernel


def _for_cpu_op(t: torch.Tensor) -> torch.Tensor:
    """`t` [rows, cols] as the CPU op takes it (`_CPU_ROW_MULTIPLE`): a new tensor only
    where `t` is not already so."""
    pad = -t.shape[1] % _CPU_ROW_MULTIPLE
    if pad:
        return F.pad(t, (0, pad))  # a new allocation: contiguous and aligned
    if t.is_contiguous() and t.data_ptr() % _CPU_ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
