"""Decode steps through the CUDA graph runner's padded static buffers
(engine/worker/cuda_graphs.py).

On CPU the runner works in eager replay mode: the same static buffers and padding rows,
the captured callable called directly. The Triton kernels then run in Triton's
interpreter (tests/conftest.py), so the model is tiny and the steps few. With a GPU the
same checks run against really captured graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.modeling.attention import TorchAttentionBackend
from pdserve.engine.modeling.triton_backend import TritonAttentionBackend
from pdserve.engine.sched.scheduler import SchedulerOutput
from pdserve.engine.worker.cuda_graphs import (
    CudaGraphRunner,
    capture_sizes,
    cuda_graphs_enabled,
    padded_size,
)
from pdserve.engine.worker.model_runner import ModelRunner, StepResult

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHARED = list(range(10, 30))  # one full block of 16 and a partial one
# 3 sequences: decode batches 3, 3, 2, 1 -> padded to 4, 4, 2, 1; the second prompt
# shares the first's first block (a prefix-cache hit once it is cached).
THREE = ([SHARED, [*SHARED, 7, 8, 9], [5, 6, 7]], [5, 4, 3])
# 5 sequences: decode batches 5, 3, 3, 1 -> padded to 8, 4, 4, 1 (row 3 held a real row
# the step before it is padding).
FIVE = (
    [SHARED, [*SHARED, 7, 8, 9], [5, 6, 7], [40, 41, 42, 43, 44], [SHARED[0], 99]],
    [2, 2, 4, 4, 5],
)
# Budget 4 (chunked prefill): while 3 sequences decode, the last prompt advances one
# token a step, a non-sampling row of a decode-only step (5 such steps, padded to 4);
# its 2-token chunks make mixed steps, which run eagerly.
CHUNKED = ([[5, 6, 7], [8, 9, 10], [11, 12, 13], list(range(20, 27))], [8, 8, 8, 3])
GRAPH_BATCH = 8
# A fixed pool: on CUDA the engine would otherwise take 90% of the GPU for each LLM.
KV_BLOCKS = 128


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 35
    assert sizes[3:] == list(range(8, 257, 8))
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size() -> None:
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        20,
        20,
    ]
    assert padded_size(21, sizes) is None


def test_cuda_graphs_enabled_only_on_cuda_with_triton() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton, plain = TritonAttentionBackend(), TorchAttentionBackend()
    assert cuda_graphs_enabled(False, cuda, triton)
    assert not cuda_graphs_enabled(True, cuda, triton)  # enforce_eager
    assert not cuda_graphs_enabled(False, cpu, triton)
    assert not cuda_graphs_enabled(False, cuda, plain)


def test_graph_runner_refuses_other_backends_and_cpu_graphs(make_checkpoint: Any) -> None:
    llm = LLM(make_checkpoint(), dtype="float32", attention_backend="torch")
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="Triton"):
        runner.capture_cuda_graphs(GRAPH_BATCH, llm.engine.max_model_len, use_cuda_graph=False)
    runner.backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="CUDA"):
        runner.capture_cuda_graphs(GRAPH_BATCH, llm.engine.max_model_len, use_cuda_graph=True)
    assert runner.graphs is None


def _llm(model_dir: Any, graphs: str, **kwargs: Any) -> LLM:
    """`eager`: no graph runner; `replay`: eager replay (CPU); `cuda`: captured graphs."""
    if graphs == "cuda":
        llm = LLM(
            model_dir,
            dtype="float32",
            device="cuda",
            max_cuda_graph_batch_size=GRAPH_BATCH,
            num_kv_blocks=KV_BLOCKS,
            **kwargs,
        )
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.use_cuda_graph
        return llm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(
        model_dir,
        dtype="float32",
        device=device,
        attention_backend="triton",
        enforce_eager=True,
        num_kv_blocks=KV_BLOCKS,
        **kwargs,
    )
    assert llm.engine.runner.graphs is None
    if graphs == "replay":
        engine = llm.engine
        engine.runner.capture_cuda_graphs(GRAPH_BATCH, engine.max_model_len, use_cuda_graph=False)
    return llm


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params)
    llm.engine.block_pool.check_no_leaks()
    assert [len(out.token_ids) for out in outs] == max_tokens
    if llm.engine.config.enable_prefix_caching:
        # the second prompt decodes over the first's cached block
        assert outs[1].num_cached_tokens == 16
    return [out.token_ids for out in outs]


def _check_padding(runner: ModelRunner) -> Callable[[SchedulerOutput], StepResult]:
    """`runner.execute`, checking every graph step: the KV cache changes only in the
    slots of the step's real rows, and the buffers' padding rows hold padding."""
    execute = runner.execute

    def checked(out: SchedulerOutput) -> StepResult:
        graphs = runner.graphs
        assert graphs is not None
        steps_before = sum(graphs.steps.values())
        before = runner.kv_cache.clone()
        result = execute(out)
        if sum(graphs.steps.values()) == steps_before:
            return result  # an eager step (prefill rows)
        bs = runner.block_size
        written = {
            item.seq.blocks[item.start // bs].block_id * bs + item.start % bs
            for item in out.decodes
        }
        # [layers, 2, blocks, KVH, block_size, D] -> which (block, offset) changed
        changed = (runner.kv_cache != before).any(dim=5).any(dim=3).any(dim=1).any(dim=0)
        changed_slots = {int(s) for s in changed.flatten().nonzero().flatten().tolist()}
        assert changed_slots == written
        num_rows = len(out.decodes)
        size = padded_size(num_rows, graphs.sizes)
        assert size is not None
        assert graphs.slot_mapping[num_rows:size].eq(-1).all()
        assert graphs.context_lens[num_rows:size].eq(1).all()
        assert graphs.block_tables[num_rows:size, 0].eq(0).all()
        assert graphs.input_ids[num_rows:size].eq(0).all()
        assert graphs.positions[num_rows:size].eq(0).all()
        return result

    return checked


@pytest.mark.parametrize(
    "graphs", ["replay", pytest.param("cuda", marks=needs_cuda)], ids=["eager-replay", "cuda"]
)
@pytest.mark.parametrize(
    ("case", "padded", "engine_kwargs"),
    [
        (THREE, {4: 2, 2: 1, 1: 1}, {"enable_prefix_caching": True}),
        (FIVE, {8: 1, 4: 2, 1: 1}, {"enable_prefix_caching": True}),
        (
            CHUNKED,
            {4: 5, 2: 1, 1: 1},
            {"enable_prefix_caching": False, "max_num_batched_tokens": 4},
        ),
    ],
    ids=["3-padded-to-4", "5-padded-to-8", "chunked"],
)
def test_padded_decode_tokens_equal_eager(
    make_checkpoint: Any,
    monkeypatch: pytest.MonkeyPatch,
    graphs: str,
    case: tuple[list[list[int]], list[int]],
    padded: dict[int, int],
    engine_kwargs: dict[str, Any],
) -> None:
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    prompts, max_tokens = case
    expected = _generate(_llm(model_dir, "eager", **engine_kwargs), prompts, max_tokens)

    llm = _llm(model_dir, graphs, **engine_kwargs)
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "execute", _check_padding(runner))
    assert _generate(llm, prompts, max_tokens) == expected
    assert runner.graphs is not None
    assert dict(runner.graphs.steps) == padded


def test_run_resets_stale_rows_and_rejects_what_does_not_fit(make_checkpoint: Any) -> None:
    llm = _llm(make_checkpoint(), "replay")
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, CudaGraphRunner)
    width = graphs.max_blocks_per_seq
    # Padding rows only (slot -1): nothing is written, whatever the tables say.
    before = llm.engine.runner.kv_cache.clone()
    logits = graphs.run([1] * 5, [3] * 5, [-1] * 5, [[1, 2]] * 5, [4] * 5)
    assert logits.shape == (5, llm.engine.model_config.vocab_size)
    assert torch.equal(llm.engine.runner.kv_cache, before)
    assert graphs.block_tables[:5, :2].eq(torch.tensor([1, 2], dtype=torch.int32)).all()
    graphs.run([1] * 3, [3] * 3, [-1] * 3, [[4]] * 3, [2] * 3)
    assert graphs.block_tables[:3, 0].eq(4).all()
    assert graphs.block_tables[3, 0] == 0 and graphs.context_lens[3] == 1
    assert graphs.slot_mapping[3] == -1 and graphs.input_ids[3] == 0
    assert dict(graphs.steps) == {8: 1, 4: 1}
    assert not graphs.fits(GRAPH_BATCH + 1, 1)
    assert not graphs.fits(1, width * graphs.block_size + 1)
    assert graphs.fits(GRAPH_BATCH, width * graphs.block_size)
    with pytest.raises(ValueError, match="do not fit"):
        graphs.run([1] * 9, [0] * 9, [-1] * 9, [[0]] * 9, [1] * 9)


@needs_cuda
def test_cuda_graphs_captured_at_engine_start(make_checkpoint: Any) -> None:
    model_dir = make_checkpoint()
    kwargs: dict[str, Any] = {"device": "cuda", "dtype": "float32", "num_kv_blocks": KV_BLOCKS}
    llm = LLM(model_dir, max_cuda_graph_batch_size=20, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.use_cuda_graph
    assert sorted(graphs._graphs) == capture_sizes(20)
    eager = LLM(model_dir, enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    small = LLM(model_dir, max_num_seqs=3, **kwargs)
    assert small.engine.runner.graphs is not None
    assert small.engine.runner.graphs.sizes == [1, 2, 3]  # never past max_num_seqs


def test_enforce_eager_reaches_the_engine_from_the_cluster_and_the_cli(
    make_checkpoint: Any,
) -> None:
    from pdserve.cluster.config import ClusterConfig
    from pdserve.deploy.cli import build_parser

    model = str(make_checkpoint())
    assert ClusterConfig(model=model).engine_config().enforce_eager is False
    assert ClusterConfig(model=model, enforce_eager=True).engine_config().enforce_eager is True
    parser = build_parser()
    assert parser.parse_args(["up", "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["up"]).enforce_eager is False
