"""Continuous batching with iteration-level scheduling (plain Python).

Each step gets a token budget. Running sequences go first (a decode token each, or the
next chunk of a prefill); then waiting ones are admitted in order, reusing their longest
cached prefix, while budget, sequence slots and KV blocks last. When a running sequence
needs a block and none is free, another is preempted: its blocks are freed and it waits
to be recomputed from its tokens so far, so it later finishes with exactly the tokens it
would have produced anyway.

Priorities (`SamplingParams.priority`, larger is more important: the opposite of vLLM,
where smaller goes first): the waiting queue is ordered by priority, then arrival (a
preempted sequence goes back ahead of the waiting ones of its priority), and the running
list by priority, then admission, so each step serves the most important first and a
preemption takes the least important, most recently admitted sequence. With one
priority throughout this is plain arrival order and newest-first preemption.

With a step-time target (`SchedulerLimits.step_time_target_s`) and a cost model, a step
that has decode rows takes only as many prefill tokens (new prompts, chunks of long ones,
recomputed preempted sequences alike) as keep its predicted time within the target, but
always at least `min_prefill_chunk` so prompts still progress: every running stream waits
for the whole step, so an uncapped prompt would stall them all (Sarathi-style chunking).
A step without decode rows keeps the whole token budget: no stream waits on it.
The cap holds only while prefill keeps up (`SchedulerLimits.prefill_wait_limit_s`): once
a request has waited longer than that to be admitted, steps take the whole token budget
until no request has. Capped steps prefill fewer tokens per
second (small chunks, each step's fixed cost paid more often); when prompts arrive faster
than that, a cap without the limit lets the queue, and TTFT, grow without bound (the
`mid` model at 2 requests/s of 512-token prompts on 2 cores: TTFT p50 ~4 s under a 100
ms target, against ~0.6 s for vLLM, which caps nothing).

With a proposer (speculative decoding, `engine/spec_decode/proposer.py`), the token budget left
once every running sequence has its decode token or prefill chunk goes to proposals
before waiting requests are admitted: a decoding sequence with `m` proposed tokens (as
many as the adaptive `SpecPolicy` finds worth their cost, when it is on) becomes a
*verify* row of `m + 1` query tokens (its last token, then the proposals), for which
KV slots are reserved like any chunk. Speculation never preempts: a proposal that
does not fit the free blocks is dropped. A draft model (a `BatchProposer`) writes its own
KV into those slots while proposing, so for it the lengths are decided and the slots
reserved first, and it is asked once for the whole step. After the step, `update` keeps the accepted
tokens only: the sequence's computed tokens end at the accepted length (the KV written
for rejected proposals lies beyond it, never read, and is overwritten by the next step),
and blocks that held only rejected slots go back to the pool. Block hashes come from
`seq.all_token_ids`, which never holds an unaccepted token, so no block holding one is
ever registered in the prefix cache.

LoRA adapters (`lora_slots`, engine/sched/lora_slots.py): a step holds sequences of at
most `max_loras` adapters, the resident ones. A waiting sequence whose adapter can get
no slot (every resident adapter serves running sequences) stays in its place in the
queue while those behind it are admitted. A sequence that joins the running batch
directly (its prompt's KV imported from a prefill worker) takes its slot then
(`take_lora_slot`), or is refused.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.lora_slots import LoRASlots
from pdserve.engine.sched.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.sched.step_cost import StepShape, chunk_attention
from pdserve.engine.spec_decode.proposer import BatchProposer, Proposer, SpecPolicy, SpecStats

# Called after each token `update` appends (and its token-level stop check), with the
# token's index among the sequence's tokens of this step; True ends the sequence (STOP):
# the engine's stop-string check.
OnToken = Callable[[Sequence, int, int], bool]


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query tokens of its row (a verify row: 1 + the proposals)
    start: int  # seq.num_computed_tokens when scheduled
    # A verify row's proposed tokens, after the sequence's last token (speculative.py).
    spec_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token (and so samples)."""
        return self.start + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # > 1 new token
    decodes: list[ScheduledSeq] = field(default_factory=list)  # exactly 1 new token
    # Decoding sequences with proposals: the last token + the proposals (all sample).
    verifies: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        rows = (*self.prefills, *self.verifies)
        return sum(s.num_new_tokens for s in rows) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies

    @property
    def scheduled(self) -> tuple[ScheduledSeq, ...]:
        """Every scheduled sequence: prefills, verify rows, decodes (the batch's order)."""
        return (*self.prefills, *self.verifies, *self.decodes)

    def shape(self) -> StepShape:
        """What the step costs depend on (the cost model's input). A verify row of n
        tokens runs as n decode rows (model_runner.py), of contexts start + 1..start + n."""
        chunks = [(s.start, s.num_new_tokens) for s in self.prefills]
        verify = [(s.start, s.num_new_tokens) for s in self.verifies]
        return StepShape(
            decode_rows=len(self.decodes) + sum(n for _, n in verify),
            decode_context=sum(s.start + 1 for s in self.decodes)
            + sum(n * start + n * (n + 1) // 2 for start, n in verify),
            prefill_tokens=sum(n for _, n in chunks),
            prefill_attention=sum(chunk_attention(start, n) for start, n in chunks),
        )


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Keep a step with decode rows within this many seconds (needs a cost model and
    # chunked prefill; None: the token budget alone), granting at least
    # `min_prefill_chunk` prefill tokens per step whatever the prediction.
    step_time_target_s: float | None = None
    min_prefill_chunk: int = 16
    # Drop that cap for a step while a request not yet admitted arrived more than this many
    # seconds ago; None: never.
    prefill_wait_limit_s: float | None = None


class StepCostPredictor(Protocol):
    """What the scheduler needs of a cost model (`step_cost.StepCostModel`, or a fake)."""

    def predict(self, shape: StepShape) -> float | None: ...


@dataclass
class SchedulerStats:
    """Counters since start, for metrics and tests."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefill_steps: int = 0  # prefill chunks that left the prompt unfinished
    num_aborted: int = 0  # requests cancelled before they finished
    num_latency_capped_steps: int = 0  # steps whose prefill the step-time target cut short
    num_backlog_uncapped_steps: int = 0  # steps the prefill wait limit freed from the target


class _PrefillCap:
    """The prefill tokens one step with decode rows may still take, chunk by chunk."""

    def __init__(
        self, cost: StepCostPredictor, target_s: float, shape: StepShape, room: int, floor: int
    ) -> None:
        self.cost = cost
        self.target_s = target_s
        self.shape = shape  # the step so far: its decode rows, then each granted chunk
        self.room = room  # token budget left once every decode row has its token
        self.floor = floor  # prefill tokens still granted whatever the prediction
        self.cut = False  # whether the target cut a chunk short this step

    def allow(self, start: int, want: int) -> int:
        """The largest chunk of at most `want` tokens from `start` that keeps the predicted
        step time within the target (at least what is left of the floor)."""
        want = min(want, self.room)
        if want <= 0 or self._fits(start, want):
            return max(want, 0)
        self.cut = True
        lo, hi = 0, want  # predictions grow with the chunk: lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits(start, mid) else (lo, mid)
        return max(lo, min(self.floor, want))

    def add(self, start: int, num_tokens: int) -> None:
        self.shape = self.shape.with_chunk(start, num_tokens)
        self.room -= num_tokens
        self.floor = max(self.floor - num_tokens, 0)

    def _fits(self, start: int, num_tokens: int) -> bool:
        predicted = self.cost.predict(self.shape.with_chunk(start, num_tokens))
        return predicted is None or predicted <= self.target_s


def _by_priority(seq: Sequence) -> int:
    return -seq.params.priority


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        limits: SchedulerLimits,
        cost_model: StepCostPredictor | None = None,
        proposer: Proposer | BatchProposer | None = None,
        spec_policy: SpecPolicy | None = None,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        self.kv = kv
        self.lora_slots = lora_slots  # resident LoRA adapters; None: every one is
        self.limits = limits
        self.cost_model = cost_model
        self.proposer = proposer  # speculative decoding; None: off
        self.spec_policy = spec_policy  # how much of a proposal to verify; None: all
        self.stats = SchedulerStats()
        self.spec_stats = SpecStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Put `seq` in the waiting queue, after the ones of higher priority and before
        those of lower; among its equals last (a new request) or first (`front`: a
        preempted one, which arrived before them)."""
        waiting, priority = self.waiting, seq.params.priority
        if front and (not waiting or waiting[0].params.priority <= priority):
            waiting.appendleft(seq)
        elif not front and (not waiting or waiting[-1].params.priority >= priority):
            waiting.append(seq)
        else:  # mixed priorities: find its place (the queue is short next to a step)
            at = next(
                (
                    i
                    for i, other in enumerate(waiting)
                    if other.params.priority < priority
                    or (front and other.params.priority == priority)
                ),
                len(waiting),
            )
            waiting.insert(at, seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        # most important first, admission order among equals (a stable sort): the step
        # serves them in that order and preemption takes victims from the end
        self.running.sort(key=_by_priority)
        cap = self._prefill_cap(count=True)
        budget = self._schedule_running(out, budget, cap)
        if self.proposer is not None and not out.preempted:
            budget = self._speculate(out, budget, cap)
        if not out.preempted:
            self._schedule_waiting(out, budget, cap)
        self.stats.num_steps += 1
        self.stats.num_latency_capped_steps += int(cap is not None and cap.cut)
        self.stats.num_preemptions += len(out.preempted)
        self.stats.num_chunked_prefill_steps += sum(not s.samples for s in out.prefills)
        return out

    def prefill_budget(self) -> int:
        """Prefill tokens a step could take now beside the running decodes (a gauge)."""
        cap = self._prefill_cap()
        full = self.limits.max_num_batched_tokens
        return full if cap is None else cap.allow(0, full)

    def _prefill_cap(self, count: bool = False) -> _PrefillCap | None:
        """The step's prefill limit from the step-time target; None: no limit. `count`:
        this is the step's own (its stats count a limit the wait limit lifted)."""
        target, limits = self.limits.step_time_target_s, self.limits
        if target is None or self.cost_model is None or not limits.enable_chunked_prefill:
            return None
        contexts = [
            s.num_computed_tokens + 1
            for s in self.running
            if s.num_tokens - s.num_computed_tokens == 1
        ][: limits.max_num_batched_tokens]
        if not contexts:
            return None  # no stream waits on this step: the whole budget
        if self._prefill_backlogged():
            self.stats.num_backlog_uncapped_steps += int(count)
            return None  # prefill is falling behind: the whole budget until it catches up
        shape = StepShape(decode_rows=len(contexts), decode_context=sum(contexts))
        if self.cost_model.predict(shape) is None:
            return None  # no estimate yet
        room = limits.max_num_batched_tokens - len(contexts)
        return _PrefillCap(self.cost_model, target, shape, room, limits.min_prefill_chunk)

    def _prefill_backlogged(self) -> bool:
        """Whether a request still waiting to be admitted arrived more than
        `prefill_wait_limit_s` ago. Only the waiting queue counts: one long prompt being
        prefilled chunk by chunk under the cap is what the cap is for, however long it
        takes; requests queueing behind it are what says prefill is falling behind."""
        limit = self.limits.prefill_wait_limit_s
        if limit is None or not self.waiting:
            return False
        oldest = min(s.arrival_s for s in self.waiting)
        return time.monotonic() - oldest > limit

    def _schedule_running(self, out: SchedulerOutput, budget: int, cap: _PrefillCap | None) -> int:
        scheduled: list[Sequence] = []  # in running order, including any skipped this step
        while self.running and budget > 0:
            seq = self.running.pop(0)
            start, remaining = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget)
            if cap is not None and remaining > 1:
                num_new = cap.allow(start, num_new)
                if num_new == 0:  # a prefill the target leaves for a later step
                    scheduled.append(seq)
                    continue
            if not self._allocate_or_preempt(seq, num_new, out):
                break  # seq itself was preempted: nothing else can be freed for it
            scheduled.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new
            if cap is not None and remaining > 1:
                cap.add(start, num_new)
        self.running = scheduled + self.running
        return budget

    def _speculate(self, out: SchedulerOutput, budget: int, cap: _PrefillCap | None) -> int:
        """Turn decode rows into verify rows where the proposer has tokens and budget and
        free blocks last (never preempting for them); return the budget left."""
        proposer, policy, stats = self.proposer, self.spec_policy, self.spec_stats
        assert proposer is not None
        if policy is not None:
            rows = sum(s.samples for s in (*out.prefills, *out.decodes))
            policy.begin_step(out.shape().features(), rows)
        if isinstance(proposer, BatchProposer):
            budget = self._speculate_batch(proposer, out, budget, cap)
        else:
            budget = self._speculate_each(proposer, out, budget, cap)
        if out.verifies:
            stats.verify_steps += 1
            stats.verify_rows += len(out.verifies)
            stats.proposed_tokens += sum(len(v.spec_token_ids) for v in out.verifies)
        return budget

    def _room(self, item: ScheduledSeq, k: int, budget: int) -> int:
        """The most tokens `item`'s sequence may have proposed: at most `k`, the budget,
        the tokens the request may still emit and the context holds, minus the one a
        verify row always emits; 0 for a row that does not sample."""
        seq = item.seq
        # NOTE: a constrained sequence never speculates: its proposals would need the
        # grammar's mask at every verify position (and a rollback of the rejected ones).
        if not item.samples or seq.grammar is not None:
            return 0
        return min(
            k,
            budget,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,
            self.limits.max_model_len - seq.num_tokens - 1,
        )

    @staticmethod
    def _verify(
        out: SchedulerOutput, item: ScheduledSeq, proposal: list[int], cap: _PrefillCap | None
    ) -> None:
        """Schedule `item` as a verify row of `proposal` (its slots reserved)."""
        m = len(proposal)
        out.verifies.append(ScheduledSeq(item.seq, 1 + m, item.start, tuple(proposal)))
        if cap is not None:  # each proposal runs as one more decode row
            for j in range(1, m + 1):
                cap.shape = cap.shape.with_decode(item.start + j + 1)
            cap.room -= m

    def _speculate_each(
        self, proposer: Proposer, out: SchedulerOutput, budget: int, cap: _PrefillCap | None
    ) -> int:
        """A proposer asked sequence by sequence (prompt lookup): propose, let the policy
        cut, then reserve the slots of what is left."""
        policy, stats = self.spec_policy, self.spec_stats
        k = proposer.num_speculative_tokens
        decodes: list[ScheduledSeq] = []
        for item in out.decodes:
            seq = item.seq
            room = self._room(item, k, budget)
            proposal = proposer.propose(seq, room) if room > 0 else []
            if proposal and policy is not None:
                worth = policy.length(seq, item.start, len(proposal))
                if worth == 0:
                    policy.withhold(seq, proposal[0])
                stats.withheld_tokens += len(proposal) - worth
                proposal = proposal[:worth]
            if not proposal or not self.kv.allocate_slots(seq, 1 + len(proposal)):
                decodes.append(item)
                continue
            self._verify(out, item, proposal, cap)
            budget -= len(proposal)
        out.decodes = decodes
        return budget

    def _speculate_batch(
        self, proposer: BatchProposer, out: SchedulerOutput, budget: int, cap: _PrefillCap | None
    ) -> int:
        """A proposer asked once for the whole step (a draft model), which writes KV into
        the verify rows' slots: each sequence's length is decided first (its room, cut by
        the policy, which needs only the length), its slots reserved, then every proposal
        is made in one call. A sequence the policy withholds entirely still gets its first
        proposed token, for the policy's shadow check (the draft's catch-up forward makes
        it anyway); one whose slots do not fit decodes plainly and is not asked."""
        policy, stats = self.spec_policy, self.spec_stats
        k = proposer.num_speculative_tokens
        planned: list[tuple[ScheduledSeq, int]] = []  # (item, tokens to verify)
        for item in out.decodes:
            seq = item.seq
            room = self._room(item, k, budget)
            if room <= 0:
                continue
            worth = room if policy is None else policy.length(seq, item.start, room)
            if worth == 0 and policy is None:
                continue
            if worth > 0 and not self.kv.allocate_slots(seq, 1 + worth):
                continue
            stats.withheld_tokens += room - worth
            planned.append((item, worth))
            budget -= worth
        if not planned:
            return budget
        proposals = proposer.propose_batch([(item.seq, max(m, 1)) for item, m in planned])
        verified: set[int] = set()
        for (item, worth), proposal in zip(planned, proposals, strict=True):
            if worth == 0:
                assert policy is not None
                policy.withhold(item.seq, proposal[0])
                continue
            self._verify(out, item, proposal[:worth], cap)
            verified.add(id(item))
        out.decodes = [item for item in out.decodes if id(item) not in verified]
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        # the running list is sorted by priority: its last is the least important (the
        # latest admitted among equals), and none left is more important than `seq`
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
        self._enqueue(seq, front=True)

    def take_lora_slot(self, seq: Sequence) -> bool:
        """For a sequence that joins `running` directly (its prompt's KV imported): make
        its adapter resident now. False when no slot is free for it (every one serves
        running sequences); then it must not run."""
        slots, lora = self.lora_slots, seq.params.lora
        if slots is None or lora is None:
            return True
        in_use = self.adapters_running()
        if not slots.can_admit(lora, in_use):
            return False
        slots.admit(lora, in_use)
        return True

    def adapters_running(self) -> set[str]:
        """The LoRA adapters running sequences use (each holds a resident slot)."""
        return {s.params.lora for s in self.running if s.params.lora is not None}

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, cap: _PrefillCap | None) -> None:
        slots = self.lora_slots
        in_use = self.adapters_running() if slots is not None else set()
        if slots is not None:
            slots.touch(in_use)
        passed: list[Sequence] = []  # waiting for an adapter slot: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            lora = seq.params.lora
            if slots is not None and lora is not None and not slots.can_admit(lora, in_use):
                passed.append(self.waiting.popleft())
                continue
            computed = self.kv.get_computed_blocks(seq)
            num_cached = len(computed) * self.kv.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.limits.enable_chunked_prefill:
                    break
                num_new = budget
            if cap is not None:
                num_new = cap.allow(num_cached, num_new)
                if num_new == 0:
                    break
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            if cap is not None:
                cap.add(num_cached, num_new)
            self.waiting.popleft()
            if slots is not None and lora is not None:
                slots.admit(lora, in_use)
                in_use.add(lora)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_prompt_tokens = num_cached
                if seq.first_scheduled_s is None:
                    seq.first_scheduled_s = time.monotonic()
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

    @staticmethod
    def _emit(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        item = ScheduledSeq(seq, num_new, seq.num_computed_tokens)
        (out.decodes if num_new == 1 else out.prefills).append(item)

    def update(
        self,
        out: SchedulerOutput,
        sampled: Mapping[str, int | Seq[int]],
        on_token: OnToken | None = None,
    ) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens; return sequences that finished.

        `sampled` maps request id -> the token (or tokens: a verify row's accepted ones
        and the target's next) sampled for each sequence whose step completed its
        tokens. Tokens are appended one at a time, each checked for a stop as if it were
        its own step: a stop ends the sequence there and drops the tokens after it.
        `on_token` runs after each (the engine's stop strings).
        """
        finished: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            tokens = sampled.get(seq.request_id)
            if tokens is None:
                continue
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if item.spec_token_ids:
                appended = self._append(seq, tokens, on_token)
                self._roll_back(seq, item, len(tokens), appended)
            else:
                if self.spec_policy is not None:
                    self.spec_policy.shadow(seq, tokens[0])
                self._append(seq, tokens, on_token)
            if seq.is_finished:
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, tokens: Seq[int], on_token: OnToken | None) -> int:
        """Append `tokens` up to the first stop; return how many were appended."""
        for index, token_id in enumerate(tokens):
            seq.append_token(token_id)
            reason = self.stop_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
            if on_token is not None and on_token(seq, index, token_id):
                self.finish(seq, FinishReason.STOP)  # no-op when already finished
            if seq.is_finished:
                return index + 1
        return len(tokens)

    def _roll_back(self, seq: Sequence, item: ScheduledSeq, emitted: int, appended: int) -> None:
        """After a verify row: the KV computed is that of the last token and the accepted
        proposals (`emitted` - 1 of them): the computed tokens end there, and the blocks
        beyond the sequence's tokens (they held rejected slots only) go back to the pool."""
        stats = self.spec_stats
        stats.accepted_tokens += emitted - 1
        stats.emitted_tokens += appended
        if self.spec_policy is not None:
            self.spec_policy.observe(seq, len(item.spec_token_ids), emitted - 1)
        seq.num_computed_tokens = item.start + appended
        if seq.blocks:  # not freed by finishing
            self.kv.trim(seq)

    def stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Why `seq` stops after appending `token_id`, or None to go on."""
        params = seq.params
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.is_terminated:
            return FinishReason.STOP  # complete (or, never under its mask, violated)
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
