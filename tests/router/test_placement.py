"""Joint placement: cached prefix against load, and the two baselines."""

from __future__ import annotations

import random
from collections.abc import Callable

from pdserve.cluster.config import Placement, PlacementWeights
from pdserve.cluster.prefix_index import MatchResult, WorkerInfo
from pdserve.router.placement import Placer

BLOCK = 16


def match(worker_id: str, role: str, matched: int, **load: int) -> MatchResult:
    return MatchResult(WorkerInfo(worker_id, role, f"{worker_id}:1", 1, load), matched)


def pool(*matches: MatchResult) -> dict[str, MatchResult]:
    return {m.worker.worker_id: m for m in matches}


def placer(policy: Placement = "prefix-aware", seed: int = 0) -> Placer:
    return Placer(policy, PlacementWeights(), BLOCK, random.Random(seed))


def decode_id(
    p: Placer,
    matches: dict[str, MatchResult],
    inflight: dict[str, int],
    holds: Callable[[MatchResult], bool] | None = None,
) -> str:
    choice = p.choose_decode(matches, inflight, holds)
    assert choice is not None
    return choice.worker_id


def prefill_id(p: Placer, matches: dict[str, MatchResult], prompt_len: int) -> str:
    choice = p.choose_prefill(matches, prompt_len, {})
    assert choice is not None
    return choice.worker_id


def test_prefill_goes_to_the_holder_of_the_prefix_when_loads_are_equal() -> None:
    p = pool(match("a", "prefill", 0), match("b", "prefill", 10))
    choice = placer().choose_prefill(p, prompt_len=200, inflight_tokens={})
    assert choice is not None and (choice.worker_id, choice.matched_blocks) == ("b", 10)


def test_prefill_leaves_the_holder_when_its_queue_costs_more_than_the_hit() -> None:
    # b saves 160 tokens of compute but has 500 queued: a finishes this prompt sooner.
    p = pool(match("a", "prefill", 0), match("b", "prefill", 10, queued_prefill_tokens=500))
    choice = placer().choose_prefill(p, prompt_len=200, inflight_tokens={})
    assert choice is not None and choice.worker_id == "a"


def test_in_flight_tokens_the_heartbeat_has_not_seen_count_as_queue() -> None:
    p = pool(match("a", "prefill", 0), match("b", "prefill", 0))
    choice = placer().choose_prefill(p, prompt_len=50, inflight_tokens={"a": 400})
    assert choice is not None and choice.worker_id == "b"


def test_prefill_goes_where_it_finishes_soonest_at_each_workers_measured_rate() -> None:
    # a: (1000 queued + 200) / 4000 tok/s = 0.3 s; b: 200 / 500 tok/s = 0.4 s
    p = pool(match("a", "prefill", 0, queued_prefill_tokens=1000), match("b", "prefill", 0))
    fast_busy = placer().choose_prefill(p, 200, {}, rates={"a": 4000.0, "b": 500.0})
    assert fast_busy is not None and fast_busy.worker_id == "a"
    # in tokens alone (no rate measured yet), the idle one
    assert prefill_id(placer(), p, 200) == "b"


def test_decode_weighs_running_sequences_kv_usage_and_held_prefix() -> None:
    total = {"kv_blocks_total": 100}
    idle_holder = match("a", "decode", 8, running=0, kv_blocks_used=0, **total)
    busy = match("b", "decode", 0, running=5, kv_blocks_used=50, **total)
    assert decode_id(placer(), pool(idle_holder, busy), {}) == "a"
    # The holder is now far busier than what its prefix saves: cost 20 + 18 - 4 > 0.
    loaded_holder = match("a", "decode", 8, running=20, kv_blocks_used=90, **total)
    empty = match("b", "decode", 0, running=0, kv_blocks_used=0, **total)
    assert decode_id(placer(), pool(loaded_holder, empty), {}) == "b"
    # Requests this router is streaming from a count even before its heartbeat shows them.
    fresh = pool(match("a", "decode", 0, **total), match("b", "decode", 0, **total))
    assert decode_id(placer(), fresh, {"a": 3}) == "b"


def test_ties_are_broken_at_random_and_every_tied_worker_gets_chosen() -> None:
    p = pool(*(match(w, "decode", 0) for w in "abcd"))
    chosen = {decode_id(placer(seed=s), p, {}) for s in range(40)}
    assert chosen == set("abcd")


def test_round_robin_and_random_ignore_prefix_and_load() -> None:
    p = pool(match("a", "prefill", 10), match("b", "prefill", 0, queued_prefill_tokens=10**6))
    rr = placer("round-robin")
    turns = [prefill_id(rr, p, 200) for _ in range(4)]
    assert turns == ["a", "b", "a", "b"]
    rnd = placer("random", seed=1)
    picks = {prefill_id(rnd, p, 200) for _ in range(40)}
    assert picks == {"a", "b"}


def test_an_empty_pool_gives_no_choice() -> None:
    assert placer().choose_prefill({}, 10, {}) is None
    assert placer().choose_decode({}, {}) is None


def _holds(*pairs: tuple[str, str]) -> Callable[[str], Callable[[MatchResult], bool]]:
    """`holds_lora` for a request of adapter `lora`: the (worker, adapter) pairs held."""
    return lambda lora: lambda m: (m.worker.worker_id, lora) in pairs


def test_a_lora_request_goes_to_the_worker_holding_its_adapter_unless_it_is_much_busier() -> None:
    holds = _holds(("b", "x"))
    p = pool(match("a", "decode", 0, running=2), match("b", "decode", 0, running=6))
    assert decode_id(placer(), p, {}, holds("x")) == "b"
    # without the adapter the least loaded wins; a base request ignores adapters
    assert decode_id(placer(), p, {}, holds("y")) == "a"
    assert decode_id(placer(), p, {}) == "a"
    # busier by more than a load is worth (PlacementWeights.lora_load running requests)
    p = pool(match("a", "decode", 0, running=2), match("b", "decode", 0, running=11))
    assert decode_id(placer(), p, {}, holds("x")) == "a"
    # weight 0: adapters do not count (the benchmark's adapter-blind placement)
    blind = Placer("prefix-aware", PlacementWeights(lora_load=0), BLOCK, random.Random(0))
    p = pool(match("a", "decode", 0, running=2), match("b", "decode", 0, running=6))
    assert decode_id(blind, p, {}, holds("x")) == "a"


def test_an_adapter_no_worker_holds_goes_where_a_slot_is_free() -> None:
    """Every slot of the idler worker serves running requests: its load would wait."""
    p = pool(
        match("a", "decode", 0, running=1, lora_slots_free=0),
        match("b", "decode", 0, running=4, lora_slots_free=2),
    )
    assert decode_id(placer(), p, {}, _holds()("x")) == "b"


def test_a_prefill_worker_holding_the_adapter_is_preferred_by_its_load_in_tokens() -> None:
    holds = _holds(("b", "x"))
    p = pool(match("a", "prefill", 0), match("b", "prefill", 0, queued_prefill_tokens=300))
    choice = placer().choose_prefill(p, 200, {}, None, holds("x"))
    assert choice is not None and choice.worker_id == "b"  # 300 queued < 512 for a load
    p = pool(match("a", "prefill", 0), match("b", "prefill", 0, queued_prefill_tokens=900))
    choice = placer().choose_prefill(p, 200, {}, None, holds("x"))
    assert choice is not None and choice.worker_id == "a"


def tiered(
    worker_id: str, role: str, matched: int, host: int, disk: int, **load: int
) -> MatchResult:
    # the per-block costs each worker measured of its tiers, as its heartbeat reports them
    costs = {"kv_host_promote_us_per_block": 500, "kv_disk_read_us_per_block": 4_500}
    info = WorkerInfo(worker_id, role, f"{worker_id}:1", 1, {**costs, **load})
    return MatchResult(info, matched, host, disk)


def test_a_hit_costs_what_bringing_it_back_from_its_tier_costs() -> None:
    """Two prefill workers hold the same 20 blocks of a prompt: `a` in its device pool,
    `b` on disk (5 ms a block to read and copy back). At 1,000 tokens/s, computing a
    block takes 16 ms, so `b`'s hit still saves most of the prompt: `b` beats a worker
    holding nothing, but `a` beats `b`, and `b` beats a pool holder with a little queue
    only when that queue outweighs the disk reads."""
    p = placer()
    rates = {"a": 1000.0, "b": 1000.0, "c": 1000.0}
    a, b = match("a", "prefill", 20), tiered("b", "prefill", 20, 0, 20)
    c = match("c", "prefill", 0)
    assert p.choose_prefill(pool(b, c), 400, {}, rates).worker_id == "b"  # type: ignore[union-attr]
    assert p.choose_prefill(pool(a, b), 400, {}, rates).worker_id == "a"  # type: ignore[union-attr]
    # 100 ms of disk reads on b, 50 ms of queue on a: a; 150 ms of queue: b
    queued_a = match("a", "prefill", 20, queued_prefill_tokens=50)
    assert p.choose_prefill(pool(queued_a, b), 400, {}, rates).worker_id == "a"  # type: ignore[union-attr]
    queued_a = match("a", "prefill", 20, queued_prefill_tokens=150)
    assert p.choose_prefill(pool(queued_a, b), 400, {}, rates).worker_id == "b"  # type: ignore[union-attr]
    # a decode worker's hit, in blocks: 20 host blocks at 0.5 ms are worth 0.625 of one
    # computed block less; 20 disk blocks at 5 ms, 6.25 less
    assert p.hit_blocks(tiered("d", "decode", 20, 20, 0), 1000.0) == 20 - 0.625
    assert p.hit_blocks(tiered("d", "decode", 20, 0, 20), 1000.0) == 20 - 6.25
    assert p.hit_blocks(tiered("d", "decode", 20, 0, 20), None) == 20  # no rate to weigh
    d_pool, d_disk = match("p", "decode", 20), tiered("q", "decode", 20, 0, 20)
    decode_rates = {"p": 1000.0, "q": 1000.0}
    choice = p.choose_decode(pool(d_pool, d_disk), {}, None, decode_rates)
    assert choice is not None and choice.worker_id == "p"
