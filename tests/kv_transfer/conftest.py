"""Transports under test: every backend runs the same conformance suite."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from pdserve.kv_transfer.base import KVLayout, KVReceiver, KVSender, ReceiverConfig
from pdserve.kv_transfer.grpc_backend import GrpcReceiver, GrpcSender
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender

T = TypeVar("T")
TOKEN = "test-cluster-token"


@dataclass
class Transport:
    """A backend under test, with the suite's helpers (tests cannot import conftest)."""

    name: str
    make_receiver: Callable[[ReceiverConfig], KVReceiver]
    make_sender: Callable[[], KVSender]
    uses_sockets: bool
    token: str = TOKEN

    @staticmethod
    def layout(dtype: str = "bfloat16") -> KVLayout:
        return KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)

    def config(self, layout: KVLayout, token: str | None = None, **kwargs: Any) -> ReceiverConfig:
        return ReceiverConfig(cluster_token=token or self.token, layout=layout, **kwargs)

    @staticmethod
    def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run a test body on a fresh event loop, with an overall deadline."""

        async def bounded() -> T:
            return await asyncio.wait_for(coro, timeout_s)

        return asyncio.run(bounded())


def loopback_transport() -> Transport:
    hub = LoopbackHub()
    return Transport(
        "loopback", lambda cfg: LoopbackReceiver(hub, cfg), lambda: LoopbackSender(hub), False
    )


def grpc_transport() -> Transport:
    return Transport("grpc", GrpcReceiver, GrpcSender, True)


TRANSPORTS: dict[str, Callable[[], Transport]] = {"loopback": loopback_transport}
TRANSPORTS["grpc"] = grpc_transport


def ucx_transport() -> Transport:
    from pdserve.kv_transfer.ucx_backend import UcxReceiver, UcxSender

    return Transport("ucx", UcxReceiver, UcxSender, True)


TRANSPORTS["ucx"] = ucx_transport


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> Transport:
    return TRANSPORTS[request.param]()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`socket_transport`: only the backends that talk over real sockets (no skips)."""
    if "socket_transport" in metafunc.fixturenames:
        names = sorted(name for name, make in TRANSPORTS.items() if make().uses_sockets)
        metafunc.parametrize("socket_transport", names, indirect=True)


@pytest.fixture
def socket_transport(request: pytest.FixtureRequest) -> Transport:
    return TRANSPORTS[request.param]()
