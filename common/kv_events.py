"""What an engine's prefix cache reports to the cluster: blocks registered, moved to a
lower tier, or evicted.

The engine's block pool records them (engine/sched/block_pool.py); a worker publishes
them to the cluster's prefix index (runtime/index_member.py), and every router's view
replays them (cluster/index_view.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.hashing import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"  # in the device pool (registered, or promoted back from a tier)
    DEMOTED_HOST = "host"  # left the device pool, held in host memory
    DEMOTED_DISK = "disk"  # held on disk only
    REMOVED = "removed"  # no longer held anywhere


TIER_OPS = {
    KVEventKind.STORED: "+",
    KVEventKind.DEMOTED_HOST: "h",
    KVEventKind.DEMOTED_DISK: "d",
    KVEventKind.REMOVED: "-",
}
"""Each kind's one-character op, as the prefix index and its events stream carry it."""


@dataclass(frozen=True)
class KVEvent:
    """Blocks of the prefix cache and where they now are: in the device pool (STORED), in
    a lower tier only (DEMOTED_HOST, DEMOTED_DISK; still held, at the cost of a copy), or
    gone (REMOVED). The cluster's prefix index keeps each held block's tier, so placement
    can weigh a hit by what using it costs (docs/kv-tiers.md)."""

    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...]
