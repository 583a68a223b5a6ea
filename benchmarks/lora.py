"""Output tokens/s of a batch spread over many LoRA adapters, against the base model alone.

    python -m pdserve.benchmarks.lora [--model mid] [--dtype bfloat16] [--threads 2]
        [--requests 32] [--adapters 1 8 32] [--rank 16] [--quick]

One random Llama checkpoint (benchmarks/engine_throughput.py's `mid` by default) is built
with `transformers`, and `max(--adapters)` random PEFT adapters for it (rank `--rank`,
every projection an adapter may target: q, k, v, o, gate, up, down; A and B seeded, in
float32 as PEFT saves them), all loaded into one engine (`LLM`). The same `--requests`
prompts (`--prompt-len` random tokens, `--output-len` greedy tokens, ignore eos) are then
generated at once:

- base: no request names an adapter;
- N adapters: request i runs adapter i mod N, so every step holds N adapters' rows side
  by side (the engine adds each adapter's delta per segment of rows:
  engine/lora/apply.py).

Each configuration runs `--repeats` times, alternating, after one warm-up; the best wall
time counts. Reported per row: output tokens/s, its ratio to the base's, and how many
requests' tokens differ from the base's (the adapters change the tokens: 0 there would
mean they did not run). Prints the CPU and its flags first: figures only compare within
one run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.benchmarks.engine_throughput import MODELS, ModelSpec, build_checkpoint
from pdserve.benchmarks.machine import print_machine
from pdserve.common.sampling_params import SamplingParams
from pdserve.demo.model import write_random_model
from pdserve.engine.llm import LLM
from pdserve.engine.lora.adapter import TARGETS


def write_adapter(folder: Path, spec: ModelSpec, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every targetable projection, as PEFT saves one."""
    head_dim = spec.hidden_size // spec.num_heads
    q, kv, ffn = spec.num_heads * head_dim, spec.num_kv_heads * head_dim, spec.intermediate_size
    shapes = {  # (in, out) of each projection
        "q_proj": (spec.hidden_size, q),
        "k_proj": (spec.hidden_size, kv),
        "v_proj": (spec.hidden_size, kv),
        "o_proj": (q, spec.hidden_size),
        "gate_proj": (spec.hidden_size, ffn),
        "up_proj": (spec.hidden_size, ffn),
        "down_proj": (ffn, spec.hidden_size),
    }
    assert set(shapes) == set(TARGETS)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.5
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(shapes),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(
    llm: LLM, prompts: list[list[int]], output_len: int, names: list[str | None]
) -> tuple[float, list[list[int]]]:
    """Generate every prompt at once, request i with adapter names[i % len(names)]."""
    params = [
        SamplingParams(
            max_tokens=output_len,
            temperature=0.0,
            ignore_eos=True,
            lora=names[i % len(names)],
        )
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, [list(o.token_ids) for o in outputs]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mid")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model, short runs: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.model, args.requests, args.adapters = "tiny", 8, [1, 4]
        args.prompt_len, args.output_len, args.repeats = 16, 8, 1
    return args


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    args = parse_args()
    print_machine()
    spec = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-") as tmp:
        root = Path(tmp)
        model = build_checkpoint(spec, root / args.model, write_random_model(root / "tok"))
        most = max(args.adapters)
        llm = LLM(
            model,
            dtype=args.dtype,
            num_threads=args.threads,
            max_num_seqs=max(args.requests, 1),
            max_lora_rank=max(args.rank, 1),
            max_loras=most,  # every adapter resident: the steps mix all of them
        )
        for i in range(most):
            llm.load_lora(f"a{i}", write_adapter(root / f"a{i}", spec, args.rank, seed=i + 1))
        print(
            f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output"
            f" tokens; {most} adapters of rank {args.rank} on every projection;"
            f" {args.model} {args.dtype}, {args.threads} threads",
            flush=True,
        )
        rng = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, spec.vocab_size, (args.prompt_len,), generator=rng).tolist()
            for _ in range(args.requests)
        ]
        configs: dict[str, list[str | None]] = {"base": [None]}
        for n in args.adapters:
            configs[f"{n} adapter{'s' if n > 1 else ''}"] = [f"a{i}" for i in range(n)]
        run(llm, prompts[:2], 4, [None, "a0"])  # warm-up: both paths
        best: dict[str, float] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, names in configs.items():
                wall, tokens[name] = run(llm, prompts, args.output_len, names)
                best[name] = min(best.get(name, wall), wall)
        llm.close()
    output_tokens = args.requests * args.output_len
    base_rate = output_tokens / best["base"]
    print("\n| run | output tokens/s | vs base | requests whose tokens differ from base |")
    print("|---|---|---|---|")
    for name in configs:
        rate = output_tokens / best[name]
        differ = sum(a != b for a, b in zip(tokens[name], tokens["base"], strict=True))
        print(f"| {name} | {rate:,.1f} | {rate / base_rate:.2f}x | {differ}/{args.requests} |")


if __name__ == "__main__":
    main()
