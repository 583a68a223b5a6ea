"""One device check: everything a GPU changes, proved in one command on the first GPU met.

    python -m pdserve.benchmarks.gpu_check            # on a CUDA machine (well inside 8 min)
    python -m pdserve.benchmarks.gpu_check --smoke    # the same code on CPU, tiny shapes (CI)

Needs the dev extras (`transformers` is the reference, `openai` the client). One summary
line per check, `ok` or `FAIL`, then `gpu_check: N checks, M failed`; exit status 1 if any
failed. The checks, in order:

1. kernels: the suite of `benchmarks/kernels_gpu.py` (each Triton kernel against its torch
   reference, with achieved bandwidth or TFLOP/s).
2. parity: greedy tokens of a small float32 checkpoint equal `transformers`' on the same
   device: prefix caching on and off, chunked prefill, CUDA graphs on and off.
3. decode / prefill: a Llama-3-8B-shaped bf16 model with random weights
   (`load_format="dummy"`): decode tok/s at batch 1 and 64 against the bandwidth bound
   (weights + KV read per step at the device copy bandwidth measured here), prefill tok/s
   against the bf16 matmul bound (2 FLOPs per weight per token at the matmul rate measured
   here).
4. cluster (grpc, ucx): `pdserve up` disaggregated, 1 prefill + 1 decode replica sharing
   the one GPU (half a GPU each): reference tokens through the official client, KV blocks
   sent > 0, local prefills 0, and the transfer time of one 2,048-token request's KV.

`--smoke` runs the Triton kernels in the interpreter (TRITON_INTERPRET=1), the engine with
`attention_backend="triton"` (so the CUDA path's Python runs), tiny shapes, the cluster on
CPU. Its numbers mean nothing; it keeps the script from rotting.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

MAX_NEW_TOKENS = 8
TRANSFER_PROMPT_LEN = 2048


@dataclass
class Run:
    """Where the check runs, and the summary lines so far."""

    smoke: bool
    device: str
    workdir: Path
    lines: list[tuple[str, bool, str]] = field(default_factory=list)

    def report(self, name: str, ok: bool, text: str) -> None:
        self.lines.append((name, ok, text))
        print(f"{name}: {'ok' if ok else 'FAIL'}: {text}", flush=True)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.smoke else torch.bfloat16

    @property
    def backend(self) -> Literal["triton"]:
        # The Triton path everywhere: on CPU that is the interpreter (smoke only).
        return "triton"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeat: int = 3) -> float:
    """Best seconds per call of `fn` (after one warm-up call)."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


# -- 1. kernels ---------------------------------------------------------------------


def check_kernels(run: Run) -> None:
    from pdserve.benchmarks import kernels_gpu

    setup = kernels_gpu.Setup(run.device, run.dtype, smoke=run.smoke)
    copy_bw = kernels_gpu.copy_bandwidth(setup)
    lines = [
        kernels_gpu.bench_decode(setup, copy_bw),
        kernels_gpu.bench_prefill(setup),
        kernels_gpu.bench_kv_pack(setup, copy_bw),
        kernels_gpu.bench_small_kernels(setup),
    ]
    # The suite reports exactness as "byte-exact True" / "exact True": any False fails.
    ok = not any("False" in line for line in lines)
    run.report("kernels", ok, f"copy {copy_bw / 1e9:.0f} GB/s | " + " | ".join(lines))


# -- 2. parity ----------------------------------------------------------------------


def small_checkpoint(run: Run) -> Path:
    """A random float32 Llama (GQA, 4,096 positions) with the demo tokenizer, via
    `transformers`, so that its own greedy tokens are the reference."""
    import transformers

    from pdserve.engine.demo_model import write_random_model

    out = run.workdir / "small"
    if (out / "config.json").is_file():
        return out
    tok_dir = write_random_model(run.workdir / "random")
    demo = json.loads((tok_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=demo["vocab_size"],
        hidden_size=64 if run.smoke else 256,
        intermediate_size=128 if run.smoke else 512,
        num_hidden_layers=2 if run.smoke else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.1,
        bos_token_id=demo["bos_token_id"],
        eos_token_id=demo["eos_token_id"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out


def prompts(num: int, vocab: int, length: int = 24) -> list[list[int]]:
    """Distinct prompts, the first two sharing a block-aligned prefix (a prefix hit)."""
    out = [[3 + (7 * i + 11 * j) % (vocab - 3) for j in range(length + i)] for i in range(num)]
    if num > 1:
        out[1][:16] = out[0][:16]
    return out


def hf_greedy(model_dir: Path, device: str, batch: list[list[int]], n: int) -> list[list[int]]:
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = loaded.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs
    outs = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(
                ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def check_parity(run: Run) -> None:
    from pdserve.engine import LLM, SamplingParams

    model_dir = small_checkpoint(run)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    # In the interpreter every prompt token costs ~40 ms per case: the smoke keeps the
    # prefix hit and a prompt longer than the chunk (16 tokens), and no more.
    batch = prompts(2, vocab, 17) if run.smoke else prompts(3, vocab)
    ref = hf_greedy(model_dir, run.device, batch, MAX_NEW_TOKENS)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    common: dict[str, Any] = {
        "dtype": "float32",
        "device": run.device,
        "attention_backend": run.backend,
    }
    cases: dict[str, dict[str, Any]] = {
        "prefix-cache": {"enable_prefix_caching": True},
        "no-prefix-cache": {"enable_prefix_caching": False},
        "chunked": {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
        "graphs": {"enforce_eager": False},
        "eager": {"enforce_eager": True},
    }
    results = []
    for name, kwargs in cases.items():
        llm = LLM(model_dir, **common, **kwargs)
        got = [out.token_ids for out in llm.generate(batch, params)]
        llm.engine.block_pool.check_no_leaks()
        results.append((name, got == ref))
        del llm
    ok = all(equal for _, equal in results)
    text = ", ".join(f"{name} {'equal' if equal else 'DIFFERS'}" for name, equal in results)
    run.report("parity", ok, f"{len(batch)} prompts x {MAX_NEW_TOKENS} tokens: {text}")


# -- 3. decode and prefill against their bounds --------------------------------------


def matmul_flops(run: Run) -> float:
    """bf16 (fp32 in smoke) FLOP/s of one large square matmul on the device."""
    n = 512 if run.smoke else 8192
    a = torch.randn(n, n, device=run.device).to(run.dtype)
    b = torch.randn(n, n, device=run.device).to(run.dtype)
    return 2 * n**3 / timed(lambda: a @ b, run.device)


def copy_bandwidth(run: Run) -> float:
    """Bytes read + written per second by a plain device copy (as kernels_gpu counts)."""
    num_bytes = (8 << 20) if run.smoke else (1 << 30)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), run.device)


def dummy_model_dir(run: Run) -> Path:
    from pdserve.engine.dummy_model import LLAMA3_8B, TINY, write_config_only_model

    tok_dir = run.workdir / "random"
    if not (tok_dir / "tokenizer.json").is_file():
        from pdserve.engine.demo_model import write_random_model

        write_random_model(tok_dir)
    shape = TINY if run.smoke else LLAMA3_8B
    return write_config_only_model(run.workdir / "dummy", shape, tokenizer_dir=tok_dir)


def weight_bytes_per_token(cfg: Any, itemsize: int) -> int:
    """Bytes of the weights a decode step reads (every matrix but the embedding table)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    per_layer += 3 * h * cfg.intermediate_size
    return (cfg.num_layers * per_layer + cfg.vocab_size * h) * itemsize


def check_decode_prefill(run: Run) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = dummy_model_dir(run)
    batches = [1, 4] if run.smoke else [1, 64]
    prompt_len, steps = (16, 2) if run.smoke else (512, 32)
    prefill_len = 32 if run.smoke else 4096
    engine = LLMEngine(
        model_dir,
        EngineConfig(
            load_format="dummy",
            dtype="float32" if run.smoke else "bfloat16",
            device=run.device,
            attention_backend=run.backend,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(prefill_len, max(batches) * prompt_len),
            max_model_len=max(prefill_len, prompt_len + steps) + 16,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.85 if not run.smoke else None,
        ),
    )
    mc = engine.model_config
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    weights = weight_bytes_per_token(mc, itemsize)
    kv_per_token = mc.kv_bytes_per_token * itemsize // 4  # kv_bytes_per_token is fp32
    copy_bw, flops = copy_bandwidth(run), matmul_flops(run)
    parts, ok = [], True
    for batch in batches:
        ids = [f"decode-{batch}-{i}" for i in range(batch)]
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        for i, rid in enumerate(ids):
            engine.add_request(rid, [5 + (i + j) % 400 for j in range(prompt_len)], params)
        waiting = set(ids)
        while waiting:  # the prefills, up to every request's first token
            waiting -= {out.request_id for out in engine.step()}
        synchronize(run.device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(run.device)
        step_s = (time.perf_counter() - start) / steps
        engine.abort(ids)
        while engine.has_unfinished:
            engine.step()
        context = prompt_len + steps // 2
        bound_s = (weights + batch * context * kv_per_token) / copy_bw
        frac = bound_s / step_s
        parts.append(f"decode B={batch}: {batch / step_s:.0f} tok/s = {frac:.0%} of bandwidth")
        if batch == 1 and not run.smoke:
            ok = ok and frac >= 0.70
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request("prefill", [5 + j % 400 for j in range(prefill_len)], params)
    synchronize(run.device)
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    synchronize(run.device)
    prefill_s = time.perf_counter() - start
    bound_tok_s = flops / (2 * weights / itemsize)
    tok_s = prefill_len / prefill_s
    parts.append(f"prefill {prefill_len}: {tok_s:.0f} tok/s = {tok_s / bound_tok_s:.0%} of matmul")
    engine.block_pool.check_no_leaks()
    shape = f"{mc.num_layers}L h{mc.hidden_size} {engine.dtype}".replace("torch.", "")
    run.report(
        "decode/prefill",
        ok,
        f"{shape}, {engine.num_kv_blocks} KV blocks; copy {copy_bw / 1e9:.0f} GB/s, "
        f"matmul {flops / 1e12:.1f} TFLOP/s; " + "; ".join(parts),
    )


# -- 4. the disaggregated cluster on one device ---------------------------------------


def cluster_flags(run: Run, transport: str) -> list[str]:
    flags = ["--mode", "disagg", "--prefill-replicas", "1", "--decode-replicas", "1"]
    flags += ["--transport", transport, "--disagg-policy", "always", "--dtype", "float32"]
    flags += ["--device", run.device, "--max-model-len", str(TRANSFER_PROMPT_LEN + 64)]
    if run.device.startswith("cuda"):
        flags += ["--replica-gpus", "0.5", "--replica-cpus", "1"]
    else:
        flags += ["--replica-cpus", "0"]
    return flags


def check_cluster(run: Run, transport: str) -> None:
    import openai

    from pdserve.benchmarks.bench_report import sample, scrape_metrics
    from pdserve.benchmarks.compare import cluster

    model_dir = small_checkpoint(run)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = prompts(4, vocab)
    ref = hf_greedy(model_dir, run.device, batch, MAX_NEW_TOKENS)
    long_prompt = prompts(1, vocab, TRANSFER_PROMPT_LEN)[0]
    with cluster(str(model_dir), cluster_flags(run, transport)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        model_id = client.models.list().data[0].id
        extra = {"ignore_eos": True, "return_token_ids": True}

        def complete(prompt: list[int], max_tokens: int) -> list[int]:
            out = client.completions.create(
                model=model_id,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
            return list(out.choices[0].model_extra["token_ids"])  # type: ignore[index]

        got = [complete(p, MAX_NEW_TOKENS) for p in batch]
        before = scrape_metrics(url)
        complete(long_prompt, 1)
        after = scrape_metrics(url)

    def delta(name: str) -> float:
        return sample(after, name) - sample(before, name)

    local = sum(v for (name, _), v in after.items() if name == "pdserve_decode_local_prefill_total")
    blocks = sample(after, "pdserve_kv_transfer_blocks_total")
    moved, seconds = (
        delta("pdserve_kv_transfer_bytes_total"),
        delta("pdserve_kv_transfer_seconds_total"),
    )
    ok = got == ref and blocks > 0 and local == 0 and moved > 0
    run.report(
        f"cluster/{transport}",
        ok,
        f"tokens {'equal' if got == ref else 'DIFFER'} ({len(batch)} requests); KV blocks sent "
        f"{blocks:.0f}, local prefills {local:.0f}; {TRANSFER_PROMPT_LEN}-token KV: "
        f"{moved / 2**20:.1f} MiB in {seconds * 1e3:.1f} ms",
    )


# -- main ---------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Run], None]] = {
    "kernels": check_kernels,
    "parity": check_parity,
    "decode": check_decode_prefill,
    "grpc": lambda run: check_cluster(run, "grpc"),
    "ucx": lambda run: check_cluster(run, "ucx"),
}

# the summary line's name of each check
LABELS = {"decode": "decode/prefill", "grpc": "cluster/grpc", "ucx": "cluster/ucx"}
LABELS.update({name: name for name in CHECKS if name not in LABELS})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma list of checks ({', '.join(CHECKS)})"
    )
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module import
        device = "cpu"
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print("gpu_check: needs a CUDA device (or --smoke on the CPU)", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        name = torch.cuda.get_device_name()
        total = torch.cuda.get_device_properties(0).total_memory
        print(f"gpu_check: {name}, {total / 2**30:.0f} GiB, torch {torch.__version__}")
    torch.manual_seed(0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        run = Run(args.smoke, device, Path(tmp))
        for name in only:
            check_start = time.monotonic()
            gc.collect()  # each check's engines gone, and on CUDA their cached memory
            if device == "cuda":  # (a cluster's replicas size their KV pools from free memory)
                torch.cuda.empty_cache()
            try:
                CHECKS[name](run)
            except Exception as exc:  # one broken check must not hide the others' lines
                run.report(LABELS[name], False, f"{type(exc).__name__}: {exc}")
            print(f"  ({name}: {time.monotonic() - check_start:.0f} s)", flush=True)
    failed = [name for name, ok, _ in run.lines if not ok]
    print(
        f"gpu_check: {len(run.lines)} checks, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
        + f", {time.monotonic() - started:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
