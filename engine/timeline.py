"""An engine's timeline (common/timeline.py): its steps, and its requests' arrivals and
first tokens. Off (None) unless PDSERVE_TIMELINE_DIR is set."""

from __future__ import annotations

from pdserve.common.timeline import Timeline
from pdserve.engine.sched.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence


class EngineTimeline:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    @classmethod
    def from_env(cls, model_id: str) -> EngineTimeline | None:
        timeline = Timeline.from_env("engine", model=model_id)
        return None if timeline is None else cls(timeline)

    def added(self, seq: Sequence, prefilled: bool = False) -> None:
        """A request arrived; `prefilled`: with its prompt's KV and first token."""
        rid, n = seq.request_id, len(seq.prompt_token_ids)
        self.timeline.write("add", rid=rid, prompt=n, prefilled=prefilled)
        if prefilled:
            self.timeline.write("first", rid=rid)

    def step(
        self,
        start_wall: float,
        duration_s: float,
        sched_out: SchedulerOutput,
        scheduler: Scheduler,
        produced: dict[str, int],
    ) -> None:
        """One step, and the first tokens it produced (`produced`: each request's new
        tokens in it)."""
        self.timeline.write(
            "step",
            t=start_wall,
            dur=duration_s,
            prefill=[[s.seq.request_id, s.start, s.num_new_tokens] for s in sched_out.prefills],
            decode=len(sched_out.decodes),
            verify=sum(s.num_new_tokens for s in sched_out.verifies),
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
        )
        for item in sched_out.scheduled:
            seq = item.seq
            new = produced.get(seq.request_id, 0)
            if new and len(seq.output_token_ids) == new:
                self.timeline.write("first", rid=seq.request_id)

    def close(self) -> None:
        self.timeline.close()
