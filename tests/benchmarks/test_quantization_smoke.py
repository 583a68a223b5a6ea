"""`benchmarks/quantization.py` end to end on the tiny shape: both tables print, the int8
variant holds fewer weight bytes than bf16 and agrees with it at most positions, and the
baseline scores itself exactly; the 8-bit KV cache section's functions run. Timings are
not asserted; the benchmark reports them."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from pdserve.benchmarks.quantization import kv_attention_times, kv_step_times, kv_table
from pdserve.engine import cpu_kernels


def test_quantization_benchmark_runs_on_the_tiny_shape() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.quantization", "--model-size", "tiny"]
    argv += ["--batches", "1", "4", "--steps", "2", "--prompt-len", "8"]
    argv += ["--quality-prompts", "2", "--quality-tokens", "16"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in r] for r in rows if r[0].strip() != "variant"]
    speed = [r for r in cells if len(r) == 7]
    quality = [r for r in cells if len(r) == 4]
    assert [(r[0], r[1]) for r in speed] == [
        ("bf16", "1"),
        ("int8", "1"),
        ("bf16", "4"),
        ("int8", "4"),
    ]
    assert all(float(r[6]) < 0.7 for r in speed if r[0] == "int8")  # weights vs bf16
    assert [(r[0], r[1]) for r in quality] == [("bf16", "32"), ("int8", "32")]
    assert quality[0][2:] == ["100.00%", "0.00e+00"]
    assert float(quality[1][2].rstrip("%")) >= 80 and 0 < float(quality[1][3]) < 0.01
    assert "int8 vs bf16 decode tok/s at batch 1:" in proc.stdout


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
