"""An engine warmed up compiles no kernel variant while it serves (kernels/_variants.py).

Under Triton's interpreter nothing compiles, but every launch is keyed as Triton's JIT keys
its cache (constexprs, dtypes, options and Triton's own specialisation of ints and
pointers), so a key first seen after the warm-up is exactly a compile a GPU would do
mid-serving. The engine here is a tiny float32 model on the Triton backend, serving
prompts of many lengths with chunked prefill: the steps' query lengths, context lengths,
block-table widths and decode batch sizes all vary.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from pdserve.benchmarks.bench_report import parse_scrape, sample
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.engine import LLM, SamplingParams
from pdserve.kernels import _variants, paged_decode_attention
from pdserve.kernels._variants import VariantKey, VariantRegistry
from pdserve.router.metrics import RouterMetrics

# The CPU engine's Triton path runs only in the interpreter; on a GPU the same keys are
# real compiles (tests/kernels/test_variants.py pins them to Triton's own).
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "yes", "on"),
    reason="the Triton path on CPU runs only in Triton's interpreter (tests/conftest.py)",
)
BLOCK_SIZE = 16
BUDGET = 32  # tokens per step: longer prompts prefill in chunks
# Requests served one wave after another: (prompt length, tokens to generate). Short
# prompts alone decode over one block; a mixed batch prefills chunks of every length
# beside decodes of 1-5 blocks; a long prompt alone decodes over 8 blocks.
WAVES = (((4, 3), (6, 2)), ((3, 4), (9, 2), (17, 3), (30, 2), (45, 3), (70, 2)), ((120, 2),))


class RecordingRegistry(VariantRegistry):
    """A registry that also lists every launch's key: which variants a phase used."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[VariantKey] = []

    def record(self, key: VariantKey) -> bool:
        self.launched.append(key)
        return super().record(key)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> RecordingRegistry:
    """A fresh process registry: keys other tests launched would hide a missed warm-up."""
    fresh = RecordingRegistry()
    monkeypatch.setattr(_variants, "REGISTRY", fresh)
    return fresh


def _values(keys: set[VariantKey], kernel: str, name: str) -> set[Any]:
    return {key.value(name) for key in keys if key.kernel == kernel}


def test_warmed_engine_serves_varied_steps_without_new_variants(
    make_checkpoint: Any, registry: RecordingRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Splits from 16-token contexts (not 256): the interpreter serves short prompts only.
    monkeypatch.setattr(paged_decode_attention, "_MIN_TOKENS_PER_SPLIT", 16)
    llm = LLM(
        make_checkpoint(num_layers=1),
        dtype="float32",
        attention_backend="triton",
        device="cpu",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=BUDGET,
    )
    engine = llm.engine
    plan = engine.runner.warm_up_kernels(engine.max_model_len, BUDGET)
    assert plan is not None and registry.ready
    warmed = registry.seen()
    # every split count the heuristic can pick here, and both query tiles of fp32
    assert _values(warmed, "_paged_decode_kernel", "NUM_SPLITS") == {1, 2, 4, 8}
    assert _values(warmed, "_paged_prefill_kernel", "BLOCK_M") == {16, 32}
    registry.launched.clear()

    for wave in WAVES:
        prompts = [[5 + i for i in range(n)] for n, _ in wave]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in wave]
        outputs = llm.generate(prompts, params)
        assert [len(out.token_ids) for out in outputs] == [m for _, m in wave]

    used = set(registry.launched)
    # the steps really varied: every split count and both query tiles
    assert _values(used, "_paged_decode_kernel", "NUM_SPLITS") == {1, 2, 4, 8}
    assert _values(used, "_paged_prefill_kernel", "BLOCK_M") == {16, 32}
    assert used <= warmed
    assert registry.compiles_after_ready == 0
    assert engine.load()["kernel_compiles_after_ready"] == 0

    # A launch outside the warmed set counts, in the engine's load too: 3 splits is no
    # bucket of the heuristic's (a new decode variant, and a new merge of its splits).
    k_cache, v_cache = engine.runner.kv_caches[0]
    q = torch.zeros(1, 4, k_cache.shape[-1])
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    paged_decode_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, num_splits=3
    )
    late = [(key.kernel, key.value("NUM_SPLITS")) for key in registry.late_keys]
    assert late == [("_paged_decode_kernel", 3), ("_reduce_splits_kernel", 3)]
    load = engine.load()
    assert load["kernel_compiles_after_ready"] == 2
    # as a worker heartbeats it, the router's scrape shows it (runtime/replica.py index_load)
    worker = WorkerInfo("w0", "decode", "", load=load)
    scrape = parse_scrape(RouterMetrics().render({"m": [worker]}).decode())
    assert sample(scrape, "pdserve_worker_kernel_compiles_after_ready", worker="w0") == 2


def test_a_new_variant_after_ready_is_counted_once_and_logged(
    registry: RecordingRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    from pdserve.kernels.rms_norm import rms_norm

    weight = torch.randn(64)
    rms_norm(torch.randn(3, 64), weight, 1e-6)  # before ready: never counted
    registry.mark_ready()
    rms_norm(torch.randn(5, 64), weight, 1e-6)  # other rows, the same variant
    with registry.warming():
        rms_norm(torch.randn(2, 64, dtype=torch.float64), weight.double(), 1e-6)
    assert registry.compiles_after_ready == 0
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels._variants"):
        for _ in range(2):
            rms_norm(torch.randn(3, 64, dtype=torch.float16), weight.half(), 1e-6)
    assert registry.compiles_after_ready == 1
    (message,) = [r.getMessage() for r in caplog.records]
    assert "_rms_norm_kernel" in message and "x_ptr:*fp16" in message
