"""Peer fetch, the router's side: whether a prompt's prefix should come from the worker
holding it (docs/kv-tiers.md, "Fetching from a peer").

Placement weighs a prefix hit against load and may choose a decode worker that holds
less of a prompt's prefix than another worker, of either pool, to prefill it (colocated
mode; in disaggregated mode a prompt the router left to the decode worker). The blocks it
lacks are then computed there, unless the holder pushes them: `choose_fetch` names the
holder when the blocks are at least `kv_fetch_min_blocks` and the measured push (this
router's record of earlier fetches, plus the holder's copies out of its host-memory or
disk tier for the blocks only a tier holds there) is sooner than computing them at the
chosen worker's measured rate. Unmeasured, it fetches: that is how the push gets
measured. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pdserve.cluster.prefix_index import MatchResult
from pdserve.router.placement import tier_cost_s


class Fetch(NamedTuple):
    """Blocks `first_block`..`num_blocks - 1` of the prompt, pushed by `holder`."""

    holder: str
    num_blocks: int
    first_block: int
    compute_s: float | None  # what computing them would take (None: not measured)
    fetch_s: float | None  # what pushing them is expected to take (None: not measured)
    holder_role: str = "decode"  # which pool's handle the holder is called on


def choose_fetch(
    chosen: str,
    matches: Mapping[str, MatchResult],
    num_prompt_tokens: int,
    block_size: int,
    min_blocks: int,
    tokens_per_s: float | None,
    fetch_s_per_block: float | None,
) -> Fetch | None:
    """The fetch for a prompt placed on `chosen`, or None (nothing worth fetching, or
    computing it is sooner). `matches`: each live worker's hit on the prompt's chain
    (either pool: a prefill worker holds what it prefilled); `tokens_per_s`: the chosen
    worker's prefill rate."""
    if min_blocks <= 0 or chosen not in matches:
        return None
    usable = (num_prompt_tokens - 1) // block_size  # a lookup always leaves a token
    have = min(matches[chosen].matched_blocks, usable)
    best: tuple[int, str] | None = None
    for worker_id, m in matches.items():
        if worker_id != chosen:
            held = min(m.matched_blocks, usable)
            if best is None or (held, worker_id) > best:
                best = (held, worker_id)
    if best is None or best[0] - have < min_blocks:
        return None
    held, holder = best
    blocks = held - have
    compute_s = blocks * block_size / tokens_per_s if tokens_per_s else None
    fetch_s = None
    if fetch_s_per_block is not None:
        # the holder's tiered blocks, prorated over what it pushes: their copies first
        m = matches[holder]
        tier_s = tier_cost_s(m) * blocks / m.matched_blocks if m.matched_blocks else 0.0
        fetch_s = blocks * fetch_s_per_block + tier_s
    if compute_s is not None and fetch_s is not None and fetch_s >= compute_s:
        return None
    return Fetch(holder, held, have, compute_s, fetch_s, matches[holder].worker.role)
