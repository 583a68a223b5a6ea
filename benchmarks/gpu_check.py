"""One device check: everything a GPU changes, proved in one command on the first GPU met.

    python -m pdserve.benchmarks.gpu_check                 # CUDA; stops starting checks at 420 s
    python -m pdserve.benchmarks.gpu_check --budget-s 900  # a longer budget (cold caches)
    python -m pdserve.benchmarks.gpu_check --only kernels,bf16  # some checks (`CHECKS` keys)
    python -m pdserve.benchmarks.gpu_check --smoke         # the same code on CPU, tiny (CI)

Needs the dev extras (`transformers` is the reference, `openai` the client). One summary
line per check, `NAME: ok: ...`, `NAME: FAIL: ...` or `NAME: skipped: WHY`, then
`gpu_check: N checks, M failed, K skipped, T s`; exit status 1 if any failed (a skipped
check is not a failure: its line says why). The checks, most valuable first (each is worth
less once an earlier one failed, and the budget cuts from the end):

1. kernels: every Triton kernel in bf16 against its float32 reference with a tolerance per
   kernel; copies byte-exact (`benchmarks/kernels_gpu.py`). Every other check runs these
   kernels, so a kernel error here explains a failure there.
   kernels/speed: paged decode attention >= 80% of the copy bandwidth at batch >= 32,
   context >= 4k (judged); the other kernels' bandwidth, prefill against SDPA (reported).
2. parity: greedy tokens of a small float32 checkpoint equal `transformers`' on the same
   device, exactly: prefix caching on and off, chunked prefill, CUDA graphs on and off,
   and prefixes brought back from the host and disk KV tiers (docs/kv-tiers.md).
   The engine's own contract, and the cheapest proof that its CUDA path computes the model.
3. parity/bf16: the dtype served. Greedy tokens against `transformers` in bf16 on the same
   device, compared where the reference's top-2 logit gap is >= BF16_GAP_MARGIN (two bf16
   implementations may break a nearer tie either way), for as long as both agree; fails on
   a difference at such a position, or when fewer than BF16_MIN_DECIDED positions decided.
4. quant: int8 weights and the int8 / fp8 KV caches against the bf16 float path on the
   same token sequences (the float path's greedy ones, read back teacher forced): top-1
   agreement >= a bound and max |logit error| <= a bound per variant (`QUANT_BOUNDS`).
5. speculative: prompt lookup (`ngram:k=4`) and two draft models (the checkpoint cut to
   half its layers; the checkpoint itself, whose proposals are all accepted), every
   proposal verified, give plain greedy decoding's tokens exactly (float32: a verify row
   takes other kernels than a decode step, and float32 keeps ties apart).
6. cluster/grpc: `pdserve up` disaggregated, 1 prefill + 1 decode replica sharing the GPU:
   reference tokens through the official client, KV blocks sent > 0, local prefills 0,
   the transfer time of one 2,048-token request's KV. The deployment as it ships.
7. decode/prefill: a Llama-3-8B-shaped bf16 model with random weights: decode tok/s at
   batch 1 (judged: >= 70% of the bandwidth bound, weights + KV read per step at the copy
   bandwidth measured here) and 64, prefill tok/s against the matmul bound. Speed matters
   only once the results are right, hence after them; the most memory-hungry check.
8. cluster/ucx: the same cluster over UCX, the other transport: after grpc it proves only
   the transport, so it comes after the speed checks.
9. tp: tensor_parallel_size=2 gives TP=1's tokens; last, as it needs two GPUs, which few
   machines have (else `tp: skipped: one GPU`, not a failure).

The budget (`--budget-s`, default 420 s from main()'s start; the import of torch before
it is not counted): before each check the script estimates its time (`Check.estimate_s`
on a warm Triton cache, plus `compile_s` on a cold one, times how much slower the
finished checks ran than their estimates) and, if that would end past the budget, prints
`NAME: skipped: out of budget` for it and every check after it, and the summary. A
check that has started always runs to its end: the script never interrupts one (a
half-stopped cluster or engine would prove nothing). On an H200 the estimates add up to
~305 s on a warm Triton cache; on a cold one the last checks are skipped.

A first run's compile time is visible: the Triton cache's location and whether it was
warm, each kernel's first (compiling) call, each engine's construction and first
generate, each check's time against its estimate.

`--smoke` runs every check's code on CPU: the Triton kernels in the interpreter
(TRITON_INTERPRET=1), the engine on `attention_backend="triton"`, tiny shapes, float32
where bf16 means nothing in the interpreter (the kernels, parity/bf16 and quant then
compare float32 paths, by the same code), tensor parallelism over gloo, the cluster on CPU.
Its numbers mean nothing; it keeps the script from rotting.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from pdserve.benchmarks.machine import print_machine

MAX_NEW_TOKENS = 8
TRANSFER_PROMPT_LEN = 2048
DEFAULT_BUDGET_S = 420.0
# Engines of the correctness checks: a fixed pool (no memory profiling, and room for a
# cluster's replicas afterwards) and few CUDA graph sizes to capture.
SMALL_ENGINE: dict[str, Any] = {"num_kv_blocks": 512, "max_num_seqs": 8}
# The small checkpoints' weight scale. 0.1 spreads the float32 parity model's logits so
# exact ties are rare; 0.05 makes a calmer model whose rounding errors grow less through
# its layers, so that the bf16 and 8-bit checks' bounds can be tight, and whose copy
# prompts it does copy (prompt lookup accepted 37 of 87 proposals on CPU; 0 with 0.1).
PARITY_INIT, CALM_INIT = 0.1, 0.05

# parity/bf16. On CPU (the torch backend against `transformers`, both bf16, the calm
# checkpoint) the top-2 gap of the two differed by at most 0.031 and tokens parted only
# at gaps of 0 (ties); the margin is 4x that: 8 bf16 steps at the top logits' size (2-4).
BF16_GAP_MARGIN = 0.125
BF16_PROMPTS, BF16_TOKENS = 8, 32
BF16_MIN_DECIDED = 64  # of 256 positions; ~60% of the reference's gaps exceed the margin
SMOKE_BF16_PROMPTS, SMOKE_BF16_MIN_DECIDED = 2, 4

# quant: prompts x tokens of the float path, read back teacher forced by every variant.
QUANT_PROMPTS, QUANT_TOKENS = 8, 32
SMOKE_QUANT_PROMPTS = 2


@dataclass(frozen=True)
class QuantBound:
    """What an 8-bit variant must keep of the float path: the share of positions whose
    argmax agrees, and the largest logit error (logits of std ~0.8 on the calm model)."""

    min_agreement: float
    max_logit_err: float


# Measured on CPU (bf16, the calm checkpoint, 8 x 32 positions): agreement 0.957 / 0.969 /
# 0.926, max |logit error| 0.12 / 0.074 / 0.195; the bounds leave ~0.1 of agreement and 4x
# the error (a broken kernel agrees on a few percent, with errors of whole logits).
QUANT_BOUNDS: dict[str, tuple[dict[str, Any], QuantBound]] = {
    "int8 weights": ({"quantization": "int8"}, QuantBound(0.85, 0.5)),
    "kv int8": ({"kv_cache_dtype": "int8"}, QuantBound(0.90, 0.3)),
    "kv fp8": ({"kv_cache_dtype": "fp8"}, QuantBound(0.80, 0.75)),
}

SPEC_TOKENS, SMOKE_SPEC_TOKENS = 24, 8
NGRAM_SPEC = "ngram:k=4,adaptive=off"  # adaptive=off: every proposal verified
DRAFT_OPTIONS = "k=4,adaptive=off"

DECODE_B1_TARGET = 0.70  # of the bandwidth bound, H200


Status = Literal["ok", "FAIL", "skipped"]
T = TypeVar("T")


@dataclass
class Run:
    """Where the check runs, and the summary lines so far."""

    smoke: bool
    device: str
    workdir: Path
    lines: list[tuple[str, Status, str]] = field(default_factory=list)

    def report(self, name: str, ok: bool, text: str) -> None:
        self._line(name, "ok" if ok else "FAIL", text)

    def skip(self, name: str, why: str) -> None:
        self._line(name, "skipped", why)

    def _line(self, name: str, status: Status, text: str) -> None:
        self.lines.append((name, status, text))
        print(f"{name}: {status}: {text}", flush=True)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.smoke else torch.bfloat16

    @property
    def dtype_name(self) -> Literal["float32", "bfloat16"]:
        return "float32" if self.smoke else "bfloat16"

    @property
    def backend(self) -> Literal["triton"]:
        # The Triton path everywhere: on CPU that is the interpreter (smoke only).
        return "triton"

    def engine_args(self, dtype: str = "float32", **overrides: Any) -> dict[str, Any]:
        """A correctness engine's configuration (`SMALL_ENGINE`), with `overrides`."""
        base = {"dtype": dtype, "device": self.device, "attention_backend": self.backend}
        return {**base, **SMALL_ENGINE, **overrides}


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


def info(text: str) -> None:
    """A line that is no check's verdict (indented: no summary line starts so)."""
    print(f"  ({text})", flush=True)


class TimedLLM:
    """An `LLM` whose construction and first use (a generate, or a forward) are timed and
    printed: on a cold Triton cache, or at a first CUDA graph capture, they hold the
    compile time."""

    def __init__(self, run: Run, label: str, model_dir: Path, **config: Any) -> None:
        from pdserve.engine import LLM

        self.run, self.label = run, label
        start = time.perf_counter()
        self.llm = LLM(model_dir, **config)
        synchronize(run.device)
        self.built_s = time.perf_counter() - start
        self.used = False

    def first(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`; timed and printed with the construction's time if it is the first use."""
        if self.used:
            return fn()
        start = time.perf_counter()
        out = fn()
        synchronize(self.run.device)
        self.used = True
        took = time.perf_counter() - start
        info(f"engine {self.label}: LLM() {self.built_s:.1f} s, first {what} {took:.1f} s")
        return out

    def generate(self, prompts: Sequence[list[int]], params: Any) -> list[Any]:
        return self.first("generate", lambda: self.llm.generate(list(prompts), params))

    def close(self) -> None:
        self.llm.engine.block_pool.check_no_leaks()
        self.llm.close()


def greedy(max_tokens: int, logprobs: int | None = None) -> Any:
    from pdserve.engine import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


# -- 1. kernels ---------------------------------------------------------------------


def check_kernels(run: Run) -> None:
    from pdserve.benchmarks import kernels_gpu

    suite = kernels_gpu.Suite(run.device, run.dtype, smoke=run.smoke)
    copy_bw = kernels_gpu.run_suite(suite)
    dtype = str(run.dtype).replace("torch.", "")
    correct = [line.text for line in suite.correct]
    run.report(
        "kernels",
        all(line.ok for line in suite.correct),
        f"{len(correct)} checks in {dtype}, err = max|out - ref| / max|ref| against float32: "
        + "; ".join(correct),
    )
    judged = "" if run.smoke else " (decode attention judged)"
    run.report(
        "kernels/speed",
        all(line.ok for line in suite.speed),
        f"copy {copy_bw / 1e9:.0f} GB/s{judged}; target "
        f"{kernels_gpu.DECODE_BANDWIDTH_TARGET:.0%} at B >= 32, ctx >= 4k | "
        + "; ".join(line.text for line in suite.speed),
    )
    firsts = ", ".join(f"{name} {s:.1f} s" for name, s in suite.first_calls.items())
    info(f"first kernel calls (a cold Triton cache compiles here): {firsts}")


# -- 2. parity ----------------------------------------------------------------------


def small_checkpoint(run: Run, init: float = PARITY_INIT) -> Path:
    """A random float32 Llama (GQA, 4,096 positions) with the demo tokenizer, via
    `transformers`, so that its own greedy tokens are the reference."""
    import transformers

    from pdserve.demo.model import write_random_model

    out = run.workdir / f"small-{init:g}"
    if (out / "config.json").is_file():
        return out
    tok_dir = run.workdir / "random"
    if not (tok_dir / "config.json").is_file():
        write_random_model(tok_dir)
    demo = json.loads((tok_dir / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=demo["vocab_size"],
        hidden_size=64 if run.smoke else 256,
        intermediate_size=128 if run.smoke else 512,
        num_hidden_layers=2 if run.smoke else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=init,
        bos_token_id=demo["bos_token_id"],
        eos_token_id=demo["eos_token_id"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out


def vocab_of(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def prompts(num: int, vocab: int, length: int = 24) -> list[list[int]]:
    """Distinct prompts, the first two sharing a block-aligned prefix (a prefix hit) when
    longer than one block."""
    out = [[3 + (7 * i + 11 * j) % (vocab - 3) for j in range(length + i)] for i in range(num)]
    if num > 1 and length > 16:
        out[1][:16] = out[0][:16]
    return out


@dataclass(frozen=True)
class Reference:
    """`transformers`' greedy tokens of one prompt, and at each step its top-2 logit gap
    and the two token ids."""

    tokens: list[int]
    gaps: list[float]
    top2: list[tuple[int, int]]


def hf_generate(
    model_dir: Path, device: str, dtype: torch.dtype, batch: list[list[int]], n: int
) -> list[Reference]:
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = loaded.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs
    outs = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            top = torch.stack(gen.scores)[:, 0].float().topk(2, dim=-1)
            gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
            ids2 = [(int(a), int(b)) for a, b in top.indices.tolist()]
            outs.append(Reference(gen.sequences[0, len(prompt) :].tolist(), gaps, ids2))
    return outs


def hf_greedy(model_dir: Path, device: str, batch: list[list[int]], n: int) -> list[list[int]]:
    """`transformers`' float32 greedy tokens: the reference exact parity asks for."""
    return [ref.tokens for ref in hf_generate(model_dir, device, torch.float32, batch, n)]


def check_parity(run: Run) -> None:
    model_dir = small_checkpoint(run)
    # In the interpreter every prompt token costs ~40 ms per case: the smoke keeps the
    # prefix hit and a prompt longer than the chunk (16 tokens), and no more.
    batch = prompts(2, vocab_of(model_dir), 17) if run.smoke else prompts(3, vocab_of(model_dir))
    ref = hf_greedy(model_dir, run.device, batch, MAX_NEW_TOKENS)
    cases: dict[str, dict[str, Any]] = {
        "prefix-cache": {"enable_prefix_caching": True},
        "no-prefix-cache": {"enable_prefix_caching": False},
        "chunked": {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
        "graphs": {"enforce_eager": False},
        "eager": {"enforce_eager": True},
    }
    results = []
    for name, kwargs in cases.items():
        llm = TimedLLM(run, f"parity/{name}", model_dir, **run.engine_args(**kwargs))
        got = [out.token_ids for out in llm.generate(batch, greedy(MAX_NEW_TOKENS))]
        llm.close()
        results.append((name, got == ref))
        del llm
    results.append(check_kv_tiers(run, model_dir, batch))
    ok = all(equal for _, equal in results)
    text = ", ".join(f"{name} {'equal' if equal else 'DIFFERS'}" for name, equal in results)
    run.report("parity", ok, f"{len(batch)} prompts x {MAX_NEW_TOKENS} tokens: {text}")


def check_kv_tiers(run: Run, model_dir: Path, batch: list[list[int]]) -> tuple[str, bool]:
    """The host and disk KV tiers (docs/kv-tiers.md): a pool of two blocks, every prompt
    twice round-robin, so that the second round's prefixes come back from host memory
    (pinned, on CUDA) and from the arena file. The parity prompts reversed: they share no
    first block, which would stay in the pool."""
    batch = [p[::-1] for p in batch]
    ref = hf_greedy(model_dir, run.device, batch, MAX_NEW_TOKENS)
    llm = TimedLLM(
        run,
        "parity/kv-tiers",
        model_dir,
        **run.engine_args(
            enable_prefix_caching=True,
            num_kv_blocks=2,  # one request: each evicts the one before it
            kv_host_gib=16 / 1024,
            kv_disk_dir=str(run.workdir / "kv-disk"),
            kv_disk_gib=16 / 1024,
        ),
    )
    got = [llm.generate([p], greedy(MAX_NEW_TOKENS))[0].token_ids for _ in range(2) for p in batch]
    hits = llm.llm.engine.load()["kv_host_hit_blocks"]
    llm.close()
    return f"kv-tiers ({hits} blocks back)", got == ref * 2 and hits > 0


# -- 3. parity in bf16 ----------------------------------------------------------------


@dataclass(frozen=True)
class MarginComparison:
    """One prompt's tokens against the reference's, decided where its gap is wide."""

    decided: int  # positions compared with the reference's gap >= the margin
    near_ties: int  # positions passed with a smaller gap (equal there, or where they part)
    parted_at_tie: bool  # the tokens parted at a near-tie: the comparison ended there
    differs_at: int | None  # a decided position whose tokens differ: the failure


def compare_with_margin(ours: Sequence[int], ref: Reference, margin: float) -> MarginComparison:
    """Walk the tokens while they agree (until then both saw the same context, so the
    reference's gap says how close the choice was): a difference where the gap is >=
    `margin` fails; one at a nearer tie ends the comparison (the contexts part there)."""
    decided = near_ties = 0
    for pos, (mine, theirs, gap) in enumerate(zip(ours, ref.tokens, ref.gaps, strict=True)):
        if gap < margin:
            near_ties += 1
            if mine != theirs:
                return MarginComparison(decided, near_ties, True, None)
        elif mine != theirs:
            return MarginComparison(decided, near_ties, False, pos)
        else:
            decided += 1
    return MarginComparison(decided, near_ties, False, None)


def gap_error(outs: Sequence[Any], refs: Sequence[Reference]) -> float:
    """The largest difference between our top-2 logit gap and the reference's, where our
    top 2 are its top 2 and the tokens so far agree: how much of the margin is used."""
    worst = 0.0
    for out, ref in zip(outs, refs, strict=True):
        for mine, theirs, lp, (first, second), gap in zip(
            out.token_ids, ref.tokens, out.logprobs, ref.top2, ref.gaps, strict=False
        ):
            top = dict(lp.top)
            if first in top and second in top:
                worst = max(worst, abs(top[first] - top[second] - gap))
            if mine != theirs:
                break
    return worst


def check_parity_bf16(run: Run) -> None:
    model_dir = small_checkpoint(run, CALM_INIT)
    num, tokens = (SMOKE_BF16_PROMPTS, MAX_NEW_TOKENS) if run.smoke else (BF16_PROMPTS, BF16_TOKENS)
    min_decided = SMOKE_BF16_MIN_DECIDED if run.smoke else BF16_MIN_DECIDED
    batch = prompts(num, vocab_of(model_dir))
    refs = hf_generate(model_dir, run.device, run.dtype, batch, tokens)
    llm = TimedLLM(run, "parity/bf16", model_dir, **run.engine_args(run.dtype_name))
    outs = llm.generate(batch, greedy(tokens, logprobs=2))
    llm.close()
    found = [
        compare_with_margin(out.token_ids, ref, BF16_GAP_MARGIN)
        for out, ref in zip(outs, refs, strict=True)
    ]
    decided = sum(c.decided for c in found)
    differs = [(i, c.differs_at) for i, c in enumerate(found) if c.differs_at is not None]
    ok = not differs and decided >= min_decided
    text = (
        f"{run.dtype_name}, {num} prompts x {tokens} tokens, margin {BF16_GAP_MARGIN}: "
        f"{decided} positions decided (need >= {min_decided}), "
        f"{sum(c.near_ties for c in found)} near-ties passed, "
        f"{sum(c.parted_at_tie for c in found)} prompts parted at a near-tie; "
        f"max |top-2 gap - reference's| {gap_error(outs, refs):.3f}"
    )
    if differs:
        text += "; DIFFERS at (prompt, position) " + ", ".join(map(str, differs))
    run.report("parity/bf16", ok, text)


# -- 4. int8 weights and 8-bit KV caches against the float path ------------------------


def teacher_forced(
    llm: TimedLLM, sequences: list[list[int]], prompt_lens: list[int]
) -> torch.Tensor:
    """[positions, vocab] float32: the logits that predict each generated token."""
    from pdserve.benchmarks.quantization import sequence_logits

    def forward() -> torch.Tensor:
        rows = [
            sequence_logits(llm.llm.engine, seq)[start - 1 : -1].float()
            for seq, start in zip(sequences, prompt_lens, strict=True)
        ]
        return torch.cat(rows)

    return llm.first("teacher-forced forward", forward)


def check_quant(run: Run) -> None:
    model_dir = small_checkpoint(run, CALM_INIT)
    # the interpreter pays per token of each teacher-forced prefill: shorter in smoke
    num, length = (SMOKE_QUANT_PROMPTS, 12) if run.smoke else (QUANT_PROMPTS, 24)
    tokens = MAX_NEW_TOKENS if run.smoke else QUANT_TOKENS
    batch = prompts(num, vocab_of(model_dir), length)
    lens = [len(p) for p in batch]
    # prefix caching off: `sequence_logits` prefills into the first blocks of an idle engine
    config = run.engine_args(run.dtype_name, enable_prefix_caching=False)
    base = TimedLLM(run, "quant/float", model_dir, **config)
    outs = base.generate(batch, greedy(tokens))
    sequences = [p + out.token_ids for p, out in zip(batch, outs, strict=True)]
    ref = teacher_forced(base, sequences, lens)
    base.close()
    parts, ok = [], True
    for name, (overrides, bound) in QUANT_BOUNDS.items():
        llm = TimedLLM(run, f"quant/{name}", model_dir, **{**config, **overrides})
        logits = teacher_forced(llm, sequences, lens)
        llm.close()
        agree = float((logits.argmax(-1) == ref.argmax(-1)).double().mean())
        err = float((logits - ref).abs().max())
        good = agree >= bound.min_agreement and err <= bound.max_logit_err
        ok = ok and good
        parts.append(
            f"{name} top-1 {agree:.1%} (>= {bound.min_agreement:.0%}), max |dlogit| "
            f"{err:.3f} (<= {bound.max_logit_err}){'' if good else ' MISSED'}"
        )
    run.report(
        "quant",
        ok,
        f"against {run.dtype_name} over {ref.shape[0]} teacher-forced positions "
        f"(logit std {float(ref.std()):.2f}): " + "; ".join(parts),
    )


# -- 5. speculative decoding ---------------------------------------------------------


def spec_prompts(llm: TimedLLM, vocab: int, num: int, tokens: int) -> list[list[int]]:
    """Half copy prompts (a seed S, the model's continuation T of it, S again: the model
    writes T again, which prompt lookup proposes from the prompt), half plain ones."""
    seeds = prompts(num, vocab, tokens)
    half = num // 2
    outs = llm.generate(seeds[:half], greedy(tokens))
    copies = [s + out.token_ids + s for s, out in zip(seeds[:half], outs, strict=True)]
    return copies + seeds[half:]


def spec_run(
    run: Run, label: str, model_dir: Path, spec: str, batch: list[list[int]], tokens: int
) -> Any:
    """(tokens of each prompt, the engine's speculative counters)."""
    llm = TimedLLM(run, label, model_dir, **run.engine_args(speculative=spec))
    got = [out.token_ids for out in llm.generate(batch, greedy(tokens))]
    stats = dataclasses.replace(llm.llm.engine.spec_stats())
    llm.close()
    return got, stats


def check_speculative(run: Run) -> None:
    from pdserve.benchmarks.speculative import first_layers

    model_dir = small_checkpoint(run, CALM_INIT)
    layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    draft = run.workdir / "draft"
    if not draft.is_dir():
        first_layers(model_dir, draft, layers // 2)
    # the interpreter pays per token of every verify row and draft forward: fewer in smoke
    tokens = SMOKE_SPEC_TOKENS if run.smoke else SPEC_TOKENS
    plain = TimedLLM(run, "speculative/plain", model_dir, **run.engine_args())
    batch = spec_prompts(plain, vocab_of(model_dir), 2 if run.smoke else 4, tokens)
    want = [out.token_ids for out in plain.generate(batch, greedy(tokens))]
    plain.close()
    # What each case must show besides the tokens, so that its path surely ran: how many
    # proposals a random model's prompt lookup or cut draft gets accepted is luck (often
    # none in smoke), the model as its own draft has every one accepted.
    cases = {
        "ngram": (NGRAM_SPEC, "verified"),
        f"draft={layers // 2} of {layers} layers": (f"draft:{draft},{DRAFT_OPTIONS}", "verified"),
        "draft=itself": (f"draft:{model_dir},{DRAFT_OPTIONS}", "accepted"),
    }
    parts, ok = [], True
    for name, (spec, must) in cases.items():
        got, stats = spec_run(run, f"speculative/{name}", model_dir, spec, batch, tokens)
        equal = got == want
        counts = {"verified": stats.proposed_tokens, "accepted": stats.accepted_tokens}
        ok = ok and equal and counts[must] > 0
        parts.append(
            f"{name} {'equal' if equal else 'DIFFERS'} (verified {counts['verified']}, "
            f"accepted {counts['accepted']}{'' if counts[must] else f': none {must}'})"
        )
    run.report(
        "speculative",
        ok,
        f"float32, {NGRAM_SPEC} / {DRAFT_OPTIONS}, {len(batch)} prompts x {tokens} tokens "
        "against plain greedy: " + "; ".join(parts),
    )


# -- 6. decode and prefill against their bounds --------------------------------------


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
    from pdserve.demo.dummy import LLAMA3_8B, TINY, write_config_only_model

    tok_dir = run.workdir / "random"
    if not (tok_dir / "tokenizer.json").is_file():
        from pdserve.demo.model import write_random_model

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
    from pdserve.common.engine_config import EngineConfig
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.llm_engine import LLMEngine

    model_dir = dummy_model_dir(run)
    batches = [1, 4] if run.smoke else [1, 64]
    prompt_len, steps = (16, 2) if run.smoke else (512, 32)
    prefill_len = 32 if run.smoke else 4096
    start = time.perf_counter()
    engine = LLMEngine(
        model_dir,
        EngineConfig(
            load_format="dummy",
            dtype=run.dtype_name,
            device=run.device,
            attention_backend=run.backend,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(prefill_len, max(batches) * prompt_len),
            max_model_len=max(prefill_len, prompt_len + steps) + 16,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.85 if not run.smoke else None,
        ),
    )
    synchronize(run.device)
    info(f"engine decode/prefill: LLMEngine() {time.perf_counter() - start:.1f} s")
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
        text = f"decode B={batch}: {batch / step_s:.0f} tok/s = {frac:.0%} of bandwidth"
        if batch == 1 and not run.smoke:
            ok = ok and frac >= DECODE_B1_TARGET
            text += f" (target {DECODE_B1_TARGET:.0%}{' met' if ok else ': MISSED'})"
        parts.append(text)
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
    engine.close()
    shape = f"{mc.num_layers}L h{mc.hidden_size} {engine.dtype}".replace("torch.", "")
    run.report(
        "decode/prefill",
        ok,
        f"{shape}, {engine.num_kv_blocks} KV blocks; copy {copy_bw / 1e9:.0f} GB/s, "
        f"matmul {flops / 1e12:.1f} TFLOP/s; " + "; ".join(parts),
    )


# -- 7. the disaggregated cluster on one device ---------------------------------------


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
    vocab = vocab_of(model_dir)
    batch = prompts(4, vocab)
    ref = hf_greedy(model_dir, run.device, batch, MAX_NEW_TOKENS)
    long_prompt = prompts(1, vocab, TRANSFER_PROMPT_LEN)[0]
    start = time.perf_counter()
    with cluster(str(model_dir), cluster_flags(run, transport)) as url:
        info(f"cluster/{transport}: ready in {time.perf_counter() - start:.1f} s")
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


# -- 8. tensor parallelism ----------------------------------------------------------


def check_tp(run: Run) -> None:
    model_dir = small_checkpoint(run)
    batch = prompts(2 if run.smoke else 4, vocab_of(model_dir))
    got = {}
    for size in (1, 2):
        llm = TimedLLM(run, f"tp/{size}", model_dir, **run.engine_args(tensor_parallel_size=size))
        got[size] = [out.token_ids for out in llm.generate(batch, greedy(MAX_NEW_TOKENS))]
        llm.close()
    equal = got[1] == got[2]
    where = "gloo on CPU" if run.smoke else "NCCL, 2 GPUs"
    run.report(
        "tp",
        equal,
        f"tensor_parallel_size=2 ({where}) {'equal to' if equal else 'DIFFERS from'} "
        f"TP=1, float32, {len(batch)} prompts x {MAX_NEW_TOKENS} tokens",
    )


# -- the checks, their order and their budget ---------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: its function, the summary lines it prints, and what it should take.

    `estimate_s`: seconds on an H200 with a warm Triton cache; `compile_s`: more on a cold
    one (its kernels' first variants compile); `smoke_s`: the smoke run on 2 shared CPU
    cores. The H200 figures are estimates from the work each check does, not yet
    measured: each run prints every check's time against its estimate to correct them.
    `min_gpus`: CUDA devices it needs (the smoke run needs none: gloo on CPU).
    """

    key: str
    fn: Callable[[Run], None]
    labels: tuple[str, ...]
    estimate_s: float
    compile_s: float
    smoke_s: float
    min_gpus: int = 1

    def expected_s(self, smoke: bool, cold: bool) -> float:
        if smoke:
            return self.smoke_s
        return self.estimate_s + (self.compile_s if cold else 0.0)


CHECKS: tuple[Check, ...] = (
    Check("kernels", check_kernels, ("kernels", "kernels/speed"), 45, 60, 8),
    Check("parity", check_parity, ("parity",), 30, 30, 12),
    Check("bf16", check_parity_bf16, ("parity/bf16",), 15, 20, 5),
    Check("quant", check_quant, ("quant",), 25, 40, 12),
    Check("speculative", check_speculative, ("speculative",), 25, 20, 14),
    Check("grpc", lambda run: check_cluster(run, "grpc"), ("cluster/grpc",), 60, 20, 20),
    Check("decode", check_decode_prefill, ("decode/prefill",), 45, 30, 5),
    Check("ucx", lambda run: check_cluster(run, "ucx"), ("cluster/ucx",), 60, 10, 25),
    Check("tp", check_tp, ("tp",), 25, 20, 13, min_gpus=2),
)


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (TRITON_CACHE_DIR, else its default)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton < 3.4 has no knobs
        default = Path.home() / ".triton" / "cache"
        return Path(os.environ.get("TRITON_CACHE_DIR", default))


def describe_triton_cache(smoke: bool) -> bool:
    """Print the cache's location and state; True if cold (nothing compiled there yet)."""
    if smoke:
        print("gpu_check: Triton in the interpreter (TRITON_INTERPRET=1): nothing compiles")
        return False
    where = triton_cache_dir()
    entries = sum(1 for _ in where.iterdir()) if where.is_dir() else 0
    state = f"warm, {entries} entries" if entries else "cold: every first kernel call compiles"
    print(f"gpu_check: Triton cache {where} ({state})", flush=True)
    return entries == 0


def run_one(run: Run, check: Check) -> None:
    gc.collect()  # each check's engines gone, and on CUDA their cached memory
    if run.device == "cuda":  # (a cluster's replicas size their KV pools from free memory)
        torch.cuda.empty_cache()
    before = len(run.lines)
    try:
        check.fn(run)
    except Exception as exc:  # one broken check must not hide the others' lines
        done = {name for name, _, _ in run.lines[before:]}
        for label in check.labels:
            if label not in done:
                run.report(label, False, f"{type(exc).__name__}: {exc}")


def run_checks(run: Run, checks: Sequence[Check], budget_s: float, cold: bool) -> None:
    """Run `checks` in order while each is expected to end within the budget."""
    started = time.monotonic()
    spent = expected = 0.0
    for i, check in enumerate(checks):
        # the finished checks' overrun (a slower machine, more to compile) applies ahead
        if not run.smoke and torch.cuda.device_count() < check.min_gpus:
            for label in check.labels:
                run.skip(label, "one GPU")
            continue
        slowdown = max(1.0, spent / expected) if expected else 1.0
        need = check.expected_s(run.smoke, cold) * slowdown
        left = budget_s - (time.monotonic() - started)
        if need > left:
            info(f"budget: {check.key} needs ~{need:.0f} s, {max(left, 0):.0f} s left")
            for rest in checks[i:]:
                for label in rest.labels:
                    run.skip(label, "out of budget")
            return
        start = time.monotonic()
        run_one(run, check)
        took = time.monotonic() - start
        spent += took
        expected += check.expected_s(run.smoke, cold)
        info(f"{check.key}: {took:.0f} s, estimated {check.expected_s(run.smoke, cold):.0f} s")


def summary(run: Run, started: float) -> int:
    failed = [name for name, status, _ in run.lines if status == "FAIL"]
    skipped = [name for name, status, _ in run.lines if status == "skipped"]
    checked = len(run.lines) - len(skipped)
    print(
        f"gpu_check: {checked} checks, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
        + f", {len(skipped)} skipped, {time.monotonic() - started:.0f} s"
    )
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    keys = [check.key for check in CHECKS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument(
        "--only", default=",".join(keys), help=f"comma list of checks ({', '.join(keys)})"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="start no check expected to end later than this many seconds after the start",
    )
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(keys))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {keys}")
    return args


def main(argv: list[str] | None = None) -> int:
    print_machine()  # the CPU and its flags, with every figure
    started = time.monotonic()
    args = parse_args(argv)
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
    cold = describe_triton_cache(args.smoke)
    torch.manual_seed(0)
    checks = [check for check in CHECKS if check.key in args.only]
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        run = Run(args.smoke, device, Path(tmp))
        run_checks(run, checks, args.budget_s - (time.monotonic() - started), cold)
    return summary(run, started)


if __name__ == "__main__":
    sys.exit(main())
