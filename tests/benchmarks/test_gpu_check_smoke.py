"""`benchmarks/gpu_check.py --smoke`: the device check's own code, run on CPU in CI.

The script is what proves the CUDA path on the first GPU it meets, in one run; a script
that only ever runs there rots between GPUs. Its smoke mode runs every check's code on
CPU (the Triton kernels in the interpreter, the engine on its Triton path, the cluster
over both transports), and this test holds it to what the GPU run must show: each check
`ok`, the parity cases equal to `transformers`, KV blocks sent with no local prefill.
Numbers are not asserted (CPU figures mean nothing here).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

RUN_TIMEOUT_S = 900.0
CHECKS = ("kernels", "parity", "decode/prefill", "cluster/grpc", "cluster/ucx")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cluster check needs Linux")
def test_gpu_check_smoke_passes_every_check() -> None:
    argv = [sys.executable, "-m", "pdserve.benchmarks.gpu_check", "--smoke"]
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
    lines = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^([a-z/]+): (ok|FAIL): (.*)$", out, re.MULTILINE)
    }
    assert sorted(lines) == sorted(CHECKS), out[-4000:]
    failed = {name: text for name, (status, text) in lines.items() if status != "ok"}
    assert not failed, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    parity = lines["parity"][1]
    assert parity.count("equal") == 5 and "DIFFERS" not in parity, parity
    for transport in ("grpc", "ucx"):
        text = lines[f"cluster/{transport}"][1]
        sent = int(re.search(r"KV blocks sent (\d+)", text).group(1))  # type: ignore[union-attr]
        assert sent > 0, text
        assert "local prefills 0;" in text, text
        assert "tokens equal" in text, text
    assert re.search(r"^gpu_check: 5 checks, 0 failed", out, re.MULTILINE), out[-2000:]
