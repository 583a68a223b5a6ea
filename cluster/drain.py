"""A worker replica leaving its pool (a scale-down): the notice that tells it to drain.

Ray Serve stops a replica it scales down by routing nothing more to it and waiting (up to
the deployment's `graceful_shutdown_timeout_s`) for its requests to end; the replica
itself is told nothing until its destructor runs. The routers are: Serve's request
router in each of them drops the replica from its running set at once
(`router/request_router.py`). A router that sees a worker go announces it here, in
Redis, with a deadline; every router then places nothing more on it, and the worker,
which reads its notice with each heartbeat (`runtime/index_member.py`):

1. leaves the prefix index: its cached prefixes stop attracting requests, and it drops
   out of the routers' live workers;
2. lets its running streams go on until the deadline (`drain_deadline_s` after the
   first router saw it go);
3. then ends those still running with a `migrate` error item: the router resumes each on
   another decode worker, from the tokens already streamed, exactly as after a failure
   (prompt plus tokens so far prefilled there: greedy and seeded sampling give the same
   tokens), counted in `pdserve_drain_migrations_total`.

A prefill replica's transfers are calls Serve waits for: it finishes them.

Key, prefixed like the index's (`pdserve:{model_id}:`): ``drain:{worker_id}`` STRING the
deadline (Unix seconds), set once (NX) by the first router, expiring after an hour.
Plain Python: no torch.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

NOTICE_TTL_S = 3600  # far beyond any replica's graceful shutdown


class DrainNotices:
    """The drain notices of one model's workers.

    Args:
        redis_client: A redis.asyncio client.
        model_id: The model whose workers these are (the index's key prefix).
    """

    def __init__(self, redis_client: aioredis.Redis, model_id: str) -> None:
        self._redis = redis_client
        self._prefix = f"pdserve:{model_id}:drain:"

    async def announce(self, worker_id: str, deadline_in_s: float) -> bool:
        """Tell `worker_id` to drain, its streams moving `deadline_in_s` from now. Only the
        first announcement counts (its deadline holds): True if this was it."""
        deadline = f"{time.time() + deadline_in_s:.3f}"
        return bool(
            await self._redis.set(self._prefix + worker_id, deadline, nx=True, ex=NOTICE_TTL_S)
        )

    async def deadline(self, worker_id: str) -> float | None:
        """When `worker_id`'s streams move elsewhere (Unix seconds); None: not draining."""
        value = await self._redis.get(self._prefix + worker_id)
        return None if value is None else float(value)
