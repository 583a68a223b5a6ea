"""Which compiled variant of a Triton kernel each launch uses, and whether it is a new one.

Triton compiles a kernel once per *variant*: its constexpr values, its arguments' dtypes,
its launch options (num_warps, ...) and the specialisation it adds on its own to integer
and pointer arguments (an int equal to 1 becomes a constant; an int or a pointer divisible
by 16 is marked so). A new variant compiles on the launching thread, in the engine the
step loop (0.5-2 s for the attention kernels: every stream stalls). So:

- the launchers round every launch parameter that follows a per-step size to a few
  buckets (the decode split count, the prefill BLOCK_M, the int8 tiles), and exempt the
  integer arguments that follow a per-step size (block-table widths, row counts, packed
  block counts) from Triton's specialisation with `do_not_specialize`;
- they launch through `launch`, which records each variant's key in `REGISTRY`;
- the engine launches every bucket at its shapes once before serving (the shapes from
  `warmup_plan`, run by `ModelRunner.warm_up_kernels`) and marks the registry ready; from
  then on each new key counts in `compiles_after_ready` (the engine's load gauge
  `kernel_compiles_after_ready`) and logs one warning naming the kernel and key.

The key is what Triton's JIT keys its cache by, computed the same way (Triton's own
specialisation function, with the divisibility rule the CUDA backend inherits), from the
launch's arguments alone: it is the same under the interpreter (TRITON_INTERPRET=1, where
nothing compiles) as on CUDA, so a CPU test of the keys shows what a GPU would compile.

Process-wide, as Triton's kernel cache is. Importing this module imports no Triton: the
engine reads the counter on CPU installs too, which have none.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # hashed by identity: one per kernel
class _Signature:
    """What a kernel's key needs of its parameters, read once per kernel."""

    name: str
    names: tuple[str, ...]
    index: Mapping[str, int]
    # per parameter: None for a constexpr, else Triton's (specialize, align) flags: False
    # where do_not_specialize / do_not_specialize_on_alignment names it
    modes: tuple[tuple[bool, bool] | None, ...]


class VariantKey(NamedTuple):
    """One compiled variant: per parameter, Triton's (type, specialisation) of its value
    (("constexpr", value) for a constexpr or an int specialised to 1), and the options.
    A tuple: it is built and hashed at every launch."""

    signature: _Signature
    device: torch.device
    specs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, Any], ...]

    @property
    def kernel(self) -> str:
        return self.signature.name

    def value(self, name: str) -> Any:
        """A constexpr's value (KeyError for a parameter that is not constant here)."""
        kind, value = self.specs[self.signature.index[name]]
        if kind != "constexpr":
            raise KeyError(f"{name} of {self.kernel} is not a constant: {kind}")
        return value

    def __str__(self) -> str:
        names = self.signature.names
        params = ", ".join(
            f"{name}={value!r}" if kind == "constexpr" else f"{name}:{kind}{_ATTR.get(value, '')}"
            for name, (kind, value) in zip(names, self.specs, strict=True)
        )
        options = ", ".join(f"{name}={value!r}" for name, value in self.options)
        return f"{self.kernel}[{self.device}]({params}; {options})"


# how a specialisation attribute reads in a key: "D" is Triton's divisible-by-16 mark
_ATTR = {"D": "%16"}


class VariantRegistry:
    """The variant keys launched in this process, and those first seen after `mark_ready`.

    `warming()` brackets a warm-up: keys it launches never count, even once ready (a
    second engine in the process warming up after the first is serving). Thread-safe;
    the warming state is per thread, so another thread's launches meanwhile still count.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[VariantKey] = set()
        self._local = threading.local()
        self.ready = False
        self.compiles_after_ready = 0
        self.late_keys: list[VariantKey] = []  # the keys counted, in order

    def record(self, key: VariantKey) -> bool:
        """Note a launch of `key`; True when the key is new (Triton compiles it now)."""
        if key in self._seen:  # every launch but a variant's first: no lock
            return False
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            counts = self.ready and not self._warming()
            if counts:
                self.compiles_after_ready += 1
                self.late_keys.append(key)
        if counts:
            logger.warning(
                "kernel %s compiled a new variant after the engine was ready (every stream"
                " waits for it): %s",
                key.kernel,
                key,
            )
        return True

    @contextmanager
    def warming(self) -> Iterator[None]:
        """New keys launched by this thread inside the block are warm-up, never counted."""
        self._local.depth = self._depth() + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def mark_ready(self) -> None:
        """From now on a new key (outside `warming`) counts as a compile after ready."""
        self.ready = True

    def seen(self) -> set[VariantKey]:
        """The keys launched so far (a copy)."""
        with self._lock:
            return set(self._seen)

    def _depth(self) -> int:
        depth: int = getattr(self._local, "depth", 0)
        return depth

    def _warming(self) -> bool:
        return self._depth() > 0


REGISTRY = VariantRegistry()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, its variant recorded in `REGISTRY` first (the
    module attribute, read at each launch: tests swap in a fresh registry)."""
    REGISTRY.record(variant_key(kernel, args, kwargs))
    kernel[grid](*args, **kwargs)


def variant_key(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> VariantKey:
    """The key of launching `kernel` with these arguments (keyword arguments that are not
    parameters are launch options: num_warps, enable_fp_fusion, ...)."""
    sig = _signature(kernel)
    index = sig.index
    values = [*args, *[kwargs.get(name) for name in sig.names[len(args) :]]]
    specialize_impl, backend = _triton_specialization()
    specs = tuple(
        [
            # (mode[0], mode[1]), not *mode: this runs per argument of every launch
            ("constexpr", value)
            if mode is None
            else specialize_impl(backend, value, False, mode[0], mode[1])
            for value, mode in zip(values, sig.modes, strict=True)
        ]
    )
    options = tuple(sorted([(k, v) for k, v in kwargs.items() if k not in index]))
    device = next(v for v in values if isinstance(v, torch.Tensor)).device
    return VariantKey(sig, device, specs, options)


_SIGNATURES: dict[int, tuple[Any, _Signature]] = {}


def _signature(kernel: Any) -> _Signature:
    cached = _SIGNATURES.get(id(kernel))
    if cached is not None and cached[0] is kernel:
        return cached[1]
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    names = tuple(p.name for p in params)
    not_specialized = _names(kernel, "do_not_specialize", names)
    not_aligned = _names(kernel, "do_not_specialize_on_alignment", names)
    sig = _Signature(
        name=fn.__name__,
        names=names,
        index={name: i for i, name in enumerate(names)},
        # a constexpr as Triton tells one (the annotation may be a string: `from
        # __future__ import annotations`)
        modes=tuple(
            None
            if "constexpr" in str(p.annotation)
            else (p.name not in not_specialized, p.name not in not_aligned)
            for p in params
        ),
    )
    _SIGNATURES[id(kernel)] = (kernel, sig)
    return sig


def _names(kernel: Any, option: str, names: tuple[str, ...]) -> frozenset[str]:
    """A `triton.jit` option's parameters by name: a JITFunction keeps it as an
    attribute, the interpreter's function among its keyword arguments."""
    given = getattr(kernel, option, None)
    if given is None:
        given = getattr(kernel, "kwargs", {}).get(option)
    return frozenset(names[p] if isinstance(p, int) else p for p in given or ())


@functools.cache
def _triton_specialization() -> tuple[Callable[..., tuple[str, Any]], Any]:
    """Triton's specialisation function and the backend class whose divisibility rule
    the CUDA backend inherits (what `triton.runtime.jit.mangle_type` uses too)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl, BaseBackend


# -- warm-up ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmupPlan:
    """The steps that launch every bucket of every kernel an engine uses at its shapes:
    one prefill step of each token count (no cached prefix), then one decode-only step of
    each (rows, block-table width). Each step's token count also picks the int8 tile."""

    prefill_lens: tuple[int, ...]
    decode_shapes: tuple[tuple[int, int], ...]


def warmup_plan(
    *,
    dtype: torch.dtype,
    num_kv_heads: int,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    max_step_tokens: int | None = None,
) -> WarmupPlan:
    """The finite set of launch buckets an engine of these shapes can hit, as steps.

    `max_step_tokens` (the engine's token budget; None: unknown) bounds a step's tokens,
    decode rows included; the longest prefill chunk is `max_model_len` at most. Without a
    budget the plan is a superset: a bucket no step reaches costs one compile at start.
    `num_kv_heads`: this rank's. A prefill length past `max_model_len` (an int8 tile's
    rows) is a step of several sequences.
    """
    from pdserve.kernels import int8_linear, paged_decode_attention, paged_prefill_attention

    budget = max_step_tokens
    max_chunk = max_model_len if budget is None else min(budget, max_model_len)
    chunks = {n for n in paged_prefill_attention.query_len_buckets(dtype) if n <= max_chunk}
    rows = {n for n in int8_linear.row_buckets(dtype) if budget is None or n <= budget}
    shapes = paged_decode_attention.split_shapes(
        num_kv_heads, block_size, -(-max_model_len // block_size), budget, device
    )
    return WarmupPlan(
        prefill_lens=tuple(sorted(chunks | rows)),
        decode_shapes=tuple(shapes[s] for s in sorted(shapes)),
    )
