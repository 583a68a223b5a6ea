"""The draft-model proposer of speculative decoding (`"draft:PATH,k=K"`).

engine/spec_decode/proposer.py describes the design; in short: the draft's paged KV cache has the
target's number of blocks and is addressed by the target sequence's own block table and
slots, so the scheduler's allocation covers it; each sequence remembers how far the
draft's KV is valid; a step's proposals take k batched forwards of the draft, whatever
the batch: one catch-up forward over every speculating sequence's tokens the draft lacks
(prefill chunks with context, or decode rows for a single token), whose last rows give
the first proposals by argmax, then one decode forward per further proposal, each
writing the previous proposal's KV into the slot the scheduler reserved for it.

Every forward's inputs (positions, slots, block tables: all known on the host before
any runs) are built and copied to the device first; the proposals stay on the device
between forwards (each forward's input is the previous one's argmax, indexed there), and
the host reads them once per step, at the end: the one synchronisation the scheduler
needs (it schedules the verify rows from them). The forwards run back to back.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pdserve.engine.modeling.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeMeta,
    PrefillBatch,
    PrefillMeta,
)
from pdserve.engine.modeling.llama import LlamaModel
from pdserve.engine.modeling.ops import ops_for
from pdserve.engine.sched.kv_cache_manager import cdiv
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.spec_decode.proposer import SpecStats
from pdserve.engine.worker.model_runner import allocate_kv_cache, layer_views


@dataclass(frozen=True)
class _Written:
    """What the draft's KV holds for one sequence: its tokens before `upto` (the
    sequence's own, as they were when written: they never change), then `proposed`
    tokens at positions `upto`, `upto + 1`, ... (valid as far as the sequence really got
    them); both void after a preemption (the blocks were freed and the KV recomputed
    elsewhere)."""

    upto: int
    proposed: tuple[int, ...]
    preemptions: int


@dataclass(frozen=True)
class _Pass:
    """One draft forward's inputs, on the device (see `DraftProposer._pass`)."""

    input_ids: torch.Tensor | None  # None: the previous proposals of `targets`
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows whose logits propose; None: every row
    targets: torch.Tensor  # the sequences (batch indices) those rows propose for
    column: int  # which proposal they make


@dataclass(frozen=True)
class _Row:
    """One sequence's rows of a draft forward: `n` tokens from position `start`."""

    index: int  # the sequence's index in the step's (sorted) batch
    start: int
    n: int


class DraftProposer:
    """Greedy proposals of a draft model over its own paged KV cache (a `BatchProposer`).

    `model`: the draft, loaded like the target (same device and dtype). `num_blocks`,
    `block_size`: the target's pool, whose block ids address the draft's cache too.
    `max_batch_tokens`: the most tokens one catch-up forward takes (the engine's step
    budget), so a long catch-up (a prompt imported or prefilled without the draft) is
    chunked like a prefill rather than making one huge forward. `stats`: where the draft's
    forward count and time are added (the scheduler's `SpecStats`).
    """

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        num_speculative_tokens: int,
        max_batch_tokens: int,
        stats: SpecStats | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.kv_cache = allocate_kv_cache(model, num_blocks, block_size, device)
        self.kv_caches = layer_views(self.kv_cache)
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch_tokens = max(max_batch_tokens, 1)
        self.stats = stats if stats is not None else SpecStats()
        self.clock = clock
        model.ops = ops_for(backend)
        self._written: weakref.WeakKeyDictionary[Sequence, _Written] = weakref.WeakKeyDictionary()

    def valid_tokens(self, seq: Sequence) -> int:
        """How many of `seq`'s leading tokens have valid draft KV (at most its computed
        tokens: the last token is always run again, its logits giving the first guess)."""
        written = self._written.get(seq)
        if written is None or written.preemptions != seq.num_preemptions:
            return 0
        valid, tokens = written.upto, seq.all_token_ids
        for token in written.proposed:
            if valid >= len(tokens) or tokens[valid] != token:
                break
            valid += 1
        return min(valid, seq.num_computed_tokens)

    @torch.inference_mode()
    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> list[list[int]]:
        start_s = self.clock()
        # Ascending by length: each forward's decode rows then come ordered by context.
        order = sorted(range(len(requests)), key=lambda i: requests[i][0].num_tokens)
        seqs = [requests[i][0] for i in order]
        wants = [requests[i][1] for i in order]
        assert min(wants) >= 1
        # Every forward's inputs first (host work and copies to the device), so that the
        # forwards then run back to back: nothing waits for the device until the end.
        passes = self._catch_up_passes(seqs)
        for j in range(1, max(wants)):
            active = [i for i, want in enumerate(wants) if want > j]
            rows = [_Row(i, seqs[i].num_tokens + j - 1, 1) for i in active]
            passes.append(self._pass(seqs, [], rows, None, active, j))
        proposals = torch.zeros(len(seqs), max(wants), dtype=torch.int64, device=self.device)
        for p in passes:
            # A proposal forward's tokens: the previous proposals of its rows' sequences.
            ids = proposals[p.targets, p.column - 1] if p.input_ids is None else p.input_ids
            hidden = self.model.forward(ids, p.positions, self.kv_caches, self.backend, p.meta)
            if p.sample_rows is not None:
                hidden = hidden.index_select(0, p.sample_rows)
            if p.targets.numel():
                proposals[p.targets, p.column] = self.model.logits(hidden).argmax(dim=-1)
        host = proposals.tolist()  # the step's one wait for the device
        out: list[list[int]] = [[] for _ in requests]
        for i, seq in enumerate(seqs):
            guesses = host[i][: wants[i]]
            out[order[i]] = guesses
            # KV written: every token before num_tokens, and the guesses but the last.
            self._written[seq] = _Written(seq.num_tokens, tuple(guesses[:-1]), seq.num_preemptions)
        self.stats.draft_forwards += len(passes)
        self.stats.draft_seconds += self.clock() - start_s
        return out

    def _catch_up_passes(self, seqs: list[Sequence]) -> list[_Pass]:
        """The forwards over the tokens the draft lacks, `max_batch_tokens` at most each
        (one, unless a catch-up is long): chunks with context, or decode rows for a
        single token; the rows that end a sequence's tokens give its first proposal."""
        at = [self.valid_tokens(seq) for seq in seqs]
        pending = list(range(len(seqs)))
        passes: list[_Pass] = []
        while pending:
            budget = self.max_batch_tokens
            chunks: list[_Row] = []
            singles: list[_Row] = []
            behind: list[int] = []
            for i in pending:
                take = min(seqs[i].num_tokens - at[i], budget)
                if take > 0:
                    (chunks if take > 1 else singles).append(_Row(i, at[i], take))
                    budget -= take
                    at[i] += take
                if at[i] < seqs[i].num_tokens:
                    behind.append(i)
            singles.sort(key=lambda row: row.start)  # decode rows ascending by context
            tokens: list[int] = []
            done: list[int] = []  # the sequences whose last token this forward runs...
            last_rows: list[int] = []  # ...and its row
            for row in (*chunks, *singles):
                seq = seqs[row.index]
                tokens += seq.all_token_ids[row.start : row.start + row.n]
                if row.start + row.n == seq.num_tokens:
                    done.append(row.index)
                    last_rows.append(len(tokens) - 1)
            passes.append(self._pass(seqs, chunks, singles, (tokens, last_rows), done, 0))
            pending = behind
        return passes

    def _pass(
        self,
        seqs: list[Sequence],
        chunks: list[_Row],
        singles: list[_Row],
        tokens: tuple[list[int], list[int]] | None,
        targets: list[int],
        column: int,
    ) -> _Pass:
        """One forward's inputs on the device: `chunks` (prefill rows with context) then
        `singles` (decode rows, ascending by position). `tokens`: (the rows' tokens, the
        rows that sample) for a catch-up; None for a proposal forward, whose every row
        samples and whose tokens are proposals[targets, column - 1]. Proposal `column`
        of sequences `targets` comes from the sampled rows, in order."""
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillMeta] = []
        for row in (*chunks, *singles):
            blocks = seqs[row.index].blocks
            span = range(row.start, row.start + row.n)
            positions += span
            slots += [blocks[p // bs].block_id * bs + p % bs for p in span]
        query_start = 0
        for row in chunks:
            end = row.start + row.n
            table = [b.block_id for b in seqs[row.index].blocks[: cdiv(end, bs)]]
            prefills.append(PrefillMeta(query_start, row.n, end, self._tensor(table)))
            query_start += row.n
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_prefill_tokens=query_start,
            prefills=prefills,
            prefill_batch=self._prefill_batch(prefills),
            decode=self._decode_meta([(r.start + 1, seqs[r.index]) for r in singles]),
        )
        return _Pass(
            input_ids=None if tokens is None else self._tensor(tokens[0]),
            positions=self._tensor(positions),
            meta=meta,
            sample_rows=None if tokens is None else self._tensor(tokens[1]),
            targets=self._tensor(targets),
            column=column,
        )

    def _tensor(
        self, data: list[int] | list[list[int]], dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _prefill_batch(self, prefills: list[PrefillMeta]) -> PrefillBatch | None:
        """The chunks as one launch's tensors, for backends that want them (Triton)."""
        if not prefills or not self.backend.wants_prefill_batch:
            return None
        width = max(p.block_table.numel() for p in prefills)
        tables = torch.zeros(len(prefills), width, dtype=torch.int32, device=self.device)
        for i, p in enumerate(prefills):
            tables[i, : p.block_table.numel()] = p.block_table
        starts = [p.query_start for p in prefills] + [sum(p.query_len for p in prefills)]
        return PrefillBatch(
            block_tables=tables,
            query_start_loc=self._tensor(starts, torch.int32),
            context_lens=self._tensor([p.context_len for p in prefills], torch.int32),
        )

    def _decode_meta(self, rows: list[tuple[int, Sequence]]) -> DecodeMeta | None:
        """Decode rows' metadata; `rows`: (context length, sequence), ascending."""
        if not rows:
            return None
        contexts = [context for context, _ in rows]
        width = cdiv(contexts[-1], self.block_size)
        tables = [[b.block_id for b in seq.blocks[: cdiv(c, self.block_size)]] for c, seq in rows]
        return DecodeMeta(
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            context_lens=self._tensor(contexts, torch.int32),
            context_lens_list=contexts,
        )
