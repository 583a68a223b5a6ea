"""Every benchmark prints the CPU it measured on (benchmarks/machine.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from pdserve.benchmarks.machine import FLAGS, cpu_line, machine

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# the entry points that print figures: each module's `main`, and `pdserve bench`'s two
ENTRIES = {"bench_cli.py": "run_from_args", "compare.py": "compare_from_args"}

AVX512_BF16 = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni
"""
AVX2_ONLY = "model name\t: Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz\nflags\t: fpu avx avx2\n"


def test_the_line_names_the_model_and_the_flags_it_has_and_lacks() -> None:
    line = cpu_line(machine(AVX512_BF16))
    assert line.startswith("CPU: AMD EPYC 9R14 96-Core Processor, ")
    assert "; avx2 avx512f avx512_bf16 avx512_vnni; lacks amx_bf16" in line
    old = machine(AVX2_ONLY)
    assert (old["flags"], old["lacks"]) == (["avx2"], [f for f in FLAGS if f != "avx2"])
    assert machine("")["usable_cpus"] == len(os.sched_getaffinity(0))


def test_every_benchmark_entry_point_prints_the_machine() -> None:
    missing = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(path.read_text())
        entry = ENTRIES.get(path.name, "main")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == entry:
                calls = {
                    n.func.id
                    for n in ast.walk(node)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                }
                if "print_machine" not in calls:
                    missing.append(f"{path.name}:{entry}")
    assert not missing, f"print_machine() not called by: {missing}"
