"""`benchmarks/gpu_check.py --smoke`: the device check's own code, run on CPU in CI.

The script is what proves the CUDA path on the first GPU it meets, in one run; a script
that only ever runs there rots between GPUs. Its smoke mode runs every check's code on
CPU (the Triton kernels in the interpreter, the engine on its Triton path, the cluster
over both transports, tensor parallelism over gloo), and this test holds it to what the
GPU run must show: each check `ok`, the parity cases equal to `transformers`, the
speculative and tensor-parallel tokens equal to plain decoding's, KV blocks sent with no
local prefill. Numbers are not asserted (CPU figures mean nothing here).

The budget: a run whose budget covers the first check only runs that one and reports
every later check `skipped: out of budget`, in order, with a summary and exit status 0.
The margin comparison of parity/bf16 is pinned on hand-made references.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from pdserve.benchmarks.gpu_check import CHECKS as CHECK_LIST
from pdserve.benchmarks.gpu_check import Reference, compare_with_margin

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'

RUN_TIMEOUT_S = 900.0
CHECKS = (
    "kernels",
    "kernels/speed",
    "parity",
    "parity/bf16",
    "quant",
    "speculative",
    "cluster/grpc",
    "decode/prefill",
    "cluster/ucx",
    "tp",
)
LINE = re.compile(r"^([a-z0-9/]+): (ok|FAIL|skipped): (.*)$", re.MULTILINE)


def run_gpu_check(*args: str) -> tuple[int, str]:
    """`gpu_check --smoke ARGS` as a user runs it: (exit status, stdout and stderr)."""
    argv = [sys.executable, "-m", "pdserve.benchmarks.gpu_check", "--smoke", *args]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cluster check needs Linux")
def test_gpu_check_smoke_passes_every_check() -> None:
    code, out = run_gpu_check()
    lines = {m.group(1): (m.group(2), m.group(3)) for m in LINE.finditer(out)}
    assert sorted(lines) == sorted(CHECKS), out[-4000:]
    failed = {name: text for name, (status, text) in lines.items() if status != "ok"}
    assert not failed, out[-4000:]
    assert code == 0, out[-4000:]
    parity = lines["parity"][1]
    assert parity.count("equal") == 6 and "DIFFERS" not in parity, parity
    assert "kv-tiers (0 blocks back)" not in parity, parity
    bf16 = lines["parity/bf16"][1]
    assert "DIFFERS" not in bf16 and "positions decided" in bf16, bf16
    quant = lines["quant"][1]
    assert quant.count("top-1") == 3 and "MISSED" not in quant, quant
    spec = lines["speculative"][1]
    assert spec.count(" equal") == 3 and "DIFFERS" not in spec, spec
    assert "equal to TP=1" in lines["tp"][1], lines["tp"][1]
    for transport in ("grpc", "ucx"):
        text = lines[f"cluster/{transport}"][1]
        sent = int(re.search(r"KV blocks sent (\d+)", text).group(1))  # type: ignore[union-attr]
        assert sent > 0, text
        assert "local prefills 0;" in text, text
        assert "tokens equal" in text, text
    assert re.search(r"^gpu_check: 10 checks, 0 failed, 0 skipped", out, re.MULTILINE), out[-2000:]


def test_a_check_past_the_budget_is_skipped_with_all_after_it() -> None:
    first = CHECK_LIST[0]
    # room for the first check's estimate, never for the second's after it
    assert CHECK_LIST[1].smoke_s > 1.0
    code, out = run_gpu_check("--budget-s", str(first.smoke_s + 1.0))
    found = [(m.group(1), m.group(2), m.group(3)) for m in LINE.finditer(out)]
    assert [name for name, _, _ in found] == list(CHECKS), out[-4000:]
    ran = {name: status for name, status, _ in found if name in first.labels}
    assert ran == dict.fromkeys(first.labels, "ok"), out[-4000:]
    rest = [(status, text) for name, status, text in found if name not in first.labels]
    assert rest == [("skipped", "out of budget")] * len(rest), out[-4000:]
    summary = f"gpu_check: {len(first.labels)} checks, 0 failed, {len(rest)} skipped"
    assert re.search(f"^{summary}", out, re.MULTILINE), out[-2000:]
    assert code == 0, out[-4000:]


def reference(tokens: list[int], gaps: list[float]) -> Reference:
    return Reference(tokens, gaps, [(t, t + 1) for t in tokens])


def test_tokens_are_decided_only_where_the_reference_gap_is_wide() -> None:
    ref = reference([5, 6, 7, 8], [1.0, 1.0, 1.0, 1.0])
    same = compare_with_margin([5, 6, 7, 8], ref, 0.5)
    assert (same.decided, same.near_ties, same.differs_at) == (4, 0, None)
    wrong = compare_with_margin([5, 6, 9, 8], ref, 0.5)
    assert (wrong.decided, wrong.differs_at) == (2, 2)


def test_a_near_tie_passes_and_a_flip_there_ends_the_comparison() -> None:
    ref = reference([5, 6, 7, 8], [1.0, 0.1, 1.0, 1.0])
    agreed = compare_with_margin([5, 6, 7, 8], ref, 0.5)
    assert (agreed.decided, agreed.near_ties, agreed.parted_at_tie) == (3, 1, False)
    flipped = compare_with_margin([5, 9, 1, 2], ref, 0.5)  # later tokens follow the flip
    assert (flipped.decided, flipped.near_ties, flipped.parted_at_tie) == (1, 1, True)
    assert flipped.differs_at is None
