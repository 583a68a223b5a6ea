"""CPU kernels in C, compiled on first use with the machine's C compiler, called by ctypes.

Only what torch has no good CPU kernel for: decode attention over the paged KV cache
(`csrc/paged_decode.c`). SDPA's CPU kernel pays a fixed cost per (sequence, KV head)
and needs the blocks gathered into a padded copy first; at head_dim 32-128 with a few
query heads per KV head that ran at 2-4 GB/s, against the 13 GB/s a copy reaches here.

The shared object is built once per source, compiler flags and CPU into a cache folder
(`$PDSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdserve/kernels`, else
`~/.cache/pdserve/kernels`); concurrent builders each write a private file and rename
it into place. `PDSERVE_CPU_KERNELS=0` turns the kernels off. Without a compiler, or if
the build fails, `load()` returns None and callers keep the torch path: the kernels make
things faster, never possible.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
_BUILD_TIMEOUT_S = 120.0
_FUNCTIONS = {torch.float32: "pd_decode_f32", torch.bfloat16: "pd_decode_bf16"}
if platform.machine() in ("x86_64", "AMD64"):
    _FUNCTIONS[torch.float16] = "pd_decode_f16"  # _Float16 is an x86-64/arm64 gcc type


def _cache_dir() -> Path:
    if env := os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve" / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(keys)}))


def _openmp_runtime() -> Path | None:
    """The OpenMP runtime torch loaded into this process (libgomp, or libiomp5/libomp,
    which export the same GOMP_* entry points), so the kernel joins torch's thread pool
    instead of starting a second one that would fight it for the cores."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if re.search(r"/lib(gomp|iomp5|omp)[-\w.]*\.so", path):
            return Path(path)
    return None


def _build(compiler: str, source_file: Path = _SOURCE) -> Path:
    openmp = _openmp_runtime()
    flags = [*_FLAGS, "-fopenmp"] if openmp else _FLAGS
    link = [str(openmp), f"-Wl,-rpath,{openmp.parent}"] if openmp else []
    source = source_file.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join([compiler, *flags, *link]).encode(), _cpu_id().encode()])
    ).hexdigest()[:24]
    target = _cache_dir() / f"{source_file.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, str(source_file), *link, "-lm"],
            check=True,
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)  # atomic: a concurrent builder's file is equal
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuKernels:
    """The loaded library: `paged_decode` and the dtypes it takes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                *[ctypes.c_void_p] * 4,  # q, k_cache, v_cache, block_tables
                ctypes.c_int64,  # the block table's row stride
                *[ctypes.c_void_p] * 2,  # context_lens, out
                ctypes.c_int64,  # work items: sequences x KV heads
                *[ctypes.c_int] * 4,  # heads, KV heads, head_dim, block size
                ctypes.c_float,  # scale
                ctypes.c_int,  # threads
            ]
            self._fns[dtype] = fn
        self.dtypes = frozenset(self._fns)
        # KV cache formats (EngineConfig.kv_cache_dtype) the decode kernel reads
        self.kv_cache_dtypes = frozenset({"auto"})

    def takes(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> bool:
        """Whether `paged_decode` runs for a model of `dtype` over a `kv_cache_dtype` cache."""
        return dtype in self.dtypes and kv_cache_dtype in self.kv_cache_dtypes

    def paged_decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        context_lens: torch.Tensor,  # [B] int32, each >= 1
        scale: float,
        num_threads: int = 1,
    ) -> torch.Tensor:
        """Attention of each row's one query token over its whole context: [B, H, D]."""
        fn = self._fns[q.dtype]
        _check(q, k_cache, v_cache, block_tables, context_lens)
        batch, num_heads, head_dim = q.shape
        _, kv_heads, block_size, _ = k_cache.shape
        out = torch.empty_like(q)
        status = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            out.data_ptr(),
            batch * kv_heads,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            num_threads,
        )
        if status == -1:
            raise MemoryError("paged_decode could not allocate its scratch memory")
        if status:
            raise ValueError(
                f"paged_decode does not take q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
            )
        return out


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bt: torch.Tensor, cl: torch.Tensor
) -> None:
    if q.device.type != "cpu" or not all(t.is_contiguous() for t in (q, k, v, cl)):
        raise ValueError("paged_decode takes contiguous CPU tensors")
    if bt.dtype != torch.int32 or cl.dtype != torch.int32 or bt.stride(1) != 1:
        raise ValueError("block_tables and context_lens must be int32, rows contiguous")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape != v.shape:
        raise ValueError("q, k_cache and v_cache must share dtype; K and V their shape")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k.shape)}")


@functools.cache
def load() -> CpuKernels | None:
    """The compiled kernels, or None where they cannot be built here (logged once)."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the torch path")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning(
            "building the CPU kernels failed (%s%s): decode attention uses the torch path",
            exc,
            f": {detail.decode(errors='replace')[-500:]}" if detail else "",
        )
        return None
