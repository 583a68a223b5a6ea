"""The KV pool sized from the device's memory (`gpu_memory_utilization`, as vLLM's).

The arithmetic is pure; the measurement sits behind a `MemoryReader`, so these tests run
the engine's whole profile -> size path on CPU (the CPU twin of the CUDA path): a fake
reader reports the device's numbers while the engine really loads the model and runs
its profile steps through its `ModelRunner`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.cluster.config import ClusterConfig
from pdserve.common.engine_config import EngineConfig
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sched.kv_cache_manager import cdiv
from pdserve.engine.sched.scheduler import SchedulerOutput
from pdserve.engine.worker.memory_profile import (
    DeviceMemory,
    kv_blocks_for_memory,
    profile_batches,
)
from pdserve.engine.worker.model_runner import ModelRunner, StepResult

GIB = 1 << 30
MIB = 1 << 20
STEP_TOKENS = 256
MAX_SEQS = 16
# The random model (tests/conftest.py): 4 layers, 2 KV heads of 32, float32, 2048 positions.
BLOCK_BYTES = 16 * 2 * 4 * 2 * 32 * 4
MAX_POSITIONS = 2048


class FakeReader:
    """Device numbers as a test sets them; records the calls into `log`."""

    def __init__(
        self, start: DeviceMemory, end: DeviceMemory, peak: int, log: list[str] | None = None
    ) -> None:
        self.snapshots = [start, end]
        self.peak = peak
        self.log = [] if log is None else log

    def snapshot(self) -> DeviceMemory:
        self.log.append("snapshot")
        return self.snapshots[self.log.count("snapshot") - 1]

    def reset_peak(self) -> None:
        self.log.append("reset_peak")

    def peak_allocated(self) -> int:
        self.log.append("peak_allocated")
        return self.peak


class UnusedReader:
    def snapshot(self) -> DeviceMemory:
        raise AssertionError("the configuration sizes this pool: nothing to measure")

    def reset_peak(self) -> None:
        raise AssertionError("the configuration sizes this pool: nothing to measure")

    def peak_allocated(self) -> int:
        raise AssertionError("the configuration sizes this pool: nothing to measure")


def device(total: int, free: int, reserved: int = 0, allocated: int = 0) -> DeviceMemory:
    return DeviceMemory(
        total_bytes=total,
        free_bytes=free,
        torch_reserved_bytes=reserved,
        torch_allocated_bytes=allocated,
    )


def engine(model_dir: Path, reader: Any = None, **config: Any) -> LLMEngine:
    config = {
        "dtype": "float32",
        "max_num_batched_tokens": STEP_TOKENS,
        "max_num_seqs": MAX_SEQS,
        **config,
    }
    return LLMEngine(model_dir, EngineConfig(**config), memory_reader=reader)


def handoff_bytes(max_len: int = MAX_POSITIONS) -> int:
    """Kept for the KV handoff's device copies: two sequences of the context."""
    return 2 * cdiv(max_len, 16) * BLOCK_BYTES


def scratch_bytes(max_len: int = MAX_POSITIONS) -> int:
    """The profile's scratch KV cache: enough blocks for the larger of its two steps."""
    batches = profile_batches(MAX_SEQS, STEP_TOKENS, max_len)
    return max(sum(cdiv(n, 16) for n in lengths) for lengths in batches) * BLOCK_BYTES


# -- the arithmetic ---------------------------------------------------------------------


def test_blocks_are_the_share_less_peak_and_non_torch_memory() -> None:
    block = 2 * MIB
    assert kv_blocks_for_memory(100 * GIB, 0.9, 20 * GIB, 2 * GIB, block) == 68 * 512
    assert kv_blocks_for_memory(100 * GIB, 0.5, 20 * GIB, 2 * GIB, block) == 28 * 512
    # memory outside torch costs blocks like torch's own
    assert kv_blocks_for_memory(100 * GIB, 0.9, 20 * GIB, 0, block) == 70 * 512
    # a partial block does not count; nothing left is 0, never negative
    assert kv_blocks_for_memory(100 * GIB, 0.9, 20 * GIB, 2 * GIB + 1, block) == 68 * 512 - 1
    assert kv_blocks_for_memory(100 * GIB, 0.2, 20 * GIB, 2 * GIB, block) == 0


def test_profile_steps_cover_the_longest_prefill_and_the_most_sampled_rows() -> None:
    assert profile_batches(256, 2048, 8192) == [[2048], [8] * 256]
    # a context shorter than the budget: the prefill stops short of it
    assert profile_batches(4, 2048, 1000) == [[999], [512, 512, 512, 512]]
    # an uneven split keeps the whole budget
    (longest,), spread = profile_batches(3, 10, 100)
    assert longest == 10 and sorted(spread) == [3, 3, 4]
    assert profile_batches(1, 64, 100) == [[64]]
    assert profile_batches(512, 100, 100) == [[99], [1] * 100]  # no more rows than tokens


# -- which rule sizes the pool ------------------------------------------------------------


def test_num_kv_blocks_overrides_the_memory_setting_and_the_measurement(
    random_model_dir: Path,
) -> None:
    eng = engine(
        random_model_dir,
        UnusedReader(),
        num_kv_blocks=300,
        kv_cache_memory_gb=0.01,
        gpu_memory_utilization=0.5,
    )
    assert eng.num_kv_blocks == 300 and eng.memory_profile is None


def test_kv_cache_memory_gb_overrides_the_utilization(random_model_dir: Path) -> None:
    eng = engine(
        random_model_dir, UnusedReader(), kv_cache_memory_gb=0.01, gpu_memory_utilization=0.5
    )
    assert eng.num_kv_blocks == int(0.01 * GIB) // BLOCK_BYTES == 327
    assert eng.memory_profile is None


def test_cpu_ignores_the_utilization_and_keeps_the_1_gib_rule(random_model_dir: Path) -> None:
    plain = engine(random_model_dir)
    with_util = engine(random_model_dir, gpu_memory_utilization=0.01)
    rule = min(MAX_SEQS * cdiv(MAX_POSITIONS, 16), GIB // BLOCK_BYTES)
    assert plain.num_kv_blocks == with_util.num_kv_blocks == rule == 2048
    assert with_util.memory_profile is None  # nothing measured


# -- the profile -> size path ---------------------------------------------------------------


def test_the_pool_follows_from_the_measured_numbers(
    random_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log: list[str] = []
    steps: list[tuple[int, int]] = []  # (tokens, sampled rows) of each profiled step
    execute = ModelRunner.execute

    def recording_execute(self: ModelRunner, out: SchedulerOutput) -> StepResult:
        log.append("execute")
        result = execute(self, out)
        steps.append((out.num_tokens, len(result.sampled)))
        return result

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    start = device(total=4 * GIB, free=3 * GIB, reserved=GIB // 2, allocated=GIB // 4)
    # outside torch: 512 MiB at start (other processes, the CUDA context), 576 after
    end = device(total=4 * GIB, free=2 * GIB, reserved=GIB + 448 * MIB, allocated=GIB)
    engine_peak = 100 * MIB  # weights + the step, as the engine should derive it
    peak = start.torch_allocated_bytes + engine_peak + scratch_bytes()
    reader = FakeReader(start, end, peak, log)

    with caplog.at_level(logging.INFO, logger="pdserve.engine.llm_engine"):
        eng = engine(random_model_dir, reader, gpu_memory_utilization=0.25)

    # measured around the profile's steps: the largest prefill, then the most samplers
    assert log == ["snapshot", "reset_peak", "execute", "execute", "peak_allocated", "snapshot"]
    assert steps == [(STEP_TOKENS, 1), (STEP_TOKENS, MAX_SEQS)]
    profile = eng.memory_profile
    assert profile is not None
    assert profile.peak_torch_bytes == engine_peak
    assert profile.non_torch_bytes == 64 * MIB  # the growth; others' 512 MiB are not ours
    # kept for the KV handoff's device copies: an export's and an import's, each at most
    # one sequence of the context (2048 tokens: 4 MiB here)
    assert profile.reserved_bytes == handoff_bytes() == 8 * MIB
    expected = (GIB - engine_peak - 64 * MIB - 8 * MIB) // BLOCK_BYTES
    assert profile.num_blocks == expected == 27264
    # more than max_num_seqs sequences of the context can use: capped at that
    assert eng.num_kv_blocks == MAX_SEQS * cdiv(MAX_POSITIONS, 16) < expected
    assert eng.max_model_len == MAX_POSITIONS
    assert eng.runner.kv_cache.shape[2] == eng.num_kv_blocks
    (line,) = [r.getMessage() for r in caplog.records if "KV pool sized" in r.getMessage()]
    assert "torch peak 0.10 GiB" in line and "0.06 GiB outside torch" in line, line
    assert "0.01 GiB kept for graphs and KV handoffs" in line, line
    assert "27264 blocks" in line and "the pool takes 2048 blocks (0.06 GiB)" in line, line
    # and the engine serves
    eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    while eng.has_unfinished:
        eng.step()
    eng.block_pool.check_no_leaks()


def test_speculation_profiles_a_step_of_verify_rows(
    random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculative decoding a step can sample at every token of its budget (verify
    rows): the profile runs such a step too, after the two usual ones."""
    steps: list[tuple[int, int]] = []  # (tokens, sampled logits rows) of each step
    execute = ModelRunner.execute

    def recording_execute(self: ModelRunner, out: SchedulerOutput) -> StepResult:
        result = execute(self, out)
        rows = sum(1 + len(s.spec_token_ids) for s in out.scheduled if s.samples)
        steps.append((out.num_tokens, rows))
        return result

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    start = device(total=4 * GIB, free=3 * GIB)
    peak = 100 * MIB + scratch_bytes()
    reader = FakeReader(start, start, peak)
    engine(random_model_dir, reader, gpu_memory_utilization=0.25, speculative="ngram:k=3")
    # 16 sequences at most: 16 verify rows of 4 tokens, 64 logits rows
    assert steps == [(STEP_TOKENS, 1), (STEP_TOKENS, MAX_SEQS), (4 * MAX_SEQS, 4 * MAX_SEQS)]


def test_the_default_utilization_is_0_9_and_limits_the_pool(random_model_dir: Path) -> None:
    start = device(total=GIB, free=GIB)
    engine_peak = int(0.9 * GIB) - 100 * BLOCK_BYTES - handoff_bytes() - 5
    reader = FakeReader(start, start, engine_peak + scratch_bytes())
    eng = engine(random_model_dir, reader)
    assert eng.memory_profile is not None and eng.memory_profile.utilization == 0.9
    assert eng.num_kv_blocks == 100
    # the context is capped to the pool, since max_model_len was not set
    assert eng.max_model_len == 100 * 16


def test_nothing_left_for_the_kv_cache_fails_naming_the_field(random_model_dir: Path) -> None:
    start = device(total=GIB, free=GIB)
    reader = FakeReader(start, start, int(0.95 * GIB))  # the step alone takes the share
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization=0\.9") as err:
        engine(random_model_dir, reader)
    assert "no memory is left for the KV cache" in str(err.value)


def test_a_pool_too_small_for_an_explicit_max_model_len_fails_naming_the_field(
    random_model_dir: Path,
) -> None:
    start = device(total=GIB, free=GIB)
    # 0.5 GiB - (0.5 GiB - 1 MiB - the handoff's copies) leaves 32 blocks of 16 tokens
    peak = GIB // 2 - MIB - handoff_bytes(1024) + scratch_bytes(1024)
    reader = FakeReader(start, start, peak)
    with pytest.raises(
        InvalidRequestError,
        match=r"32 blocks of 16 that gpu_memory_utilization=0.5 leaves.*max_model_len=1024",
    ):
        engine(random_model_dir, reader, gpu_memory_utilization=0.5, max_model_len=1024)


def test_a_share_that_is_not_free_fails_before_the_model_loads(random_model_dir: Path) -> None:
    log: list[str] = []
    start = device(total=10 * GIB, free=5 * GIB)  # another process holds half
    reader = FakeReader(start, start, 0, log)
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization=0.6 asks for 6.00 GiB"):
        engine(random_model_dir, reader, gpu_memory_utilization=0.6)
    assert log == ["snapshot"]  # no profile: it failed before loading anything
    # its half fits
    ok = engine(random_model_dir, FakeReader(start, start, GIB), gpu_memory_utilization=0.5)
    assert ok.memory_profile is not None


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -0.1, 1.5])
def test_a_utilization_outside_0_1_is_rejected(value: float, random_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        ClusterConfig(model=str(random_model_dir), gpu_memory_utilization=value)


def test_the_cluster_passes_its_utilization_and_splits_a_shared_gpu(
    random_model_dir: Path,
) -> None:
    model = str(random_model_dir)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    cpu = ClusterConfig(model=model)
    assert cpu.engine_config().gpu_memory_utilization is None
    whole = ClusterConfig(model=model, device="cuda", replica_num_gpus=1)
    assert whole.engine_config().gpu_memory_utilization is None  # the engine's 0.9
    shared = ClusterConfig(model=model, device="cuda", replica_num_gpus=0.5)
    assert shared.engine_config().gpu_memory_utilization == pytest.approx(0.45)
    chosen = ClusterConfig(
        model=model, device="cuda", replica_num_gpus=0.5, gpu_memory_utilization=0.3
    )
    assert chosen.engine_config().gpu_memory_utilization == 0.3


def test_graph_outputs_and_handoff_copies_are_kept_out_of_the_pool(
    random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine takes after sizing comes out of its own share, not the 1 -
    utilization headroom (two replicas sharing a GPU would run out): each captured
    decode graph keeps its logits, and a handoff copies through the device in chunks of
    at most DEVICE_CHUNK_BYTES. Graphs need CUDA, so their decision is forced here."""
    from pdserve.engine import llm_engine
    from pdserve.engine.worker.cuda_graphs import capture_sizes
    from pdserve.engine.worker.kv_staging import DEVICE_CHUNK_BYTES

    eng = engine(random_model_dir, num_kv_blocks=64, max_num_seqs=24)
    sequence = cdiv(MAX_POSITIONS, 16) * BLOCK_BYTES
    assert eng._reserved_after_sizing(MAX_POSITIONS) == 2 * sequence
    monkeypatch.setattr(llm_engine, "cuda_graphs_enabled", lambda *args: True)
    graphs = sum(capture_sizes(24)) * 512 * 4  # rows of float32 logits, vocab 512
    assert sum(capture_sizes(24)) == 1 + 2 + 4 + 8 + 16 + 24
    assert eng._reserved_after_sizing(MAX_POSITIONS) == 2 * sequence + graphs
    # a context long enough for a payload past the chunk: the chunk bounds the copy
    long_context = 4 * DEVICE_CHUNK_BYTES // BLOCK_BYTES * 16
    assert eng._reserved_after_sizing(long_context) == 2 * DEVICE_CHUNK_BYTES + graphs
