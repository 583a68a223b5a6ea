"""A router's in-memory copy of the prefix index's block entries, matched in its memory.

The Redis index (`prefix_index.py`) answers a match with one Lua script whose work grows
with the number of live workers whatever the prompt, and every router asks Redis for
every request. This view holds the same entries (which registration, `worker:generation`,
holds which block) in the router's memory, so a match walks only the prompt's chain and
the holders of its blocks: time proportional to the chain, not to the fleet.

It is fed the same events the workers publish (`apply`: STORED, REMOVED, and DEMOTED,
which keeps a block held and notes that it is only in a lower tier), or a snapshot of a
registration's whole cache (`store`, `set_tiers`), and forgets a registration at once when its lease
lapses or its worker registers again (`drop`). Liveness is not its business: a match is
given the live workers with their generations (what `PrefixIndex.live_workers` returns,
which the router refreshes on its own clock), and entries of any other registration never
count, as in the Lua script. What it returns is what `PrefixIndex.match` returns per live
worker: how many leading blocks of the chain that worker holds.

Memory: a block is keyed by the first 8 bytes of its hash, as a Python int; two blocks
whose hashes share 8 bytes (about one pair in 10^12 at 10 million blocks) would only
make a placement worse, never an answer wrong: the decode worker's receiver checks full
hashes. Its holders are one registration slot (an int), or a tuple of them when several
workers hold it. Plain Python: no torch, no Redis.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

from pdserve.common.hashing import BlockHash
from pdserve.common.kv_events import TIER_OPS, KVEvent

Holders = int | tuple[int, ...]
_INTERN_LIMIT = 1 << 16


def block_key(block_hash: BlockHash) -> int:
    """A block's key in the view: its hash's first 8 bytes."""
    return int.from_bytes(block_hash[:8], "little")


def hex_key(hash_hex: str) -> int:
    """`block_key` of a hash given in hex (at least its first 16 digits)."""
    return int.from_bytes(bytes.fromhex(hash_hex[:16]), "little")


class IndexView:
    """Block -> registrations holding it, for one model's index, in memory."""

    def __init__(self) -> None:
        self._holders: dict[int, Holders] = {}
        self._slot_of: dict[tuple[str, int], int] = {}  # (worker_id, generation) -> slot
        self._member: dict[int, tuple[str, int]] = {}  # slot -> (worker_id, generation)
        self._held: dict[int, set[int]] = {}  # slot -> block keys (to drop a registration)
        # slot -> its blocks held only in a lower tier: key -> "h" (host) or "d" (disk)
        self._tier: dict[int, dict[int, str]] = {}
        self._next_slot = 0
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __len__(self) -> int:
        """Blocks held by at least one registration."""
        return len(self._holders)

    @property
    def registrations(self) -> list[tuple[str, int]]:
        """(worker_id, generation) of every registration with entries here."""
        return sorted(self._member.values())

    def apply(self, worker_id: str, generation: int, events: Sequence[KVEvent]) -> None:
        """A registration's block-pool events, in order (as `PrefixIndex.publish`)."""
        for event in events:
            op = TIER_OPS[event.kind]
            if op == "-":
                self.remove(worker_id, generation, event.block_hashes)
            else:
                slot = self._slot(worker_id, generation)
                for h in event.block_hashes:
                    self._hold(slot, block_key(h), op)

    def store(self, worker_id: str, generation: int, hashes: Iterable[BlockHash]) -> None:
        """The registration holds these blocks (idempotent)."""
        self.store_keys(worker_id, generation, (block_key(h) for h in hashes))

    def remove(self, worker_id: str, generation: int, hashes: Iterable[BlockHash]) -> None:
        """The registration no longer holds these blocks (idempotent)."""
        self.remove_keys(worker_id, generation, (block_key(h) for h in hashes))

    def apply_ops(self, worker_id: str, generation: int, ops: str) -> None:
        """A registration's ops as the index's events stream carries them: per op its
        character ('+', 'h', 'd' or '-': `TIER_OPS`) and a block's key in 16 hex digits
        (`prefix_index.OP_LEN` characters)."""
        slot = self._slot(worker_id, generation)
        for i in range(0, len(ops), 17):
            key = hex_key(ops[i + 1 : i + 17])
            if ops[i] != "-":
                self._hold(slot, key, ops[i])
            elif key in self._held[slot]:
                self._held[slot].discard(key)
                self._unhold(key, slot)

    def store_keys(self, worker_id: str, generation: int, keys: Iterable[int]) -> None:
        """`store`, by block keys (`block_key`)."""
        slot = self._slot(worker_id, generation)
        for key in keys:
            self._hold(slot, key)

    def remove_keys(self, worker_id: str, generation: int, keys: Iterable[int]) -> None:
        """`remove`, by block keys."""
        slot = self._slot_of.get((worker_id, generation))
        if slot is None:
            return
        held = self._held[slot]
        for key in keys:
            if key in held:
                held.discard(key)
                self._unhold(key, slot)

    def set_tiers(self, worker_id: str, generation: int, tiers: Mapping[int, str]) -> None:
        """A snapshot's tiers: block key -> "h" or "d" for the registration's blocks held
        only in a lower tier (held blocks only; the rest are in its device pool)."""
        slot = self._slot(worker_id, generation)
        held = self._held[slot]
        own = {key: tier for key, tier in tiers.items() if key in held and tier in "hd"}
        if own:
            self._tier.setdefault(slot, {}).update(own)

    def tier_counts(
        self, block_hashes: Sequence[BlockHash], worker_id: str, generation: int, depth: int
    ) -> tuple[int, int]:
        """Of the chain's first `depth` blocks (those the registration holds), how many it
        holds only in host memory and only on disk."""
        slot = self._slot_of.get((worker_id, generation))
        tiers = self._tier.get(slot) if slot is not None else None
        if not tiers or depth <= 0:
            return 0, 0
        found = [tiers.get(block_key(h)) for h in block_hashes[:depth]]
        return found.count("h"), found.count("d")

    def _hold(self, slot: int, key: int, op: str = "+") -> None:
        if op == "+":
            tiers = self._tier.get(slot)
            if tiers:
                tiers.pop(key, None)
        else:
            self._tier.setdefault(slot, {})[key] = op
        held = self._held[slot]
        if key in held:
            return
        held.add(key)
        current = self._holders.get(key)
        if current is None:
            self._holders[key] = slot
        elif isinstance(current, int):
            self._holders[key] = self._intern((current, slot))
        else:
            self._holders[key] = self._intern((*current, slot))

    def drop(self, worker_id: str, generation: int | None = None) -> int:
        """Forget a registration (its lease lapsed, it deregistered, or its worker
        registered again), or every registration of `worker_id`; the entries removed."""
        slots = [
            slot
            for (w, g), slot in self._slot_of.items()
            if w == worker_id and (generation is None or g == generation)
        ]
        removed = 0
        for slot in slots:
            for key in self._held.pop(slot):
                self._unhold(key, slot)
                removed += 1
            self._tier.pop(slot, None)
            del self._slot_of[self._member.pop(slot)]
        return removed

    def drop_older(self, worker_id: str, generation: int) -> int:
        """Forget `worker_id`'s registrations other than `generation` (it registered
        again); the entries removed."""
        older = [g for w, g in self._member.values() if w == worker_id and g != generation]
        return sum(self.drop(worker_id, g) for g in older)

    def drop_all_but(self, live: Mapping[str, int]) -> int:
        """Forget every registration that is not one of `live` (worker_id -> generation):
        after the router refreshed the live workers. The entries removed."""
        dead = [m for m in self._member.values() if live.get(m[0]) != m[1]]
        return sum(self.drop(w, g) for w, g in dead)

    def approx_bytes(self) -> int:
        """The view's memory, by `sys.getsizeof` of its containers and what they hold
        (ints shared by CPython's small-int cache are counted too: an upper bound)."""
        size = sys.getsizeof(self._holders) + sys.getsizeof(self._held)
        for key, holders in self._holders.items():
            size += sys.getsizeof(key) + sys.getsizeof(holders)
        for held in self._held.values():
            size += sys.getsizeof(held)  # its keys are the entries' keys, counted above
        for tiers in self._tier.values():
            size += sys.getsizeof(tiers)
        return size

    def match(self, block_hashes: Sequence[BlockHash], live: Mapping[str, int]) -> dict[str, int]:
        """Per live worker (worker_id -> its current generation), the leading blocks of
        the chain it holds, stopping at its first missing block: `PrefixIndex.match`'s
        counts (0 for a live worker holding none)."""
        return {**dict.fromkeys(live, 0), **self.holders(block_hashes, live)}

    def holders(self, block_hashes: Sequence[BlockHash], live: Mapping[str, int]) -> dict[str, int]:
        """`match` without the workers holding none of the chain: time proportional to
        the chain and the holders of its blocks, whatever the fleet's size."""
        counts: dict[str, int] = {}
        running: set[int] | None = None  # slots still matching
        for depth, h in enumerate(block_hashes):
            holders = self._holders.get(block_key(h))
            if holders is None:
                break
            slots = (holders,) if isinstance(holders, int) else holders
            if running is None:  # the first block: its live holders start
                running = set()
                for slot in slots:
                    worker_id, generation = self._member[slot]
                    if live.get(worker_id) == generation:
                        running.add(slot)
            else:
                running.intersection_update(slots)
            if not running:
                break
            for slot in running:
                counts[self._member[slot][0]] = depth + 1
        return counts

    def levels(self, block_hashes: Sequence[BlockHash]) -> list[tuple[int, set[int]]]:
        """Who holds how much of the chain, by registration slot: (depth, the slots
        holding exactly `depth` leading blocks), deepest first, depth > 0 only. Liveness
        is the caller's (`member`). Time: the chain, plus the holders where they change
        from one block to the next."""
        out: list[tuple[int, set[int]]] = []
        running: set[int] | None = None
        previous: Holders | None = None
        depth = 0
        for h in block_hashes:
            holders = self._holders.get(block_key(h))
            if holders is None:
                break
            if holders is not previous:
                slots = {holders} if isinstance(holders, int) else set(holders)
                if running is None:
                    running = slots
                else:
                    kept = running & slots
                    if len(kept) != len(running):
                        out.append((depth, running - kept))
                        running = kept
                previous = holders
            if not running:
                break
            depth += 1
        if running:
            out.append((depth, running))
        out.reverse()
        return [(d, slots) for d, slots in out if d > 0]

    def member(self, slot: int) -> tuple[str, int] | None:
        """The registration (worker_id, generation) of a slot, None once dropped."""
        return self._member.get(slot)

    def slot_of(self, worker_id: str, generation: int, create: bool = False) -> int | None:
        """A registration's slot (made, empty, with `create`)."""
        if create:
            return self._slot(worker_id, generation)
        return self._slot_of.get((worker_id, generation))

    def _slot(self, worker_id: str, generation: int) -> int:
        slot = self._slot_of.get((worker_id, generation))
        if slot is None:
            slot = self._slot_of[(worker_id, generation)] = self._next_slot
            self._next_slot += 1
            self._member[slot] = (worker_id, generation)
            self._held[slot] = set()
        return slot

    def _unhold(self, key: int, slot: int) -> None:
        tiers = self._tier.get(slot)
        if tiers:
            tiers.pop(key, None)
        current = self._holders[key]
        if isinstance(current, int):
            del self._holders[key]
            return
        rest = tuple(s for s in current if s != slot)
        self._holders[key] = rest[0] if len(rest) == 1 else self._intern(rest)

    def _intern(self, holders: tuple[int, ...]) -> tuple[int, ...]:
        """One tuple object for equal holder sets: consecutive blocks of a prefix that
        the same workers hold share it, so a walk skips them at the cost of an identity
        check (`levels`), and the memory is shared. A cache, cleared when it grows."""
        if len(self._interned) >= _INTERN_LIMIT:
            self._interned.clear()
        return self._interned.setdefault(holders, holders)
