"""What `LLM(model)` gets without a thread count, against `LLM(model, num_threads=1)`.

    python -m pdserve.benchmarks.default_threads [--model mid] [--dtype bfloat16] [--quick]

An engine told no `num_threads` uses the CPUs its process may run on (`OMP_NUM_THREADS`
when set, else its affinity mask: common/engine_config.py, `default_num_threads`). This measures
that against one thread on engine_throughput's `uniform-b32` workload (32 random prompts
of 128 tokens, 128 greedy tokens each, submitted at once), each setting in a fresh
process, since torch's thread count is per process:

- `num_threads=1`: the baseline (what `LLM(model)` did before threads by default);
- `default`: `LLM(model)` in a process that never set a count;
- `torch.set_num_threads(2)`: `LLM(model)` after the user set torch's count first, as
  one does with any torch program (the engine's default is the usable CPUs either way).

Each figure is the best of REPEATS runs in each of ROUNDS processes per setting: of the
whole batch (prefill included), and of its decode once every request has its first
token (the batch-32 decode rate). The rounds take the settings in turn, each round
starting one setting later (1, default, set; default, set, 1; set, 1, default), so a
slow spell of a shared host (its other tenants) spoils one process of each setting, not
every process of one, and no setting always runs first after an idle host or last
after a busy one (on a 2-core EPYC VM the same setting measured 504 decode tok/s run
first and 405 run fourth): noise only slows, and the best of each is the setting's rate.

The line that matters is the ratio of each to the baseline's decode tokens/s, printed
with the CPU (benchmarks/machine.py). `OMP_NUM_THREADS` is removed from the children's
environment, so the default is the mask's. Benchmarks live here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.benchmarks.engine_throughput import (
    FULL,
    MODELS,
    QUICK,
    build_checkpoint,
    make_workloads,
    num_kv_blocks_for,
)
from pdserve.benchmarks.machine import print_machine

SETTINGS = ("num_threads=1", "default", "torch.set_num_threads(2)")
CHILD_TIMEOUT_S = 1800
REPEATS = 3
ROUNDS = 3  # each setting once in each position; --quick: one round (a smoke run)


def run_one(model_dir: str, dtype: str, setting: str, quick: bool) -> dict[str, float]:
    """In this (fresh) process: build the engine as `setting` says, warm it, time the
    batch; its tokens/s and the threads it ran on."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    sizes = QUICK if quick else FULL
    spec = next(s for s in MODELS.values() if s.name == Path(model_dir).name)
    name = f"uniform-b{sizes.big_batch}"  # 32 (--quick: 8)
    (workload,) = [w for w in make_workloads(sizes, spec.vocab_size) if w.name == name]
    # no prefix caching: each repeat prefills its prompts again
    kwargs: dict[str, object] = {
        "num_kv_blocks": num_kv_blocks_for([workload]),
        "enable_prefix_caching": False,
    }
    if setting == "num_threads=1":
        kwargs["num_threads"] = 1
    elif setting == "torch.set_num_threads(2)":
        torch.set_num_threads(2)
    llm = LLM(model_dir, dtype=dtype, **kwargs)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens
    ]
    llm.generate(workload.prompts[:2], params[:2])  # warm-up
    best, best_decode = 0.0, 0.0
    for repeat in range(REPEATS):  # the best of a few: a shared machine's noise only slows
        tok_s, decode_tok_s = _timed_batch(llm.engine, workload.prompts, params, repeat)
        best, best_decode = max(best, tok_s), max(best_decode, decode_tok_s)
    return {"tok_s": best, "decode_tok_s": best_decode, "threads": float(torch.get_num_threads())}


def _order(rounds: int) -> list[str]:
    """The settings, round after round, each round starting one setting later."""
    n = len(SETTINGS)
    return [SETTINGS[(r + i) % n] for r in range(rounds) for i in range(n)]


def _timed_batch(
    engine: Any, prompts: list[list[int]], params: list[Any], repeat: int
) -> tuple[float, float]:
    """(tokens/s of the whole batch, tokens/s once every request has its first token:
    the batch's decode rate)."""
    import time

    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{repeat}-{i}", prompt, p, stream=True)
    start = time.perf_counter()
    started: set[str] = set()
    decode_start, total, decoded = 0.0, 0, 0
    while engine.has_unfinished:
        for out in engine.step():
            total += len(out.new_token_ids)
            if len(started) == len(prompts):
                decoded += len(out.new_token_ids)
            elif out.new_token_ids:
                started.add(out.request_id)
                if len(started) == len(prompts):
                    decode_start = time.perf_counter()
    end = time.perf_counter()
    return total / (end - start), decoded / (end - decode_start)


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="tiny model, batch 8: a smoke run")
    parser.add_argument(
        "--child", nargs=2, metavar=("MODEL_DIR", "SETTING"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child[0], args.dtype, args.child[1], args.quick)))
        return
    model = "tiny" if args.quick else args.model
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-threads-") as tmp:
        from pdserve.demo.model import write_random_model

        tokenizer_dir = write_random_model(Path(tmp) / "random")
        model_dir = build_checkpoint(MODELS[model], Path(tmp) / model, tokenizer_dir)
        for setting in _order(1 if args.quick else ROUNDS):
            argv = [
                sys.executable,
                "-m",
                "pdserve.benchmarks.default_threads",
                "--dtype",
                args.dtype,
            ]
            argv += [*(["--quick"] if args.quick else []), "--child", str(model_dir), setting]
            out = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
            )
            if out.returncode != 0:
                raise SystemExit(f"{setting}: exit {out.returncode}\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            best = results.setdefault(setting, got)
            for key in ("tok_s", "decode_tok_s"):
                best[key] = max(best[key], got[key])
    base = results["num_threads=1"]["tok_s"]
    batch = (QUICK if args.quick else FULL).big_batch
    print(f"\n{model} {args.dtype}, batch-{batch} decode, each setting in a process of its own")
    decode_base = results["num_threads=1"]["decode_tok_s"]
    print("| LLM(model) | threads | tok/s | vs num_threads=1 | decode tok/s | vs num_threads=1 |")
    print("|---|---|---|---|---|---|")
    for setting, r in results.items():
        whole, decode = r["tok_s"], r["decode_tok_s"]
        print(
            f"| {setting} | {r['threads']:.0f} | {whole:.1f} | {whole / base:.2f}x"
            f" | {decode:.1f} | {decode / decode_base:.2f}x |"
        )


if __name__ == "__main__":
    main()
