"""The host-memory KV tier: blocks the engine's pool evicts, kept in a second budget.

One tensor of `capacity` slots, each one block of every layer's K and V in the cache's own
dtype and format (an 8-bit cache's rows move as bytes, scales inside), laid out
slot-major so that a slot is contiguous: [slots, layers, 2, kv_heads, block_size, row].
On CUDA the tensor is pinned host memory; on CPU it is a separate budget of the same RAM
(`kv_host_gib`), which turns recomputing an evicted prefix into a copy.

Slots are kept in LRU order by hash. A demotion takes a free slot or the least recently
used unpinned one (its hash is dropped and reported, for the pool's REMOVED event); a
hit (promotion) makes its slot the most recently used. With every slot pinned a
demotion is refused (the block is dropped instead): a tier that fills evicts, it never
blocks the engine.

With a disk tier below (`engine/worker/kv_disk_tier.py`) every block taken in is also
written there (write-through): a slot reused here drops nothing the disk still holds, a
hash is dropped (REMOVED for the index) once neither holds it, and a prefix found only
on disk is read (and its checksum checked) when the cache manager asks whether it is
held, so a corrupt block ends the cached prefix there and is computed instead.

Copies are synchronous, in the engine's thread, at the moment the pool needs them: a
demotion runs inside the allocation that takes the block (before any step or KV import
can write it), a promotion inside the admission that needs it (before the step that
reads it). On CUDA that is a device-to-host copy into pinned memory and a host-to-device
copy out of it, each waited for.
NOTE: overlapping them with the step (a side stream, an event the step waits on) is the
next step on CUDA; on CPU a copy is a memcpy in the step's own thread either way.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pdserve.common.hashing import BlockHash
from pdserve.engine.worker.kv_disk_tier import DiskKVTier


@dataclass
class TierStats:
    demoted: int = 0  # blocks copied in
    promoted: int = 0  # hits: blocks copied back instead of computed
    dropped: int = 0  # hashes dropped for room (or refused while every slot was pinned)
    disk_hits: int = 0  # of `promoted`, read back from the disk tier
    # wall time of the copies (demotions: the disk's writes included; a disk block's
    # read happens at lookup, in the disk's own stats): what a hit costs here, against
    # computing its tokens
    demote_s: float = 0.0
    promote_s: float = 0.0

    def us_per_block(self, seconds: float, blocks: int) -> int:
        return round(seconds / blocks * 1e6) if blocks else 0


def block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes one block of every layer takes: [layers, 2, blocks, kv_heads, bs, row]."""
    per_block = kv_cache[:, :, 0]
    return per_block.numel() * kv_cache.element_size()


def slots_for(kv_cache: torch.Tensor, gib: float) -> int:
    return int(gib * (1 << 30)) // block_bytes(kv_cache)


class HostKVTier:
    """A `LowerTier` (engine/sched/lower_tier.py) in host memory for one engine's cache."""

    def __init__(
        self, kv_cache: torch.Tensor, capacity: int, disk: DiskKVTier | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {capacity}")
        self.kv_cache = kv_cache
        self.capacity = capacity
        layers, two, _, heads, block_size, row = kv_cache.shape
        pin = kv_cache.device.type == "cuda"
        self.store = torch.empty(
            (capacity, layers, two, heads, block_size, row),
            dtype=kv_cache.dtype,
            device="cpu",
            pin_memory=pin,
        )
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self._pinned: dict[BlockHash, int] = {}
        self.stats = TierStats()
        self.disk = disk
        # blocks read from disk (checksums checked) for a promotion about to happen
        self._staged: dict[BlockHash, torch.Tensor] = {}
        # moved to disk only, or dropped outside demote(): for the index (take_changes)
        self._changes: list[tuple[BlockHash, str | None]] = []

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._slots or block_hash in self._staged:
            return True
        if self.disk is None or not isinstance(block_hash, bytes) or block_hash not in self.disk:
            return False
        block = self.disk.read(block_hash)  # None: its checksum failed, and it is gone
        if block is None:
            self._changes.append((block_hash, None))
            return False
        if len(self._staged) >= _MAX_STAGED:
            self._staged.pop(next(iter(self._staged)))
        self._staged[block_hash] = block
        return True

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[BlockHash]:
        if self.disk is None:
            return list(self._slots)
        return list(dict.fromkeys([*self._slots, *self.disk.hashes()]))

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            self._pinned[h] = self._pinned.get(h, 0) + 1

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
            else:
                del self._pinned[h]

    def demote(self, blocks: Sequence[tuple[int, BlockHash]]) -> list[BlockHash]:
        dropped: list[BlockHash] = []
        taken: list[tuple[int, BlockHash, int]] = []  # (block id, hash, slot), not yet copied
        for block_id, block_hash in blocks:
            if block_hash in self._slots:  # the same contents already here
                self._slots.move_to_end(block_hash)
                continue
            if not self._free and taken:  # the slot to reuse may be one taken just now
                self._copy_in(taken, dropped)
                taken = []
            slot = self._take_slot(dropped)
            if slot is None:
                dropped.append(block_hash)
                continue
            self._slots[block_hash] = slot
            taken.append((block_id, block_hash, slot))
        self._copy_in(taken, dropped)
        if self.disk is not None:  # held while either tier has it
            gone = [h for h in dropped if h not in self._slots]
            self._changes += [(h, "disk") for h in gone if h in self.disk]
            dropped = [h for h in gone if h not in self.disk]
        self.stats.dropped += len(dropped)
        return dropped

    def tier_of(self, block_hash: BlockHash) -> str | None:
        if block_hash in self._slots:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def take_changes(self) -> list[tuple[BlockHash, str | None]]:
        changes, self._changes = self._changes, []
        return changes

    def _copy_in(self, taken: list[tuple[int, BlockHash, int]], dropped: list[BlockHash]) -> None:
        """Copy device blocks into their slots (and through to the disk)."""
        if not taken:
            return
        start = time.perf_counter()
        ids = _index([block_id for block_id, _, _ in taken], self.kv_cache.device)
        slots = torch.tensor([slot for _, _, slot in taken], device="cpu")
        self.store[slots] = self.kv_cache[:, :, ids].movedim(2, 0).to("cpu")
        self.stats.demoted += len(taken)
        if self.disk is not None:
            for _, block_hash, slot in taken:
                dropped.extend(self.disk.put(block_hash, self.store[slot]))
        self.stats.demote_s += time.perf_counter() - start

    def promote(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        if not blocks:
            return
        start = time.perf_counter()
        rows = []
        for _, block_hash in blocks:
            staged = self._staged.pop(block_hash, None)
            if staged is not None:
                rows.append(staged)
                self.stats.disk_hits += 1
                continue
            self._slots.move_to_end(block_hash)  # KeyError: a hash this tier never held
            rows.append(self.store[self._slots[block_hash]])
        src = torch.stack(rows, dim=2)  # [L, 2, n, ...]
        ids = _index([block_id for block_id, _ in blocks], self.kv_cache.device)
        self.kv_cache[:, :, ids] = src.to(self.kv_cache.device)
        self.stats.promoted += len(blocks)
        self.stats.promote_s += time.perf_counter() - start

    def clear(self) -> list[BlockHash]:
        dropped = self.hashes()
        self._slots.clear()
        self._staged.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        if self.disk is not None:
            self.disk.clear()
        return dropped

    def _take_slot(self, dropped: list[BlockHash]) -> int | None:
        """A free slot, or the least recently used unpinned one (its hash goes into
        `dropped`; demote() keeps it held where the disk has it)."""
        if self._free:
            return self._free.pop()
        for victim in self._slots:  # least recently used first
            if victim not in self._pinned:
                dropped.append(victim)
                return self._slots.pop(victim)
        return None


# Disk blocks read ahead of their promotion; more are only left by admissions that did
# not happen (their prompt is read again when it is admitted).
_MAX_STAGED = 256


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)
