"""The CPU engine needs no Triton: a CPU install of torch brings none (only CUDA builds do).

Triton is a dev extra here (kernel tests run its interpreter); `pip install pdserve` on a
CPU machine has none. A subprocess that cannot import `triton` generates, and hands a
prompt's KV from one engine to another (the disaggregated path's engine half), with the
same tokens as this process computes with Triton importable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"no module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

model_dir, prompt = sys.argv[1], json.loads(sys.argv[2])
cfg = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=64)
p_eng, d_eng = LLMEngine(model_dir, cfg), LLMEngine(model_dir, cfg)
first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
p_eng.add_request("r", prompt, first_params, hold_kv=True)
while p_eng.has_unfinished:
    p_eng.step()
export = p_eng.export_kv("r")
first = d_eng.add_prefilled_request(
    "r", prompt, export.first_token, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    export.payload,
)
tokens = []
while d_eng.has_unfinished:
    for out in d_eng.step():
        tokens = out.token_ids
export.release()
p_eng.release_kv("r")
assert "triton" not in sys.modules
print(json.dumps({"first": export.first_token, "tokens": tokens}))
"""


def test_cpu_engine_and_handoff_run_without_triton(make_checkpoint: Any) -> None:
    from pdserve.engine import LLM, SamplingParams

    model_dir = Path(make_checkpoint())
    prompt = list(range(3, 21))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (want,) = LLM(model_dir, dtype="float32", block_size=4).generate([prompt], params)
    assert got["first"] == want.token_ids[0]
    assert got["tokens"] == want.token_ids
