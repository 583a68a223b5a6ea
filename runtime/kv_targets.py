"""Where a request's KV goes: a decode replica's receivers and the KV heads each owns.

A decode replica with one rank announces its receiver's address. A tensor-parallel one
announces every rank's receiver with its KV heads, as one string (`join_targets`) that
the index and the router carry as they carry any address; a prefill worker splits it
(`split_targets`) and sends each rank's heads straight there (`send_parts`;
runtime/tp_ranks.py has the whole design).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from pdserve.engine.worker.kv_handoff import HeadRange
from pdserve.kv_transfer.base import KVLayout, KVSender, make_header
from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.torch_payload import part_layout, payload_bytes

_TARGETS_PREFIX = "kv-ranks:"


def join_targets(targets: Sequence[tuple[str, HeadRange]]) -> str:
    """A tensor-parallel decode replica's KV address: every rank's receiver and heads."""
    return _TARGETS_PREFIX + json.dumps([[a, h[0], h[1]] for a, h in targets])


def split_targets(address: str) -> list[tuple[str, HeadRange | None]]:
    """(receiver address, its KV heads) for each rank behind a decode replica's address;
    a plain address is one receiver owning every head (heads None)."""
    if not address.startswith(_TARGETS_PREFIX):
        return [(address, None)]
    try:
        return [
            (str(a), (int(h0), int(h1)))
            for a, h0, h1 in json.loads(address[len(_TARGETS_PREFIX) :])
        ]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed tensor-parallel KV address {address!r}") from exc


async def send_parts(
    sender: KVSender,
    request_id: str,
    parts: Sequence[Any],
    targets: Sequence[tuple[str, HeadRange]],
    header: dict[str, Any],
    layout: KVLayout,
    timeout_s: float,
) -> list[tuple[int, float]]:
    """Send each packed part (engine/worker/kv_handoff.py `ExportedPart`) to every target whose
    heads contain it; (bytes, seconds) per transfer, concurrently. `header`: the fields of
    `make_header` common to every part; `layout`: the sender's cache layout (its heads
    count replaced by each part's). `targets` ranges are global head indices; a part
    covering every head of the model (`header["total_kv_heads"]`) goes without a head
    range, as with no tensor parallelism at all."""
    total = header["total_kv_heads"]
    fields = {k: v for k, v in header.items() if k not in ("total_kv_heads", "model_id", "token")}

    async def one(part: Any, address: str) -> tuple[int, float]:
        payload = payload_bytes(await asyncio.to_thread(part.staged.wait))
        start, end = part.kv_heads
        transfer = make_header(
            request_id,
            header["model_id"],
            part_layout(layout, (start, end)),
            payload,
            header["token"],
            kv_heads=None if (start, end) == (0, total) else (start, end),
            **fields,
        )
        stats = await sender.send(address, transfer, payload, timeout_s=timeout_s)
        return stats.num_bytes, stats.seconds

    sends = [
        one(part, address)
        for part in parts
        for address, (lo, hi) in targets
        if lo <= part.kv_heads[0] and part.kv_heads[1] <= hi
    ]
    if len(sends) < len(parts):
        raise TransferError(f"{request_id}: no receiver owns some of KV heads {parts}")
    return list(await asyncio.gather(*sends))
