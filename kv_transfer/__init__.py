"""KV block transport from prefill to decode workers: API (`base`), gRPC, UCX, loopback.

`make_sender` / `make_receiver` build a socket transport by name, importing its library
only when asked (each pulls in a large one).
"""

from __future__ import annotations

from pdserve.kv_transfer.base import KVReceiver, KVSender, ReceiverConfig

TRANSPORT_NAMES = ("grpc", "ucx")


def make_sender(name: str) -> KVSender:
    if name == "grpc":
        from pdserve.kv_transfer.grpc_backend import GrpcSender

        return GrpcSender()
    if name == "ucx":
        from pdserve.kv_transfer.ucx_backend import UcxSender

        return UcxSender()
    raise ValueError(f"unknown transport {name!r} (one of {TRANSPORT_NAMES})")


def make_receiver(name: str, config: ReceiverConfig) -> KVReceiver:
    if name == "grpc":
        from pdserve.kv_transfer.grpc_backend import GrpcReceiver

        return GrpcReceiver(config)
    if name == "ucx":
        from pdserve.kv_transfer.ucx_backend import UcxReceiver

        return UcxReceiver(config)
    raise ValueError(f"unknown transport {name!r} (one of {TRANSPORT_NAMES})")
