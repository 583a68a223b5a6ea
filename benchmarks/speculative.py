"""Speculative decoding with prompt lookup and with a draft model: decode tok/s with
and without it, and how many proposals the model accepts, in one run.

    python -m pdserve.benchmarks.speculative [--model mid|tiny] [--batches 1 8]
        [--spec ngram:k=4] [--drafts same layers:2] [--draft-options k=4,adaptive=off]
        [--seed-len 32] [--output-len 96] [--threads 1] [--dtype float32] [--repeats 3]

The checkpoint is `engine_throughput`'s random `transformers` Llama of that name ("mid":
hidden 1024, 8 layers, 16 heads, 4 KV heads, vocabulary 32000, ~156M parameters, float32),
built in a temporary folder. Two workloads, each at every batch size:

- copy: the output repeats text of the prompt (as "repeat/edit this text" does). With
  random weights, a prompt is made to have a repetitive greedy output from the model's own
  behaviour: T is the model's greedy continuation (`--output-len` tokens, run without
  speculation) of a random seed S (`--seed-len` tokens), and the prompt is S + T + S: a
  model that continues S as it did before writes T again, and prompt lookup proposes T's
  tokens from the prompt. How much of T the model really repeats is what the acceptance
  column measures.
- random: random prompts of the same length. A random model's greedy output often falls
  into loops of its own, which prompt lookup then proposes: the acceptance column says
  how much.
- wrong: the random prompts again, every proposal made wrong (each proposed token + 1):
  what speculation costs where it cannot help (the adaptive policy backs off; with
  `adaptive=off` every wrong proposal is verified).
- draft=...: the random prompts again, proposed by a draft model (`"draft:PATH,"` +
  `--draft-options`, by default every proposal verified), one row per `--drafts` entry:
  `same`, the checkpoint as its own draft (every greedy proposal accepted: the upper
  bound on acceptance, so the row measures what drafting and verifying cost), and
  `layers:N`, the checkpoint cut to its first N layers (embedding, final norm and LM
  head kept: a smaller draft that agrees with it often, as a layer-skip draft does).

Each workload runs greedily (eos ignored, `--output-len` tokens) on two engines of the same
checkpoint, without and with `--spec`; only the decode phase is timed (from the first step
after every request has its first token to the last), best of `--repeats` runs, the two
engines alternating. Columns: decode tok/s (wall) without and with speculation and their
ratio, the same ratio in this process's CPU time (steadier where other processes share
the cores), the tokens verified, the acceptance rate (accepted / verified), tokens
emitted per verify row, decode steps, and whether every request's tokens were the same
(greedy speculation is exact: must be all).

On a CPU a verify row of k + 1 tokens costs more than a one-token decode step (the matrix
products are not free there, as they nearly are on a memory-bound GPU), so the gain per
accepted token is smaller than on a GPU. Benchmarks live here, never in tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.benchmarks.engine_throughput import MODELS, build_checkpoint
from pdserve.benchmarks.machine import print_machine
from pdserve.demo.model import write_random_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.spec_decode.proposer import BatchProposer, Proposer, SpecStats

_ids = itertools.count()


@dataclass(frozen=True)
class Run:
    decode_tokens: int
    decode_s: float  # wall time
    decode_cpu_s: float  # this process's CPU time over the same steps
    steps: int
    tokens: list[list[int]]
    stats: SpecStats  # this run's counters

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def cpu_tok_s(self) -> float:
        return self.decode_tokens / self.decode_cpu_s


@dataclass(frozen=True)
class Row:
    workload: str
    batch: int
    plain: Run
    spec: Run

    def cells(self) -> list[str]:
        s = self.spec.stats
        rate = f"{s.accepted_tokens / s.proposed_tokens:.0%}" if s.proposed_tokens else "-"
        per_row = f"{s.emitted_tokens / s.verify_rows:.2f}" if s.verify_rows else "-"
        same = sum(a == b for a, b in zip(self.plain.tokens, self.spec.tokens, strict=True))
        return [
            self.workload,
            str(self.batch),
            f"{self.plain.tok_s:.1f}",
            f"{self.spec.tok_s:.1f}",
            f"{self.spec.tok_s / self.plain.tok_s:.2f}x",
            f"{self.spec.cpu_tok_s / self.plain.cpu_tok_s:.2f}x",
            f"{s.proposed_tokens}",
            rate,
            per_row,
            f"{self.plain.steps} -> {self.spec.steps}",
            f"{same}/{len(self.plain.tokens)}",
        ]


HEADERS = [
    "workload",
    "batch",
    "plain tok/s",
    "spec tok/s",
    "speedup",
    "speedup (CPU time)",
    "proposed",
    "accepted",
    "tokens/verify row",
    "decode steps",
    "same tokens",
]


def decode_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Run:
    """Run `prompts` together; time the steps after every one has its first token."""
    engine = llm.engine
    before = dataclasses.replace(engine.spec_stats())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"bench-{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    counts: dict[str, int] = {}
    finals: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            counts[out.request_id] = len(out.token_ids)
            if out.finished:
                finals[out.request_id] = out.token_ids

    while len(counts) < len(ids):  # prefill (and maybe some first decode tokens)
        step()
    at_start, steps = sum(counts.values()), 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished:
        step()
        steps += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = engine.spec_stats()
    stats = SpecStats(
        *(getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after))
    )
    tokens = [finals[r] for r in ids]
    return Run(sum(counts.values()) - at_start, elapsed, cpu, steps, tokens, stats)


class WrongProposer:
    """Prompt lookup's proposals, each token + 1: never what the model picks (unless by
    a coincidence of its own)."""

    def __init__(self, inner: Proposer, vocab: int) -> None:
        self.inner = inner
        self.vocab = vocab
        self.num_speculative_tokens = inner.num_speculative_tokens

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return [(t + 1) % self.vocab for t in self.inner.propose(seq, max_tokens)]


def best(runs: list[Run]) -> Run:
    """The fastest run: other processes on a shared machine only ever slow one down."""
    return max(runs, key=lambda r: r.tok_s)


def copy_prompts(
    plain: LLM, rng: random.Random, batch: int, seed_len: int, output_len: int, vocab: int
) -> list[list[int]]:
    """S + T + S, T the model's greedy continuation of the random seed S."""
    seeds = [[rng.randrange(3, vocab) for _ in range(seed_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    continuations = [out.token_ids for out in plain.generate(seeds, params)]
    return [s + t + s for s, t in zip(seeds, continuations, strict=True)]


def first_layers(model_dir: Path, out: Path, layers: int) -> Path:
    """`model_dir` cut to its first `layers` layers (embedding, final norm, LM head and
    tokenizer kept): a draft of the same vocabulary that agrees with it often."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = load_file(model_dir / "model.safetensors")
    kept = {
        k: v
        for k, v in tensors.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return out


def draft_dir(model_dir: Path, name: str) -> tuple[str, Path]:
    """A `--drafts` entry's row label and folder: `same` or `layers:N`."""
    if name == "same":
        return "draft=target", model_dir
    kind, _, n = name.partition(":")
    if kind != "layers" or not n.isdigit() or int(n) < 1:
        raise SystemExit(f"--drafts: expected 'same' or 'layers:N', got {name!r}")
    return f"draft={n} layers", first_layers(model_dir, model_dir.parent / f"draft-{n}", int(n))


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def run(args: argparse.Namespace, model_dir: Path, vocab: int) -> list[Row]:
    prompt_len = 2 * args.seed_len + args.output_len
    max_batch = max(args.batches)
    config = {
        "dtype": args.dtype,
        "num_threads": args.threads,
        "max_num_seqs": max_batch,
        "max_model_len": prompt_len + args.output_len + 16,
        "num_kv_blocks": max_batch * (-(-(prompt_len + args.output_len + 16) // 16)) + 16,
        # every run prefills its prompts anew: no run reuses the one before's blocks
        "enable_prefix_caching": False,
    }
    plain = LLM(model_dir, **config)
    spec = LLM(model_dir, speculative=args.spec, **config)
    drafts = {
        label: LLM(model_dir, speculative=f"draft:{path},{args.draft_options}", **config)
        for label, path in (draft_dir(model_dir, name) for name in args.drafts)
    }
    warm = [[5, 6, 7, 8] * 4]
    for llm in (plain, spec, *drafts.values()):
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rows = []
    for batch in args.batches:
        rng = random.Random(batch)
        random_prompts = [
            [rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)
        ]
        workloads = {
            "copy": copy_prompts(plain, rng, batch, args.seed_len, args.output_len, vocab),
            "random": random_prompts,
            "wrong": random_prompts,
        }
        proposer = spec.engine.scheduler.proposer
        assert proposer is not None
        runs = [(name, spec, prompts) for name, prompts in workloads.items()]
        runs += [(label, llm, random_prompts) for label, llm in drafts.items()]
        for name, llm, prompts in runs:
            if name == "wrong":
                if isinstance(proposer, BatchProposer):
                    continue  # a draft's proposals are made in the model: not rewritten
                spec.engine.scheduler.proposer = WrongProposer(proposer, vocab)
            plain_runs, spec_runs = [], []
            for _ in range(args.repeats):
                plain_runs.append(decode_run(plain, prompts, args.output_len))
                spec_runs.append(decode_run(llm, prompts, args.output_len))
            spec.engine.scheduler.proposer = proposer
            row = Row(name, batch, best(plain_runs), best(spec_runs))
            rows.append(row)
            print("  " + "  ".join(row.cells()), flush=True)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--spec", default="ngram:k=4", help="EngineConfig.speculative")
    parser.add_argument(
        "--drafts",
        nargs="*",
        default=["same", "layers:2"],
        help="draft models, a row each on the random prompts: 'same' (the checkpoint"
        " itself) or 'layers:N' (its first N layers); none for no draft rows",
    )
    parser.add_argument(
        "--draft-options", default="k=4,adaptive=off", help="the draft rows' options"
    )
    parser.add_argument("--seed-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    args = parse_args()
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        start = time.perf_counter()
        tokenizer_dir = write_random_model(Path(tmp) / "random")
        model_dir = build_checkpoint(spec, Path(tmp) / spec.name, tokenizer_dir)
        print(
            f"{spec.name}: checkpoint built in {time.perf_counter() - start:.1f} s;"
            f" speculative={args.spec!r}, {args.threads} thread(s), {args.dtype},"
            f" prompts {2 * args.seed_len + args.output_len} tokens,"
            f" {args.output_len} output tokens, best of {args.repeats}",
            flush=True,
        )
        rows = run(args, model_dir, spec.vocab_size)
    print()
    print(markdown_table(HEADERS, [r.cells() for r in rows]))


if __name__ == "__main__":
    main()
