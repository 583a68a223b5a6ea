"""Whether Serve's direct ingress will be able to take its HTTP ports on this host.

A router replica with direct ingress binds its port with a plain socket (no
SO_REUSEADDR), and Serve marks a port it once failed to bind as taken for the rest of the
cluster's life. So `pdserve up` restarted on the same port within a minute of serving
traffic, while the kernel still holds the last server's closed connections in TIME_WAIT,
would never become ready: the one port in the router range is blocked for good. This
module tells "taken by a listener" (an error at once) from "lingering closed connections"
(wait for the kernel to let go, at most TIME_WAIT's 60 s on Linux) before Ray starts.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable

# Linux keeps a closed connection in TIME_WAIT for 60 s; a little over that.
LINGER_WAIT_S = 65.0
_POLL_S = 0.5

FREE = "free"
LINGERING = "lingering"  # nothing listens, yet it cannot be bound: TIME_WAIT connections
IN_USE = "in_use"  # something accepts connections on it


class PortInUseError(OSError):
    """A port that an ingress needs is bound by another socket, or stays held too long."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_state(host: str, port: int) -> str:
    """FREE if a plain bind of host:port succeeds (as Serve's direct ingress binds it);
    else IN_USE if something accepts connections there, LINGERING if nothing does
    (closed connections in TIME_WAIT: they block even an SO_REUSEADDR bind when the
    server that left them bound without it, as Serve does)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
            return FREE
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((probe, port), timeout=2.0):
            return IN_USE
    except OSError:
        return LINGERING


def wait_for_ports(
    host: str,
    ports: Iterable[int],
    timeout_s: float = LINGER_WAIT_S,
    on_wait: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Return once every port is FREE (or `stop` is set); `on_wait(port)` once per
    lingering port.

    Raises:
        PortInUseError: a port is IN_USE, or still LINGERING after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    for port in ports:
        told = False
        while True:
            state = port_state(host, port)
            if state == FREE:
                break
            if state == IN_USE:
                raise PortInUseError(
                    errno.EADDRINUSE, f"{host}:{port} is in use by another process"
                )
            if time.monotonic() >= deadline:
                raise PortInUseError(
                    errno.EADDRINUSE,
                    f"{host}:{port} is still held by closed connections (TIME_WAIT) "
                    f"after {timeout_s:g}s",
                )
            if not told and on_wait is not None:
                on_wait(port)
                told = True
            if stop is None:
                time.sleep(_POLL_S)
            elif stop.wait(_POLL_S):
                return
