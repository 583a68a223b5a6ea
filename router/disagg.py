"""Conditional disaggregation and prefill admission (docs/architecture.md, "Conditional
disaggregation").

Per request (in disagg mode), once placement chose a prefill worker P and a decode
worker D, the router decides where the prompt is prefilled: on P, whose KV then crosses
to D (remote), or on D itself (local). Each option is estimated as the time until this
prompt's prefill would be done there:

    seconds = (queued tokens + this prompt's uncached tokens) / measured tokens per second

queued tokens: the worker's heartbeat gauge, or what this router has sent it and not
seen finish, whichever is larger (the heartbeat lags); uncached: the prompt's tokens
minus the blocks that worker holds; the rate: P's own measurement (heartbeat), else what
this router measured from P's results, for D what it measured from D's local prefills,
else the prefill pool's rate (same model, same engine). Remote adds the KV push.

The rules, in order (`decide`), each a reason of `pdserve_disagg_decisions_total`:

- `always` (policy "always"): remote, today's split for every prompt.
- `short_prompt`: D's uncached part is at most `local_prefill_max_tokens`: a push would
  cost more than computing it (unless D's queue makes it the slower option).
- `prefill_idle`: P has nothing queued: remote, the split costs nothing to wait for.
- `unmeasured`: no rate is known yet (the cluster's first prompts): remote.
- `faster` (local): D runs at most `local_prefill_max_running` sequences (default 0:
  none would stall) and finishes sooner even with its time weighted by
  1 + `local_prefill_interference` x those sequences, which stall meanwhile.
- `prefill_busy` (local): P's queue is longer than this prompt's own prefill time on D,
  D would have the prompt sooner, and D's spill budget covers the prompt's prefill there
  (`SpillBudget`: at most `decode_prefill_share` of D's time, over a window, goes to
  prompts spilled this way, so its streams keep most of the TPOT the split buys). What
  each local choice is predicted to save (P's estimate less D's) is counted
  (`pdserve_disagg_saved_seconds_total`).
- `prefill_saturated` (local): P's queue is past `prefill_spill_queue_s` (at most
  `max_prefill_queue_s`) and D's is not, or D finishes the prompt sooner, or P's queue is
  past `max_prefill_queue_s`; never while D's own queue is past that bound.
- `faster` (remote): otherwise.
- `kv_wait_limit` (local): the remote choice's estimate is longer than D waits for KV at
  most (`kv_wait_timeout_s`), so D would prefill the prompt anyway once its wait ran out,
  after P had (the work twice, the later TTFT); unless D's queue is past the bound.

Admission: when every option's queue (seconds of work ahead of this prompt) is past
`max_prefill_queue_s` (a lower priority's share of it, priority.py), the request is shed
(429, Retry-After: the excess). Only the queue counts, not the prompt's own compute, so
a long prompt is never refused by an idle cluster. A remote request's KV wait on D is
`kv_wait_factor` x the latest the remote prefill can be done + `kv_wait_floor_s`, at
most `kv_wait_timeout_s`: the estimate with a whole step's token budget in place of the
prompt's own tokens, since prompts arriving after it can join its step.
Plain Python.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.prefix_index import MatchResult
from pdserve.cluster.rate_meter import RateMeter

# where -> the reasons it is decided for (metric labels; every pair is exported at 0)
REASONS: dict[str, tuple[str, ...]] = {
    "remote": ("always", "prefill_idle", "unmeasured", "faster", "unplaced"),
    "local": (
        *("short_prompt", "faster", "prefill_busy", "prefill_saturated", "kv_wait_limit"),
        *("no_prefill_worker", "resume"),
    ),
    "shed": ("over_capacity",),
}
# the local decisions that are the policy's choice (local-prefill counter reason "policy")
POLICY_LOCAL = ("short_prompt", "faster", "prefill_busy", "prefill_saturated", "kv_wait_limit")
RATE_GAUGE = "prefill_tokens_per_s"  # what a prefill worker's heartbeat publishes
# The window over which a decode worker's spill budget evens out: a bucket holds the
# share of this many seconds (`SpillBudget`).
SPILL_WINDOW_S = 10.0


@dataclass(frozen=True)
class Option:
    """One place to prefill a prompt, with what is known of its speed and queue."""

    worker_id: str
    uncached_tokens: int
    queued_tokens: int
    tokens_per_s: float | None  # None: not measured yet
    extra_s: float = 0.0  # after the prefill, before D has the KV (the push)

    @property
    def queue_s(self) -> float | None:
        """Seconds of work ahead of this prompt there."""
        if self.tokens_per_s is None:
            return None
        return self.queued_tokens / self.tokens_per_s

    @property
    def own_s(self) -> float | None:
        """Seconds this prompt's own prefill takes there (no queue, no push)."""
        if self.tokens_per_s is None:
            return None
        return self.uncached_tokens / self.tokens_per_s

    @property
    def seconds(self) -> float | None:
        """Seconds until this prompt's prefill is done there (and its KV pushed)."""
        if self.tokens_per_s is None:
            return None
        return (self.queued_tokens + self.uncached_tokens) / self.tokens_per_s + self.extra_s

    def latest_s(self, step_tokens: int) -> float | None:
        """Seconds by which this prompt's prefill is done there at the latest.

        A prompt is done when the step that holds its last chunk ends, and prompts that
        arrive after it join that step: the work that step adds is up to a whole step's
        token budget (`step_tokens`), not only the prompt's own tokens. Measured: a
        512-token prompt estimated at 4.2 s (512 queued ahead, 241 tok/s) shared its
        2,048-token step with three later ones and was done after 11.8 s, past its KV
        wait of 2 x 4.2 + 2 s.
        """
        if self.tokens_per_s is None:
            return None
        work = self.queued_tokens + max(self.uncached_tokens, step_tokens)
        return work / self.tokens_per_s + self.extra_s


@dataclass(frozen=True)
class Decision:
    """Where a prompt is prefilled, why, and the chosen option's estimate."""

    where: str  # "remote", "local" or "shed"
    reason: str
    estimate_s: float | None = None
    retry_after_s: float = 0.0  # shed: how far the shortest queue is past the bound
    latest_s: float | None = None  # remote: done by then at the latest (`Option.latest_s`)
    saved_s: float = 0.0  # local by choice: P's estimate less D's (what the choice saves)

    @property
    def local_prefill_reason(self) -> str | None:
        """The local-prefill counter's reason for a local decision (None: remote)."""
        if self.where != "local":
            return None
        return "policy" if self.reason in POLICY_LOCAL else self.reason


def decide(
    config: ClusterConfig,
    remote: Option | None,
    local: Option | None,
    decode_running: int,
    max_queue_s: float | None = None,
    spill_room_s: float = 0.0,
) -> Decision:
    """Where to prefill (see the module's rules), or shed past capacity.

    remote: the chosen prefill worker (None: no prefill worker is live); local: the
    chosen decode worker (None: placement chose none, Serve picks it); decode_running:
    sequences D is decoding; max_queue_s: the shedding bound for this request's
    priority (priority.py; None: `max_prefill_queue_s`); spill_room_s: seconds of
    prefill D's spill budget still allows (`SpillBudget.room_s`; 0: no `prefill_busy`).
    """
    choice = _decide(config, remote, local, decode_running, max_queue_s, spill_room_s)
    if choice.where == "remote" and remote is not None:
        choice = replace(choice, latest_s=remote.latest_s(config.max_num_batched_tokens))
    elif choice.reason in POLICY_LOCAL and remote is not None and local is not None:
        remote_s, local_s = remote.seconds, local.seconds
        if remote_s is not None and local_s is not None:
            choice = replace(choice, saved_s=max(0.0, remote_s - local_s))
    return choice


def _decide(
    config: ClusterConfig,
    remote: Option | None,
    local: Option | None,
    decode_running: int,
    max_queue_s: float | None,
    spill_room_s: float,
) -> Decision:
    bound = config.max_prefill_queue_s if max_queue_s is None else max_queue_s
    if remote is None:
        return Decision("local", "no_prefill_worker", local.seconds if local else None)
    if local is None:
        return Decision("remote", "unplaced", remote.seconds)
    if config.disagg_policy == "always":
        return _admit(Decision("remote", "always", remote.seconds), [remote], bound)
    remote_s, local_s = remote.seconds, local.seconds
    if local.uncached_tokens <= config.local_prefill_max_tokens and not (
        remote_s is not None and local_s is not None and local_s > remote_s
    ):
        choice = Decision("local", "short_prompt", local_s)
    elif remote.queued_tokens <= 0:
        choice = Decision("remote", "prefill_idle", remote_s)
    elif remote_s is None or local_s is None:
        choice = Decision("remote", "unmeasured", remote_s)
    elif (
        decode_running <= config.local_prefill_max_running
        and local_s * (1.0 + config.local_prefill_interference * decode_running) < remote_s
    ):
        choice = Decision("local", "faster", local_s)
    elif _busy_spill(config, remote, local, spill_room_s):
        choice = Decision("local", "prefill_busy", local_s)
    elif past_bound(remote.queue_s, spill_queue_s(config)) and _spill(config, remote, local):
        choice = Decision("local", "prefill_saturated", local_s)
    else:
        choice = Decision("remote", "faster", remote_s)
    if (
        choice.where == "remote"
        and remote_s is not None
        and remote_s > config.kv_wait_timeout_s
        and local_s is not None
        and not past_bound(local.queue_s, config.max_prefill_queue_s)
    ):
        # D would stop waiting before the KV came and prefill it anyway: the work twice
        choice = Decision("local", "kv_wait_limit", local_s)
    return _admit(choice, [remote, local], bound)


def spill_queue_s(config: ClusterConfig) -> float:
    """P's queue past which a prompt may spill to D (`prefill_saturated`)."""
    return min(config.prefill_spill_queue_s, config.max_prefill_queue_s)


def _busy_spill(config: ClusterConfig, remote: Option, local: Option, room_s: float) -> bool:
    """Whether D takes a prompt that would queue on P (`prefill_busy`): P's queue ahead
    of it is at least its own prefill time on D (the budget goes to the prompts that
    would wait longest: each such spill saves at least what it costs D), D has it
    sooner, D's own queue is short, and D's spill budget covers the prompt there."""
    own_s, local_s, remote_s = local.own_s, local.seconds, remote.seconds
    if own_s is None or local_s is None or remote_s is None or local_s >= remote_s:
        return False
    if not past_bound(remote.queue_s, own_s) or own_s > room_s:
        return False
    return not past_bound(local.queue_s, spill_queue_s(config))


def _spill(config: ClusterConfig, remote: Option, local: Option) -> bool:
    """Whether D prefills a prompt that a saturated P would queue: D's queue is short,
    or D finishes it sooner (both saturated: the queues even out over both), or P is
    past the shedding bound; never onto D past that bound itself while P is not."""
    bound = config.max_prefill_queue_s
    if past_bound(local.queue_s, bound):
        return False
    if not past_bound(local.queue_s, spill_queue_s(config)) or past_bound(remote.queue_s, bound):
        return True
    local_s, remote_s = local.seconds, remote.seconds
    return local_s is not None and remote_s is not None and local_s < remote_s


def past_bound(queue_s: float | None, bound_s: float) -> bool:
    """A measured queue longer than the bound (an unmeasured one never is)."""
    return queue_s is not None and queue_s > bound_s


def _admit(choice: Decision, options: list[Option], bound_s: float) -> Decision:
    """`choice`, or a shed decision when every option's queue is past `bound_s`."""
    waits = [o.queue_s for o in options]
    if not all(past_bound(w, bound_s) for w in waits):
        return choice
    excess = min(w for w in waits if w is not None) - bound_s
    return Decision("shed", "over_capacity", choice.estimate_s, excess)


def kv_wait_s(config: ClusterConfig, decision: Decision) -> float | None:
    """How long D waits for a remote prefill's KV (None: D's own `kv_wait_timeout_s`)."""
    if decision.where != "remote" or decision.estimate_s is None:
        return None
    basis = decision.estimate_s if decision.latest_s is None else decision.latest_s
    wait = config.kv_wait_factor * basis + config.kv_wait_floor_s
    return min(wait, config.kv_wait_timeout_s)


class SpillBudget:
    """The share of each decode worker's time that this router may give to prompts it
    spills from a busy prefill pool (`prefill_busy`).

    A bucket of seconds per decode worker, filled at `share` seconds per second up to
    `burst_s` and drawn by each spill's estimated prefill time on that worker. A full
    bucket lets any one prompt through (one longer than the burst too; the bucket then
    runs into debt and refills from below zero), so over any long window the spills take
    at most `share` of the worker's time plus one burst. Each router replica keeps its
    own: the share a replica gets is the cluster's divided by the router replicas.
    """

    def __init__(self, share: float, burst_s: float) -> None:
        self.share = share
        self.burst_s = burst_s
        self._level: dict[str, tuple[float, float]] = {}  # worker -> (seconds, as of when)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> SpillBudget:
        share = config.decode_prefill_share / config.router_replicas
        return cls(share, share * SPILL_WINDOW_S)

    def _now_level(self, worker_id: str, now_s: float) -> float:
        level, at = self._level.get(worker_id, (self.burst_s, now_s))
        return min(self.burst_s, level + self.share * max(0.0, now_s - at))

    def room_s(self, worker_id: str, now_s: float) -> float:
        """Seconds of prefill a spill onto `worker_id` may take now (inf: a full bucket)."""
        if self.share <= 0:
            return 0.0
        level = self._now_level(worker_id, now_s)
        return math.inf if level >= self.burst_s else max(0.0, level)

    def take(self, worker_id: str, seconds: float, now_s: float) -> None:
        """A spill of `seconds` (estimated) onto `worker_id`."""
        self._level[worker_id] = (self._now_level(worker_id, now_s) - seconds, now_s)

    def forget_except(self, live: Iterable[str]) -> None:
        keep = set(live)
        for worker_id in [w for w in self._level if w not in keep]:
            del self._level[worker_id]


# How long a measured fetch rate stands without a new measurement: past it the next
# candidate fetches, whatever the old rate said, and measures it again.
FETCH_PROBE_S = 30.0


class RateBook:
    """What this router measured of each worker's prefill speed, and of KV pushes.

    Prefill workers publish their own rate (more exact: they see their batches); the
    router's own measurement of their results is the fallback. Decode workers' rates
    come only from their local prefills as this router saw them.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.prefill: dict[str, RateMeter] = {}
        self.local: dict[str, RateMeter] = {}
        self.push_s_per_block: float | None = None
        # peer fetches (router/fetch.py): seconds per block pushed, and when last measured
        self.fetch_s_per_block: float | None = None
        self.fetch_measured_s = 0.0
        self._fetch_pairs: set[tuple[str, str]] = set()  # (holder, receiver) seen pushing

    def prefill_done(self, worker_id: str, tokens: int, compute_s: float, end_s: float) -> None:
        meter = self.prefill.setdefault(worker_id, RateMeter(self.decay))
        meter.add(tokens, end_s - compute_s, end_s)

    def local_done(self, worker_id: str, tokens: int, compute_s: float, end_s: float) -> None:
        meter = self.local.setdefault(worker_id, RateMeter(self.decay))
        meter.add(tokens, end_s - compute_s, end_s)

    def push_done(self, seconds: float, blocks: int) -> None:
        """A prefill worker's push: `blocks` in `seconds`, packing included."""
        self.push_s_per_block = self._per_block(self.push_s_per_block, seconds, blocks)

    def prefill_rates(self, matches: Mapping[str, MatchResult]) -> dict[str, float | None]:
        """Each prefill worker's rate; one not measured yet gets the pool's mean."""
        own = {w: self._prefill_rate(m) for w, m in matches.items()}
        known = [r for r in own.values() if r is not None]
        mean = sum(known) / len(known) if known else None
        return {w: mean if r is None else r for w, r in own.items()}

    def local_rate(self, worker_id: str, pool_rate: float | None) -> float | None:
        meter = self.local.get(worker_id)
        rate = meter.tokens_per_s if meter is not None else None
        return pool_rate if rate is None else rate

    def fetch_done(
        self, holder: str, receiver: str, seconds: float, blocks: int, now_s: float
    ) -> None:
        """A peer fetch's push from `holder` to `receiver`: `blocks` in `seconds`, export
        included. The first push between two workers also opened their connection (a
        UCX endpoint's setup alone took 68 ms where a warm push of the same 50 blocks
        took 2): it is not taken as the rate."""
        if (holder, receiver) not in self._fetch_pairs:
            self._fetch_pairs.add((holder, receiver))
            return
        self.fetch_s_per_block = self._per_block(self.fetch_s_per_block, seconds, blocks)
        self.fetch_measured_s = now_s

    def fetch_rate(self, now_s: float, probe_s: float = FETCH_PROBE_S) -> float | None:
        """Seconds per fetched block, or None when not measured, or not for `probe_s`:
        a fetch is then made to measure it again (a link once slow may be fast now)."""
        if now_s - self.fetch_measured_s > probe_s:
            return None
        return self.fetch_s_per_block

    def _per_block(self, old: float | None, seconds: float, blocks: int) -> float | None:
        """`old` seconds per block moved towards this transfer's (unchanged for none)."""
        if blocks <= 0:
            return old
        per_block = seconds / blocks
        return per_block if old is None else old * self.decay + per_block * (1.0 - self.decay)

    def push_s(self, blocks: int) -> float:
        return 0.0 if self.push_s_per_block is None else blocks * self.push_s_per_block

    def forget_except(self, live: Iterable[str]) -> None:
        """Drop what is known of workers no longer live (replica churn)."""
        keep = set(live)
        self._fetch_pairs = {p for p in self._fetch_pairs if p[0] in keep and p[1] in keep}
        for book in (self.prefill, self.local):
            for worker_id in [w for w in book if w not in keep]:
                del book[worker_id]

    def _prefill_rate(self, m: MatchResult) -> float | None:
        published = m.worker.load.get(RATE_GAUGE, 0)
        if published > 0:
            return float(published)
        meter = self.prefill.get(m.worker.worker_id)
        return meter.tokens_per_s if meter is not None else None
