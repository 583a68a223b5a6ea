"""Tensor parallelism offline: 2 ranks on the CPU over gloo, float32 (engine/worker/parallel.py).

Greedy tokens at TP=2 equal `transformers`' on GQA, MQA (the KV head replicated), Qwen2
with biases and tied embeddings, with prefix caching and with forced chunked prefill;
logits at TP=2 match TP=1; each rank holds 1/2 of the sharded weights; worker processes
never outlive the engine; a stalled or dead rank fails the driver within the timeout.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.errors import UnsupportedModelError
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.parallel import TensorParallelError

MAX_TOKENS = 16
# Small pools: every rank allocates its KV slice up front.
BASE = {"dtype": "float32", "num_kv_blocks": 128}

CHECKPOINTS: list[tuple[str, dict[str, Any]]] = [
    ("gqa-2kv", {"num_heads": 4, "num_kv_heads": 2}),
    ("mqa", {"num_heads": 4, "num_kv_heads": 1}),
    ("qwen2-bias", {"arch": "qwen2", "num_heads": 4, "num_kv_heads": 2}),
    ("tied", {"num_heads": 4, "num_kv_heads": 2, "tie_word_embeddings": True}),
    # several safetensors files: each rank reads its slices across them
    ("sharded-files", {"num_heads": 8, "num_kv_heads": 2, "head_dim": 16, "shard": True}),
]
MODES: dict[str, dict[str, Any]] = {
    "prefix-cache": {"enable_prefix_caching": True},
    "chunked-prefill": {"max_num_batched_tokens": 8, "block_size": 4},
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """6 prompts; three share a 40-token prefix (cached blocks), one is a single token."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731 - skip specials
    shared = ids(40)
    return [shared + ids(7), shared + ids(1), shared, ids(1), ids(30), ids(66)]


@contextmanager
def llm(model_dir: Path, **config: Any) -> Iterator[LLM]:
    engine = LLM(model_dir, **{**BASE, **config})
    try:
        yield engine
    finally:
        engine.close()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie or a missing process does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def record_logits(engine: LLM) -> list[torch.Tensor]:
    """Every logits tensor the driver's sampler sees, in step order."""
    runner = engine.engine.runner
    seen: list[torch.Tensor] = []
    sample = runner.sampler

    def recording(logits: torch.Tensor, *args: Any) -> Any:
        seen.append(logits.clone())
        return sample(logits, *args)

    runner.sampler = recording  # type: ignore[assignment]
    return seen


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def checkpoint(
    request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path], hf_greedy: Any
) -> tuple[Path, list[list[int]]]:
    model_dir = make_checkpoint(**request.param[1])
    return model_dir, hf_greedy(model_dir, make_prompts(), MAX_TOKENS)


@pytest.mark.parametrize("mode", list(MODES))
def test_tp2_greedy_tokens_equal_transformers(
    checkpoint: tuple[Path, list[list[int]]], mode: str
) -> None:
    model_dir, expected = checkpoint
    with llm(model_dir, tensor_parallel_size=2, **MODES[mode]) as engine:
        # Twice: the second round reads every prompt's full blocks from the prefix cache.
        for round_ in range(2):
            outs = engine.generate(make_prompts(), GREEDY)
            for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
                assert out.token_ids == ref, f"prompt {i} diverged ({mode}, round {round_})"
        assert outs[-1].num_cached_tokens > 0  # the 66-token prompt, in round 2


@pytest.mark.parametrize("kwargs", [CHECKPOINTS[0][1], CHECKPOINTS[1][1]], ids=["gqa", "mqa"])
def test_tp2_logits_match_tp1_and_weights_are_halved(
    make_checkpoint: Callable[..., Path], kwargs: dict[str, Any]
) -> None:
    model_dir = make_checkpoint(**kwargs)
    runs = {}
    for tp in (1, 2):
        with llm(model_dir, tensor_parallel_size=tp, **MODES["chunked-prefill"]) as engine:
            logits = record_logits(engine)
            tokens = [o.token_ids for o in engine.generate(make_prompts(), GREEDY)]
            runs[tp] = (tokens, logits, engine.engine.parallel_stats())
    (tokens1, logits1, stats1), (tokens2, logits2, stats2) = runs[1], runs[2]
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1)
    for step, (a, b) in enumerate(zip(logits1, logits2, strict=True)):
        assert b.shape == a.shape
        assert torch.allclose(a, b, atol=1e-4, rtol=0), f"step {step}: {(a - b).abs().max()}"

    # Criterion 2, from parameter bytes per rank: each holds half of the sharded weights.
    (whole,) = stats1.ranks
    assert stats2.tensor_parallel_size == 2 and len(stats2.ranks) == 2
    cfg = _config(model_dir)
    # With one KV head for two ranks, each rank holds the K/V projections whole.
    kv_proj = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * cfg["hidden_size"] * 4
    replicated_kv = cfg["num_hidden_layers"] * kv_proj if cfg["num_key_value_heads"] < 2 else 0
    for rank in stats2.ranks:
        assert rank.sharded_weight_bytes * 2 == whole.sharded_weight_bytes - replicated_kv
        assert rank.replicated_weight_bytes == whole.replicated_weight_bytes + replicated_kv
        assert rank.weight_bytes == rank.sharded_weight_bytes + rank.replicated_weight_bytes
        # Each rank's KV cache: its KV heads of the same 128 blocks.
        kv_heads = max(cfg["num_key_value_heads"] // 2, 1)
        assert rank.kv_cache_bytes == whole.kv_cache_bytes * kv_heads // cfg["num_key_value_heads"]
    # The step metrics: the driver timed its all-reduces (1 + 2 per layer per step).
    assert stats2.steps >= len(logits2)  # chunk-only steps sample nothing
    assert stats2.all_reduces == stats2.steps * (1 + 2 * cfg["num_hidden_layers"])
    assert 0 < stats2.all_reduce_s_per_step <= stats2.collective_s_per_step
    assert stats1.steps == 0 and stats1.all_reduce_s == 0


def _config(model_dir: Path) -> dict[str, Any]:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def test_tp3_pads_the_vocabulary_and_replicates_the_kv_head(
    make_checkpoint: Callable[..., Path], hf_greedy: Any
) -> None:
    """512 ids over 3 ranks (171, 171, 170 + a zero row); one KV head on 3 ranks."""
    model_dir = make_checkpoint(
        hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16, intermediate_size=96
    )
    prompts = make_prompts()[:4]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    with llm(model_dir, tensor_parallel_size=3) as engine:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp"),
    [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 2, 8), (8, 8, 4), (12, 3, 6), (6, 3, 3)],
)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(
    heads: int, kv_heads: int, tp: int
) -> None:
    from pdserve.common.model_config import ModelConfig, RopeConfig
    from pdserve.engine.worker.parallel import TPShard, check_tensor_parallel

    cfg = ModelConfig(
        "LlamaForCausalLM", 512, 64, 96, 2, heads, kv_heads, 16, 1e-5, RopeConfig(1e4),
        1024, False, False, False, False, "float32", None, None, (),
    )  # fmt: skip
    check_tensor_parallel(cfg, tp)
    covered: set[int] = set()
    for rank in range(tp):
        shard = TPShard(cfg, rank, tp)
        h0, h1 = shard.head_range
        k0, k1 = shard.kv_head_range
        assert (h1 - h0, k1 - k0) == (shard.num_heads, shard.num_kv_heads)
        group = shard.num_heads // shard.num_kv_heads  # as attention groups the local heads
        for j in range(shard.num_heads):
            # transformers' repeat_kv: query head h reads KV head h // (H / KVH).
            assert k0 + j // group == (h0 + j) // (heads // kv_heads)
        covered.update(range(h0, h1))
    assert covered == set(range(heads))


def test_bad_tensor_parallel_size_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint(num_heads=4, num_kv_heads=2)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=3 cannot shard"):
        LLM(model_dir, tensor_parallel_size=3, **BASE)


def gone(pids: list[int]) -> bool:
    """A `poll` check: none of `pids` runs."""
    return not any(alive(pid) for pid in pids)


def test_workers_stop_on_close(make_checkpoint: Callable[..., Path], poll: Any) -> None:
    with llm(make_checkpoint(), tensor_parallel_size=2) as engine:
        pids = engine.engine.tp_workers.pids  # type: ignore[union-attr]
        assert len(pids) == 1 and all(alive(pid) for pid in pids)
        engine.generate([[5, 6, 7]], GREEDY)
    poll(f"workers {pids} stop with their engine", lambda: gone(pids), 1.0)


# An engine left open at exit, or a driver killed outright: no worker survives it.
_SCRIPT = """
import os, signal, sys
from pdserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
print("PIDS", *llm.engine.tp_workers.pids, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_orphan_workers(make_checkpoint: Callable[..., Path], how: str, poll: Any) -> None:
    argv = [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(make_checkpoint()), how]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == (-signal.SIGKILL if how == "kill" else 0), proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert pids
    poll(f"workers {pids} gone with the driver ({how})", lambda: gone(pids), 15.0)


def test_stalled_rank_times_out_instead_of_hanging(
    make_checkpoint: Callable[..., Path], poll: Any
) -> None:
    timeout_s = 3.0
    with llm(make_checkpoint(), tensor_parallel_size=2, distributed_timeout_s=timeout_s) as engine:
        (pid,) = engine.engine.tp_workers.pids  # type: ignore[union-attr]
        engine.generate([[5, 6, 7]], GREEDY)
        os.kill(pid, signal.SIGSTOP)  # alive, but never answers
        try:
            start = time.monotonic()
            with pytest.raises(TensorParallelError, match="distributed_timeout_s"):
                engine.generate([[8, 9, 10]], GREEDY)
            assert time.monotonic() - start < timeout_s + 10
        finally:
            with contextlib.suppress(ProcessLookupError):  # the driver killed it: expected
                os.kill(pid, signal.SIGCONT)
        with pytest.raises(TensorParallelError):  # the engine stays failed
            engine.generate([[8, 9, 10]], GREEDY)
    poll(f"the stalled rank {pid} is killed", lambda: gone([pid]), 15.0)


def test_dead_rank_fails_the_driver(make_checkpoint: Callable[..., Path], poll: Any) -> None:
    with llm(make_checkpoint(), tensor_parallel_size=2, distributed_timeout_s=5.0) as engine:
        (pid,) = engine.engine.tp_workers.pids  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        poll(f"the killed rank {pid} is gone", lambda: gone([pid]), 15.0)
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            engine.generate([[8, 9, 10]], GREEDY)
        assert time.monotonic() - start < 5.0 + 10


class _FakeEvent:
    """A CUDA event's timing API: done once `done` is set, `ms` after the start event."""

    def __init__(self, ms: float = 1.0) -> None:
        self.ms = ms
        self.done = True
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.ms


def test_every_rank_lets_its_collective_events_go() -> None:
    """A rank times its collectives with CUDA events (two per collective, ~130 a step for
    32 layers) and only the driver ever reads the times: each step must let the finished
    ones go, on every rank, or they pile up without bound. CPU stand-ins for the events
    drive `TPGroup`'s bookkeeping (the CUDA path itself needs a GPU: gpu_check's TP
    check)."""
    from pdserve.engine.worker.parallel import MAX_PENDING_EVENTS, CollectiveTimes, TPGroup

    group = object.__new__(TPGroup)
    group._times = CollectiveTimes()
    for _step in range(50):
        for _ in range(64):
            group._times._pending.append(("all_reduce", _FakeEvent(), _FakeEvent()))  # type: ignore[arg-type]
        group.count_step()
        assert len(group._times._pending) == 0
    assert group._times.all_reduce_s == pytest.approx(50 * 64 / 1000)
    # events still running stay, up to the bound; past it the oldest are waited for
    running = [_FakeEvent() for _ in range(MAX_PENDING_EVENTS + 10)]
    for event in running:
        event.done = False
        group._times._pending.append(("broadcast", _FakeEvent(), event))  # type: ignore[arg-type]
    group.count_step()
    assert len(group._times._pending) == MAX_PENDING_EVENTS
    assert [e.waited for e in running[:12]] == [True] * 10 + [False] * 2
    assert group.times().steps == 51 and not group._times._pending
