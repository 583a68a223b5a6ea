"""Speculative decoding: the proposers' protocols, prompt-lookup proposals, acceptance,
and the policy (the settings are pdserve/common/speculative.py).

Plain Python, no tensors (the draft-model proposer, which runs a model, is
engine/spec_decode/draft.py). A decode step of a memory-bound model costs about the same for
one query token as for a few, so a sequence that has a guess of its next `m` tokens is
run as a *verify row* of `m + 1` query tokens (its last sampled token and the `m`
proposed ones, attending to its own paged context like a chunked-prefill row; the runner
lays it out as `m + 1` decode rows, model_runner.py): the target model's distributions
at every position come from that one forward pass, and each proposed token the target
agrees with is a token gained for free (`accept`). How many proposed tokens are worth
verifying is `SpecPolicy`'s call; the scheduler reserves their KV slots and rolls back
what is rejected (scheduler.py).

Two proposers:

- *Prompt lookup* (`"ngram:k=K,n=N"`, n-gram matching, Saxena 2023): the sequence's
  last `n` tokens are looked up in its own prompt and output so far, and the tokens that
  followed their most recent earlier occurrence are proposed. It costs no model, and pays
  off where the output copies its input (summaries, edits, code, extraction) or repeats
  itself; where nothing matches, nothing is proposed and the sequence decodes as usual.
- *A draft model* (`"draft:PATH,k=K"`, `draft.DraftProposer`): a smaller checkpoint of
  the same vocabulary (`check_draft_checkpoint`), loaded with the engine's own model code
  on the target's device and dtype, proposes k tokens by greedy decoding. Its KV cache is
  a second paged cache of the draft's shape with the *same number of blocks*, addressed
  by the target sequence's own block table and slots: the scheduler's allocation, prefix
  caching, preemption and rollback cover it with no bookkeeping of their own. Each
  sequence remembers how many of its tokens the draft has KV for (and which proposed
  tokens it wrote past them); before proposing, the draft catches up over the tokens it
  lacks (one batched forward over every speculating sequence's missing tokens, like a
  chunked prefill), which also yields the first proposal, then runs one batched decode
  forward per further proposal: k forwards per step, whatever the batch. The proposals'
  draft KV lands in the slots the scheduler reserved for the verify row; a proposed token
  the sequence then really has (accepted) sits at its position with its true prefix, so
  its draft KV stays valid, and the draft's count is cut back at the first token that
  differs. So it does not matter where the target's prompt KV came from (a local
  prefill, a prefix-cache hit, or a KV import from a prefill worker): the draft builds
  its own. Preemption (a recompute into other blocks) resets it. The draft never writes
  a slot of a block another sequence shares with different tokens: shared blocks are
  full of the sequence's own tokens, whose draft KV (a function of the same prefix) it
  rewrites with the same values. With tensor parallelism the draft runs whole on rank 0
  (the scheduler's), beside its shard, with its own small cache; the other ranks never
  see it. It runs eagerly (no CUDA graphs).

Acceptance is exact (`accept`): the emitted tokens have exactly the distribution of
decoding without speculation, and greedy requests get exactly its tokens. That holds
for both proposers: each proposal is a deterministic function of the sequence's tokens
before it (a greedy draft is a point mass, q = one-hot), drawn with none of the
target's random numbers, which is the case `accept`'s rejection rule is exact for.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pdserve.common.speculative import (
    DEFAULT_NGRAM,
    DEFAULT_PROPOSAL_LEN,
    MAX_NGRAM,
    MAX_PROPOSAL_LEN,
    SpeculativeConfig,
    check_draft_checkpoint,
)
from pdserve.engine.sched.sequence import Sequence

__all__ = [
    "DEFAULT_NGRAM",
    "DEFAULT_PROPOSAL_LEN",
    "MAX_NGRAM",
    "MAX_PROPOSAL_LEN",
    "BatchProposer",
    "NgramProposer",
    "Proposer",
    "SpecPolicy",
    "SpecStats",
    "SpeculativeConfig",
    "accept",
    "check_draft_checkpoint",
    "make_proposer",
    "propose_from",
]


class Proposer(Protocol):
    """What the scheduler asks for a decoding sequence's next tokens."""

    num_speculative_tokens: int

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) guesses of the tokens after `seq.all_token_ids`;
        [] for none."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that guesses for every speculating sequence of a step at once and
    writes KV of its own into the slots reserved for their verify rows (the draft
    model, `draft.DraftProposer`): the scheduler decides each one's length and reserves
    its slots first, then asks once."""

    num_speculative_tokens: int

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]:
        """Exactly `n` (>= 1) guesses of the tokens after each `seq.all_token_ids`, for
        each (seq, n) of `requests`, in order. Each seq is a decode row of this step
        (its last token's slot reserved) with slots reserved for `n - 1` more tokens."""
        ...


class _Occurrences:
    """Where each token of one sequence occurs: token -> the positions after it
    ("ends", ascending), extended as the sequence grows. One int per token."""

    __slots__ = ("ends", "upto")

    def __init__(self) -> None:
        self.ends: dict[int, list[int]] = {}
        self.upto = 0  # ends < upto are indexed

    def extend(self, tokens: list[int]) -> None:
        if len(tokens) < self.upto:  # never happens today (tokens are only appended)
            self.ends.clear()
            self.upto = 0
        # An end e < len(tokens) has a following token: the last token is not indexed
        # yet, so a lookup never finds the suffix it is matching.
        for e in range(max(self.upto, 1), len(tokens)):
            self.ends.setdefault(tokens[e - 1], []).append(e)
        self.upto = max(len(tokens), 1)


class NgramProposer:
    """Prompt lookup: for j = n, n-1, ..., 1, the most recent earlier occurrence of the
    sequence's last j tokens (in prompt + output); the tokens after it are proposed, and
    where they run into the sequence's end (a tail that repeats), the copy goes on from
    its own start.

    Each sequence keeps an index of where each token occurs (dropped with the sequence),
    so a step costs O(new tokens) to index plus a walk over the earlier occurrences of
    the last token, most recent first, that stops at the first full n-token match:
    nothing like a scan of the whole sequence per step.
    """

    def __init__(self, num_speculative_tokens: int, max_ngram: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_ngram = max_ngram
        self._index: weakref.WeakKeyDictionary[Sequence, _Occurrences] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = _Occurrences()
        tokens = seq.all_token_ids
        index.extend(tokens)
        return propose_from(tokens, index.ends.get(tokens[-1], ()), self.max_ngram, max_tokens)


def propose_from(tokens: list[int], ends: Seq[int], max_ngram: int, max_tokens: int) -> list[int]:
    """The proposal for `tokens` given `ends`, the positions right after each earlier
    occurrence of its last token, ascending (see `NgramProposer`)."""
    length = len(tokens)
    longest = min(max_ngram, length - 1)
    best_end, best_len = -1, 0
    for e in reversed(ends):
        # How many tokens up to `e` equal the sequence's last ones (at least 1: the last
        # token itself), at most `longest`.
        match = 1
        while match < longest and match < e and tokens[e - 1 - match] == tokens[-1 - match]:
            match += 1
        if match > best_len:  # the most recent occurrence of the longest match so far
            best_end, best_len = e, match
            if match == longest:
                break
    if best_end < 0:
        return []
    # The tokens that followed the match. When they run into the sequence's end (a tail
    # repeating with period length - best_end), the copy goes on from its own start:
    # the same match predicts them.
    proposal: list[int] = []
    for i in range(max_tokens):
        at = best_end + i
        proposal.append(tokens[at] if at < length else proposal[at - length])
    return proposal


def accept(targets: list[int], proposals: list[int]) -> list[int]:
    """The tokens a verify row emits: `targets[j]` is the token the target model picked
    at the row's position j (j = 0..m, `proposals` has m): the longest prefix of
    proposals equal to the targets, then the target's own token at the first mismatch,
    or after all m the bonus token `targets[m]`.

    Greedy requests pick the argmax, so the tokens are exactly those of decoding without
    speculation. Sampled requests pick `targets[j]` by drawing from the target's
    (tempered, top-k/top-p filtered) distribution p_j with the uniform number decoding
    would use at that position (`Sampler`): proposal x_j is then accepted with
    probability p_j(x_j), and on rejection the emitted token is the draw itself, which
    given that it is not x_j is distributed as p_j with x_j removed, renormalised. That
    is the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 for a
    deterministic proposer (q = one-hot at x_j: accept with min(1, p/q) = p(x_j),
    resample from norm(max(p - q, 0))), so every emitted token has exactly the target's
    distribution; and since the draws are decoding's own, a seeded request gets the
    same tokens with speculation as without.
    """
    m = len(proposals)
    assert len(targets) == m + 1
    for j in range(m):
        if targets[j] != proposals[j]:
            return targets[: j + 1]
    return list(targets)


class CostCoefficients(Protocol):
    """What `SpecPolicy` needs of the engine's step cost model (`step_cost.StepCostModel`):
    seconds per unit of each `StepShape.features()` entry, fitted at least on steps
    without prefill (which decode rows cost), or None before a fit."""

    @property
    def decode_coefficients(self) -> tuple[float, ...] | None: ...


class _Acceptance:
    """One sequence's recent proposal outcomes, decayed (see `SpecPolicy`)."""

    __slots__ = ("accepted", "pending", "rejected")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0
        self.pending: int | None = None  # a withheld proposal's first token


class SpecPolicy:
    """How many of a proposal's tokens are worth verifying this step.

    A verify row's i-th proposal is accepted with about probability alpha^i (alpha: the
    sequence's recent acceptance, each token accepted or not after the ones before it),
    so m proposals add E(m) = alpha + ... + alpha^m tokens; they make the whole step
    longer by dT(m), the cost of m more decode rows (a verify row runs as decode rows,
    model_runner.py) of contexts start + 2..start + m + 1 in the engine's step cost
    model, fitted online to its measured steps (`step_cost.StepCostModel`). The step
    makes B tokens (its rows that sample) in T seconds, so dT(m) is worth B/T * dT(m)
    tokens elsewhere: m maximises E(m) - B/T * dT(m), and is 0 (a plain decode) when
    nothing is positive. On a
    memory-bound GPU dT is small and proposals are verified; on a CPU, or a batch large
    enough to make the step compute-bound, only sequences that accept most of theirs.
    Before the cost model has a fit, every proposed token is verified.

    alpha counts accepted and rejected proposal tokens with a decay per verify row (and
    a prior of one each), so it follows a sequence that starts or stops repeating
    itself. A proposal withheld entirely still teaches it: its first token is compared
    with the token the sequence then gets (`shadow`), so a sequence whose proposals
    start to match gets verify rows again.
    """

    DECAY = 0.75
    PRIOR = 1.0  # pseudo-counts of accepted and of rejected tokens

    def __init__(self, cost: CostCoefficients) -> None:
        self.cost = cost
        self._coef: tuple[float, ...] | None = None
        self._rate = 0.0  # tokens per second of the step as scheduled so far
        self._seqs: weakref.WeakKeyDictionary[Sequence, _Acceptance] = weakref.WeakKeyDictionary()

    def begin_step(self, features: tuple[float, ...], sampling_rows: int) -> None:
        """Before this step's proposals: `features` of the step as scheduled without them
        (`StepShape.features()`), `sampling_rows` the rows that make a token."""
        coef = self.cost.decode_coefficients
        seconds = None if coef is None else sum(c * x for c, x in zip(coef, features, strict=True))
        if coef is None or seconds is None or seconds <= 0:
            self._coef = None
            return
        self._coef = coef
        self._rate = max(sampling_rows, 1) / seconds

    def alpha(self, seq: Sequence) -> float:
        state = self._seqs.get(seq)
        if state is None:
            return 0.5
        return (state.accepted + self.PRIOR) / (state.accepted + state.rejected + 2 * self.PRIOR)

    def length(self, seq: Sequence, start: int, proposed: int) -> int:
        """How many of `proposed` (>= 1) tokens to verify for `seq`, whose decode row
        starts at position `start`: 0 to decode it plainly."""
        if self._coef is None:
            return proposed
        per_row, per_context = self._coef[1:3]
        alpha = self.alpha(seq)
        best, best_gain, expected, p, extra = 0, 0.0, 0.0, 1.0, 0.0
        for m in range(1, proposed + 1):
            p *= alpha
            expected += p
            # the m-th proposal runs as one more decode row, of context start + m + 1
            extra += per_row + per_context * (start + m + 1)
            gain = expected - self._rate * extra
            if gain > best_gain:
                best, best_gain = m, gain
        return best

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verify row's outcome: `accepted` of `proposed` tokens."""
        state = self._state(seq)
        state.accepted = self.DECAY * state.accepted + accepted
        state.rejected = self.DECAY * state.rejected + (accepted < proposed)
        state.pending = None

    def withhold(self, seq: Sequence, first_token: int) -> None:
        """A proposal was not verified; remember its first token for `shadow`."""
        self._state(seq).pending = first_token

    def shadow(self, seq: Sequence, token_id: int) -> None:
        """The token `seq` got in a step whose proposal was withheld."""
        state = self._seqs.get(seq)
        if state is not None and state.pending is not None:
            self.observe(seq, 1, int(state.pending == token_id))

    def _state(self, seq: Sequence) -> _Acceptance:
        state = self._seqs.get(seq)
        if state is None:
            state = self._seqs[seq] = _Acceptance()
        return state


@dataclass
class SpecStats:
    """Speculative decoding counters since start (`LLMEngine.load`'s spec_* gauges)."""

    proposed_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # proposed tokens the target agreed with
    emitted_tokens: int = 0  # tokens verify rows added to their sequences (stops cut them)
    verify_rows: int = 0  # sequence-steps run as verify rows
    verify_steps: int = 0  # steps with at least one verify row
    withheld_tokens: int = 0  # proposed tokens the adaptive policy did not verify
    # A draft model's forward passes and their wall time (0 with prompt lookup).
    draft_forwards: int = 0
    draft_seconds: float = 0.0

    def gauges(self) -> dict[str, int]:
        gauges = {
            "spec_proposed_tokens": self.proposed_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_emitted_tokens": self.emitted_tokens,
            "spec_verify_rows": self.verify_rows,
            "spec_verify_steps": self.verify_steps,
            "spec_withheld_tokens": self.withheld_tokens,
        }
        if self.draft_forwards:
            gauges["spec_draft_forwards"] = self.draft_forwards
            gauges["spec_draft_forward_us"] = round(self.draft_seconds * 1e6)
        return gauges

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The prompt-lookup proposer of `config` (a draft model's is built by the engine,
    which holds the model: `draft.DraftProposer`)."""
    if config.method != "ngram":
        raise ValueError(f"make_proposer builds prompt lookup only, not {config.method!r}")
    return NgramProposer(config.num_speculative_tokens, config.max_ngram)
