"""The router's side of a scale-down: announce each worker that leaves its pool.

Serve drops a replica it stops from the running set its request routers hold
(`router/request_router.py` notes it in `DEPARTURES`); the router then places nothing
more on it (`RouterCore.place` skips every worker in `DEPARTURES.seen`) and announces
it in Redis (cluster/drain.py), with the model's `drain_deadline_s`: the worker leaves the
index and, past the deadline, moves its streams elsewhere. Every router that saw it go
announces it; the first announcement's deadline holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from redis.exceptions import RedisError

from pdserve.cluster.settings import model_app_name
from pdserve.router.models import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
from pdserve.router.request_router import DEPARTURES, Departures

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the departures Serve's routers noted are read
_ROLES = {DECODE_DEPLOYMENT: "decode", PREFILL_DEPLOYMENT: "prefill"}


class Announces(Protocol):
    async def announce(self, worker_id: str, deadline_in_s: float) -> bool: ...


class Pool(Protocol):
    """What announcing needs of a served model (`router/models.py` `ServedModel`)."""

    @property
    def drain_notices(self) -> Announces: ...

    @property
    def drain_deadline_s(self) -> float: ...

    def count_drain(self, role: str) -> None: ...


async def announce_departures(
    pools: Mapping[str, Pool],
    departures: Departures = DEPARTURES,
    single: bool = True,
) -> int:
    """Announce every departure noted since the last call; the number announced.

    `pools`: the served models by id. A departure of another application, or of a
    deployment that is no pool, is ignored; one Redis did not take is noted again for
    the next call.
    """
    announced = 0
    retry: list[tuple[str, str, str]] = []
    for app, deployment, replica_id in departures.take():
        role = _ROLES.get(deployment)
        model = _model_of(pools, app, single)
        if role is None or model is None:
            continue
        pool = pools[model]
        try:
            first = await pool.drain_notices.announce(replica_id, pool.drain_deadline_s)
        except (RedisError, OSError) as exc:
            logger.warning("could not announce the drain of %s (%r); will retry", replica_id, exc)
            retry.append((app, deployment, replica_id))
            continue
        if first:
            pool.count_drain(role)
            logger.info(
                "%s worker %s left its pool: drains, its streams move in %g s",
                role,
                replica_id,
                pool.drain_deadline_s,
            )
        announced += 1
    for app, deployment, replica_id in retry:
        departures.note(app, deployment, {replica_id})
    return announced


def _model_of(pools: Mapping[str, Pool], app: str, single: bool) -> str | None:
    """The model whose pools application `app` runs: the one model when the router and
    its pools are one application, else the model whose application it is."""
    for model in pools:
        if model_app_name(model) == app:
            return model
    return next(iter(pools)) if single and len(pools) == 1 else None


async def run(pools: Callable[[], Mapping[str, Pool]], single: bool) -> None:
    """Announce departures every POLL_S until cancelled."""
    while True:
        await asyncio.sleep(POLL_S)
        await announce_departures(pools(), single=single)
