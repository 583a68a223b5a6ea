"""KV block transport from prefill to decode workers: API (`base`), gRPC, UCX, loopback.

`make_sender` / `make_receiver` build a socket transport by name, importing its library
only when asked (each pulls in a large one). `tls` (gRPC only: UCX has no TLS) encrypts
and authenticates the channel; there is no fallback to plaintext when it is set.
"""

from __future__ import annotations

from pdserve.kv_transfer.base import KVReceiver, KVSender, ReceiverConfig
from pdserve.kv_transfer.tls import TLSConfig

TRANSPORT_NAMES = ("grpc", "ucx")


def _no_tls_on_ucx(name: str, tls: TLSConfig | None) -> None:
    if tls is not None:
        raise ValueError(f"transport {name!r} has no TLS: use 'grpc' for encrypted KV transfers")


def make_sender(name: str, tls: TLSConfig | None = None) -> KVSender:
    if name == "grpc":
        from pdserve.kv_transfer.grpc_backend import GrpcSender

        return GrpcSender(tls=tls)
    if name == "ucx":
        _no_tls_on_ucx(name, tls)
        from pdserve.kv_transfer.ucx_backend import UcxSender

        return UcxSender()
    raise ValueError(f"unknown transport {name!r} (one of {TRANSPORT_NAMES})")


def make_receiver(name: str, config: ReceiverConfig, tls: TLSConfig | None = None) -> KVReceiver:
    if name == "grpc":
        from pdserve.kv_transfer.grpc_backend import GrpcReceiver

        return GrpcReceiver(config, tls=tls)
    if name == "ucx":
        _no_tls_on_ucx(name, tls)
        from pdserve.kv_transfer.ucx_backend import UcxReceiver

        return UcxReceiver(config)
    raise ValueError(f"unknown transport {name!r} (one of {TRANSPORT_NAMES})")
