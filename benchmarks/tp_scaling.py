"""Tensor parallelism's accounting: decode step time at TP=1 and TP=2, the all-reduce share
of each step, and each rank's memory, in one run.

    python -m pdserve.benchmarks.tp_scaling [--model DIR] [--shape mid|tiny]
        [--batches 1 32] [--prompt-len 32] [--steps 16] [--threads 1] [--dtype float32]

Without `--model`, a mid-sized Llama shape (hidden 1024, 8 layers, 16 heads, 4 KV heads,
intermediate 2816, vocabulary 32000: ~156M parameters) is written without weights
(`demo/dummy.py`) and each rank makes random weights for its shard
(`load_format="dummy"`). For each TP size and batch the engine prefills `batch` prompts
of `--prompt-len` random tokens, then times `--steps` decode steps (`engine.step()`; the
median, and the mean that the all-reduce share is taken of). The all-reduce time is what
the driver (rank 0) spent in all-reduces over those steps (`LLMEngine.parallel_stats`):
it includes waiting for the slower rank. "collectives" adds the step's input broadcast
and the logits gather.

Each rank runs `--threads` torch threads, so TP=2 uses twice the cores TP=1 does. On a
2-core machine shared with other processes TP=2 is not expected to be faster (every
all-reduce is a loopback TCP round trip and a wait for the other rank); the point is the
accounting. Benchmarks live here, never in tests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.benchmarks.machine import print_machine
from pdserve.demo.dummy import TINY, ConfigShape, write_config_only_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.parallel import ParallelStats

MID = ConfigShape(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    torch_dtype="float32",
)
SHAPES = {"mid": MID, "tiny": TINY}
BLOCK_SIZE = 16
MIB = 1 << 20


@dataclass(frozen=True)
class StepRow:
    tp: int
    batch: int
    median_s: float
    mean_s: float
    all_reduce_s: float  # per step, on the driver
    collective_s: float  # per step: all-reduces, the input broadcast and the logits gather

    def cells(self) -> list[str]:
        share = self.all_reduce_s / self.mean_s if self.mean_s else 0.0
        return [
            str(self.tp),
            str(self.batch),
            f"{self.median_s * 1e3:.2f}",
            f"{self.mean_s * 1e3:.2f}",
            f"{self.all_reduce_s * 1e3:.2f}",
            f"{share:.0%}",
            f"{self.collective_s * 1e3:.2f}",
        ]


def decode_steps(
    llm: LLM, batch: int, prompt_len: int, num_steps: int, vocab: int
) -> tuple[list[float], float, float]:
    """(step times, all-reduce s per step, collective s per step) of `num_steps` decode
    steps of `batch` sequences, after their prefill and one warm-up step."""
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=num_steps + 3, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"tp-{batch}-{i}", prompt, params)
    # Prefill (chunked within the step budget) until every sequence has sampled, then one
    # warm-up decode step.
    sampled: set[str] = set()
    while len(sampled) < batch:
        sampled.update(o.request_id for o in engine.step())
    engine.step()
    before = engine.parallel_stats()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    after = engine.parallel_stats()
    while engine.has_unfinished:
        engine.step()
    all_reduce = (after.all_reduce_s - before.all_reduce_s) / num_steps
    collective = (
        after.all_reduce_s
        + after.broadcast_s
        + after.gather_s
        - before.all_reduce_s
        - before.broadcast_s
        - before.gather_s
    ) / num_steps
    return times, all_reduce, collective


def memory_rows(stats: ParallelStats) -> list[list[str]]:
    return [
        [
            str(stats.tensor_parallel_size),
            str(r.rank),
            f"{r.weight_bytes / MIB:.2f}",
            f"{r.sharded_weight_bytes / MIB:.2f}",
            f"{r.replicated_weight_bytes / MIB:.2f}",
            f"{r.kv_cache_bytes / MIB:.2f}",
        ]
        for r in stats.ranks
    ]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def run(args: argparse.Namespace, model_dir: Path, load_format: str, vocab: int) -> None:
    max_batch = max(args.batches)
    per_seq = -(-(args.prompt_len + args.steps + 4) // BLOCK_SIZE)
    config: dict[str, Any] = {
        "dtype": args.dtype,
        "load_format": load_format,
        "num_threads": args.threads,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": max_batch * per_seq + 8,
        "max_num_seqs": max_batch,
        "max_model_len": args.prompt_len + args.steps + 8,
        "enable_prefix_caching": False,
    }
    step_rows: list[StepRow] = []
    mem_rows: list[list[str]] = []
    for tp in args.tp:
        start = time.perf_counter()
        with LLM(model_dir, tensor_parallel_size=tp, **config) as llm:
            print(f"TP={tp}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
            for batch in args.batches:
                times, all_reduce, collective = decode_steps(
                    llm, batch, args.prompt_len, args.steps, vocab
                )
                row = StepRow(
                    tp,
                    batch,
                    statistics.median(times),
                    statistics.fmean(times),
                    all_reduce,
                    collective,
                )
                step_rows.append(row)
                print("  " + "  ".join(row.cells()), flush=True)
            mem_rows += memory_rows(llm.engine.parallel_stats())
    print()
    print(
        markdown_table(
            [
                "TP",
                "batch",
                "step ms (median)",
                "step ms (mean)",
                "all-reduce ms/step",
                "all-reduce share",
                "collectives ms/step",
            ],
            [r.cells() for r in step_rows],
        )
    )
    print()
    print(
        markdown_table(
            ["TP", "rank", "weights MiB", "sharded MiB", "replicated MiB", "KV cache MiB"],
            mem_rows,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an HF model folder (default: dummy weights)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser.parse_args()


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    args = parse_args()
    if args.model is not None:
        from pdserve.common.model_config import load_model_config

        vocab = min(load_model_config(args.model).vocab_size, 512)
        print(f"model {args.model}; batches {args.batches}; {args.steps} decode steps")
        run(args, args.model, "auto", vocab)
        return
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_only_model(Path(tmp) / f"{args.shape}-dummy", shape)
        print(
            f"{args.shape} Llama (hidden {shape.hidden_size}, {shape.num_layers} layers,"
            f" {shape.num_heads} heads, {shape.num_kv_heads} KV heads, intermediate"
            f" {shape.intermediate_size}, vocabulary {shape.vocab_size}), dummy weights,"
            f" {args.dtype}; prompts of {args.prompt_len} tokens; {args.steps} decode steps;"
            f" {args.threads} torch thread(s) per rank"
        )
        # The demo tokenizer's ids (< 512) are the prompts' ids.
        run(args, model_dir, "dummy", 512)


if __name__ == "__main__":
    main()
