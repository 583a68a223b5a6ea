"""The int8 weight-only linear for the CPU in C (`csrc/int8_linear.c`), for `Int8Linear`.

torch's CPU op for it (`_weight_int8pack_mm`) is compute-bound: it widens and scales
every weight before the FMA, and is vectorised for bfloat16 only. A decode step should
be bound by the weight bytes it reads. The kernel reads each int8 weight once per call,
from a layout packed at load (`Int8CpuKernel.pack`) so that the read is one sequential
stream, and widens it in registers: bf16 activations multiply through AVX512_BF16's
vdpbf16ps, others through float32 FMAs; larger batches widen a few rows at a time into a
per-thread tile in cache that every activation row then reads. On 1 Zen 4 core (mid
model's projections, weights from memory) it ran at 2-3x the packed bf16 `Linear` at 1
row and about level with it at 32, where torch's op ran 1.1x and 0.3x.

Built, cached and switched off (`PDSERVE_CPU_KERNELS=0`) as `cpu_kernels` does. Used
only where it compiles to a vectorised path (AVX-512); elsewhere its portable C loop is
slower than torch's op, and `Int8Linear` keeps torch's.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.cpu.kernels import build_library

_SOURCE = Path(__file__).with_name("csrc") / "int8_linear.c"
# The packed layout (the C file's R and C): groups of ROWS output rows, each cut into
# chunks of COLS columns; chunk j of a group holds its ROWS rows' COLS bytes in a row.
ROWS = 4
COLS = 64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# What `i8_linear_path` returns: how the kernel multiplies on this CPU.
PATHS = {0: "portable C", 1: "AVX-512 float32", 2: "AVX-512 bf16"}


class Int8CpuKernel:
    """The loaded library: `pack` a weight once, then `linear` as often as needed."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.i8_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.c_int,  # dtype
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # x's row stride
            *[ctypes.c_void_p] * 3,  # packed weight, scales, y
            *[ctypes.c_int64] * 3,  # B, N, K
            ctypes.c_int,  # threads
        ]
        lib.i8_linear_path.restype = ctypes.c_int
        self.path = int(lib.i8_linear_path())
        index = lib.i8_pack_index
        index.restype = ctypes.c_int64
        index.argtypes = [ctypes.c_int64] * 3
        # The order of a chunk's bytes: position p holds column _columns[p] of the chunk.
        self._columns = torch.empty(COLS, dtype=torch.long)
        for k in range(COLS):
            self._columns[int(index(0, k, COLS))] = k
        self.dtypes = frozenset(_DTYPES)

    @property
    def vectorised(self) -> bool:
        """Whether it beats torch's op here (the portable loop does not)."""
        return self.path > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The int8 `weight` [N, K] in the kernel's layout, [ceil(N / ROWS), ceil(K / COLS),
        ROWS, COLS], zero-padded."""
        n, k = weight.shape
        padded = F.pad(weight, (0, -k % COLS, 0, -n % ROWS))
        groups, chunks = padded.shape[0] // ROWS, padded.shape[1] // COLS
        grouped = padded.view(groups, ROWS, chunks, COLS).index_select(3, self._columns)
        return grouped.permute(0, 2, 1, 3).contiguous()

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """`pack`'s inverse: the int8 weight [out_features, in_features]."""
        groups, chunks = packed.shape[:2]
        grouped = torch.empty_like(packed.permute(0, 2, 1, 3))
        grouped[..., self._columns] = packed.permute(0, 2, 1, 3)
        rows = grouped.reshape(groups * ROWS, chunks * COLS)
        return rows[:out_features, :in_features].contiguous()

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        """x [T, K] @ (w * scales[:, None]).T for `packed` = pack(w): [T, out_features] in
        x's dtype (which the scales share)."""
        if x.dtype != scales.dtype or x.dtype not in _DTYPES or x.device.type != "cpu":
            raise ValueError(f"int8 linear takes CPU x in the scales' dtype, not {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"int8 linear takes x [T, in_features], not {tuple(x.shape)}")
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        batch, in_features = x.shape
        groups, chunks = packed.shape[:2]
        if not (0 <= in_features <= chunks * COLS and out_features <= groups * ROWS):
            raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(packed.shape)}")
        y = torch.empty(batch, out_features, dtype=x.dtype)
        status = self._fn(
            _DTYPES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            scales.data_ptr(),
            y.data_ptr(),
            batch,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if status == -1:
            raise MemoryError("the int8 linear could not allocate its scratch memory")
        if status:
            raise ValueError(f"the int8 linear does not take x {tuple(x.shape)}")
        return y


@functools.cache
def load() -> Int8CpuKernel | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    return build_library(
        _SOURCE, "the int8 CPU kernel", "int8 linears use torch's op", Int8CpuKernel
    )
