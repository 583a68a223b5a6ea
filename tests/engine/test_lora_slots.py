"""Resident LoRA adapters (engine/sched/lora_slots.py) and how the scheduler admits
sequences of adapters that have no slot yet: without a model."""

from __future__ import annotations

import pytest

from pdserve.common.hashing import hash_namespace
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.lora_slots import LoRASlots
from pdserve.engine.sched.scheduler import Scheduler, SchedulerLimits
from pdserve.engine.sched.sequence import Sequence

BLOCK = 4
NS = hash_namespace("test-model")


def test_slots_fill_then_evict_the_least_recently_used_one_not_in_use() -> None:
    slots = LoRASlots(2)
    for name in ("a", "b"):
        assert slots.can_admit(name, set())
        slots.admit(name, set())
    slots.touch({"a"})  # a used since b: b is now the least recently used
    assert slots.can_admit("c", set())
    slots.admit("c", set())
    assert slots.resident == ["a", "c"]
    assert slots.take_changes() == [("load", "a"), ("load", "b"), ("evict", "b"), ("load", "c")]
    assert (slots.loads, slots.evictions) == (3, 1)
    # every slot serves running sequences: no room, and admitting anyway is a bug
    assert not slots.can_admit("d", {"a", "c"})
    assert slots.free({"a", "c"}) == 0 and slots.free({"a"}) == 1
    with pytest.raises(RuntimeError, match="every one is in use"):
        slots.admit("d", {"a", "c"})
    slots.admit("d", {"c"})  # a is in no running sequence: it goes, not c
    assert slots.resident == ["c", "d"]
    slots.admit("c", set())  # resident: no load, only its place in the order
    assert slots.resident == ["d", "c"] and slots.loads == 4
    slots.forget("d")
    assert slots.resident == ["c"] and slots.evictions == 2  # an unload is no eviction
    assert slots.take_changes() == [("evict", "a"), ("load", "d"), ("evict", "d")]
    with pytest.raises(ValueError):
        LoRASlots(0)


def _seq(rid: str, lora: str | None, max_tokens: int = 3) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=lora)
    prompt = [ord(rid[0]), 5, 6]
    return Sequence(rid, prompt, params, eos_token_ids=frozenset({0}), hash_namespace=NS)


def _scheduler(max_loras: int) -> Scheduler:
    limits = SchedulerLimits(8, 64, max_model_len=64, enable_chunked_prefill=True)
    kv = KVCacheManager(BlockPool(64, enable_caching=True), BLOCK)
    return Scheduler(kv, limits, lora_slots=LoRASlots(max_loras))


def _step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update(out, {s.seq.request_id: 7 for s in out.scheduled if s.samples})
    return [s.seq.request_id for s in out.scheduled]


def test_a_step_mixes_at_most_max_loras_adapters_and_a_waiting_one_keeps_its_place() -> None:
    sched = _scheduler(max_loras=2)
    for rid, lora in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("n1", None), ("a2", "a")]:
        sched.add(_seq(rid, lora))
    # c has no slot while a and b run; the base model's and a's next requests go past it
    assert _step(sched) == ["a1", "b1", "n1", "a2"]
    assert [s.request_id for s in sched.waiting] == ["c1"]
    assert sched.adapters_running() == {"a", "b"}
    while sched.waiting:
        steps = _step(sched)
        adapters = {s.params.lora for s in sched.running} - {None}
        assert len(adapters) <= 2, steps
    assert sched.lora_slots is not None
    # c1 was admitted once a slot's adapter had no running sequence
    assert "c" in sched.lora_slots.resident and sched.lora_slots.loads == 3
    assert sched.lora_slots.evictions == 1
