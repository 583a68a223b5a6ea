"""Continuous batching with iteration-level scheduling (plain Python).

Each step gets a token budget. Running sequences go first (a decode token each, or the
next chunk of a prefill); then waiting ones are admitted in arrival order, reusing
their longest cached prefix, while budget, sequence slots and KV blocks last. When a
running sequence needs a block and none is free, the most recently admitted one is
preempted: its blocks are freed and it waits to be recomputed from its tokens so far,
so it later finishes with exactly the tokens it would have produced anyway.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start: int  # seq.num_computed_tokens when scheduled

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token (and so samples)."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # > 1 new token
    decodes: list[ScheduledSeq] = field(default_factory=list)  # exactly 1 new token
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerStats:
    """Counters since start, for metrics and tests."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefill_steps: int = 0  # prefill chunks that left the prompt unfinished
    num_aborted: int = 0  # requests cancelled before they finished


class Scheduler:
    def __init__(self, kv: KVCacheManager, limits: SchedulerLimits) -> None:
        self.kv = kv
        self.limits = limits
        self.stats = SchedulerStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(out.preempted)
        self.stats.num_chunked_prefill_steps += sum(not s.samples for s in out.prefills)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            seq = self.running.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._allocate_or_preempt(seq, num_new, out):
                break  # seq itself was preempted: nothing else can be freed for it
            scheduled.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new
        self.running = scheduled + self.running
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(seq, num_new):
            victim = self.running.pop() if self.running else seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq)
            num_cached = len(computed) * self.kv.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.limits.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_prompt_tokens = num_cached
                if seq.first_scheduled_s is None:
                    seq.first_scheduled_s = time.monotonic()
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new

    @staticmethod
    def _emit(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        item = ScheduledSeq(seq, num_new, seq.num_computed_tokens)
        (out.decodes if num_new == 1 else out.prefills).append(item)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens; return sequences that finished.

        `sampled` maps request id -> the token sampled for each sequence whose step
        completed its tokens.
        """
        finished: list[Sequence] = []
        for item in (*out.prefills, *out.decodes):
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            token_id = sampled.get(seq.request_id)
            if token_id is None:
                continue
            seq.append_token(token_id)
            reason = self.stop_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why `seq` stops after appending `token_id`, or None to go on."""
        params = seq.params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` (any state) and free its blocks, unless it holds them for a transfer
        (`hold_kv`): then the caller frees them with `kv.free` once the KV is shipped.
        Idempotent."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.hold_kv or reason is FinishReason.ABORT:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_ids: Iterable[str]) -> list[Sequence]:
        ids = set(request_ids)
        victims = [s for s in (*self.running, *self.waiting) if s.request_id in ids]
        for seq in victims:
            self.finish(seq, FinishReason.ABORT)
        self.stats.num_aborted += len(victims)
        return victims
