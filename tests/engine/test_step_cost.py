"""Steps within a time target: the online step cost model and the scheduler's prefill cap.

A step that mixes prefill chunks with decode rows must stay within `tpot_target_ms`
(every running stream waits for it), from a cost model fitted to measured step times.
Nothing here asserts a duration: the fits get synthetic costs, the scheduler a fake cost
model, the engine tests a fake cost model or a fake clock; the real-clock test only needs
a step to take more than a microsecond.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.common.engine_config import EngineConfig
from pdserve.common.hashing import hash_namespace
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence, SequenceStatus
from pdserve.engine.sched.step_cost import StepCostModel, StepShape, chunk_attention

BLOCK = 4
NS = hash_namespace("test-model")

# A synthetic cost (seconds): intercept, per decode row, per decode context token, per
# prefill token, per prefill query-key pair. Roughly a small model on one CPU core.
TRUE_COEF = (2e-3, 3e-4, 1e-7, 6e-4, 2e-9)


def true_cost(shape: StepShape) -> float:
    return sum(c * x for c, x in zip(TRUE_COEF, shape.features(), strict=True))


def random_shape(rng: random.Random, prefill: bool) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randrange(0, 33)):
        shape = shape.with_decode(rng.randrange(1, 1000))
    if prefill or shape.decode_rows == 0:
        for _ in range(rng.randrange(1, 3)):
            shape = shape.with_chunk(rng.randrange(0, 1500), rng.randrange(1, 512))
    return shape


def fitted(rng: random.Random, num_steps: int, spikes: bool = True) -> StepCostModel:
    model = StepCostModel()
    for _ in range(num_steps):
        shape = random_shape(rng, prefill=rng.random() < 0.5)
        seconds = true_cost(shape) * rng.lognormvariate(0.0, 0.03)
        if spikes and rng.random() < 0.05:  # a descheduled thread, a GC pause
            seconds *= rng.uniform(3.0, 20.0)
        model.observe(shape, seconds)
    return model


def relative_errors(model: StepCostModel, rng: random.Random) -> list[float]:
    errors = []
    for _ in range(200):
        shape = random_shape(rng, prefill=True)
        predicted = model.predict(shape)
        assert predicted is not None
        errors.append(abs(predicted - true_cost(shape)) / true_cost(shape))
    return errors


def test_the_cost_model_recovers_a_synthetic_cost_despite_noise_and_spikes() -> None:
    rng = random.Random(0)
    model = fitted(rng, 400)
    errors = relative_errors(model, rng)
    assert max(errors) < 0.1, max(errors)
    coef = model.coefficients
    assert coef is not None and all(c >= 0 for c in coef)
    # the term the cap leans on: what a prefill token costs
    assert coef[3] == pytest.approx(TRUE_COEF[3], rel=0.15)


def test_no_prediction_until_enough_steps_with_prefill_were_seen() -> None:
    model = StepCostModel(min_samples=16, min_prefill_samples=4, warmup_steps=2)
    decode_only = StepShape().with_decode(10).with_decode(20)
    mixed = decode_only.with_chunk(0, 64)
    for _ in range(2 + 30):  # the warm-up steps are dropped; decodes alone teach no prefill
        model.observe(decode_only, true_cost(decode_only))
        assert model.predict(mixed) is None
    assert model.num_observed == 30
    for _ in range(3):
        model.observe(mixed, true_cost(mixed))
        assert model.predict(mixed) is None
    model.observe(mixed.with_chunk(100, 32), true_cost(mixed.with_chunk(100, 32)))
    predicted = model.predict(mixed)
    assert predicted is not None and predicted == pytest.approx(true_cost(mixed), rel=0.05)


def test_decode_coefficients_come_from_decode_steps_alone_until_a_full_fit() -> None:
    """A decode-heavy engine sees few prefills: what a decode row costs (speculative
    decoding's `SpecPolicy` needs it) is still fitted, from the steps without prefill."""
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(60):
        shape = random_shape(rng, prefill=False)
        if shape.prefill_tokens:
            continue
        model.observe(shape, true_cost(shape))
    assert model.coefficients is None and model.predict(StepShape().with_decode(10)) is None
    coef = model.decode_coefficients
    assert coef is not None and coef[3:] == (0.0, 0.0)
    assert coef[:3] == pytest.approx(TRUE_COEF[:3], rel=0.05)
    full = fitted(rng, 400)
    assert full.decode_coefficients == full.coefficients  # the full fit, once there is one


def test_coefficients_stay_non_negative_so_longer_chunks_never_predict_less() -> None:
    # Times that *fall* with the decode context (as noise or a changing machine can make
    # them look): the fit drops that term rather than predicting negative costs.
    model = StepCostModel(warmup_steps=0)
    rng = random.Random(1)
    for _ in range(100):
        shape = random_shape(rng, prefill=rng.random() < 0.5)
        seconds = 1e-3 + 5e-4 * shape.prefill_tokens - 1e-6 * shape.decode_context
        model.observe(shape, max(seconds, 1e-4))
    coef = model.coefficients
    assert coef is not None and all(c >= 0 for c in coef)
    base = StepShape().with_decode(500)
    predictions = [model.predict(base.with_chunk(0, n)) for n in (1, 16, 128, 512)]
    assert None not in predictions
    assert predictions == sorted(predictions)  # type: ignore[type-var]


def test_a_long_stretch_of_pure_decoding_keeps_the_prefill_estimate() -> None:
    rng = random.Random(2)
    model = fitted(rng, 300, spikes=False)
    for _ in range(2000):  # every prompt done: steps without prefill only
        shape = random_shape(rng, prefill=False)
        while shape.prefill_tokens:
            shape = random_shape(rng, prefill=False)
        model.observe(shape, true_cost(shape))
    assert max(relative_errors(model, rng)) < 0.1


# -- the scheduler's cap, with a fake cost model ----------------------------------------


class LinearCost:
    """A known cost: `per_step` + `per_decode` * rows + `per_prefill` * prefill tokens."""

    def __init__(self, per_step: float, per_decode: float, per_prefill: float) -> None:
        self.per_step, self.per_decode, self.per_prefill = per_step, per_decode, per_prefill
        self.ready = True

    def predict(self, shape: StepShape) -> float | None:
        if not self.ready:
            return None
        rows, prefill = shape.decode_rows, shape.prefill_tokens
        return self.per_step + self.per_decode * rows + self.per_prefill * prefill


def make_scheduler(
    cost: LinearCost | None,
    target: float | None = 5.0,
    num_blocks: int = 32,
    budget: int = 64,
    caching: bool = True,
    wait_limit: float | None = None,
) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=caching)
    limits = SchedulerLimits(
        8,
        budget,
        max_model_len=64,
        step_time_target_s=target,
        min_prefill_chunk=BLOCK,
        prefill_wait_limit_s=wait_limit,
    )
    return Scheduler(KVCacheManager(pool, BLOCK), limits, cost)


def make_seq(rid: str, prompt: list[int], max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(rid, prompt, params, eos_token_ids=frozenset({0}), hash_namespace=NS)


def planned(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in (*out.prefills, *out.decodes)]


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.seq.request_id: token for s in (*out.prefills, *out.decodes) if s.samples}
    sched.update(out, sampled)
    return out


def start_a_stream(sched: Scheduler, max_tokens: int = 30) -> Sequence:
    """A request that is decoding (one step prefilled its 3-token prompt)."""
    stream = make_seq("stream", [1, 2, 3], max_tokens=max_tokens)
    sched.add(stream)
    assert planned(run_step(sched)) == [("stream", 0, 3)]
    return stream


def test_a_long_prompt_beside_decode_rows_is_cut_to_the_target() -> None:
    # one decode row costs 1 + 0.5; the target 5.5 leaves (5.5 - 1.5) / 0.125 = 32 tokens
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=5.5)
    start_a_stream(sched)
    sched.add(make_seq("long", list(range(10, 50))))
    assert sched.prefill_budget() == 32
    assert planned(run_step(sched)) == [("long", 0, 32), ("stream", 3, 1)]
    assert sched.stats.num_latency_capped_steps == 1
    assert planned(run_step(sched)) == [("long", 32, 8), ("stream", 4, 1)]
    assert sched.stats.num_latency_capped_steps == 1  # 8 tokens fit: not cut


def test_a_prompt_past_the_wait_limit_lifts_the_cap_until_prefill_catches_up() -> None:
    # the same cut as above (32 tokens beside one decode row), with a 60 s wait limit
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=5.5, wait_limit=60.0)
    start_a_stream(sched, max_tokens=40)
    fresh = make_seq("fresh", list(range(10, 50)))
    sched.add(fresh)  # arrived now: within the limit, the target holds
    assert planned(run_step(sched)) == [("fresh", 0, 32), ("stream", 3, 1)]
    assert sched.stats.num_backlog_uncapped_steps == 0
    # a prompt that has waited past the limit (its arrival set in the past, not slept)
    old = make_seq("old", list(range(60, 100)))
    sched.add(old)
    old.arrival_s -= 61.0
    assert sched.prefill_budget() == 64  # the whole token budget
    out = run_step(sched)
    assert planned(out) == [("fresh", 32, 8), ("old", 0, 40), ("stream", 4, 1)]
    assert sched.stats.num_backlog_uncapped_steps == 1
    assert sched.stats.num_latency_capped_steps == 1  # only the first step was cut
    # nothing waits for prefill any more: the next prompt is capped again
    sched.add(make_seq("next", list(range(110, 150))))
    assert planned(run_step(sched))[0] == ("next", 0, 32 - 2 * 4)  # 3 decode rows now
    assert sched.stats.num_backlog_uncapped_steps == 1


def test_a_long_prompt_being_chunked_keeps_the_cap_past_the_wait_limit() -> None:
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=5.5, wait_limit=60.0)
    start_a_stream(sched)
    long = make_seq("long", list(range(10, 50)))
    sched.add(long)
    assert planned(run_step(sched)) == [("long", 0, 32), ("stream", 3, 1)]
    long.arrival_s -= 61.0  # admitted, chunked, arrived long ago: still capped
    assert sched.prefill_budget() == 32
    # a request queueing behind it past the limit lifts the cap
    queued = make_seq("queued", list(range(60, 100)))
    sched.add(queued)
    assert sched.prefill_budget() == 32  # it arrived just now
    queued.arrival_s -= 61.0
    assert sched.prefill_budget() == 64
    assert planned(run_step(sched)) == [("long", 32, 8), ("queued", 0, 40), ("stream", 4, 1)]
    assert sched.stats.num_backlog_uncapped_steps == 1


def test_without_a_target_or_a_cost_model_the_token_budget_alone_applies() -> None:
    for sched in (make_scheduler(None), make_scheduler(LinearCost(1.0, 0.5, 0.125), None)):
        start_a_stream(sched)
        sched.add(make_seq("long", list(range(10, 50))))
        assert sched.prefill_budget() == 64
        assert planned(run_step(sched)) == [("long", 0, 40), ("stream", 3, 1)]


def test_a_step_without_decode_rows_keeps_the_whole_budget() -> None:
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=5.0)
    sched.add(make_seq("long", list(range(10, 50))))
    sched.add(make_seq("next", list(range(60, 70))))
    assert sched.prefill_budget() == 64
    assert planned(run_step(sched)) == [("long", 0, 40), ("next", 0, 10)]
    assert sched.stats.num_latency_capped_steps == 0


def test_before_the_cost_model_has_data_the_token_budget_applies() -> None:
    cost = LinearCost(1.0, 0.5, 0.125)
    cost.ready = False
    sched = make_scheduler(cost, target=5.0)
    start_a_stream(sched)
    sched.add(make_seq("long", list(range(10, 50))))
    assert planned(run_step(sched)) == [("long", 0, 40), ("stream", 3, 1)]


def test_prefills_progress_by_one_block_a_step_when_decodes_alone_exceed_the_target() -> None:
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=1.0)  # decode row alone: 1.5
    stream = start_a_stream(sched)
    prompt = list(range(10, 50))
    long = make_seq("long", prompt)
    sched.add(long)
    for step in range(10):  # 40 tokens, 4 (min_prefill_chunk) at a time
        out = run_step(sched)
        assert planned(out) == [("long", 4 * step, 4), ("stream", 3 + step, 1)]
    assert long.output_token_ids == [7] and stream.output_token_ids == [7] * 11
    assert sched.stats.num_latency_capped_steps == 10
    while sched.has_unfinished:
        run_step(sched)
    assert long.is_finished and stream.is_finished
    sched.kv.pool.check_no_leaks()


def test_running_prefills_and_new_prompts_share_one_allowance() -> None:
    # 32 prefill tokens per step beside one decode row: a running chunked prompt first,
    # then what is left to the next waiting prompt
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=5.5)
    start_a_stream(sched)
    sched.add(make_seq("a", list(range(10, 50))))
    sched.add(make_seq("b", list(range(60, 100))))
    assert planned(run_step(sched)) == [("a", 0, 32), ("stream", 3, 1)]  # b waits
    assert planned(run_step(sched)) == [("a", 32, 8), ("b", 0, 24), ("stream", 4, 1)]
    assert planned(run_step(sched)) == [("b", 24, 16), ("stream", 5, 1), ("a", 40, 1)]


def test_a_preempted_sequence_is_recomputed_within_the_allowance() -> None:
    # 5 blocks: a and b (6-token prompts) hold 2 each; when both need a third block, b is
    # preempted and later recomputes its 9 tokens while a decodes: a capped prefill
    sched = make_scheduler(LinearCost(1.0, 0.5, 0.125), target=0.0, num_blocks=5, caching=False)
    a, b = make_seq("a", [1, 2, 3, 4, 5, 6], 12), make_seq("b", [9, 8, 7, 6, 5, 4], 12)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(4):
        preempted += run_step(sched).preempted
    assert preempted == [b] and b.status is SequenceStatus.PREEMPTED
    out = run_step(sched)
    assert planned(out) == [("b", 0, BLOCK), ("a", 9, 1)]  # the floor, not all 9 tokens
    assert sched.stats.num_latency_capped_steps == 1
    while sched.has_unfinished:
        run_step(sched)
    assert b.output_token_ids == [7] * 12
    sched.kv.pool.check_no_leaks()


def test_chunk_attention_counts_query_key_pairs() -> None:
    assert chunk_attention(0, 1) == 1
    assert chunk_attention(0, 4) == 1 + 2 + 3 + 4
    assert chunk_attention(10, 2) == 11 + 12
    shape = StepShape().with_chunk(0, 4).with_chunk(10, 2).with_decode(7)
    assert shape == StepShape(decode_rows=1, decode_context=7, prefill_tokens=6,
                              prefill_attention=10 + 23)  # fmt: skip


# -- the engine: measured steps, exact tokens -------------------------------------------

MAX_TOKENS = 16


def staggered_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 9, 66, 30, 1, 47, 12, 58, 3, 40, 21, 70, 8, 33, 61, 17]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], every: int = 2) -> list[list[int]]:
    """A new request every `every` steps while the earlier ones decode; greedy tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    step = 0
    while len(tokens) < len(prompts) or engine.has_unfinished:
        if step % every == 0 and step // every < len(prompts):
            i = step // every
            engine.add_request(f"r{i}", prompts[i], params)
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def model_and_reference(make_checkpoint: Any, hf_greedy: Any) -> tuple[Path, list[list[int]]]:
    model_dir = make_checkpoint()
    return model_dir, hf_greedy(model_dir, staggered_prompts(), MAX_TOKENS)


def engine(model_dir: Path, **config: Any) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK, **config))


def test_greedy_tokens_with_a_fake_cost_model_equal_those_without_a_target(
    model_and_reference: tuple[Path, list[list[int]]],
) -> None:
    model_dir, expected = model_and_reference
    prompts = staggered_prompts()
    plain = engine(model_dir)
    assert plain.step_cost is None
    assert run_staggered(plain, prompts) == expected
    assert plain.scheduler.stats.num_latency_capped_steps == 0
    capped = engine(model_dir, tpot_target_ms=1.0)
    # 0.1 ms a token: beside 2 decode rows a step takes 8 prefill tokens, beside 10 or
    # more just the floor (one block)
    capped.scheduler.cost_model = LinearCost(0.0, 1e-4, 1e-4)
    assert run_staggered(capped, prompts) == expected
    stats = capped.scheduler.stats
    assert stats.num_latency_capped_steps > 10 and stats.num_chunked_prefill_steps > 10
    capped.block_pool.check_no_leaks()


def test_greedy_tokens_with_the_measured_cost_model_equal_transformers(
    model_and_reference: tuple[Path, list[list[int]]],
) -> None:
    # A 1 us target: once the model has data, every step beside decode rows is cut to
    # the floor (any real step takes longer), through the engine's own measurements.
    model_dir, expected = model_and_reference
    llm = engine(model_dir, tpot_target_ms=0.001)
    assert run_staggered(llm, staggered_prompts()) == expected
    assert llm.step_cost is not None and llm.step_cost.num_observed > 30
    assert llm.step_cost.coefficients is not None
    assert llm.scheduler.stats.num_latency_capped_steps > 0
    llm.block_pool.check_no_leaks()


class RecordingCost(StepCostModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[StepShape, float]] = []

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.seen.append((shape, seconds))
        super().observe(shape, seconds)


def test_the_engine_times_every_step_with_its_shape(
    model_and_reference: tuple[Path, list[list[int]]],
) -> None:
    # Every step measured at 3 s (a fake clock): once the model has data, the 50 ms
    # target binds and a step beside decode rows prefills one block at most.
    model_dir, expected = model_and_reference
    llm = engine(model_dir, tpot_target_ms=50.0)
    recording = RecordingCost()
    llm.step_cost = llm.scheduler.cost_model = recording
    ticks = iter(range(0, 1_000_000, 3))  # each clock read 3 s after the last
    llm.clock = lambda: float(next(ticks))
    prompts = staggered_prompts()
    assert run_staggered(llm, prompts) == expected
    seen = recording.seen
    assert seen and all(seconds == 3.0 for _, seconds in seen)
    # every computed token was in some step: prompts, and each output but the last
    computed = sum(s.prefill_tokens + s.decode_rows for s, _ in seen)
    assert computed == sum(len(p) + MAX_TOKENS - 1 for p in prompts)
    # the first step the fit could serve: 2 warm-up steps, then 16 with 4 prefills
    ready = next(
        i
        for i in range(len(seen))
        if i - 1 >= 16 and sum(s.prefill_tokens > 0 for s, _ in seen[2 : i + 1]) >= 4
    )
    later = [s for s, _ in seen[ready + 1 :] if s.decode_rows and s.prefill_tokens]
    assert later and all(s.prefill_tokens <= BLOCK for s in later)
    assert max(s.prefill_tokens for s, _ in seen[: ready + 1]) > BLOCK  # uncapped before


def test_the_load_gauge_reports_the_prefill_budget(
    model_and_reference: tuple[Path, list[list[int]]],
) -> None:
    model_dir, _ = model_and_reference
    llm = engine(model_dir, tpot_target_ms=1.05, max_num_batched_tokens=256)
    assert llm.load()["step_prefill_budget"] == 256  # nothing decoding
    llm.scheduler.cost_model = LinearCost(0.0, 1e-4, 1e-4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.add_request("a", [5, 6, 7], params)
    llm.add_request("b", [8, 9, 10], params)
    llm.step()
    assert llm.load()["step_prefill_budget"] == 8  # 2 decode rows: 10.5 tokens in 1.05 ms


def test_the_cluster_passes_the_target_to_every_engine(make_checkpoint: Any) -> None:
    model = str(make_checkpoint())
    assert ClusterConfig(model=model).engine_config().tpot_target_ms == 100.0
    off = ClusterConfig(model=model, tpot_target_ms=None).engine_config()
    assert off.tpot_target_ms is None
    # colocated: whole prompts by default; a target given still holds, and what a
    # replica receives (the validated dump) keeps either
    colocated = ClusterConfig(model=model, mode="colocated")
    assert colocated.engine_config().tpot_target_ms is None
    assert ClusterConfig.model_validate(colocated.model_dump()).tpot_target_ms is None
    given = ClusterConfig(model=model, mode="colocated", tpot_target_ms=80)
    assert ClusterConfig.model_validate(given.model_dump()).engine_config().tpot_target_ms == 80
    with pytest.raises(ValueError, match="tpot_target_ms"):
        ClusterConfig(model=model, tpot_target_ms=0)
