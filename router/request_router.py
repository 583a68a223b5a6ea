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
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

TARGET_KWARG = "target_replica"


class TargetedRequestRouter(RequestRouter):
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
