"""The machine a figure was measured on, printed with every benchmark's figures.

CPU engines differ several-fold between CPUs of one generation: bf16 matmuls run in
hardware with `avx512_bf16` or `amx_bf16` and are emulated with AVX2 alone, int8 with
`avx512_vnni`. A figure without the CPU's model and these flags cannot be compared with
another, so every benchmark prints `cpu_line()` first and the JSON reports carry
`machine()`.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any, TextIO

# The flags that decide a CPU engine's speed (Linux /proc/cpuinfo names).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def machine(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model, which of FLAGS it has, its CPUs and the ones this process may
    use; `cpuinfo`: /proc/cpuinfo's text (read when None)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    model, flags = platform.processor() or platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features"):
            flags |= set(value.split())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        usable = os.cpu_count() or 1
    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "lacks": [f for f in FLAGS if f not in flags],
        "cpus": os.cpu_count() or 1,
        "usable_cpus": usable,
    }


def cpu_line(info: dict[str, Any] | None = None) -> str:
    """One line: `CPU: <model>, <usable> of <cpus> CPUs; avx2 avx512f ...; lacks ...`."""
    m = info or machine()
    has = " ".join(m["flags"]) or "none of " + " ".join(FLAGS)
    lacks = f"; lacks {' '.join(m['lacks'])}" if m["lacks"] and m["flags"] else ""
    return f"CPU: {m['cpu']}, {m['usable_cpus']} of {m['cpus']} CPUs; {has}{lacks}"


def print_machine(file: TextIO | None = None) -> None:
    """Print `cpu_line()` (a benchmark's first line)."""
    print(cpu_line(), file=file or sys.stdout, flush=True)
