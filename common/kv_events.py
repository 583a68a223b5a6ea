"""What an engine's prefix cache reports to the cluster: blocks registered or evicted.

The engine's block pool records them (engine/sched/block_pool.py); a worker publishes
them to the cluster's prefix index (runtime/index_member.py), and every router's view
replays them (cluster/index_view.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.hashing import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    """Blocks registered in (STORED) or evicted from (REMOVED) the prefix cache."""

    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...]
