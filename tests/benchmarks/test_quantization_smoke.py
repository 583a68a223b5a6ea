"""`benchmarks/quantization.py` end to end on the tiny shape: every table prints, the int8
variant holds fewer weight bytes than bf16 and agrees with it at most positions, the 8-bit
KV caches hand off about half the bytes and fit about twice the blocks, the baseline
scores itself exactly, and the kv section's functions run. Timings are not asserted; the
benchmark reports them."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from pdserve.benchmarks.quantization import kv_attention_times, kv_step_times, kv_table
from pdserve.engine.cpu import kernels as cpu_kernels


def _tables(stdout: str) -> dict[str, list[list[str]]]:
    """The markdown tables printed, by their second header cell: each one's body rows."""
    tables: dict[str, list[list[str]]] = {}
    rows: list[list[str]] | None = None
    for line in stdout.splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if rows is None:
            rows = tables.setdefault(cells[1], [])
        elif not set(cells[0]) <= {"-", ":"}:
            rows.append(cells)
    return tables


def test_quantization_benchmark_runs_on_the_tiny_shape() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.quantization", "--model-size", "tiny"]
    argv += ["--batches", "1", "4", "--steps", "2", "--prompt-len", "8"]
    argv += ["--sections", "speed", "handoff", "quality", "--handoff-context", "40"]
    argv += ["--quality-prompts", "2", "--quality-tokens", "16"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = _tables(proc.stdout)
    speed, quality = tables["batch"], tables["positions"]
    handoff = {r[0]: r for r in tables["handoff MiB (40 tokens)"]}
    variants = ["bf16", "int8", "kv-int8", "kv-fp8"]
    assert [(r[0], r[1]) for r in speed] == [(v, b) for b in ("1", "4") for v in variants]
    assert all(float(r[6]) < 0.7 for r in speed if r[0] == "int8")  # weights vs bf16
    assert list(handoff) == variants
    for name in ("kv-int8", "kv-fp8"):  # head_dim 32: rows of 34 bytes against 64
        assert float(handoff[name][2]) == 0.531, handoff[name]  # handoff bytes vs bf16
        assert handoff[name][6] == "1.88x", handoff[name]  # blocks per GiB vs bf16
    assert float(handoff["int8"][2]) == 1.0  # int8 weights leave the KV as it was
    assert [(r[0], r[1]) for r in quality] == [(v, "32") for v in variants]
    assert quality[0][2:] == ["100.00%", "0.00e+00"]
    for row in quality[1:]:
        assert float(row[2].rstrip("%")) >= 80 and 0 < float(row[3]) < 0.01, row
    assert "int8 vs bf16 decode tok/s at batch 1:" in proc.stdout
    assert "kv-fp8 vs bf16: handoff bytes 0.531x" in proc.stdout


def test_kv_section_times_every_format(make_checkpoint: Any) -> None:
    """The kv section's functions (the 8-bit KV cache against "auto"), tiny: every format
    gets its decode steps and its attention calls, on the C kernel where it builds."""
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    steps = kv_step_times(model_dir, {"dtype": "bfloat16"}, batch=2, context_len=40, num_steps=2)
    assert {kv: len(ts) for kv, ts in steps.items()} == {"auto": 2, "int8": 2, "fp8": 2}
    attention = kv_attention_times(4, 2, 16, batch=2, context_len=40, num_iters=2)
    backends = ("torch", "cpu") if cpu_kernels.load() is not None else ("torch",)
    assert set(attention) == {(b, kv) for b in backends for kv in ("auto", "int8", "fp8")}
    assert all(len(ts) == 2 and min(ts) > 0 for ts in [*steps.values(), *attention.values()])
    assert "| one layer's decode attention | fp8 |" in kv_table(steps, attention)
