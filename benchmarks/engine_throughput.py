"""Output tokens/s of pdserve's engine against `transformers`, on the same CPU, same threads.

    python -m pdserve.benchmarks.engine_throughput [--threads 1 2] [--models tiny mid]
        [--dtypes bfloat16 float32] [--workloads uniform-b1 uniform-b32 varied] [--quick]

Two random Llama checkpoints are built with `transformers` (float32, seeded) into a
temporary folder, removed at the end. For every (threads, model, dtype) both sides load the
same checkpoint in that dtype, warm up with a short generate, and run the same workloads:

- uniform-b1 / uniform-b32: 128 random prompt tokens, 128 greedy output tokens, ignore eos;
- varied: 64 requests, prompt lengths and max_tokens uniform in 16..512 (`random.Random(0)`).
  pdserve gets all 64 at once; `transformers` runs static batches of 32 in arrival order,
  left-padded, each batch until its longest request; only each request's own max_tokens
  count as output, so the padding work a static batch wastes is charged to it.

`--workloads` picks some of them (default all). On a CPU without bf16 matmul (AVX2 only)
`transformers`' bfloat16 runs at about a quarter of its float32 speed, and the mid model's
`varied` workload alone then takes it over an hour at 1 thread: the uniform ones measure
what thread scaling and batch 1 need in about 15 minutes.

`transformers` runs as its users run it: `model.generate(..., do_sample=False)` with its
default attention implementation and cache, under `torch.inference_mode()`. At batch 1 the
script also times pdserve's decode step and sets it against the memory-bandwidth bound.

Each row also gives both sides' cpu-wait: the share of their threads' runnable time spent
waiting for a CPU (Linux's per-thread schedstat). Near 0 a side had its cores; on a
machine other processes share, a large one says they set the figure, most of all at 2
threads, whose every fork/join waits for the slower thread. The OpenMP wait settings in
effect (`pdserve/__init__.py` bounds libgomp's spin unless the environment sets one) are
printed first.

Benchmarks live here, never in tests (STYLE.md, habit 9).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pdserve.benchmarks.machine import print_machine
from pdserve.demo.model import write_random_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.modeling.llama import LlamaModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_PROMPT_ID = 512  # the random model tokenizer's vocab; the engine is given ids only
BLOCK_SIZE = 16  # the engine's default KV block size
BANDWIDTH_BUFFER_BYTES = 256 << 20
BANDWIDTH_REPEATS = 5


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


MODELS = {
    "tiny": ModelSpec("tiny", 256, 4, 8, 2, 688, 1024),
    "mid": ModelSpec("mid", 1024, 8, 16, 4, 2816, 32000),  # ~156M parameters
}


WORKLOAD_NAMES = ("uniform-b1", "uniform-b32", "varied")  # make_workloads' order


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    hf_batch_size: int  # transformers' static batch; pdserve always gets every request


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: the full run, or the `--quick` smoke run."""

    prompt_len: int
    output_len: int
    big_batch: int
    num_varied: int
    varied_min: int
    varied_max: int


FULL = Sizes(
    prompt_len=128, output_len=128, big_batch=32, num_varied=64, varied_min=16, varied_max=512
)
QUICK = Sizes(prompt_len=32, output_len=16, big_batch=8, num_varied=16, varied_min=8, varied_max=64)


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    threads: int
    workload: str
    ours_tok_s: float
    hf_tok_s: float
    num_identical: int  # requests whose tokens equal transformers' exactly
    num_requests: int
    # share of each side's runnable thread time spent waiting for a CPU (`cpu_wait_since`)
    ours_cpu_wait: float
    hf_cpu_wait: float

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.hf_tok_s

    def cells(self) -> list[str]:
        return [
            *(self.model, self.dtype, str(self.threads), self.workload),
            *(f"{self.ours_tok_s:.1f}", f"{self.hf_tok_s:.1f}", f"{self.ratio:.2f}"),
            f"{self.num_identical}/{self.num_requests}",
            f"{self.ours_cpu_wait:.0%}",
            f"{self.hf_cpu_wait:.0%}",
        ]


class Bandwidth(NamedTuple):
    """Bytes/s measured in this run, at this thread count (see `measure_bandwidth`)."""

    copy_read: float  # size / t of `dst.copy_(src)`: the convention the bound uses
    sum_read: float  # size / t of `src.sum()`: a read-only stream, for reference


@dataclass(frozen=True)
class DecodeRow:
    model: str
    dtype: str
    threads: int
    step_s: float
    bytes_read: int
    bw: Bandwidth

    def bound_s(self, bytes_per_s: float) -> float:
        return self.bytes_read / bytes_per_s

    def pct_of(self, bytes_per_s: float) -> str:
        return f"{self.bound_s(bytes_per_s) / self.step_s:.0%}"

    def cells(self) -> list[str]:
        copy_bw, sum_bw = self.bw
        return [
            *(self.model, self.dtype, str(self.threads), f"{self.step_s * 1e3:.1f}"),
            *(f"{self.bound_s(copy_bw) * 1e3:.1f}", f"{self.bytes_read / 1e6:.0f}"),
            *(f"{copy_bw / 1e9:.1f}", self.pct_of(copy_bw), self.pct_of(2 * copy_bw)),
            *(f"{sum_bw / 1e9:.1f}", self.pct_of(sum_bw)),
        ]


# -- checkpoints and workloads -------------------------------------------------------------


def build_checkpoint(spec: ModelSpec, out: Path, tokenizer_dir: Path) -> Path:
    """Save a seeded random float32 Llama with `transformers`, plus the demo tokenizer."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,  # eos disabled: every request runs to its max_tokens on both sides
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    del model
    gc.collect()
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    top = min(vocab, MAX_PROMPT_ID)
    return [[rng.randrange(top) for _ in range(n)] for n in lengths]


def make_workloads(sizes: Sizes, vocab: int) -> list[Workload]:
    # NOTE: distinct seeds per workload, so no prompt shares a block with an earlier one and
    # prefix caching (on, as by default) never saves pdserve work transformers has to do.
    uniform = [
        Workload(
            f"uniform-b{batch}",
            random_prompts(random.Random(100 + batch), [sizes.prompt_len] * batch, vocab),
            [sizes.output_len] * batch,
            hf_batch_size=batch,
        )
        for batch in (1, sizes.big_batch)
    ]
    rng = random.Random(0)
    spans = [
        (
            rng.randint(sizes.varied_min, sizes.varied_max),
            rng.randint(sizes.varied_min, sizes.varied_max),
        )
        for _ in range(sizes.num_varied)
    ]
    varied = Workload(
        "varied",
        random_prompts(random.Random(1), [p for p, _ in spans], vocab),
        [m for _, m in spans],
        hf_batch_size=sizes.big_batch,
    )
    return [*uniform, varied]


def num_kv_blocks_for(workloads: list[Workload]) -> int:
    """A pool that holds the biggest workload whole, so pdserve never preempts."""
    need = [
        sum(-(-(len(p) + m) // BLOCK_SIZE) for p, m in zip(w.prompts, w.max_tokens, strict=True))
        for w in workloads
    ]
    return max(need) + 64  # + room for the warm-up and the decode probe


# -- memory bandwidth and the decode bound -------------------------------------------------


def best_rate(op: Callable[[], object], num_bytes: int) -> float:
    best_s = float("inf")
    for _ in range(BANDWIDTH_REPEATS):
        start = time.perf_counter()
        op()
        best_s = min(best_s, time.perf_counter() - start)
    return num_bytes / best_s


def measure_bandwidth(num_bytes: int = BANDWIDTH_BUFFER_BYTES) -> Bandwidth:
    """Bytes read per second, best of BANDWIDTH_REPEATS, by a copy and by a sum.

    NOTE: convention. The bound is bytes a decode step reads / read rate, with the read rate
    taken as a copy's size / t: the copy reads `size` bytes in t. The copy also writes
    `size` bytes (3 * size of traffic with write-allocate), so this rate is the lowest of
    the usual ones and the bound the longest: a lenient bound, the upper end of
    "% of bound". The STREAM convention, 2 * size / t, counts the writes too and halves
    the bound; a read-only `sum` is what a weight-streaming step resembles most, and on
    the 2-core dev box it reads about as fast as STREAM's figure. All three are printed.
    """
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    return Bandwidth(best_rate(lambda: dst.copy_(src), num_bytes), best_rate(src.sum, num_bytes))


def weight_bytes(weight: Any, itemsize: int) -> int:
    """Bytes of a plain tensor, or of a `Linear`'s logical [out, in] weight and bias.

    A packed (oneDNN) weight is counted at its logical size: the bytes the step needs,
    whatever padding the blocked layout adds.
    """
    if weight is None:
        return 0
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    matrix = weight.out_features * weight.in_features * itemsize
    return matrix + weight_bytes(weight.bias, itemsize)


def decode_bytes(model: LlamaModel, context_len: int) -> int:
    """Bytes one batch-1 decode step must read at `context_len` tokens of context.

    Every layer weight, the final norm and lm_head; the embedding only as one row, which is
    left out (when tied, lm_head *is* the embedding and is counted once). Plus the K and V
    cache of the context.
    """
    itemsize = model.dtype.itemsize
    weights = [w for layer in model.layers for w in vars(layer).values()]
    weights += [model.final_norm, model.lm_head]
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context_len * itemsize
    return sum(weight_bytes(w, itemsize) for w in weights) + kv


def decode_step_s(llm: LLM, prompt: list[int], num_steps: int) -> float:
    """Median time of `engine.step()` at batch 1, after the prompt's prefill step.

    The median, not the mean: other processes on a shared machine stall single steps.
    """
    engine = llm.engine
    params = SamplingParams(max_tokens=1 + num_steps, temperature=0.0, ignore_eos=True)
    engine.add_request("decode-probe", prompt, params)
    engine.step()  # the prefill: the prompt fits one step's token budget
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the two sides ---------------------------------------------------------------------------


def thread_cpu_ns() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one), summed over this process's threads
    from /proc/self/task/*/schedstat; (0, 0) where Linux does not expose them."""
    ran = waited = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            fields = stat.read_text().split()
        except OSError:  # a thread that just ended
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran, waited


def cpu_wait_since(start: tuple[int, int]) -> float:
    """Share of the threads' runnable time since `start` (a `thread_cpu_ns()`) spent waiting."""
    ran, waited = (now - then for now, then in zip(thread_cpu_ns(), start, strict=True))
    return waited / (ran + waited) if ran + waited > 0 else 0.0


class Run(NamedTuple):
    seconds: float
    outputs: list[list[int]]  # output ids per request
    cpu_wait: float  # see `cpu_wait_since`


def run_ours(llm: LLM, workload: Workload) -> Run:
    """The whole workload submitted at once."""
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens
    ]
    clock = thread_cpu_ns()
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed_s = time.perf_counter() - start
    return Run(elapsed_s, [o.token_ids for o in outs], cpu_wait_since(clock))


def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One static batch, left-padded, every row generating `max_new_tokens` tokens."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, width:].tolist()


def run_hf(model: Any, workload: Workload) -> Run:
    """Static batches in arrival order."""
    size, outputs, elapsed_s = workload.hf_batch_size, [], 0.0
    clock = thread_cpu_ns()
    for i in range(0, len(workload.prompts), size):
        prompts, max_tokens = workload.prompts[i : i + size], workload.max_tokens[i : i + size]
        start = time.perf_counter()
        rows = hf_generate(model, prompts, max(max_tokens))
        elapsed_s += time.perf_counter() - start
        outputs += [row[:m] for row, m in zip(rows, max_tokens, strict=True)]
    return Run(elapsed_s, outputs, cpu_wait_since(clock))


def measure_ours(
    model_dir: Path, dtype: str, threads: int, workloads: list[Workload], sizes: Sizes
) -> tuple[dict[str, Run], float, int]:
    """Per-workload results, the median decode step (s) and the bytes that step reads."""
    torch.set_num_threads(threads)
    llm = LLM(
        model_dir, dtype=dtype, num_threads=threads, num_kv_blocks=num_kv_blocks_for(workloads)
    )
    vocab = llm.engine.model_config.vocab_size
    print(f"pdserve attention backend: {llm.engine.runner.backend.name}", flush=True)
    llm.generate([random_prompts(random.Random(7), [8], vocab)[0]], SamplingParams(max_tokens=4))
    results = {w.name: run_ours(llm, w) for w in workloads}
    probe_steps = sizes.output_len
    probe = random_prompts(random.Random(8), [sizes.prompt_len], vocab)[0]
    step_s = decode_step_s(llm, probe, probe_steps)
    # The median step sits at mid-generation: prompt + half the decode steps of context.
    bytes_read = decode_bytes(llm.engine.model, len(probe) + probe_steps // 2)
    del llm
    gc.collect()
    return results, step_s, bytes_read


def measure_hf(
    model_dir: Path, dtype: str, threads: int, workloads: list[Workload]
) -> dict[str, Run]:
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    hf_generate(model, random_prompts(random.Random(7), [8], model.config.vocab_size), 4)
    results = {w.name: run_hf(model, w) for w in workloads}
    del model
    gc.collect()
    return results


# -- reporting ------------------------------------------------------------------------------


def make_row(
    spec: ModelSpec,
    dtype: str,
    threads: int,
    w: Workload,
    ours: Run,
    hf: Run,
) -> Row:
    useful = sum(w.max_tokens)
    for side, outputs in (("pdserve", ours.outputs), ("transformers", hf.outputs)):
        lengths = [len(o) for o in outputs]
        if lengths != w.max_tokens:
            raise RuntimeError(f"{side} produced {sum(lengths)} tokens on {w.name}, not {useful}")
    identical = sum(a == b for a, b in zip(ours.outputs, hf.outputs, strict=True))
    return Row(
        spec.name,
        dtype,
        threads,
        w.name,
        useful / ours.seconds,
        useful / hf.seconds,
        identical,
        len(w.prompts),
        ours.cpu_wait,
        hf.cpu_wait,
    )


def format_row(r: Row) -> str:
    return (
        f"{r.model:<4} {r.dtype:<8} t={r.threads} {r.workload:<11} "
        f"pdserve {r.ours_tok_s:7.1f} tok/s  transformers {r.hf_tok_s:7.1f} tok/s  "
        f"ratio {r.ratio:.2f}  (identical {r.num_identical}/{r.num_requests}, "
        f"cpu-wait {r.ours_cpu_wait:.0%} vs {r.hf_cpu_wait:.0%})"
    )


def format_decode(d: DecodeRow) -> str:
    copy_bw, sum_bw = d.bw
    return (
        f"{d.model:<4} {d.dtype:<8} t={d.threads} decode step {d.step_s * 1e3:.1f} ms, "
        f"bound {d.bound_s(copy_bw) * 1e3:.1f} ms (read {d.bytes_read / 1e6:.0f} MB at "
        f"{copy_bw / 1e9:.1f} GB/s) -> {d.pct_of(copy_bw)} of bound"
        f" | STREAM 2*size/t: bound {d.bound_s(2 * copy_bw) * 1e3:.1f} ms"
        f" -> {d.pct_of(2 * copy_bw)} | read-only sum {sum_bw / 1e9:.1f} GB/s:"
        f" bound {d.bound_s(sum_bw) * 1e3:.1f} ms -> {d.pct_of(sum_bw)}"
    )


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def print_summary(rows: list[Row], decodes: list[DecodeRow]) -> None:
    headers = (
        "model dtype threads workload pdserve_tok/s transformers_tok/s ratio identical"
        " pdserve_cpu_wait transformers_cpu_wait"
    )
    print("\n" + markdown_table(headers.split(), [r.cells() for r in rows]))
    headers = (
        "model dtype threads step_ms bound_ms MB_read GB/s(copy,size/t) %bound"
        " %bound(STREAM,2*size/t) GB/s(sum) %bound(sum)"
    )
    print("\n" + markdown_table(headers.split(), [d.cells() for d in decodes]))


# -- main -----------------------------------------------------------------------------------


def run_config(
    spec: ModelSpec,
    model_dir: Path,
    dtype: str,
    threads: int,
    sizes: Sizes,
    bw: Bandwidth,
    names: list[str],
) -> tuple[list[Row], DecodeRow]:
    # make_workloads' order is WORKLOAD_NAMES' (`--quick`'s big batch is 8, not 32)
    every = make_workloads(sizes, spec.vocab_size)
    workloads = [w for w, kind in zip(every, WORKLOAD_NAMES, strict=True) if kind in names]
    ours, step_s, bytes_read = measure_ours(model_dir, dtype, threads, workloads, sizes)
    hf = measure_hf(model_dir, dtype, threads, workloads)
    rows = [make_row(spec, dtype, threads, w, ours[w.name], hf[w.name]) for w in workloads]
    for r in rows:
        print(format_row(r), flush=True)
    decode = DecodeRow(spec.name, dtype, threads, step_s, bytes_read, bw)
    print(format_decode(decode), flush=True)
    return rows, decode


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "mid"])
    parser.add_argument(
        "--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"]
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOAD_NAMES), default=list(WORKLOAD_NAMES)
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens: a smoke run")
    return parser.parse_args()


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Loading weights" bars drown the lines
    args = parse_args()
    waits = {k: os.environ.get(k, "unset") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print("OpenMP wait: " + ", ".join(f"{k}={v}" for k, v in waits.items()), flush=True)
    sizes, model_names = (QUICK, ["tiny"]) if args.quick else (FULL, args.models)
    rows: list[Row] = []
    decodes: list[DecodeRow] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        tokenizer_dir = write_random_model(Path(tmp) / "random")
        model_dirs = {
            name: build_checkpoint(MODELS[name], Path(tmp) / name, tokenizer_dir)
            for name in model_names
        }
        for threads in args.threads:
            torch.set_num_threads(threads)
            bw = measure_bandwidth()
            print(
                f"t={threads} copy {bw.copy_read / 1e9:.1f} GB/s read (size/t), "
                f"{2 * bw.copy_read / 1e9:.1f} GB/s STREAM (2*size/t); "
                f"read-only sum {bw.sum_read / 1e9:.1f} GB/s",
                flush=True,
            )
            for name in model_names:
                for dtype in args.dtypes:
                    r, d = run_config(
                        MODELS[name], model_dirs[name], dtype, threads, sizes, bw, args.workloads
                    )
                    rows += r
                    decodes.append(d)
    print_summary(rows, decodes)


if __name__ == "__main__":
    main()
