"""Device hygiene on CPU: the device mistakes a GPU would fail on, caught without one.

An engine on a GPU keeps every tensor of its step on that GPU; a tensor made without
`device=` is made on the CPU, and an op that meets it next to a GPU tensor fails there
("Expected all tensors to be on the same device"), or, worse, copies it on every step.
On a CPU-only machine both are the same device, so such a mistake runs, and passes every
test. `DeviceHygiene` is a `TorchFunctionMode` that sees every torch call the engine
makes and enforces, on CPU, what a GPU would:

1. Made on the host by default: a tensor factory (`torch.arange`, `zeros`, `empty`,
   `tensor`, `full`, `rand*`, ...) called from pdserve's code without `device=` is a
   mistake. A host tensor the engine wants says so (`device="cpu"`, `pin_memory=True`);
   `torch.from_numpy` and `frombuffer` have no device and are host data by nature.
2. Left on the host: each tensor is tagged where it would live on a GPU: DEVICE when made
   with an explicit `device=`, moved with `.to(device)` / `.cuda()`, or computed from a
   DEVICE tensor; HOST when made on the host (`pin_memory=True`, `from_numpy`, `.cpu()`,
   `.pin_memory()`) or computed from HOST tensors only. A call from pdserve's code that
   takes a HOST tensor of one or more dimensions together with a DEVICE tensor is a
   mistake, except where CUDA allows the mix: copies (`copy_`, `.to`), and host index
   tensors indexing a device tensor. 0-dim host tensors are scalars on every device.
   Tensors made where the mode does not see them (inside C++, before it was entered)
   carry no tag and never count.

What runs under it: the engine's device-generic code (the model, sampler, speculative
decoding, structured output, parallel sampling, int8 weights, 8-bit KV caches, KV
export/import, tensor-parallel ranks) on the torch attention backend, and the Triton
path under Triton's interpreter. The CPU-only modules (`engine/cpu_*.py`: C kernels,
whose tensors are host ones by design) are not checked, and what they make carries no
tag. Tensor-parallel ranks run in processes of their own: `PDSERVE_DEVICE_HYGIENE=1` in
their environment makes each rank run its loop under the mode (engine/worker/tp_worker.py).
tests/engine/test_device_hygiene.py runs all of it; a mistake raises `DeviceMistake`
naming the call and where the host tensor was made."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ENV = "PDSERVE_DEVICE_HYGIENE"
HOST = "host"
DEVICE = "device"
_TAG = "_pdserve_device_tag"  # (HOST | DEVICE, where it was made)
_PACKAGE = Path(__file__).resolve().parents[2]
_TESTS = _PACKAGE / "tests"
_HERE = Path(__file__).resolve()
# Code that runs on the CPU only (its kernels are C, their tensors host ones by design):
# not checked, and what it makes carries no tag.
_CPU_ONLY = frozenset(
    _PACKAGE / "engine" / "cpu" / name for name in ("kernels.py", "int8.py", "bf16.py")
)

_FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.tril_indices,
    torch.triu_indices,
}
_HOST_SOURCES = {torch.from_numpy, torch.frombuffer}
_COPIES = {torch.Tensor.copy_, torch.Tensor.to}
_INDEXING = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
}


class DeviceMistake(RuntimeError):
    """A tensor made or left on the host in a step that runs on the engine's device."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _tag(t: torch.Tensor) -> tuple[str, str] | None:
    return getattr(t, _TAG, None)


def _set_tag(value: Any, tag: tuple[str, str]) -> None:
    for t in _tensors(value):
        with contextlib.suppress(AttributeError, RuntimeError):  # one takes no attribute
            setattr(t, _TAG, tag)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _caller() -> tuple[str, int, str] | None:
    """(file, line, function) of the frame that made the torch call, if pdserve's."""
    frame = sys._getframe(2)  # _caller <- __torch_function__ <- the caller
    path = Path(frame.f_code.co_filename).resolve()
    if path == _HERE or path in _CPU_ONLY or not path.is_relative_to(_PACKAGE):
        return None
    if path.is_relative_to(_TESTS):
        return None
    return str(path.relative_to(_PACKAGE)), frame.f_lineno, frame.f_code.co_name


def _site(caller: tuple[str, int, str] | None) -> str:
    return "outside pdserve" if caller is None else f"{caller[0]}:{caller[1]} {caller[2]}"


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "") or name
    if qualname.startswith(("_VariableFunctionsClass.", "_TensorBase.")) or not qualname:
        qualname = name
    qualname = qualname.replace("TensorBase.", "Tensor.", 1)
    owner = "torch.Tensor." if qualname.startswith("Tensor.") else ""
    module = getattr(func, "__module__", "") or ""
    if owner:
        return qualname.replace("Tensor.", owner, 1)
    return f"torch.{name}" if module.startswith("torch") and "." not in qualname else qualname


def _describe(t: torch.Tensor) -> str:
    tag = _tag(t)
    made = tag[1] if tag is not None else "?"
    return f"a host tensor {list(t.shape)} {str(t.dtype).removeprefix('torch.')} made at {made}"


class DeviceHygiene(TorchFunctionMode):
    """The mode (module docstring). `mistakes` lists every one seen (once per place), even
    those a caller caught; with `raise_mistakes` each is also raised where it happens."""

    def __init__(self, raise_mistakes: bool = True) -> None:
        super().__init__()
        self.raise_mistakes = raise_mistakes
        self.mistakes: list[str] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        caller = _caller()
        if func in _FACTORIES:
            return self._factory(func, args, kwargs, caller)
        if func in _HOST_SOURCES or func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            out = func(*args, **kwargs)
            _set_tag(out, (HOST, _site(caller)))
            return out
        if caller is not None:
            self._check_mix(func, args, kwargs, caller)
        out = func(*args, **kwargs)
        self._tag_result(func, args, kwargs, out, caller)
        return out

    def _fail(self, message: str) -> None:
        if message not in self.mistakes:
            self.mistakes.append(message)
        if self.raise_mistakes:
            raise DeviceMistake(message)

    def _factory(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
    ) -> Any:
        out = func(*args, **kwargs)
        if func is torch.as_tensor and args and isinstance(args[0], torch.Tensor):
            tag = _tag(args[0])
            if tag is not None and "device" not in kwargs:
                _set_tag(out, tag)
            return out
        if kwargs.get("device") is not None:
            _set_tag(out, (HOST if kwargs.get("pin_memory") else DEVICE, _site(caller)))
            return out
        if kwargs.get("pin_memory"):
            _set_tag(out, (HOST, _site(caller)))
            return out
        if caller is not None:  # made by torch's own code, or CPU-only code: no tag
            _set_tag(out, (HOST, _site(caller)))
            self._fail(
                f"{_site(caller)}: {_name(func)} without device=: made on the host, not on "
                "the engine's device (pass device=..., or device='cpu' / pin_memory=True "
                "for a tensor meant to stay on the host)"
            )
        return out

    def _check_mix(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
    ) -> None:
        if func in _COPIES:
            return
        if func in _INDEXING and args and isinstance(args[0], torch.Tensor):
            indexed = args[0]
            indices = list(_tensors(args[1:2]))
            values = list(_tensors((args[2:], kwargs)))
            if _kind(indexed) == HOST and indexed.dim() > 0:
                on_device = [t for t in indices + values if _kind(t) == DEVICE]
                if on_device:
                    self._fail(
                        f"{_site(caller)}: {_name(func)} indexes {_describe(indexed)} "
                        "with tensors on the engine's device"
                    )
            elif _kind(indexed) == DEVICE:
                self._check_tensors(func, [indexed, *values], caller)
            return
        self._check_tensors(func, list(_tensors((args, kwargs))), caller)

    def _check_tensors(self, func: Any, tensors: list[torch.Tensor], caller: Any) -> None:
        if not any(_kind(t) == DEVICE for t in tensors):
            return
        for t in tensors:
            if _kind(t) == HOST and t.dim() > 0:
                self._fail(
                    f"{_site(caller)}: {_name(func)} takes {_describe(t)} together with "
                    "tensors on the engine's device"
                )

    def _tag_result(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, caller: Any
    ) -> None:
        if func is torch.Tensor.to:
            if _names_device(args, kwargs):
                _set_tag(out, (DEVICE, _site(caller)))
            elif len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other)
                _inherit(out, args[1])
            else:  # a dtype only: where it was
                _inherit(out, args[0])
            return
        if func is torch.Tensor.cuda:
            _set_tag(out, (DEVICE, _site(caller)))
            return
        if func is torch.Tensor.copy_:
            return  # the destination keeps its own place
        inputs = list(_tensors((args, kwargs)))
        kinds = {_kind(t) for t in inputs}
        if DEVICE in kinds:
            _set_tag(out, (DEVICE, _site(caller)))
        elif HOST in kinds:
            host = next(t for t in inputs if _kind(t) == HOST)
            tag = _tag(host)
            assert tag is not None
            _set_tag(out, tag)


def _kind(t: torch.Tensor) -> str | None:
    tag = _tag(t)
    return None if tag is None or not tag[0] else tag[0]


def _inherit(out: Any, source: torch.Tensor) -> None:
    tag = _tag(source)
    if tag is not None:
        _set_tag(out, tag)


def _names_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `Tensor.to(...)` call names a device (it moves the tensor there)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(arg, str | torch.device) for arg in args[1:2])


def enter_from_env() -> DeviceHygiene | None:
    """Enter the mode for the rest of this thread if `PDSERVE_DEVICE_HYGIENE` asks for it
    (tensor-parallel rank processes); returns it, or None."""
    if not enabled_by_env():
        return None
    mode = DeviceHygiene()
    mode.__enter__()
    return mode
