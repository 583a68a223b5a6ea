"""CPU kernels in C, compiled on first use with the machine's C compiler, called by ctypes.

Only what torch has no good CPU kernel for: attention over the paged KV cache, and the
model's small per-layer ops, where torch's cost is its dispatch.
- Decode (`csrc/paged_decode.h`), over a cache of the model's dtype (`csrc/paged_decode.c`)
  or an 8-bit one (`csrc/paged_decode_kv8.c`, engine/modeling/kv_quant.py: the rows are dequantized
  as they are read, never copied). SDPA's CPU kernel pays a fixed cost per (sequence, KV
  head) and needs the blocks gathered into a padded copy first; at head_dim 32-128 with a
  few query heads per KV head that ran at 2-4 GB/s, against the 13 GB/s a copy reaches here.
- Prefill (`csrc/paged_prefill.c`), causal over a chunk's cached prefix and itself, all
  chunks of a step in one call: SDPA's fused kernel spent ~22% of a bfloat16 prompt's time
  on ~5% of its FLOPs, and a chunk with a cached prefix needed a gathered copy and a mask.
- Model ops (`csrc/model_ops.c`, engine/modeling/ops.py's `CpuOps`): the residual add with
  the RMS norm, the rotary embedding of q and k, SiLU-and-multiply, one call each where
  torch ran 5-12 ops of a few microseconds. On the mid model at batch 32 this took a
  2-thread decode step from ~33 to ~30 ms (1 thread: unchanged): ATen had split each small
  op over the pool, a wake-up and a barrier apiece.

The shared object is built once per source, compiler flags and CPU into a cache folder
(`$PDSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdserve/kernels`, else
`~/.cache/pdserve/kernels`): the source files compile in parallel (about 9 s of CPU
each here), then link; concurrent builders each write a private file and rename it into
place. `PDSERVE_CPU_KERNELS=0` turns the kernels off. Without a compiler, or if
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from pdserve.engine.modeling import kv_quant

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CSRC = Path(__file__).with_name("csrc")
_HEADERS = (
    _CSRC / "paged_decode.h",
    _CSRC / "paged_prefill_item.h",
    _CSRC / "exp2_poly.h",
    _CSRC / "bf16.h",
)
_SOURCES = (
    _CSRC / "paged_decode.c",
    _CSRC / "paged_decode_kv8.c",
    _CSRC / "paged_prefill.c",
    _CSRC / "model_ops.c",
)
# -fno-trapping-math: with traps assumed possible gcc does not if-convert a float compare
# (the exp's clamp), so the SiLU loop and the decode softmax's exp stayed scalar (the SiLU
# of a 32-row mid step took 7x torch's time). Values are unchanged: the rounding mode is
# still the default one, and no code here reads the floating-point exception flags.
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fPIC"]
_BUILD_TIMEOUT_S = 120.0
_QUERY_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
if platform.machine() in ("x86_64", "AMD64"):
    _QUERY_NAMES[torch.float16] = "f16"  # _Float16 is an x86-64/arm64 gcc type
# EngineConfig.kv_cache_dtype -> the C kernels' name suffix (csrc/paged_decode_kv8.c)
_CODE_NAMES = {"auto": "", "int8": "_i8", "fp8": "_e4m3"}
_FUNCTIONS = {
    (dtype, kv): f"pd_decode_{q}{code}"
    for dtype, q in _QUERY_NAMES.items()
    for kv, code in _CODE_NAMES.items()
}
# prefill attention (csrc/paged_prefill.c) over a cache of the model's dtype
_PREFILL_FUNCTIONS = {dtype: f"pd_prefill_{q}" for dtype, q in _QUERY_NAMES.items()}
PREFILL_HEAD_DIMS = frozenset((32, 64, 128, 256))
# csrc/model_ops.c: the dtypes it takes (its codes) and its widest norm row
_OPS_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
OPS_MAX_HIDDEN = 16384


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


def _build(compiler: str, sources: Path | tuple[Path, ...] = _SOURCES) -> Path:
    """The shared object of `sources` (compiled at once, then linked; named after the
    first), built into the cache folder unless it is there already."""
    if isinstance(sources, Path):
        sources = (sources,)
    openmp = _openmp_runtime()
    flags = [*_FLAGS, "-fopenmp"] if openmp else _FLAGS
    link = [str(openmp), f"-Wl,-rpath,{openmp.parent}"] if openmp else []
    texts = [path.read_bytes() for path in (*_HEADERS, *sources)]
    key = hashlib.sha256(
        b"\0".join([*texts, " ".join([compiler, *flags, *link]).encode(), _cpu_id().encode()])
    ).hexdigest()[:24]
    target = _cache_dir() / f"{sources[0].stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in sources]
        # the sources compile at once (two cores halve the first start), then link
        pairs = zip(sources, objects, strict=True)
        _run_all([[compiler, *flags, "-c", "-o", obj, str(src)] for src, obj in pairs])
        library = str(Path(tmp) / f"{sources[0].stem}.so")
        _run_all([[compiler, *flags, "-shared", "-o", library, *objects, *link, "-lm"]])
        os.replace(library, target)  # atomic: a concurrent builder's file is equal
    return target


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands concurrently; raise CalledProcessError (with the compiler's
    stderr) for the first that fails, TimeoutExpired past _BUILD_TIMEOUT_S."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for cmd in commands
    ]
    try:
        for cmd, proc in zip(commands, procs, strict=True):
            _, stderr = proc.communicate(timeout=_BUILD_TIMEOUT_S)
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class CpuKernels:
    """The loaded library: `paged_decode` and the dtypes and KV cache formats it takes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for key, name in _FUNCTIONS.items():
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
            self._fns[key] = fn
        self.dtypes = frozenset(dtype for dtype, _ in self._fns)
        self._prefill_fns = {}
        for dtype, name in _PREFILL_FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                *[ctypes.c_void_p] * 4,  # q, k_cache, v_cache, block_tables
                ctypes.c_int64,  # the block table's row stride
                *[ctypes.c_void_p] * 2,  # query_start_loc, context_lens
                ctypes.c_int64,  # sequences
                ctypes.c_void_p,  # out
                *[ctypes.c_int] * 4,  # heads, KV heads, head_dim, block size
                ctypes.c_float,  # scale
                ctypes.c_int,  # threads
            ]
            self._prefill_fns[dtype] = fn
        # KV cache formats (EngineConfig.kv_cache_dtype) the decode kernel reads
        self.kv_cache_dtypes = frozenset(kv for _, kv in self._fns)
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._norm = _bind(lib.pd_add_rms_norm, ptr, i64, *[ptr] * 4, i64, i64, ctypes.c_float)
        rotary_args = (ptr, i64, ptr, i64, ptr, i64, ptr, ptr, cint, cint, cint, ptr, ptr, i64)
        self._rotary = _bind(lib.pd_rotary_neox, *rotary_args)
        self._silu_mul = _bind(lib.pd_silu_mul, ptr, ptr, i64, i64)
        self._argmax = lib.pd_argmax_f32
        self._argmax.restype = ctypes.c_int
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr, cint]  # x, rows, n, stride, out

    # -- the model's small ops (csrc/model_ops.c): engine/modeling/ops.py's CpuOps --------

    def takes_ops(self, dtype: torch.dtype, hidden: int) -> bool:
        """Whether the norm, rotary and SiLU ops run for a model of `dtype` and `hidden`."""
        return dtype in _OPS_DTYPES and 0 < hidden <= OPS_MAX_HIDDEN

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, hidden], rows may be strided
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None,  # [T, hidden] contiguous
        num_threads: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * normalize(s), s) for s = x + residual rounded to x's dtype (or x):
        what `TorchOps.norm` returns, in one call; new tensors, inputs untouched."""
        rows, hidden = x.shape
        _check_ops(x, weight, residual)
        out = torch.empty((rows, hidden), dtype=x.dtype)
        summed = x if residual is None else torch.empty_like(out)
        status = self._norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            None if residual is None else summed.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            rows,
            hidden,
            eps,
            _OPS_DTYPES[x.dtype],
            num_threads,
        )
        _raise_for_op("add_rms_norm", status, x)
        return out, summed

    def rotary_neox(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, D], token rows may be strided, heads contiguous
        k: torch.Tensor,  # [T, KVH, D], likewise
        cos: torch.Tensor,  # [max_positions, D] (halves repeated), q's dtype
        sin: torch.Tensor,
        num_threads: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (neox) by the cos/sin rows at `positions`, as `apply_rotary`
        rounds them; new contiguous tensors."""
        tokens, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        for t in (q, k):
            if t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError("rotary_neox takes q and k of one dtype, heads contiguous")
        if q.dtype not in _OPS_DTYPES or cos.dtype != q.dtype or sin.dtype != q.dtype:
            raise ValueError(f"rotary_neox does not take {q.dtype} with {cos.dtype} tables")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape):
            raise ValueError("cos and sin must be contiguous tables of one shape")
        if cos.shape[1] != head_dim or positions.dtype != torch.int64 or k.shape[0] != tokens:
            raise ValueError("positions, q, k and the tables disagree")
        positions = positions.contiguous()
        q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
        k_out = torch.empty((tokens, kv_heads, head_dim), dtype=q.dtype)
        status = self._rotary(
            positions.data_ptr(),
            tokens,
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            q_out.data_ptr(),
            k_out.data_ptr(),
            heads,
            kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            _OPS_DTYPES[q.dtype],
            num_threads,
        )
        if status == -3:
            raise IndexError(f"a position is outside the rotary tables ({cos.shape[0]} rows)")
        _raise_for_op("rotary_neox", status, q)
        return q_out, k_out

    def silu_mul(self, gate_up: torch.Tensor, num_threads: int = 1) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * I] (gate, then up), as
        `F.silu(gate) * up` rounds it: [T, I]."""
        rows, width = gate_up.shape
        if gate_up.dtype not in _OPS_DTYPES or not gate_up.is_contiguous() or width % 2:
            raise ValueError(f"silu_mul takes a contiguous [T, 2I] tensor, not {gate_up.dtype}")
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        status = self._silu_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width // 2,
            _OPS_DTYPES[gate_up.dtype],
            num_threads,
        )
        _raise_for_op("silu_mul", status, gate_up)
        return out

    def argmax(self, logits: torch.Tensor, num_threads: int = 1) -> torch.Tensor:
        """`logits.argmax(dim=-1)` for float32 rows [N, vocab] (the first maximum, or the
        first NaN), int64 [N]: a greedy step's tokens without torch's element-by-element
        reduction."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
            raise ValueError(f"argmax takes CPU float32 [N, vocab], not {logits.dtype}")
        if logits.stride(1) != 1 or logits.shape[1] == 0:
            logits = logits.contiguous()
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows == 0:
            return out
        status = self._argmax(
            logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr(), num_threads
        )
        _raise_for_op("argmax", status, logits)
        return out

    def takes(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> bool:
        """Whether `paged_decode` runs for a model of `dtype` over a `kv_cache_dtype` cache."""
        return dtype in self.dtypes and kv_cache_dtype in self.kv_cache_dtypes

    def takes_prefill(
        self, dtype: torch.dtype, head_dim: int, kv_cache_dtype: str = "auto"
    ) -> bool:
        """Whether `paged_prefill` runs for a model of `dtype` and `head_dim` over that cache."""
        return (
            dtype in self._prefill_fns
            and head_dim in PREFILL_HEAD_DIMS
            and not kv_quant.is_quantized(kv_cache_dtype)
        )

    def paged_prefill(
        self,
        q: torch.Tensor,  # [T, H, D]: every prefill chunk's rows, in order
        k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D], holding the chunks' K too
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [P, max_blocks] int32
        query_start_loc: torch.Tensor,  # [P + 1] int32: chunk i is rows [loc[i], loc[i + 1])
        context_lens: torch.Tensor,  # [P] int32: cached prefix + chunk
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D], contiguous; a new tensor if None
        num_threads: int = 1,
    ) -> torch.Tensor:
        """Causal attention of each chunk's rows over its context: [T, H, D].

        A chunk's rows are the last `query_len` positions of its `context_len` tokens, and
        its K/V (prefix and chunk) are read from the cache, so they must be written first."""
        fn = self._prefill_fns.get(q.dtype)
        if fn is None or not self.takes_prefill(q.dtype, q.shape[-1]):
            raise ValueError(f"paged_prefill does not take q of {q.dtype}, {tuple(q.shape)}")
        _check(q, k_cache, v_cache, block_tables, context_lens, "auto")
        if query_start_loc.dtype != torch.int32 or not query_start_loc.is_contiguous():
            raise ValueError("query_start_loc must be contiguous int32")
        num_seqs = context_lens.numel()
        if query_start_loc.numel() != num_seqs + 1 or block_tables.shape[0] != num_seqs:
            raise ValueError("query_start_loc, block_tables and context_lens disagree on chunks")
        tokens, num_heads, head_dim = q.shape
        _, kv_heads, block_size, _ = k_cache.shape
        if int(query_start_loc[-1]) != tokens or int(query_start_loc[0]) != 0:
            raise ValueError(f"query_start_loc must run from 0 to q's {tokens} rows")
        if num_seqs and int(context_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError("a context is longer than its block table covers")
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor of q's shape and dtype")
        status = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start_loc.data_ptr(),
            context_lens.data_ptr(),
            num_seqs,
            out.data_ptr(),
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            num_threads,
        )
        _raise_for("paged_prefill", status, q, k_cache)
        return out

    def paged_decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D] (8-bit: D + 2 uint8)
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        context_lens: torch.Tensor,  # [B] int32, each >= 1
        scale: float,
        num_threads: int = 1,
        kv_cache_dtype: str = "auto",
    ) -> torch.Tensor:
        """Attention of each row's one query token over its whole context: [B, H, D].

        `kv_cache_dtype` "auto": the cache holds q's dtype; "int8" / "fp8": uint8 rows of
        D codes and a bfloat16 scale (engine/modeling/kv_quant.py), read as `code * scale`."""
        if not self.takes(q.dtype, kv_cache_dtype):
            raise ValueError(
                f"paged_decode does not take q of {q.dtype} with kv_cache_dtype={kv_cache_dtype}"
            )
        fn = self._fns[q.dtype, kv_cache_dtype]
        _check(q, k_cache, v_cache, block_tables, context_lens, kv_cache_dtype)
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
        _raise_for("paged_decode", status, q, k_cache)
        return out


def _bind(fn: Any, *argtypes: Any) -> Any:
    """A model op of csrc/model_ops.c: `argtypes`, then its dtype code and thread count."""
    fn.restype = ctypes.c_int
    fn.argtypes = [*argtypes, ctypes.c_int, ctypes.c_int]
    return fn


def _check_ops(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    hidden = x.shape[-1]
    if x.dim() != 2 or x.dtype not in _OPS_DTYPES or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"add_rms_norm takes CPU rows [T, hidden], not {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError("the norm weight must be a contiguous [hidden] vector of x's dtype")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError("the residual must be a contiguous tensor of x's shape and dtype")


def _raise_for_op(op: str, status: int, x: torch.Tensor) -> None:
    if status:
        raise ValueError(f"{op} does not take {x.dtype} {tuple(x.shape)}")


def _raise_for(kernel: str, status: int, q: torch.Tensor, cache: torch.Tensor) -> None:
    """A kernel's nonzero status as an exception: -1 scratch memory, else a shape."""
    if status == -1:
        raise MemoryError(f"{kernel} could not allocate its scratch memory")
    if status:
        raise ValueError(f"{kernel} does not take q {tuple(q.shape)}, cache {tuple(cache.shape)}")


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bt: torch.Tensor,
    cl: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    if q.device.type != "cpu" or not all(t.is_contiguous() for t in (q, k, v, cl)):
        raise ValueError("paged_decode takes contiguous CPU tensors")
    if bt.dtype != torch.int32 or cl.dtype != torch.int32 or bt.stride(1) != 1:
        raise ValueError("block_tables and context_lens must be int32, rows contiguous")
    quantized = kv_quant.is_quantized(kv_cache_dtype)
    cache_dtype = torch.uint8 if quantized else q.dtype
    if k.dtype != cache_dtype or v.dtype != cache_dtype or k.shape != v.shape:
        raise ValueError(
            f"k_cache and v_cache must be {cache_dtype} for q of {q.dtype} and"
            f" kv_cache_dtype={kv_cache_dtype} (share dtype), K and V one shape"
        )
    row = q.shape[2] + kv_quant.SCALE_BYTES if quantized else q.shape[2]
    if q.shape[1] % k.shape[1] or k.shape[3] != row:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {tuple(k.shape)}")


def build_library(
    sources: Path | tuple[Path, ...], what: str, fallback: str, wrap: Callable[[ctypes.CDLL], T]
) -> T | None:
    """`wrap` of the shared object of `sources`, loaded; None, logged, where it cannot be
    built here: `PDSERVE_CPU_KERNELS=0`, no C compiler (`$CC`, else gcc or cc), a failed
    build, or a library without the functions `wrap` looks up (AttributeError). `what`
    names the kernel and `fallback` says what runs instead, for the log line."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: %s", fallback)
        return None
    try:
        return wrap(ctypes.CDLL(str(_build(compiler, sources))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning(
            "building %s failed (%s%s): %s",
            what,
            exc,
            f": {detail.decode(errors='replace')[-500:]}" if detail else "",
            fallback,
        )
        return None


@functools.cache
def load() -> CpuKernels | None:
    """The compiled kernels, or None where they cannot be built here (logged once)."""
    return build_library(
        _SOURCES, "the CPU kernels", "decode attention uses the torch path", CpuKernels
    )
