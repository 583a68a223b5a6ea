"""The stop notice: `pdserve up` tells the routers to drain before it stops the pools.

Deleting a Serve application stops all of its deployments at once: the pools stop taking
calls while a router may still be admitting requests, and a request admitted then waits
for a pool that will never answer. So `pdserve up` stops in order. It publishes a notice
on the cluster's Redis, and every router replica subscribed there drains (router/
draining.py: new requests 503, running streams finish or end with an error event after
the grace) and, once it holds no request, says so. Only then, or at the end of the grace,
are the applications deleted, and Redis is stopped last.

PUBLISH answers how many subscribers got the notice, so `pdserve up` knows how many
routers to wait for. A stop that does not come from `pdserve up` (`serve run`'s Ctrl-C,
`serve shutdown`, a KubeRay redeploy) has no notice: the routers see their application
being deleted instead (draining.py polls Serve for it).

Keys and channels are named after a digest of the cluster token, which only the
cluster's own processes know: `pdserve:stop:<digest>` (the channel) and
`pdserve:stop:<digest>:drained` (the set of drained routers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

DRAINED_TTL_S = 600  # the drained set outlives any stop
_RESUBSCRIBE_S = 1.0  # after a lost subscription (Redis restarting)


def _base(cluster_token: str) -> str:
    digest = hashlib.sha256(cluster_token.encode()).hexdigest()[:16]
    return f"pdserve:stop:{digest}"


def channel(cluster_token: str) -> str:
    return _base(cluster_token)


def drained_key(cluster_token: str) -> str:
    return f"{_base(cluster_token)}:drained"


def announce(redis_url: str, cluster_token: str, grace_s: float, timeout_s: float = 2.0) -> int:
    """Publish the stop (blocking, for `pdserve up`); return how many routers got it."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s)
    try:
        client.delete(drained_key(cluster_token))
        return int(client.publish(channel(cluster_token), json.dumps({"grace_s": grace_s})))
    finally:
        client.close()


def wait_drained(
    redis_url: str, cluster_token: str, count: int, until_s: float, poll_s: float = 0.1
) -> int:
    """Wait until `count` routers said they drained, or time.monotonic() reaches `until_s`;
    return how many did (blocking, for `pdserve up`)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        while True:
            drained = int(client.scard(drained_key(cluster_token)))
            if drained >= count or time.monotonic() >= until_s:
                return drained
            time.sleep(poll_s)  # a set in Redis: nothing to wait on but its size
    finally:
        client.close()


async def mark_drained(redis: Any, cluster_token: str, router_id: str) -> None:
    """This router holds no request any more (router side)."""
    key = drained_key(cluster_token)
    await redis.sadd(key, router_id)
    await redis.expire(key, DRAINED_TTL_S)


async def listen(redis: Any, cluster_token: str, on_notice: Callable[[float], None]) -> None:
    """Call `on_notice(grace_s)` when the stop is published (router side; runs until
    cancelled, subscribing again whenever Redis drops the subscription)."""
    name = channel(cluster_token)
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(name)
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "message":
                    on_notice(float(json.loads(message["data"])["grace_s"]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis down or restarting: subscribe again
            logger.debug("stop notice: subscription lost (%r)", exc)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        await asyncio.sleep(_RESUBSCRIBE_S)
