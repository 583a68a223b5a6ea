"""Maps sequences to KV blocks: prefix-cache lookup, slot allocation, freeing.

Plain Python over `BlockPool`. A sequence owns `seq.blocks` (one reference each); full
blocks are registered under their chained hash as soon as their tokens are scheduled,
so a later request can share them. With a lower tier (`engine/sched/lower_tier.py`) a
cached prefix continues through blocks only the tier holds (`TierHit`): admission
allocates device blocks for them and promotes their contents before anything reads them.
"""

from __future__ import annotations

from pdserve.common.hashing import BlockHash
from pdserve.engine.sched.block_pool import BlockPool, KVBlock
from pdserve.engine.sched.lower_tier import TierHit
from pdserve.engine.sched.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock | TierHit]:
        """Cached blocks holding the longest prefix of `seq`'s tokens (not yet referenced):
        the pool's, or a `TierHit` for a block only the lower tier holds.

        At least one token is always left to compute, because the step that computes the
        last token is the one that samples the next.
        """
        if not self.pool.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.full_block_hashes(self.block_size)[:max_blocks]
        tier = self.pool.lower_tier
        if tier is None:
            return list(self.pool.get_computed_blocks(hashes))
        computed: list[KVBlock | TierHit] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is not None:
                computed.append(block)
            elif block_hash in tier:
                computed.append(TierHit(block_hash))
            else:
                break
        return computed

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: list[KVBlock | TierHit] | None = None,
    ) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens of `seq`.

        `computed_blocks` (on admission only, from `get_computed_blocks`) are the cached
        prefix the sequence reuses: the pool's blocks are referenced, a `TierHit` gets a
        new block with the tier's contents promoted into it; they come first, in order.
        Returns False, changing nothing, when the pool lacks free blocks.
        """
        computed_blocks = computed_blocks or []
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_tokens + num_new_tokens, self.block_size)
        cached = [b for b in computed_blocks if isinstance(b, KVBlock)]
        hits = [b.block_hash for b in computed_blocks if isinstance(b, TierHit)]
        num_to_allocate = num_needed - len(seq.blocks) - len(cached)
        # Touching a free cached block takes it out of the free queue, too.
        num_evictable = sum(1 for b in cached if b.ref_count == 0)
        if num_to_allocate + num_evictable > self.pool.num_free_blocks:
            return False
        self.pool.touch(cached)
        if hits:
            self._promote(seq, computed_blocks, hits)
            num_to_allocate -= len(hits)
        else:
            seq.blocks.extend(cached)
        if num_to_allocate > 0:
            seq.blocks.extend(self.pool.allocate(num_to_allocate))
        self._cache_full_blocks(seq, num_tokens + num_new_tokens)
        return True

    def _promote(
        self, seq: Sequence, computed: list[KVBlock | TierHit], hits: list[BlockHash]
    ) -> None:
        """Append the cached prefix to `seq.blocks`, a new block in place of each hit,
        with the tier's contents copied in (the hits pinned meanwhile: the allocation
        may demote blocks into the tier)."""
        tier = self.pool.lower_tier
        assert tier is not None
        tier.pin(hits)
        try:
            fresh = iter(self.pool.allocate(len(hits)))
            promoted: list[tuple[int, BlockHash]] = []
            for b in computed:
                if isinstance(b, KVBlock):
                    seq.blocks.append(b)
                else:
                    block = next(fresh)
                    seq.blocks.append(block)
                    promoted.append((block.block_id, b.block_hash))
            tier.promote(promoted)
        finally:
            tier.unpin(hits)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past `seq`'s tokens: after a verify row (speculative
        decoding) they held only rejected proposals' slots. They are never registered
        (only blocks full of the sequence's tokens are) and go to the head of the free
        queue, the next to be allocated, ahead of blocks still cached."""
        keep = cdiv(seq.num_tokens, self.block_size)
        extra = seq.blocks[keep:]
        if extra:
            assert all(b.block_hash is None for b in extra)
            del seq.blocks[keep:]
            self.pool.free(reversed(extra), front=True)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        # Only blocks full of the sequence's own tokens: a verify row's slots past them
        # (proposals, maybe rejected) never make a block count as full here.
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = seq.full_block_hashes(self.block_size)
        for i in range(seq.num_registered_blocks, num_full):
            if seq.blocks[i].block_hash is None:
                self.pool.cache_full_block(seq.blocks[i], hashes[i])
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks become the first to be evicted."""
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
        seq.num_registered_blocks = 0
