"""A ucxx listener bound to one address, which ucxx's Python API cannot create.

ucxx 0.52's C++ `ListenerBuilder` takes a bind address (`host()`), but its Python
binding passes none, so `ucxx.create_listener` listens on every interface (0.0.0.0).
This module builds, once per machine and ucxx version, a few lines of C++ against the
headers the ucxx wheels ship (`_SOURCE`), and uses them to create the C++ listener with
the address; the result goes into a `UCXListener` object in place of the one ucxx
would build, so that everything after it (connection requests, endpoints, the peer-info
exchange, `ucxx.Listener`) is ucxx's own code, exactly as `create_listener` wires it.

What this relies on, checked before anything is written (`_check_layout`): the memory
layout of Cython's `UCXListener` object (a `shared_ptr<Listener>`, then a bool, then
the `_cb_data` dict, as `ucxx/_lib/libucxx.pxd` declares it), which pyproject pins by
pinning ucxx to 0.52.x. Building needs a C++ compiler (`$CXX`, else `c++` or `g++`);
without one, binding a specific address fails with a clear error rather than silently
listening everywhere.

The shared object is cached (`$PDSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdserve/
kernels`, else `~/.cache/pdserve/kernels`); concurrent builders each write a private
file and rename it into place.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <ucxx/listener.h>
#include <ucxx/listener_builder.h>
#include <ucxx/worker.h>

// Build a listener of `worker` bound to host:port and move it into `out`, the (null)
// shared_ptr<ucxx::Listener> field of a fresh UCXListener object. 0, or -1 and `error`.
extern "C" int pdserve_ucx_listen(void* worker, const char* host, unsigned short port,
                                  ucp_listener_conn_callback_t callback, void* arg,
                                  void* out, char* error, size_t error_len) {
  try {
    std::shared_ptr<ucxx::Listener> listener = static_cast<ucxx::Worker*>(worker)
        ->listenerBuilder(port, callback, arg).host(host).build();
    new (out) std::shared_ptr<ucxx::Listener>(std::move(listener));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_len, "%s", e.what());
    return -1;
  }
}
"""
_FLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC"]
_BUILD_TIMEOUT_S = 120.0
# Cython's UCXListener: PyObject header (16 bytes), vtable pointer (8), then its fields.
_LISTENER_OFFSET = 24  # shared_ptr<ucxx::Listener> _listener (16 bytes)
_FUTURE_OFFSET = 40  # bint _enable_python_future (a C int)
_CB_DATA_OFFSET = 48  # dict _cb_data (None when fresh)
_BASICSIZE = 64
_CONN_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
ALL_INTERFACES = ("", "0.0.0.0", "::")


class BindUnsupportedError(RuntimeError):
    """This machine cannot bind a UCX listener to one address (no compiler or headers)."""


def _cache_dir() -> Path:
    if env := os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve" / "kernels"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _build_args() -> list[str]:
    """-I and link flags for the ucxx headers and libucxx: the pip wheels' layout
    (`libucxx/include`, `libucx/include`, `libucxx/lib64`), else the environment's own
    (a conda install puts them under sys.prefix)."""
    libucxx, libucx = _package_dir("libucxx"), _package_dir("libucx")
    roots = [root for root in (libucxx, libucx) if root is not None]
    includes = [f"-I{root / 'include'}" for root in roots if (root / "include").is_dir()]
    includes.append(f"-I{Path(sys.prefix) / 'include'}")
    libdirs = [*([libucxx / "lib64"] if libucxx is not None else []), Path(sys.prefix) / "lib"]
    libdir = next((d for d in libdirs if any(d.glob("libucxx.so*"))), None)
    if libdir is None:
        raise BindUnsupportedError(f"libucxx.so is in none of {[str(d) for d in libdirs]}")
    return [*includes, f"-L{libdir}", "-lucxx", f"-Wl,-rpath,{libdir}"]


@functools.cache
def _library() -> ctypes.CDLL:
    """The compiled helper, built on first use (a few seconds) and cached on disk."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise BindUnsupportedError("no C++ compiler found ($CXX, c++ or g++)")
    import ucxx

    argv_tail = [*_FLAGS, *_build_args()]
    key = hashlib.sha256(
        "\0".join([_SOURCE, compiler, *argv_tail, str(ucxx.__version__)]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"ucx_listener-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            source, built = Path(tmp) / "ucx_listener.cpp", Path(tmp) / "out.so"
            source.write_text(_SOURCE)
            argv = [compiler, str(source), "-o", str(built), *argv_tail]
            try:
                result = subprocess.run(
                    argv, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise BindUnsupportedError(f"building the UCX listener helper: {exc}") from exc
            if result.returncode != 0:
                raise BindUnsupportedError(
                    f"building the UCX listener helper failed:\n{result.stderr[-2000:]}"
                )
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    lib.pdserve_ucx_listen.restype = ctypes.c_int
    lib.pdserve_ucx_listen.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_ushort,
        _CONN_CALLBACK,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    return lib


def _check_layout(raw: Any) -> None:
    """Refuse to write into a UCXListener whose layout is not the one this module knows."""
    base = id(raw)
    words = (ctypes.c_void_p * 3).from_address(base + _LISTENER_OFFSET)
    ok = (
        type(raw).__basicsize__ == _BASICSIZE
        and type(raw).__weakrefoffset__ == _BASICSIZE - 8
        and not words[0]
        and not words[1]  # a null shared_ptr
        and ctypes.c_void_p.from_address(base + _CB_DATA_OFFSET).value == id(None)
    )
    if not ok:
        import ucxx

        raise RuntimeError(
            f"ucxx {ucxx.__version__} changed its UCXListener layout, which "
            "pdserve.kv_transfer.ucx_listener relies on (see pyproject.toml for the ucxx "
            "it supports)"
        )


class _ConnHandler:
    """The C callback UCX calls for each connection request, for as long as its listener
    lives: ucxx's own `_listener_callback` with `deliver_endpoint=True`, in Python."""

    def __init__(self, raw: Any, handler_args: tuple[Any, ...]) -> None:
        from ucxx._lib_async.listener import _listener_handler

        self._listener = weakref.ref(raw)
        self._args = handler_args
        self._handler = _listener_handler
        self.c_callback = _CONN_CALLBACK(self._on_request)

    def _on_request(self, conn_request: int | None, _arg: int | None) -> None:
        raw = self._listener()
        if raw is None or conn_request is None:
            return
        try:
            endpoint = raw.create_endpoint_from_conn_request(conn_request, True)
            self._handler(endpoint, *self._args)
        except Exception:  # in a C callback: log, never raise
            logger.exception("UCX connection request failed")


def create_listener(
    ctx: Any, callback: Callable[[Any], Any], host: str, port: int = 0
) -> tuple[Any, Any]:
    """`ctx.create_listener(callback, port)` listening on `host` only; call on the loop
    that progresses `ctx`'s worker. Returns (a `ucxx` Listener, a token to keep alive
    until that listener is closed: UCX calls into it).

    Raises:
        BindUnsupportedError: no compiler or headers to build the helper here.
        OSError: the address cannot be bound (not local, or the port is taken).
    """
    from ucxx._lib import libucxx as ucx_api
    from ucxx._lib_async.listener import Listener, _ListenerHandlerTracker

    if host in ALL_INTERFACES:
        return ctx.create_listener(callback, port=port), None
    lib = _library()
    ctx.continuous_ucx_progress()
    loop = asyncio.get_running_loop()
    tracker = _ListenerHandlerTracker()
    raw = ucx_api.UCXListener.__new__(ucx_api.UCXListener)
    _check_layout(raw)
    # the same arguments ucxx's create_listener gives its handler
    handler = _ConnHandler(raw, (loop, callback, weakref.ref(ctx), True, 5.0, tracker))
    error = ctypes.create_string_buffer(512)
    status = lib.pdserve_ucx_listen(
        ctx.worker.ucxx_ptr,
        host.encode(),
        port,
        handler.c_callback,
        None,
        id(raw) + _LISTENER_OFFSET,
        error,
        len(error),
    )
    if status != 0:
        raise OSError(f"UCX cannot listen on {host}:{port}: {error.value.decode(errors='replace')}")
    ctypes.c_int.from_address(id(raw) + _FUTURE_OFFSET).value = int(ctx.worker.enable_python_future)
    assert raw.ucxx_ptr and raw.enable_python_future == ctx.worker.enable_python_future
    return Listener(raw, tracker, ctx), handler
