"""`benchmarks/quantization.py` end to end on the tiny shape: every table prints, the int8
variant holds fewer weight bytes than bf16 and agrees with it at most positions, the 8-bit
KV caches hand off about half the bytes and fit about twice the blocks, and the baseline
scores itself exactly. Timings are not asserted; the benchmark reports them."""

from __future__ import annotations

import subprocess
import sys


def test_quantization_benchmark_runs_on_the_tiny_shape() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.quantization", "--model-size", "tiny"]
    argv += ["--batches", "1", "4", "--steps", "2", "--prompt-len", "8"]
    argv += ["--kv-context", "40", "--kv-batch", "2"]
    argv += ["--quality-prompts", "2", "--quality-tokens", "16"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in r] for r in rows if r[0].strip() != "variant"]
    speed = [r for r in cells if len(r) == 7]
    kv = {r[0]: r for r in cells if len(r) == 9}
    quality = [r for r in cells if len(r) == 4]
    variants = ["bf16", "int8", "kv-int8", "kv-fp8"]
    assert [(r[0], r[1]) for r in speed] == [(v, b) for b in ("1", "4") for v in variants]
    assert all(float(r[6]) < 0.7 for r in speed if r[0] == "int8")  # weights vs bf16
    assert list(kv) == variants
    for name in ("kv-int8", "kv-fp8"):  # head_dim 32: rows of 34 bytes against 64
        assert float(kv[name][4]) == 0.531, kv[name]  # handoff bytes vs bf16
        assert kv[name][8] == "1.88x", kv[name]  # blocks per GiB vs bf16
    assert float(kv["int8"][4]) == 1.0  # int8 weights leave the KV as it was
    assert [(r[0], r[1]) for r in quality] == [(v, "32") for v in variants]
    assert quality[0][2:] == ["100.00%", "0.00e+00"]
    for row in quality[1:]:
        assert float(row[2].rstrip("%")) >= 80 and 0 < float(row[3]) < 0.01, row
    assert "int8 vs bf16 decode tok/s at batch 1:" in proc.stdout
    assert "kv-fp8 vs bf16: long-context decode step" in proc.stdout
