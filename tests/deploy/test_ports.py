"""`pdserve up`'s check of its direct-ingress ports, on real loopback sockets.

Serve's direct ingress binds a router's port without SO_REUSEADDR and never retries a port
it failed to bind once, so a restart while the last server's connections sit in TIME_WAIT
must wait them out before Ray starts, and a port another process listens on must fail at
once with a clear message.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.deploy.ports import (
    FREE,
    IN_USE,
    LINGERING,
    PortInUseError,
    port_state,
    wait_for_ports,
)
from pdserve.deploy.redis_server import free_port
from tests.deploy.test_cli import run_cli

HOST = "127.0.0.1"


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.create_server((HOST, 0)) as sock:
        yield sock.getsockname()[1]


@pytest.fixture
def lingering_port() -> int:
    """A port whose server closed a connection first, so the kernel keeps that side in
    TIME_WAIT after the listener itself is closed (what a stopped `pdserve up` leaves).
    Bound as Serve binds it, without SO_REUSEADDR: its TIME_WAIT then blocks even an
    SO_REUSEADDR bind."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((HOST, 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection((HOST, port), timeout=5)
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: it is the one left in TIME_WAIT
    client.settimeout(5)
    assert client.recv(1) == b""  # the server's FIN reached the client
    client.close()
    server.close()
    return port


def test_a_free_port_is_free() -> None:
    port = free_port(HOST)
    assert port_state(HOST, port) == FREE
    wait_for_ports(HOST, [port], timeout_s=0.0)


def test_a_listened_port_fails_at_once(listener: int) -> None:
    assert port_state(HOST, listener) == IN_USE
    waited: list[int] = []
    with pytest.raises(PortInUseError, match="in use by another process"):
        wait_for_ports(HOST, [listener], timeout_s=30.0, on_wait=waited.append)
    assert waited == []


def test_time_wait_connections_are_waited_for_then_reported(lingering_port: int) -> None:
    if port_state(HOST, lingering_port) != LINGERING:
        pytest.fail("the closed server connection did not linger in TIME_WAIT")
    waited: list[int] = []
    with pytest.raises(PortInUseError, match="TIME_WAIT"):
        wait_for_ports(HOST, [lingering_port], timeout_s=0.3, on_wait=waited.append)
    assert waited == [lingering_port]  # told once, not once per poll


@pytest.mark.cluster  # runs `pdserve up`
def test_up_refuses_a_router_port_in_use_before_starting_anything(
    listener: int, random_model_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", str(random_model_dir), "--host", HOST, "--port", str(listener)]
    result = run_cli("up", *args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"{HOST}:{listener} is in use by another process" in result.stderr
    assert "starting" not in result.stderr  # neither Redis nor Ray was started
