"""What the block pool needs of a KV tier below the engine's own pool.

A *lower tier* keeps the contents of blocks the pool evicts, by their chained hash, so a
later request with that prefix gets them back (a copy) instead of computing them again.
The pool and the cache manager see only this protocol, plain Python: the storage and
its copies live with the tensors (`engine/worker/kv_host_tier.py`, host memory).

- `demote`: the pool hands over blocks it is about to reuse, before anything can write
  them; the tier copies their contents out and returns the hashes it dropped to make
  room (its least recently used), for the pool's REMOVED events.
- `promote`: copies held contents into freshly allocated device blocks, before the step
  (or KV import) that reads them.
- `pin`/`unpin`: hashes about to be promoted. A demotion in the same allocation must not
  drop them.
- `tier_of` and `take_changes`: where a held hash is ("host" or "disk"), and the hashes
  whose place changed inside the tier since the last call (host memory to disk only; or
  dropped, a disk copy that failed its checksum), for the pool's DEMOTED and REMOVED
  events: the cluster's index keeps each block's tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.common.hashing import BlockHash


class LowerTier(Protocol):
    def __contains__(self, block_hash: object) -> bool: ...

    def demote(self, blocks: Sequence[tuple[int, BlockHash]]) -> list[BlockHash]:
        """Copy out device blocks (id, hash); the hashes dropped to make room."""
        ...

    def promote(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Copy held hashes into device blocks (id, hash). Each hash must be held."""
        ...

    def pin(self, hashes: Iterable[BlockHash]) -> None: ...

    def unpin(self, hashes: Iterable[BlockHash]) -> None: ...

    def hashes(self) -> list[BlockHash]:
        """Every hash held now."""
        ...

    def tier_of(self, block_hash: BlockHash) -> str | None:
        """ "host" or "disk" for a held hash (the fastest copy), None for another; reads
        nothing from disk."""
        ...

    def take_changes(self) -> list[tuple[BlockHash, str | None]]:
        """(hash, "disk" or None) for each hash that moved to a slower level inside this
        tier, or was dropped there outside `demote` (a failed checksum), since the last
        call."""
        ...

    def clear(self) -> list[BlockHash]:
        """Drop everything (the weights changed); the hashes dropped."""
        ...


@dataclass(frozen=True)
class TierHit:
    """A block of a sequence's cached prefix that only a lower tier holds: admitting the
    sequence allocates a device block for it and promotes the contents there."""

    block_hash: BlockHash
