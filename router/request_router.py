"""A Ray Serve request router that sends each call to the replica placement chose.

The router ingress picks prefill and decode workers itself (prefix index + load, see
`placement.py`) and passes the chosen replica's id as the `target_replica` keyword
argument of the call. This `RequestRouter` (Ray Serve's extension point for routing,
`ray.serve.request_router`) ranks that replica first. If it is gone (scaled down, died
since the index last saw it) the others follow, least busy first by Serve's own queue
length cache, so a call is never stuck on a vanished replica; a call without a target
(placement had no index) goes to the least busy. The split survives either way: a
decode replica takes KV whichever replica it is, and reports its id and receiver address
to the router, which counts the override (`pdserve_placement_overrides_total{role}`)
and has the prefill worker push to that address.

It also notes the replicas that leave the running set (`DEPARTURES`): the router then
tells each to drain (cluster/drain.py).
"""

from __future__ import annotations

import threading

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

TARGET_KWARG = "target_replica"


class Departures:
    """Replicas that left a deployment's running set, as this process's request routers
    saw them go (Serve drops a replica it stops from the set at once: a scale-down, or
    one that died). The router announces each to its worker (cluster/drain.py) and places
    nothing more on it. Thread-safe: Serve's routers run on their own event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[tuple[str, str, str]] = []  # (app, deployment, replica id)
        self.seen: set[str] = set()  # every replica id seen leaving, for placement

    def note(self, app: str, deployment: str, replica_ids: set[str]) -> None:
        with self._lock:
            self._new += [(app, deployment, r) for r in sorted(replica_ids)]
            self.seen |= replica_ids

    def take(self) -> list[tuple[str, str, str]]:
        """The departures noted since the last call."""
        with self._lock:
            new, self._new = self._new, []
        return new


DEPARTURES = Departures()


class TargetedRequestRouter(RequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        gone = before - {r.replica_id.unique_id for r in replicas}
        if gone:
            # NOTE: through the imported module, not this function's globals: Serve
            # builds the request router from a pickled copy of this class, whose module
            # globals (DEPARTURES among them) are copies too, made anew each time.
            from pdserve.router import request_router

            deployment = self._deployment_id
            request_router.DEPARTURES.note(deployment.app_name, deployment.name, gone)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Every call ranks all candidates, so when none can take the request now, Serve
        # must back off before asking again (without this flag it retries in a busy loop).
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET_KWARG)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        queue_lens = self.replica_queue_len_cache
        others.sort(key=lambda r: queue_lens.get(r.replica_id) or 0)
        return [chosen, others] if chosen else [others]
