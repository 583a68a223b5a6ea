"""The bfloat16-weight linear for CPUs without bf16 matmul, in C (`csrc/bf16_linear.c`).

On an AVX2-only CPU (no AVX512-BF16, no AMX) oneDNN has no bf16 matmul and torch's bf16
`F.linear` widens and multiplies element by element (11 GFLOP/s on a 2-core EPYC, against
45 for float32). Holding the weight widened to float32 fixed prefill but doubled what a
decode step reads and what the weights take in memory: the mid model's batch-1 decode step
took 28.5 ms on 2 threads, against 17.2 ms with bf16 `F.linear`. This kernel keeps the
weight bf16, packed once at load (`Bf16CpuKernel.pack`), and widens it in registers (exact),
with float32 FMAs: 2 bytes a weight per decode step, register-blocked rows for a prefill.
Each output is one FMA chain over k in order, whatever the batch: a row's result does not
depend on the rows computed with it, nor on the thread count.

Built, cached and switched off (`PDSERVE_CPU_KERNELS=0`) as `cpu_kernels` does. Used only
where it compiles to its AVX2 path; elsewhere `Linear` widens the weight as before.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.cpu.kernels import build_library

_SOURCE = Path(__file__).with_name("csrc") / "bf16_linear.c"
PANEL = 16  # outputs a panel (the C file's P)
PATHS = {0: "portable C", 1: "AVX2 float32 FMA"}


class Bf16CpuKernel:
    """The loaded library: `pack` a bf16 weight once, then `linear` as often as needed."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.bf_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_void_p,  # x (float32)
            ctypes.c_int64,  # x's row stride
            *[ctypes.c_void_p] * 2,  # packed weight, y (float32)
            *[ctypes.c_int64] * 3,  # B, N, K
            ctypes.c_int,  # threads
        ]
        self._fn_bf16 = lib.bf_linear_bf16
        self._fn_bf16.restype = ctypes.c_int
        self._fn_bf16.argtypes = [
            ctypes.c_void_p,  # x (bfloat16)
            ctypes.c_int64,  # x's row stride
            *[ctypes.c_void_p] * 3,  # packed weight, bias (float32, or NULL), y (bfloat16)
            *[ctypes.c_int64] * 3,  # B, N, K
            ctypes.c_int,  # threads
        ]
        lib.bf_linear_path.restype = ctypes.c_int
        self.path = int(lib.bf_linear_path())
        perm = lib.bf_linear_perm
        perm.restype = ctypes.c_int
        perm.argtypes = [ctypes.c_int]
        # position q of a k's 16 values holds output _outputs[q] of the panel
        self._outputs = torch.tensor([int(perm(q)) for q in range(PANEL)], dtype=torch.long)

    @property
    def vectorised(self) -> bool:
        """Whether it compiled to its AVX2 path here (the portable loop is only correct)."""
        return self.path > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The bf16 `weight` [N, K] in the kernel's layout [ceil(N / 16), K, 16], rows past
        N zero."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"packs a 2-d bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        padded = F.pad(weight, (0, 0, 0, -n % PANEL))
        panels = padded.view(-1, PANEL, k).transpose(1, 2)  # [panels, K, 16] by output
        return panels.index_select(2, self._outputs).contiguous()

    def unpack(self, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """`pack`'s inverse: the weight [out_features, K]."""
        by_output = torch.empty_like(packed)
        by_output[..., self._outputs] = packed
        return by_output.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features].contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [T, K] (any float dtype) @ w.T for `packed` = pack(w): [T, out_features] float32."""
        if x.dim() != 2 or x.device.type != "cpu":
            raise ValueError(f"bf16 linear takes CPU x [T, in_features], not {tuple(x.shape)}")
        x = x.to(torch.float32)
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        batch, in_features = x.shape
        if in_features != packed.shape[1] or out_features > packed.shape[0] * PANEL:
            raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(packed.shape)}")
        y = torch.empty(batch, out_features, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            y.data_ptr(),
            batch,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"the bf16 linear does not take x {tuple(x.shape)}")
        return y

    def linear_bf16(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, K] bfloat16 @ w.T (+ `bias`, float32) for `packed` = pack(w), rounded once
        to bfloat16: `linear(x, ...)` plus the bias, `.to(bfloat16)`, equal to the bit, in
        one call (the widening of x and the rounding of y inside it: no torch op on
        either side)."""
        if x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.bfloat16:
            raise ValueError(
                f"takes CPU bfloat16 x [T, in_features], not {x.dtype} {tuple(x.shape)}"
            )
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        batch, in_features = x.shape
        if in_features != packed.shape[1] or out_features > packed.shape[0] * PANEL:
            raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(packed.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
            raise ValueError(f"the bias must be float32 [{out_features}], not {bias.dtype}")
        if bias is not None:
            bias = bias.contiguous()
        y = torch.empty(batch, out_features, dtype=torch.bfloat16)
        status = self._fn_bf16(
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            batch,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if status == -3:
            raise MemoryError(f"the bf16 linear could not allocate for x {tuple(x.shape)}")
        if status:
            raise ValueError(f"the bf16 linear does not take x {tuple(x.shape)}")
        return y


@functools.cache
def load() -> Bf16CpuKernel | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    return build_library(
        _SOURCE, "the bf16 CPU kernel", "bf16 linears hold their weights widened", Bf16CpuKernel
    )
