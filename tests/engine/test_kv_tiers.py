"""The host KV tier: evicted cached blocks copied to host memory and back.

The pool's side (which blocks go down, which events the index gets) runs against a fake
tier; the engine's against the real one, whose promoted blocks must give the tokens of
a fresh computation (transformers'), in float32 and with 8-bit caches.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine_config import EngineConfig
from pdserve.common.hashing import BlockHash, hash_block_chain, hash_namespace
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sched.block_pool import BlockPool, KVEventKind
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.lower_tier import TierHit
from pdserve.engine.sched.sequence import Sequence as Seq
from pdserve.engine.worker.device_hygiene import DeviceHygiene
from pdserve.engine.worker.kv_disk_tier import HEADER_BYTES, DiskKVTier
from pdserve.engine.worker.kv_host_tier import HostKVTier, block_bytes

BLOCK_SIZE = 4
NAMESPACE = hash_namespace("tiers")
STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED
HOST, DISK = KVEventKind.DEMOTED_HOST, KVEventKind.DEMOTED_DISK


def chain(tokens: Sequence[int]) -> list[BlockHash]:
    return hash_block_chain(tokens, BLOCK_SIZE, NAMESPACE)


class FakeTier:
    """Holds hashes (no contents), `capacity` of them, LRU; records every call."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[BlockHash, int] = {}  # hash -> block id it came from
        self.pinned: set[BlockHash] = set()
        self.promoted: list[tuple[int, BlockHash]] = []

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.held

    def demote(self, blocks: Sequence[tuple[int, BlockHash]]) -> list[BlockHash]:
        dropped = []
        for block_id, block_hash in blocks:
            if len(self.held) >= self.capacity:
                victim = next((h for h in self.held if h not in self.pinned), None)
                if victim is None:
                    dropped.append(block_hash)
                    continue
                del self.held[victim]
                dropped.append(victim)
            self.held[block_hash] = block_id
        return dropped

    def promote(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        assert all(h in self.held for _, h in blocks)
        self.promoted.extend(blocks)

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        self.pinned.update(hashes)

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        self.pinned.difference_update(hashes)

    def hashes(self) -> list[BlockHash]:
        return list(self.held)

    def tier_of(self, block_hash: BlockHash) -> str | None:
        return "host" if block_hash in self.held else None

    def take_changes(self) -> list[tuple[BlockHash, str | None]]:
        return []

    def clear(self) -> list[BlockHash]:
        dropped = list(self.held)
        self.held.clear()
        return dropped


def seq(request_id: str, tokens: list[int]) -> Seq:
    return Seq(request_id, tokens, SamplingParams(max_tokens=1), frozenset(), NAMESPACE)


def events(pool: BlockPool) -> list[tuple[KVEventKind, int]]:
    return [(e.kind, len(e.block_hashes)) for e in pool.drain_events()]


def test_an_evicted_cached_block_goes_down_and_stays_held() -> None:
    tier = FakeTier(capacity=8)
    pool = BlockPool(2, enable_events=True, lower_tier=tier)
    hashes = chain(range(8))
    blocks = pool.allocate(2)
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_full_block(block, block_hash)
    pool.free(reversed(blocks))
    assert events(pool) == [(STORED, 2)]
    pool.allocate(2)  # takes both cached blocks: their contents go to the tier first
    assert tier.held == {hashes[0]: blocks[0].block_id, hashes[1]: blocks[1].block_id}
    assert pool.get_cached_block(hashes[0]) is None
    # still held by this worker: no REMOVED, but the index hears it is in host memory
    assert events(pool) == [(HOST, 2)]
    assert set(pool.cached_hashes()) == set(hashes)
    assert [(e.kind, set(e.block_hashes)) for e in pool.snapshot_events()] == [(HOST, set(hashes))]


def test_the_tier_dropping_a_block_is_the_removal_the_index_hears() -> None:
    tier = FakeTier(capacity=1)
    pool = BlockPool(2, enable_events=True, lower_tier=tier)
    hashes = chain(range(8))
    blocks = pool.allocate(2)
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_full_block(block, block_hash)
    pool.free(blocks)
    pool.drain_events()
    pool.allocate(2)
    assert list(tier.held) == [hashes[1]]
    assert [(e.kind, e.block_hashes) for e in pool.drain_events()] == [
        (REMOVED, (hashes[0],)),
        (HOST, (hashes[1],)),
    ]


def test_a_prefix_continues_through_the_tier_and_is_promoted_in_order() -> None:
    tier = FakeTier(capacity=8)
    pool = BlockPool(8, enable_events=True, lower_tier=tier)
    kv = KVCacheManager(pool, BLOCK_SIZE)
    tokens = list(range(13))  # 3 full blocks and one token to compute
    hashes = chain(tokens)
    first = seq("a", tokens)
    assert kv.allocate_slots(first, 13, kv.get_computed_blocks(first))
    kv.free(first)
    # the second block's contents move to the tier (its device block is reused)
    block1 = pool.get_cached_block(hashes[1])
    assert block1 is not None
    pool.touch([block1])
    pool.free([block1], front=True)
    pool.allocate(1)  # takes block1 off the head of the queue
    assert hashes[1] in tier and pool.get_cached_block(hashes[1]) is None
    second = seq("b", tokens)
    computed = kv.get_computed_blocks(second)
    assert [type(c).__name__ for c in computed] == ["KVBlock", "TierHit", "KVBlock"]
    assert isinstance(computed[1], TierHit) and computed[1].block_hash == hashes[1]
    assert kv.allocate_slots(second, 1, computed)
    promoted_id, promoted_hash = tier.promoted[-1]
    assert promoted_hash == hashes[1] and second.blocks[1].block_id == promoted_id
    assert [b.block_hash for b in second.blocks[:3]] == hashes[:3]
    assert not tier.pinned


def test_a_hit_stays_pinned_while_its_own_allocation_demotes() -> None:
    tier = FakeTier(capacity=1)
    pool = BlockPool(2, enable_events=True, lower_tier=tier)
    kv = KVCacheManager(pool, BLOCK_SIZE)
    hashes = chain(range(8))
    tier.held[hashes[0]] = 99  # the tier holds block 0 of the prompt, and is full
    # both device blocks hold some other cached prefix: allocating demotes them
    others = chain(range(100, 108))
    blocks = pool.allocate(2)
    for block, block_hash in zip(blocks, others, strict=True):
        pool.cache_full_block(block, block_hash)
    pool.free(blocks)
    one = seq("a", list(range(5)))
    computed = kv.get_computed_blocks(one)
    assert computed == [TierHit(hashes[0])]
    assert kv.allocate_slots(one, 1, computed)
    # promote() found it (FakeTier asserts): the demotion that took the hit's device
    # block was refused rather than drop it; it is a device block of the prompt now
    assert tier.promoted == [(one.blocks[0].block_id, hashes[0])]
    assert pool.get_cached_block(hashes[0]) is one.blocks[0]


def test_resetting_the_prefix_cache_empties_the_tier() -> None:
    tier = FakeTier(capacity=8)
    pool = BlockPool(2, enable_events=True, lower_tier=tier)
    tier.held[chain(range(4))[0]] = 0
    assert pool.reset_prefix_cache()
    assert not tier.held
    assert events(pool) == [(REMOVED, 1)]


# -- the real tier ------------------------------------------------------------------


def test_the_host_tier_copies_bytes_both_ways_and_evicts_lru() -> None:
    cache = torch.randint(0, 255, (2, 2, 6, 2, 4, 10), dtype=torch.uint8)  # an 8-bit layout
    tier = HostKVTier(cache, capacity=2)
    assert block_bytes(cache) == 2 * 2 * 2 * 4 * 10
    h = chain(range(16))
    original = cache.clone()
    assert tier.demote([(1, h[0]), (4, h[1])]) == []
    assert tier.demote([(5, h[2])]) == [h[0]]  # the least recently used goes
    assert h[0] not in tier and len(tier) == 2
    tier.promote([(0, h[1])])  # block 4's bytes into block 0
    assert torch.equal(cache[:, :, 0], original[:, :, 4])
    assert tier.demote([(2, h[0])]) == [h[2]]  # h[1] was just used: h[2] is older
    assert (tier.stats.demoted, tier.stats.promoted, tier.stats.dropped) == (4, 1, 2)
    tier.pin([h[0], h[1]])
    assert tier.demote([(3, h[3])]) == [h[3]]  # every slot pinned: refused, not blocking
    assert len(tier) == 2


def test_the_index_hears_each_block_s_tier_from_the_real_tiers(tmp_path: Path) -> None:
    """A pool over a host tier of one slot and a disk below it: of two evicted blocks one
    stays in host memory and the other goes on to disk; a disk copy that fails its
    checksum when it is looked up is a removal; a snapshot republishes each tier."""
    cache = torch.randn(2, 2, 4, 1, BLOCK_SIZE, 8)
    disk = DiskKVTier(tmp_path, tuple(cache[:, :, 0].shape), cache.dtype, capacity=4)
    tier = HostKVTier(cache, capacity=1, disk=disk)
    pool = BlockPool(4, enable_events=True, lower_tier=tier)
    h = chain(range(8))
    blocks = pool.allocate(2)
    for block, block_hash in zip(blocks, h, strict=True):
        pool.cache_full_block(block, block_hash)
    pool.free(blocks)
    assert events(pool) == [(STORED, 2)]
    pool.allocate(4)  # both cached blocks are taken: demoted, then h[0] leaves the host
    assert [(e.kind, e.block_hashes) for e in pool.drain_events()] == [
        (DISK, (h[0],)),
        (HOST, (h[1],)),
    ]
    assert (tier.tier_of(h[0]), tier.tier_of(h[1])) == ("disk", "host")
    kinds = [(e.kind, e.block_hashes) for e in pool.snapshot_events()]
    assert kinds == [(HOST, (h[1],)), (DISK, (h[0],))]
    with open(disk.path, "r+b") as f:  # h[0]'s payload damaged: it was written first
        f.seek(HEADER_BYTES + 3)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert h[0] not in tier  # the lookup reads it, and its checksum fails
    assert [(e.kind, e.block_hashes) for e in pool.drain_events()] == [(REMOVED, (h[0],))]


# -- the engine -----------------------------------------------------------------------

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Any) -> Path:
    return make_checkpoint(hidden_size=128, num_heads=4, num_kv_heads=2)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    return [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 20))] for _ in range(6)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_promoted_blocks_give_the_tokens_of_a_fresh_computation(
    checkpoint: Path, hf_greedy: Any, kv_dtype: str
) -> None:
    prompts = _prompts()
    reference = hf_greedy(
        checkpoint,
        prompts,
        MAX_TOKENS,
        **({} if kv_dtype == "auto" else {"kv_cache_dtype": kv_dtype}),
    )
    # 20 blocks of 4 tokens: the shared 12 blocks stay in the pool, the tails of the
    # prompts before are evicted (to the tier) and come back from it in the second round
    llm = LLM(
        checkpoint,
        dtype="float32",
        kv_cache_dtype=kv_dtype,
        block_size=4,
        num_kv_blocks=20,
        kv_host_gib=0.001,
        attention_backend="torch",
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for _ in range(2) for p in prompts]
    assert [o.token_ids for o in outs] == reference * 2
    load = llm.engine.load()
    assert load["kv_host_hit_blocks"] > 0 and load["kv_host_demoted_blocks"] > 0
    assert load["kv_host_promote_us_per_block"] > 0 and load["kv_host_demote_us_per_block"] > 0
    # every prompt after the first found the shared 48 tokens (12 blocks) cached, and in
    # the second round every full block of its own
    assert all(o.num_cached_tokens >= 48 for o in outs[1:])
    assert [o.num_cached_tokens for o in outs[6:]] == [(len(p) - 1) // 4 * 4 for p in prompts]
    llm.engine.block_pool.check_no_leaks()


def test_a_full_tier_drops_blocks_and_the_tokens_hold(checkpoint: Path) -> None:
    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = LLM(checkpoint, dtype="float32", enable_prefix_caching=False)
    reference = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(checkpoint, dtype="float32", block_size=4, num_kv_blocks=20)
    tier = HostKVTier(llm.engine.runner.kv_cache, capacity=3)  # a tier far too small
    llm.engine.block_pool.lower_tier = tier
    llm.engine.host_tier = tier
    outs = [llm.generate([p], params)[0] for _ in range(2) for p in prompts]
    assert [o.token_ids for o in outs] == reference * 2
    assert tier.stats.dropped > 0 and len(tier) == 3
    assert llm.engine.load()["kv_host_dropped_blocks"] == tier.stats.dropped


def test_the_settings_that_a_host_tier_cannot_serve_yet_are_refused() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_host_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(kv_host_gib=1, tensor_parallel_size=2)
    assert EngineConfig(kv_host_gib=1).kv_host_gib == 1


# -- the disk tier --------------------------------------------------------------------


def test_the_disk_tier_finds_its_blocks_after_a_restart(tmp_path: Path) -> None:
    shape = (2, 2, 2, 4, 8)
    disk = DiskKVTier(tmp_path, shape, torch.bfloat16, capacity=3)
    h = chain(range(20))
    blocks = [torch.randn(shape).to(torch.bfloat16) for _ in range(4)]
    for i in range(3):
        assert disk.put(h[i], blocks[i]) == []
    assert disk.put(h[3], blocks[3]) == [h[0]]  # full: the least recently written goes
    disk.close()
    again = DiskKVTier(tmp_path, shape, torch.bfloat16, capacity=3)
    assert again.path == disk.path and again.stats.recovered == 3
    assert set(again.hashes()) == {h[1], h[2], h[3]}
    for i in (1, 2, 3):
        block = again.read(h[i])
        assert block is not None and torch.equal(block, blocks[i])
    # another layout (an 8-bit cache, say) never reads this file
    other = DiskKVTier(tmp_path, (2, 2, 2, 4, 10), torch.uint8, capacity=3)
    assert other.path != again.path and len(other) == 0


def test_a_second_process_on_the_directory_writes_a_file_of_its_own(tmp_path: Path) -> None:
    shape = (1, 2, 1, 4, 8)
    first = DiskKVTier(tmp_path, shape, torch.float32, capacity=2)
    second = DiskKVTier(tmp_path, shape, torch.float32, capacity=2)
    assert first.path != second.path
    first.close()
    third = DiskKVTier(tmp_path, shape, torch.float32, capacity=2)
    assert third.path == first.path  # free again: taken over


def test_a_corrupt_disk_block_is_dropped_and_counted(tmp_path: Path) -> None:
    shape = (1, 2, 1, 4, 8)
    disk = DiskKVTier(tmp_path, shape, torch.float32, capacity=2)
    h = chain(range(8))
    disk.put(h[0], torch.randn(shape))
    with open(disk.path, "r+b") as f:  # one payload byte of slot 0 flipped
        f.seek(HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert disk.read(h[0]) is None
    assert disk.stats.corrupt == 1 and h[0] not in disk


def test_a_truncated_arena_keeps_what_is_whole(tmp_path: Path) -> None:
    shape = (1, 2, 1, 4, 8)
    disk = DiskKVTier(tmp_path, shape, torch.float32, capacity=3)
    h = chain(range(12))
    blocks = [torch.randn(shape) for _ in range(3)]
    for block_hash, block in zip(h, blocks, strict=True):
        disk.put(block_hash, block)
    path, slot = disk.path, disk.slot_bytes
    disk.close()
    with open(path, "r+b") as f:  # cut in the middle of the last slot's payload
        f.truncate(2 * slot + HEADER_BYTES + 10)
    again = DiskKVTier(tmp_path, shape, torch.float32, capacity=3)
    block = again.read(h[0])
    assert block is not None and torch.equal(block, blocks[0])
    assert again.read(h[2]) is None  # its header survived, its payload did not
    assert again.stats.corrupt == 1 and h[2] not in again and h[1] in again


def _engine_with_disk(checkpoint: Path, directory: Path, host_slots: int) -> LLM:
    llm = LLM(
        checkpoint,
        dtype="float32",
        block_size=4,
        num_kv_blocks=20,
        kv_host_gib=0.001,
        kv_disk_dir=str(directory),
        kv_disk_gib=0.01,
    )
    tier = llm.engine.host_tier
    assert tier is not None and tier.disk is not None
    # a host tier of a few slots: most blocks are only on disk
    llm.engine.host_tier = llm.engine.block_pool.lower_tier = HostKVTier(
        llm.engine.runner.kv_cache, host_slots, tier.disk
    )
    return llm


def test_disk_blocks_give_the_reference_tokens_and_survive_a_restart(
    checkpoint: Path, hf_greedy: Any, tmp_path: Path
) -> None:
    prompts = _prompts()
    reference = hf_greedy(checkpoint, prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = _engine_with_disk(checkpoint, tmp_path, host_slots=2)
    outs = [llm.generate([p], params)[0] for _ in range(2) for p in prompts]
    assert [o.token_ids for o in outs] == reference * 2
    load = llm.engine.load()
    assert load["kv_disk_hit_blocks"] > 0 and load["kv_disk_blocks"] > 0
    assert load["kv_disk_read_us_per_block"] > 0
    disk = llm.engine.host_tier.disk  # type: ignore[union-attr]
    assert disk is not None
    llm.close()  # what the pool still cached (the shared prefix) is written out too
    held = len(disk)
    assert held > load["kv_disk_blocks"]
    # a new engine on the same folder: the first prompt's whole prefix comes from disk
    restarted = _engine_with_disk(checkpoint, tmp_path, host_slots=2)
    assert restarted.engine.load()["kv_disk_recovered_blocks"] == held
    out = restarted.generate([prompts[0]], params)[0]
    assert out.token_ids == reference[0]
    assert out.num_cached_tokens == (len(prompts[0]) - 1) // 4 * 4
    restarted.close()


def test_a_corrupt_block_on_disk_is_computed_instead(
    checkpoint: Path, hf_greedy: Any, tmp_path: Path
) -> None:
    prompts = _prompts()[:2]
    reference = hf_greedy(checkpoint, prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = _engine_with_disk(checkpoint, tmp_path, host_slots=1)
    llm.generate(prompts, params)
    disk = llm.engine.host_tier.disk  # type: ignore[union-attr]
    assert disk is not None
    path, slot = disk.path, disk.slot_bytes
    llm.close()  # the cached prompts are written out
    assert len(disk) > 0
    data = bytearray(path.read_bytes())  # every written payload's first byte flipped
    for offset in range(0, len(data), slot):
        if data[offset : offset + 8] == b"PDKVBLK1":
            data[offset + HEADER_BYTES] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = _engine_with_disk(checkpoint, tmp_path, host_slots=1)
    outs = [restarted.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    load = restarted.engine.load()
    assert load["kv_disk_corrupt_blocks"] > 0 and load["kv_disk_hit_blocks"] == 0
    assert outs[0].num_cached_tokens == 0
    restarted.close()


def test_the_tiers_keep_their_tensors_where_a_gpu_would(checkpoint: Path, tmp_path: Path) -> None:
    """Under DeviceHygiene (engine/worker/device_hygiene.py): the copies between the pool
    (the engine's device), the host tier's store and the disk's buffers (the host) mix
    them only where CUDA allows it."""
    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with DeviceHygiene() as mode:
        llm = _engine_with_disk(checkpoint, tmp_path, host_slots=2)
        for _ in range(2):
            for p in prompts:
                llm.generate([p], params)
        load = llm.engine.load()
        llm.close()
    assert mode.mistakes == []
    assert load["kv_disk_hit_blocks"] > 0  # promotions from disk (and so from host) ran


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def test_a_kv_import_over_a_prefix_in_the_tier_promotes_it(
    checkpoint: Path, hf_greedy: Any
) -> None:
    """Disaggregated: the decode worker claims the prompt's first blocks as cached (the
    prefill worker ships only the rest); they were evicted to its host tier meanwhile,
    and the import brings them back."""
    prompt = _prompts()[0]
    first_block = 12  # the shared 48 tokens, 4 per block
    reference = hf_greedy(checkpoint, [prompt], MAX_TOKENS)[0]
    config = dict(dtype="float32", block_size=4, attention_backend="torch")
    prefill = LLMEngine(checkpoint, EngineConfig(**config, num_kv_blocks=64))
    decode = LLMEngine(checkpoint, EngineConfig(**config, num_kv_blocks=20, kv_host_gib=0.001))
    # the decode worker once served a prompt with the same first 12 blocks, then others
    # that pushed those blocks out of its pool into the tier
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    decode.add_request("earlier", [*prompt[:48], 7, 8, 9], greedy)
    for i, other in enumerate(_other_prompts()):
        decode.add_request(f"other{i}", other, greedy)
        _drain(decode)
    assert decode.load()["kv_host_demoted_blocks"] >= first_block
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    first = _drain(prefill)["r"][0]
    export = prefill.export_kv("r", first_block)
    export.wait()
    hits_before = decode.load()["kv_host_hit_blocks"]
    out = decode.add_prefilled_request("r", prompt, first, greedy, export.payload, first_block)
    export.release()
    prefill.release_kv("r")
    tokens = _drain(decode)
    assert [out.token_ids[0], *tokens["r"][1:]] == reference
    assert decode.load()["kv_host_hit_blocks"] - hits_before == first_block
    decode.block_pool.check_no_leaks()


def _other_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(60)] for _ in range(3)]


def test_an_async_engine_stopping_cleanly_writes_the_pool_to_disk(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A worker replica stops through its AsyncEngine: the blocks its pool still caches
    reach the disk tier then, for the worker that restarts on the folder."""
    llm = _engine_with_disk(checkpoint, tmp_path, host_slots=2)
    engine = llm.engine
    disk = engine.host_tier.disk  # type: ignore[union-attr]
    assert disk is not None
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = _prompts()[0]

    async def serve() -> None:
        async_engine = AsyncEngine(engine)
        rid = "one"

        def start(e: LLMEngine) -> None:
            e.add_request(rid, prompt, params, stream=True)

        async for out in async_engine.stream(rid, start):
            if out.finished:
                break
        assert len(disk) == 0  # nothing evicted yet
        await async_engine.close()

    asyncio.run(serve())
    # every block full of computed tokens: the prompt's and the first output's (the last
    # output token's KV is never computed)
    assert len(disk) == (len(prompt) + 1) // 4
