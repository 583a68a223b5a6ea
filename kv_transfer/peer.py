"""A stand-alone sender process: pushes an all-zero payload to a receiver, then exits.

    python -m pdserve.kv_transfer.peer --transport grpc --address 127.0.0.1:5555 \\
        --request-id req-1 --token SECRET --num-bytes $((512 << 20))

Tests use it as a prefill worker that can be killed mid-transfer; it is also a quick
smoke test of a receiver from a shell. Exit status 0 on an OK ack, 1 on a typed error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

from pdserve.kv_transfer import make_sender
from pdserve.kv_transfer.base import KVLayout, TransferHeader, block_checksums
from pdserve.kv_transfer.errors import TransferError


def zeros_header(args: argparse.Namespace, layout: KVLayout) -> TransferHeader:
    """The header of an all-zero payload: every block has the checksum of a zero block."""
    num_blocks = max(1, args.num_bytes // layout.block_bytes)
    (zero_sum,) = block_checksums(np.zeros(layout.block_bytes, np.uint8), layout, 1)
    return TransferHeader(
        request_id=args.request_id,
        model_id=args.model_id,
        layout=layout,
        block_checksums=(zero_sum,) * num_blocks,
        lease_ms=args.lease_ms,
        cluster_token=args.token,
    )


async def push(args: argparse.Namespace) -> None:
    layout = KVLayout(
        args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.dtype
    )
    header = zeros_header(args, layout)
    payload = np.zeros(header.payload_bytes, np.uint8)  # calloc'd: untouched pages are free
    sender = make_sender(args.transport)
    try:
        stats = await sender.send(args.address, header, payload, args.timeout_s)
    finally:
        await sender.close()
    print(f"sent {stats.num_bytes} bytes in {stats.seconds:.3f}s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--request-id", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--model-id", default="m")
    parser.add_argument("--num-bytes", type=int, default=512 << 20)
    parser.add_argument("--lease-ms", type=int, default=30_000)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        asyncio.run(push(parse_args(argv)))
    except TransferError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
