"""Structured output's cost: decode tok/s with and without a JSON schema, and what a
grammar costs to compile, in one run.

    python -m pdserve.benchmarks.structured [--model mid|tiny] [--batches 1 32]
        [--prompt-len 64] [--output-len 64] [--threads 2] [--repeats 3]
        [--tokenizer-dir DIR]

The checkpoint is `engine_throughput`'s random `transformers` Llama of that name ("mid":
~156M parameters, vocabulary 32000, float32) with the demo tokenizer (512 tokens; the
mask is as wide as the model's vocabulary either way), or the tokenizer of
`--tokenizer-dir` (a `tokenizer.json` of the model's vocabulary size: a real 32k
vocabulary makes the grammar's token tables and masks realistic).

Decode: `batch` random prompts run together, greedy, every request `--output-len` tokens
(eos ignored), once free and once under `SCHEMA` (an object holding an array of at
least `--output-len` small objects: a real JSON grammar that cannot end before
max_tokens, so both runs emit the same number of tokens). Only the decode phase is
timed (from the first step after every request has its first token), best of
`--repeats`, the two alternating. The constrained run must emit only JSON prefixes the
grammar allows, which the benchmark checks.

Compile: `largest_schema()` (about 40 nested objects) through a fresh compiler: the
token tables (once per engine), the grammar cold, then the same schema again (cached:
a lookup and a matcher copy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.engine_throughput import MODELS, build_checkpoint
from pdserve.benchmarks.machine import print_machine
from pdserve.benchmarks.structured_schemas import largest_schema
from pdserve.common.grammar import GrammarSpec
from pdserve.demo.model import write_random_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.grammar import GrammarCompiler

_ids = itertools.count()


def schema_for(output_len: int) -> dict[str, Any]:
    row = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"rows": {"type": "array", "items": row, "minItems": output_len}},
        "required": ["rows"],
        "additionalProperties": False,
    }


@dataclass
class Run:
    tokens: int
    seconds: float
    texts: list[str]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def decode_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    engine = llm.engine
    ids = [f"bench-{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    counts: dict[str, int] = {}
    texts: dict[str, str] = {}

    def step() -> None:
        for out in engine.step():
            counts[out.request_id] = len(out.token_ids)
            if out.finished:
                texts[out.request_id] = out.text

    while len(counts) < len(ids):
        step()
    at_start = sum(counts.values())
    start = time.perf_counter()
    while engine.has_unfinished:
        step()
    elapsed = time.perf_counter() - start
    return Run(sum(counts.values()) - at_start, elapsed, [texts[r] for r in ids])


def compile_times(model_dir: Path, vocab: int) -> tuple[float, float, float, int]:
    """(token tables s, cold compile s, cached compile + matcher s, schema bytes)."""
    spec = GrammarSpec.json_schema(largest_schema())
    compiler = GrammarCompiler(model_dir / "tokenizer.json", vocab, [])
    start = time.perf_counter()
    _ = compiler.tokenizer
    tables = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(spec)
    cached = time.perf_counter() - start
    assert compiler.hits == 1
    return tables, cold, cached, len(spec.source)


def is_prefix_json(text: str) -> bool:
    """Whether `text` starts the schema's JSON: '{"rows": [{"id": ' and so on."""
    start = '{"rows": [{"id": '
    return text.startswith(start) or start.startswith(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
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
        tokenizer_dir = args.tokenizer_dir or write_random_model(Path(tmp) / "random")
        model_dir = build_checkpoint(spec, Path(tmp) / spec.name, tokenizer_dir)
        if args.tokenizer_dir is not None:
            shutil.copyfile(args.tokenizer_dir / "tokenizer.json", model_dir / "tokenizer.json")
        tables, cold, cached, size = compile_times(model_dir, spec.vocab_size)
        print(
            f"{spec.name}: vocabulary {spec.vocab_size}, {args.threads} thread(s),"
            f" prompts {args.prompt_len} tokens, {args.output_len} output tokens,"
            f" best of {args.repeats}"
        )
        print(
            f"largest schema ({size} bytes of JSON): token tables {tables * 1e3:.1f} ms"
            f" (once per engine), compile cold {cold * 1e3:.2f} ms,"
            f" cached {cached * 1e3:.3f} ms"
        )
        llm = LLM(model_dir, dtype="float32", max_num_seqs=max(args.batches), max_model_len=1024)
        grammar = GrammarSpec.json_schema(schema_for(args.output_len))
        free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        constrained = SamplingParams(
            max_tokens=args.output_len, temperature=0.0, ignore_eos=True, grammar=grammar
        )
        rng = random.Random(0)
        rows = []
        for batch in args.batches:
            prompts = [
                [rng.randrange(5, 512) for _ in range(args.prompt_len)] for _ in range(batch)
            ]
            runs: dict[str, list[Run]] = {"free": [], "schema": []}
            for _ in range(args.repeats):
                runs["free"].append(decode_run(llm, prompts, free))
                runs["schema"].append(decode_run(llm, prompts, constrained))
            best = {k: max(v, key=lambda r: r.tok_s) for k, v in runs.items()}
            valid = all(is_prefix_json(t) for r in runs["schema"] for t in r.texts)
            assert valid, runs["schema"][0].texts[0][:80]
            ratio = best["schema"].tok_s / best["free"].tok_s
            rows.append(
                [
                    str(batch),
                    f"{best['free'].tok_s:.1f}",
                    f"{best['schema'].tok_s:.1f}",
                    f"{ratio:.3f}",
                    f"{(1 - ratio) * 100:+.1f}%",
                ]
            )
    headers = ["batch", "free tok/s", "schema tok/s", "ratio", "slowdown"]
    print()
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(json.dumps({"compile_cold_ms": cold * 1e3, "compile_cached_ms": cached * 1e3}))


if __name__ == "__main__":
    main()
