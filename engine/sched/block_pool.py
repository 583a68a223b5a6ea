"""The KV block pool: block ref counts, the LRU free queue and the prefix-cache map.

Pure bookkeeping, no tensors: a block here is an id into the model runner's KV cache.
The design follows vLLM v1's BlockPool:

- A block with ref_count 0 is *free* and sits in the free queue. A free block may still
  be *cached* (registered under its hash in the cache map): it can be reused by a later
  request with the same prefix (touch) until allocate() takes it and evicts its hash.
- allocate() takes from the head of the free queue; free() appends to the tail. So the
  least recently freed block is reused first (LRU), and callers that free a sequence's
  blocks in reverse order get its tail blocks (the least shareable) evicted first.
- With events enabled, every registration (STORED) and eviction (REMOVED) is recorded
  for the cluster's prefix index; drain_events() hands them over.
- With a lower tier (`engine/sched/lower_tier.py`), a cached block that allocate() takes is
  first demoted there: its hash stays held by this worker (no REMOVED) until the tier
  drops it too, and it is no longer in the cache map once allocate() returns.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.common.errors import NoFreeBlocksError
from pdserve.common.hashing import BlockHash
from pdserve.common.kv_events import KVEvent, KVEventKind
from pdserve.engine.sched.lower_tier import LowerTier

__all__ = ["BlockPool", "KVBlock", "KVEvent", "KVEventKind", "NoFreeBlocksError"]


@dataclass(eq=False)
class KVBlock:
    """One KV-cache block. Compared by identity: each block_id has exactly one KVBlock."""

    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the pool's cache map.
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every KV block of one worker: ref counts, free queue and prefix-cache map.

    Args:
        num_blocks: Number of blocks, ids 0..num_blocks-1; all start free, in id order.
        enable_caching: Whether full blocks can be registered and reused by hash.
        enable_events: Whether STORED/REMOVED events are recorded for drain_events().
        lower_tier: Where evicted cached blocks go (None: they are forgotten).

    Raises:
        ValueError: num_blocks < 1.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        lower_tier: LowerTier | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.lower_tier = lower_tier if enable_caching else None
        self._blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # NOTE: insertion order is the LRU order: head = next to allocate. OrderedDict
        # gives O(1) append, pop-head and remove-from-the-middle (touch of a cached block).
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self._blocks
        )
        self._cached: dict[BlockHash, KVBlock] = {}
        # Pending events, consecutive ones of the same kind already merged.
        self._events: list[tuple[KVEventKind, list[BlockHash]]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, including cached ones that are evictable."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """Returns the block registered under block_hash, or None. Changes nothing."""
        return self._cached.get(block_hash)

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """Finds the cached blocks of the longest cached prefix of a chain of hashes.

        Args:
            block_hashes: A sequence's chained full-block hashes, first block first.

        Returns:
            The blocks of block_hashes[:k] for the largest k whose hashes are all cached;
            [] when caching is disabled. Ref counts are not changed: call touch() to keep
            the blocks from being evicted.
        """
        computed: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes one more reference on each block (e.g. a cache hit shared with a request).

        Side effects: ref_count += 1; a block whose ref_count was 0 leaves the free
        queue, so it can no longer be evicted, and stays cached.
        """
        for block in blocks:
            if block.ref_count == 0:
                del self._free_queue[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes num_blocks blocks from the head of the free queue (least recently freed).

        Returns:
            The blocks, each with ref_count 1 and no hash.

        Raises:
            ValueError: num_blocks < 0.
            NoFreeBlocksError: Fewer than num_blocks blocks are free; nothing is allocated.

        Side effects: a taken block that was cached is evicted: its hash leaves the
        cache map and a REMOVED event is recorded, or, with a lower tier, its contents are
        demoted there first (REMOVED then only for the hashes the tier drops).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"requested {num_blocks} blocks but only {self.num_free_blocks} are free "
                f"(of {self.num_blocks})"
            )
        blocks: list[KVBlock] = []
        demoted: list[tuple[int, BlockHash]] = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            if self.lower_tier is not None and block.block_hash is not None:
                demoted.append((block.block_id, block.block_hash))
                del self._cached[block.block_hash]
                block.block_hash = None
            else:
                self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        if demoted:
            tier = self.lower_tier
            assert tier is not None
            dropped = set(tier.demote(demoted))
            for block_hash in dropped:
                if block_hash not in self._cached:
                    self._record(KVEventKind.REMOVED, block_hash)
            recorded = set()
            for _, block_hash in demoted:
                if block_hash not in dropped and block_hash not in self._cached:
                    self._record_tier(block_hash)
                    recorded.add(block_hash)
            self._take_tier_changes(skip=recorded)
        return blocks

    def free(self, blocks: Iterable[KVBlock], front: bool = False) -> None:
        """Drops one reference on each block.

        Args:
            blocks: Blocks to release. Blocks reaching ref_count 0 are appended to the
                tail of the free queue in this order, so pass a sequence's blocks in
                reverse to have its tail blocks evicted first. Cached blocks stay cached.
            front: Put them at the head of the free queue instead (each before the
                previous one): the next to be allocated. For blocks that hold nothing
                worth caching, so that reusing them evicts no cached block.

        Raises:
            ValueError: A block would drop below ref_count 0 (a double free); nothing
                is freed then.
        """
        blocks = list(blocks)
        num_frees = Counter(block.block_id for block in blocks)
        for block in blocks:
            if block.ref_count < num_frees[block.block_id]:
                raise ValueError(
                    f"block {block.block_id} freed {num_frees[block.block_id]} time(s) "
                    f"but has ref_count {block.ref_count}"
                )
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block.block_id] = block
                if front:
                    self._free_queue.move_to_end(block.block_id, last=False)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Registers a full block under its chained hash so later requests can reuse it.

        Side effects: records a STORED event. If block_hash is already registered to
        another block, the existing mapping is kept and nothing is recorded: the new
        block stays uncached (a duplicate) and is simply reused once freed. No-op when
        caching is disabled or the block is already registered under block_hash.

        Raises:
            ValueError: The block is already registered under a different hash.
        """
        if not self.enable_caching or block_hash in self._cached:
            return
        if block.block_hash is not None:
            raise ValueError(
                f"block {block.block_id} is already cached under {block.block_hash.hex()}"
            )
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._record(KVEventKind.STORED, block_hash)

    def drain_events(self) -> list[KVEvent]:
        """Returns the pending events, oldest first, and clears them.

        Consecutive events of the same kind are merged into one KVEvent with several
        hashes, order preserved. Always [] when events are disabled.
        """
        self._take_tier_changes()
        events = [KVEvent(kind, tuple(hashes)) for kind, hashes in self._events]
        self._events = []
        return events

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash this worker holds now, in the pool's cache map or a lower tier (to
        republish a whole index)."""
        if self.lower_tier is None:
            return list(self._cached)
        return list(dict.fromkeys([*self._cached, *self.lower_tier.hashes()]))

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of every block in the cache map, least recently freed first."""
        return [(b.block_id, b.block_hash) for b in self._cached.values() if b.block_hash]

    def reset_prefix_cache(self) -> bool:
        """Unregisters every cached block, e.g. after the model weights changed.

        Returns:
            True if the cache was reset; False, changing nothing, if some cached block
            is still referenced by a request.

        Side effects: records one REMOVED event with every dropped hash; a lower tier
        is emptied too. The free queue's order is unchanged.
        """
        if any(block.ref_count > 0 for block in self._cached.values()):
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        if self.lower_tier is not None:
            for block_hash in self.lower_tier.clear():
                self._record(KVEventKind.REMOVED, block_hash)
        return True

    def check_no_leaks(self) -> None:
        """Checks that no block is referenced, e.g. at the end of a test or on shutdown.

        Raises:
            AssertionError: Naming the ids of the blocks still referenced.
        """
        leaked_ids = [block.block_id for block in self._blocks if block.ref_count != 0]
        if leaked_ids:
            raise AssertionError(f"blocks still referenced: {leaked_ids}")
        if len(self._free_queue) != self.num_blocks:
            raise AssertionError(
                f"free queue holds {len(self._free_queue)} of {self.num_blocks} blocks"
            )

    def _evict(self, block: KVBlock) -> None:
        """Removes a block's hash from the cache map, if any, and records REMOVED (unless
        a lower tier still holds the hash)."""
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        if self.lower_tier is None or block.block_hash not in self.lower_tier:
            self._record(KVEventKind.REMOVED, block.block_hash)
        else:
            self._record_tier(block.block_hash)
        block.block_hash = None

    def _take_tier_changes(self, skip: set[BlockHash] | frozenset[BlockHash] = frozenset()) -> None:
        """Events for what moved inside the lower tier (to disk only, or dropped there),
        but for hashes in `skip` (their place was just recorded)."""
        if self.lower_tier is None:
            return
        for block_hash, where in self.lower_tier.take_changes():
            if block_hash in self._cached or block_hash in skip:
                continue  # in the pool: the index lists it there
            if where is None:
                self._record(KVEventKind.REMOVED, block_hash)
            else:
                self._record_tier(block_hash)

    def _record_tier(self, block_hash: BlockHash) -> None:
        """A DEMOTED event for a hash that left the pool but a lower tier holds."""
        assert self.lower_tier is not None
        where = self.lower_tier.tier_of(block_hash)
        if where is not None:
            kind = KVEventKind.DEMOTED_DISK if where == "disk" else KVEventKind.DEMOTED_HOST
            self._record(kind, block_hash)

    def snapshot_events(self) -> list[KVEvent]:
        """Every hash this worker holds, as the events that publish it with its tier: the
        pool's STORED, then each lower tier's DEMOTED (to republish a whole index)."""
        events = [KVEvent(KVEventKind.STORED, tuple(self._cached))] if self._cached else []
        if self.lower_tier is not None:
            by_tier: dict[str, list[BlockHash]] = {"host": [], "disk": []}
            for block_hash in self.lower_tier.hashes():
                where = self.lower_tier.tier_of(block_hash)
                if block_hash not in self._cached and where is not None:
                    by_tier[where].append(block_hash)
            for kind, where in (
                (KVEventKind.DEMOTED_HOST, "host"),
                (KVEventKind.DEMOTED_DISK, "disk"),
            ):
                if by_tier[where]:
                    events.append(KVEvent(kind, tuple(by_tier[where])))
        return events

    def _record(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        if not self.enable_events:
            return
        if self._events and self._events[-1][0] is kind:
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash]))
