"""What the engine hands back per request, and the text side of stopping (stop strings)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.common.tokenizer import IncrementalDecoder, Tokenizer
from pdserve.engine.sched.sequence import FinishReason, Sequence, TokenLogprobs


@dataclass
class RequestOutput:
    """A request's result so far. `new_*` fields hold what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    # time.monotonic() of the request's arrival and first admission (for TTFT breakdowns)
    arrival_s: float = 0.0
    first_scheduled_s: float | None = None


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output that stands for two consecutive outputs of one request.

    A stream that falls behind the engine (its reader busy with other streams) then sends
    one message for several tokens instead of one per token; the cumulative fields are
    the later output's already.
    """
    return dataclasses.replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_text=earlier.new_text + later.new_text,
    )


class TextTracker:
    """Incremental text of one sequence and its stop-string check.

    Text that could still be the start of a stop string is held back, so a stream never
    shows a stop string (OpenAI semantics: stop strings are not returned).
    """

    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        self._decoder = IncrementalDecoder(tokenizer, seq.params.skip_special_tokens)
        self._stops = seq.params.stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Add new tokens; return the text now safe to emit. Sets `stopped` on a stop string."""
        if not self.stopped:
            start = max(0, len(self.text) - self._hold)
            self.text += self._decoder.step(token_ids, final=finished)
            self._truncate_at_stop(start)
        end = len(self.text) if (finished or self.stopped) else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _truncate_at_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True


def make_output(
    seq: Sequence, text: str, new_token_ids: list[int], new_text: str, want_logprobs: bool
) -> RequestOutput:
    reason = seq.finish_reason
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=text,
        finished=seq.is_finished,
        finish_reason=reason.value if isinstance(reason, FinishReason) else None,
        new_token_ids=new_token_ids,
        new_text=new_text,
        logprobs=list(seq.output_logprobs) if want_logprobs else None,
        num_cached_tokens=seq.num_cached_prompt_tokens,
        arrival_s=seq.arrival_s,
        first_scheduled_s=seq.first_scheduled_s,
    )
