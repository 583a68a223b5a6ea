"""The router's timeline (common/timeline.py): each request's stages. Off (None) unless
PDSERVE_TIMELINE_DIR is set."""

from __future__ import annotations

from pdserve.cluster.messages import OutputItem, PrefillReport
from pdserve.common.timeline import Timeline, wall_of
from pdserve.router.disagg import Decision
from pdserve.router.placement import Choice


class RouterTimeline:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    @classmethod
    def from_env(cls, model_id: str) -> RouterTimeline | None:
        timeline = Timeline.from_env("router", model=model_id)
        return None if timeline is None else cls(timeline)

    def dispatched(
        self,
        request_id: str,
        arrival_s: float,
        attempt: int,
        prompt_len: int,
        p: Choice | None,
        d: Choice | None,
        decision: Decision | None,
    ) -> None:
        """An attempt is sent (`arrival_s`: the request's, monotonic)."""
        self.timeline.write(
            "dispatch",
            rid=request_id,
            arrival=wall_of(arrival_s),
            attempt=attempt,
            prompt=prompt_len,
            prefill=p.worker_id if p is not None else None,
            decode=d.worker_id if d is not None else None,
            where=decision.where if decision is not None else "colocated",
            reason=decision.reason if decision is not None else None,
            saved_s=decision.saved_s if decision is not None else 0.0,
        )

    def prefilled(
        self, request_id: str, worker: str | None, report: PrefillReport, push_s: float
    ) -> None:
        self.timeline.write(
            "prefill",
            rid=request_id,
            worker=worker,
            queue_s=report["queue_s"],
            compute_s=report["compute_s"],
            push_s=push_s,
            blocks=report["num_blocks_sent"],
        )

    def first(self, request_id: str, decode: str | None, item: OutputItem) -> None:
        kv_used, why = item.get("kv_used", False), item.get("local_prefill")
        self.timeline.write("first", rid=request_id, decode=decode, kv_used=kv_used, local=why)

    def done(self, request_id: str, tokens: int) -> None:
        self.timeline.write("done", rid=request_id, tokens=tokens)
