"""Runs one scheduler step on the model: builds flat inputs, forwards, samples.

The only engine module besides the model that touches tensors. One step = one forward
over every scheduled token (prefill chunks first, then decode tokens) and one sampling
call for the sequences whose step completes their tokens.

A verify row (speculative decoding: a sequence's last token and `m` proposed tokens)
attends to the sequence's paged KV and causally within itself, like a prefill chunk with
context; it rides in the batch as `m + 1` decode rows, position j over the context up to
itself, since every new token's KV is written into the slots the scheduler reserved
before any row attends: the same attention, on the backends' decode kernels. All its
positions sample, and `speculative.accept` keeps the tokens to emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.grammar import fill_bitmask
from pdserve.engine.lora.adapter import LoRAAdapter
from pdserve.engine.lora.apply import LoRAStack, LoRAStep
from pdserve.engine.modeling import kv_quant
from pdserve.engine.modeling.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeMeta,
    KVCache,
    PrefillBatch,
    PrefillMeta,
)
from pdserve.engine.modeling.llama import LlamaModel
from pdserve.engine.modeling.ops import ops_for
from pdserve.engine.sampler import Sampler, apply_token_bitmask
from pdserve.engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sched.sequence import Sequence, TokenLogprobs
from pdserve.engine.spec_decode.proposer import accept
from pdserve.engine.worker.cuda_graphs import CudaGraphRunner
from pdserve.kernels import _variants

if TYPE_CHECKING:
    from pdserve.engine.worker.tp_worker import TPWorkers


@dataclass(frozen=True)
class StepResult:
    # request id -> the tokens to append: one, or a verify row's accepted proposals and
    # the target's next token
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]  # one per token of `sampled`, when wanted


def allocate_kv_cache(
    model: LlamaModel,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """All layers' KV cache as one tensor [layers, 2, blocks, kv_heads, block_size, D]
    (tensor parallel: this rank's KV heads); an 8-bit cache as uint8 rows of D + 2 bytes
    (engine/modeling/kv_quant.py)."""
    cfg = model.config
    shape = (cfg.num_layers, 2, num_blocks, model.num_kv_heads, block_size)
    if kv_quant.is_quantized(kv_cache_dtype):
        row = kv_quant.row_bytes(kv_cache_dtype, cfg.head_dim, model.dtype.itemsize)
        return torch.zeros((*shape, row), dtype=torch.uint8, device=device)
    return torch.zeros((*shape, cfg.head_dim), dtype=model.dtype, device=device)


def layer_views(kv_cache: torch.Tensor) -> list[KVCache]:
    return [(layer[0], layer[1]) for layer in kv_cache]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        tp_workers: TPWorkers | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [layers, 2, blocks, KVH, bs, D]: what a transfer packs
        self.kv_caches = layer_views(kv_cache)
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.device = device
        # The model's norm and rotary ops follow the backend: Triton kernels with Triton.
        model.ops = ops_for(backend)
        # Decode-only steps as CUDA graphs, once `capture_cuda_graphs` has run.
        self.graphs: CudaGraphRunner | None = None
        # Tensor parallel (driver): the other ranks, sent each step's inputs.
        self.tp_workers = tp_workers
        # LoRA adapters by name (the engine's registry: LLMEngine.load_lora)
        self.loras: dict[str, LoRAAdapter] = {}
        # stacks of the adapters of recent steps (the stacked form: engine/lora/apply.py)
        self._lora_stacks: dict[tuple[str, ...], LoRAStack] = {}

    def capture_cuda_graphs(
        self, max_batch_size: int, max_model_len: int, use_cuda_graph: bool = True
    ) -> None:
        """Capture the decode graphs (`engine/worker/cuda_graphs.py`); later decode-only steps
        of up to `max_batch_size` rows replay them. Call once, with the KV cache final.

        `use_cuda_graph=False` (CPU tests): the same padded static-buffer path, run
        eagerly. Raises ValueError without the Triton backend (or, for graphs, CUDA).
        """
        graphs = CudaGraphRunner(
            self.model,
            self.kv_caches,
            self.backend,
            self.block_size,
            max_model_len,
            max_batch_size,
            self.device,
            use_cuda_graph=use_cuda_graph,
        )
        # Every kernel variant compiles here, before serving, not at some step: the graphs'
        # own warm-up runs cover only full-width decodes (kernels/_variants.py).
        with _variants.REGISTRY.warming():
            if use_cuda_graph:
                self.warm_up_kernels(max_model_len)
            graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def warm_up_kernels(
        self, max_model_len: int, max_step_tokens: int | None = None
    ) -> _variants.WarmupPlan | None:
        """Launch every bucket of every Triton kernel this runner's steps use, at its
        shapes (`kernels/_variants.py`, `warmup_plan`; `max_step_tokens`: the token
        budget, None for a superset), so that each variant compiles now rather than at
        a step, then mark the variant registry ready; returns the plan.

        The steps' slots are -1 (nothing written) and they read block 0; only
        `kv_unpack` writes, block 0's own bytes back. None, doing nothing: without the
        Triton backend, or with tensor parallelism (its forward waits for every rank).
        """
        if not self.backend.uses_triton_ops or self.tp_workers is not None:
            return None
        plan = _variants.warmup_plan(
            dtype=self.model.dtype,
            num_kv_heads=self.model.num_kv_heads,
            block_size=self.block_size,
            max_model_len=max_model_len,
            device=self.device,
            max_step_tokens=max_step_tokens,
        )
        registry = _variants.REGISTRY
        with registry.warming():
            for num_tokens in plan.prefill_lens:
                self._warm_up_step(num_tokens, None, max_model_len)
            for shape in plan.decode_shapes:
                self._warm_up_step(0, shape, max_model_len)
            # a decode after prefill rows: its queries start past them (their alignment)
            self._warm_up_step(plan.prefill_lens[0], plan.decode_shapes[0], max_model_len)
            self._warm_up_kv_pack()
        registry.mark_ready()
        return plan

    def _warm_up_step(
        self, num_prefill: int, decode: tuple[int, int] | None, max_model_len: int
    ) -> None:
        """A forward of `num_prefill` prefill tokens (chunks of at most `max_model_len`)
        and `decode` = (rows, block-table width) decode rows, over padding."""
        meta = self._warm_up_meta(num_prefill, decode or (0, 0), max_model_len)
        positions = [i for p in meta.prefills for i in range(p.query_len)]
        num_decode = meta.slot_mapping.numel() - num_prefill
        hidden = self.model.forward(
            torch.zeros(num_prefill + num_decode, dtype=torch.int64, device=self.device),
            self._tensor([*positions, *[0] * num_decode]),
            self.kv_caches,
            self.backend,
            meta,
        )
        self.model.logits(hidden)

    def _warm_up_meta(
        self, num_prefill: int, decode: tuple[int, int], max_model_len: int
    ) -> AttentionMetadata:
        """A warm-up step's metadata: slots -1, every table block 0, decode contexts 1."""
        prefills: list[PrefillMeta] = []
        for start in range(0, num_prefill, max_model_len):
            n = min(max_model_len, num_prefill - start)
            table = torch.zeros(-(-n // self.block_size), dtype=torch.int64, device=self.device)
            prefills.append(PrefillMeta(start, n, n, table))
        rows, width = decode
        decode_meta = None
        if rows:
            decode_meta = DecodeMeta(
                block_tables=torch.zeros(rows, width, dtype=torch.int32, device=self.device),
                context_lens=torch.ones(rows, dtype=torch.int32, device=self.device),
                context_lens_list=[1] * rows,
            )
        slots = torch.full((num_prefill + rows,), -1, dtype=torch.int64, device=self.device)
        return AttentionMetadata(
            slot_mapping=slots,
            num_prefill_tokens=num_prefill,
            prefills=prefills,
            prefill_batch=self._prefill_batch(prefills),
            decode=decode_meta,
        )

    def _warm_up_kv_pack(self) -> None:
        """The KV handoff's gather and scatter (engine/worker/kv_staging.py) of block 0: its own
        bytes back."""
        from pdserve.kernels.kv_pack import kv_pack, kv_unpack

        ids = torch.zeros(1, dtype=torch.int64, device="cpu")  # host ids, as the staging's
        kv_unpack(kv_pack(self.kv_cache, ids), self.kv_cache, ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if _uses_lora(out):  # never the base model's forward for an adapter's rows
            return self._execute_lora(out)
        graphs = self.graphs
        if graphs is not None and not out.prefills and (out.decodes or out.verifies):
            layout = _decode_layout(out)
            if graphs.fits(len(layout.rows), layout.rows[-1][0]):
                return self._execute_graph(graphs, layout)
        input_ids, positions, meta, sample_rows, sample_items = self._prepare(out)
        if self.tp_workers is not None:
            self.tp_workers.send_step(input_ids, positions, meta, sample_rows)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, self.backend, meta)
        if not sample_items:
            return StepResult({}, {})
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))  # [N, vocab] float32
        return self._sample(logits, sample_items)

    def _execute_lora(self, out: SchedulerOutput) -> StepResult:
        """A step with rows of LoRA adapters: eager (no graph holds the deltas), the
        model told each adapter's rows for this forward."""
        input_ids, positions, meta, sample_rows, sample_items = self._prepare(out)
        groups = self._lora_rows(out)
        self.model.lora = LoRAStep.of(groups, self.device, len(input_ids), self._lora_stack)
        try:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, self.backend, meta)
        finally:
            self.model.lora = None
        if not sample_items:
            return StepResult({}, {})
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return self._sample(logits, sample_items)

    def _lora_stack(self, adapters: list[LoRAAdapter]) -> LoRAStack:
        """The stack of these adapters (engine/lora/apply.py): the last few are kept, as
        long as each of their adapters is still the one loaded under its name."""
        key = tuple(sorted(a.name for a in adapters))
        stack = self._lora_stacks.pop(key, None)
        if stack is None or not stack.holds(self.loras):
            stack = LoRAStack(sorted(adapters, key=lambda a: a.name))
        self._lora_stacks[key] = stack  # the most recent last
        for old in [k for k, s in self._lora_stacks.items() if not s.holds(self.loras)]:
            del self._lora_stacks[old]
        while len(self._lora_stacks) > _LORA_STACKS_KEPT:
            del self._lora_stacks[next(iter(self._lora_stacks))]
        return stack

    def _lora_rows(self, out: SchedulerOutput) -> list[tuple[LoRAAdapter, list[int]]]:
        """Each adapter's rows of the step, in `_prepare`'s order: the prefill chunks'
        tokens, then one row per decode (or verify) token."""
        rows: dict[str, list[int]] = {}
        at = 0
        for item in out.prefills:
            name = item.seq.params.lora
            if name is not None:
                rows.setdefault(name, []).extend(range(at, at + item.num_new_tokens))
            at += item.num_new_tokens
        for row, (_, _, item, _) in enumerate(_decode_layout(out).rows):
            name = item.seq.params.lora
            if name is not None:
                rows.setdefault(name, []).append(at + row)
        missing = sorted(set(rows) - set(self.loras))
        if missing:  # the scheduler makes every running sequence's adapter resident
            raise RuntimeError(f"LoRA adapters {missing} have rows in a step but no slot")
        return [(self.loras[name], r) for name, r in rows.items()]

    @torch.inference_mode()
    def execute_shard(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> None:
        """A tensor-parallel worker's part of a step the driver broadcast
        (`parallel.unpack_step`): the forward on this shard, joining its all-reduces, and
        this shard's logits of the rows that sample, sent to the driver."""
        meta.prefill_batch = self._prefill_batch(meta.prefills)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, self.backend, meta)
        if sample_rows.numel():
            self.model.logits(hidden.index_select(0, sample_rows))

    def _execute_graph(self, graphs: CudaGraphRunner, layout: _DecodeLayout) -> StepResult:
        """A step of decode rows only (verify rows' included) through the graph runner's
        padded static buffers."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        for context, token, item, _ in layout.rows:
            seq, pos = item.seq, context - 1
            tokens.append(token)
            positions.append(pos)
            slots.append(seq.blocks[pos // bs].block_id * bs + pos % bs)
            tables.append([b.block_id for b in seq.blocks[: pos // bs + 1]])
            context_lens.append(context)
        logits = graphs.run(tokens, positions, slots, tables, context_lens)  # [n, vocab]
        # NOTE: a 1-token prefill chunk rides as a decode row and does not sample.
        sample_rows = layout.sample_rows
        if not sample_rows:
            return StepResult({}, {})
        if sample_rows != list(range(len(layout.rows))):
            rows = torch.tensor(sample_rows, dtype=torch.int64)
            if self.device.type == "cuda":
                rows = rows.pin_memory()  # an asynchronous copy: no sync before the sampler's
            logits = logits.index_select(0, rows.to(self.device, non_blocking=True))
        return self._sample(logits, layout.sample_items)

    def _sample(self, logits: torch.Tensor, sample_items: list[ScheduledSeq]) -> StepResult:
        return sample_step(self.sampler, logits, sample_items)

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[ScheduledSeq]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillMeta] = []
        sample_rows: list[int] = []
        sample_items: list[ScheduledSeq] = []
        for item in out.prefills:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            block_ids = [b.block_id for b in seq.blocks[: -(-(start + n) // bs)]]
            query_start = len(tokens)
            prefills.append(PrefillMeta(query_start, n, start + n, self._tensor(block_ids)))
            tokens.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.samples:
                sample_rows.append(query_start + n - 1)
                sample_items.append(item)
        num_prefill_tokens = len(tokens)
        layout = _decode_layout(out)
        for context, token, item, _ in layout.rows:
            pos = context - 1
            tokens.append(token)
            positions.append(pos)
            slots.append(item.seq.blocks[pos // bs].block_id * bs + pos % bs)
        sample_rows.extend(num_prefill_tokens + row for row in layout.sample_rows)
        sample_items.extend(layout.sample_items)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_prefill_tokens=num_prefill_tokens,
            prefills=prefills,
            prefill_batch=self._prefill_batch(prefills),
            decode=self._decode_meta([(context, item.seq) for context, _, item, _ in layout.rows]),
        )
        return self._tensor(tokens), self._tensor(positions), meta, sample_rows, sample_items

    def _prefill_batch(self, prefills: list[PrefillMeta]) -> PrefillBatch | None:
        if not prefills or not self.backend.wants_prefill_batch:
            return None
        max_blocks = max(p.block_table.numel() for p in prefills)
        tables = torch.zeros(len(prefills), max_blocks, dtype=torch.int32, device=self.device)
        for i, p in enumerate(prefills):
            tables[i, : p.block_table.numel()] = p.block_table
        starts = [p.query_start for p in prefills] + [sum(p.query_len for p in prefills)]
        return PrefillBatch(
            block_tables=tables,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(
                [p.context_len for p in prefills], dtype=torch.int32, device=self.device
            ),
        )

    def _decode_meta(self, rows: list[tuple[int, Sequence]]) -> DecodeMeta | None:
        """The decode rows' metadata; `rows`: (context length, sequence), ascending."""
        if not rows:
            return None
        context_lens = [context for context, _ in rows]
        max_blocks = -(-context_lens[-1] // self.block_size)
        tables = [[b.block_id for b in seq.blocks[:max_blocks]] for _, seq in rows]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        return DecodeMeta(
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            context_lens_list=context_lens,
        )


_LORA_STACKS_KEPT = 4  # sets of adapters whose stacks a runner keeps


@dataclass
class _DecodeLayout:
    """A step's decode rows: (context length, token, item, j) ascending by context, and
    which of them sample, for which items (in the order the sampled rows come)."""

    rows: list[tuple[int, int, ScheduledSeq, int]]
    sample_rows: list[int]  # indices into `rows`
    sample_items: list[ScheduledSeq]


def _uses_lora(out: SchedulerOutput) -> bool:
    items = (*out.prefills, *out.decodes, *out.verifies)
    return any(item.seq.params.lora is not None for item in items)


def _decode_layout(out: SchedulerOutput) -> _DecodeLayout:
    """The plain decodes and each position j of each verify row (its last token, then
    the proposals), as decode rows. With every new token's KV written before attention,
    position j attending to the context up to itself (start + j + 1 tokens) is exactly a
    decode row of that context length, which every backend runs well (the CPU kernel and
    the Triton decode kernel read the paged KV in place, and CUDA graphs replay it).
    Ordered by context length: the torch backend attends to runs of similar lengths
    together, padding each run only to its own longest context."""
    rows: list[tuple[int, int, ScheduledSeq, int]] = []
    for item in out.decodes:
        rows.append((item.start + 1, item.seq.all_token_ids[item.start], item, 0))
    for item in out.verifies:
        ids = [item.seq.all_token_ids[item.start], *item.spec_token_ids]
        rows.extend((item.start + j + 1, t, item, j) for j, t in enumerate(ids))
    rows.sort(key=lambda row: row[0])
    sample_rows: list[int] = []
    sample_items: list[ScheduledSeq] = []
    verify_rows: dict[tuple[int, int], int] = {}
    for i, (_, _, item, j) in enumerate(rows):
        if item.spec_token_ids:
            verify_rows[id(item), j] = i
        elif item.samples:  # NOTE: a 1-token prefill chunk rides here and does not sample
            sample_rows.append(i)
            sample_items.append(item)
    for item in out.verifies:  # all its positions sample, in order
        sample_rows.extend(verify_rows[id(item), j] for j in range(item.num_new_tokens))
        sample_items.append(item)
    return _DecodeLayout(rows, sample_rows, sample_items)


def sample_step(
    sampler: Sampler, logits: torch.Tensor, sample_items: list[ScheduledSeq]
) -> StepResult:
    """Sample the rows of `logits` [N, vocab]: in sample_items' order, one row per
    item, or 1 + m rows for a verify row with m proposals."""
    ids = [item.seq.request_id for item in sample_items]
    _constrain(logits, sample_items)
    if not any(item.spec_token_ids for item in sample_items):
        sampled_at = [item.seq.num_tokens for item in sample_items]  # the new token's
        result = sampler(logits, sampled_at, [item.seq.params for item in sample_items])
        one = {rid: [lp] for rid, lp in zip(ids, result.logprobs, strict=True) if lp}
        return StepResult({rid: [t] for rid, t in zip(ids, result.token_ids, strict=True)}, one)
    positions: list[int] = []
    params = []
    for item in sample_items:
        n = 1 + len(item.spec_token_ids)
        # Row j predicts the token at num_tokens + j: decoding's own draw for it.
        positions.extend(range(item.seq.num_tokens, item.seq.num_tokens + n))
        params.extend([item.seq.params] * n)
    targets = sampler.sample(logits, positions, params)
    sampled: dict[str, list[int]] = {}
    kept_rows: list[int] = []  # the rows of the emitted tokens
    row = 0
    for rid, item in zip(ids, sample_items, strict=True):
        n = 1 + len(item.spec_token_ids)
        tokens = accept(targets[row : row + n], list(item.spec_token_ids))
        sampled[rid] = tokens
        kept_rows.extend(range(row, row + len(tokens)))
        row += n
    kept_params = [params[r] for r in kept_rows]
    if all(p.logprobs is None for p in kept_params):
        return StepResult(sampled, {})
    flat = sampler.logprobs(logits, [targets[r] for r in kept_rows], kept_params, kept_rows)
    logprobs: dict[str, list[TokenLogprobs]] = {}
    at = 0
    for rid, tokens in sampled.items():
        lps = flat[at : at + len(tokens)]
        at += len(tokens)
        if lps[0] is not None:
            logprobs[rid] = [lp for lp in lps if lp is not None]
    return StepResult(sampled, logprobs)


def _constrain(logits: torch.Tensor, sample_items: list[ScheduledSeq]) -> None:
    """Mask, in place, the logits of the rows whose sequence has a grammar (structured
    output): only the tokens the grammar allows next remain, EOS only once it is
    complete. Rows without one cost nothing beyond this loop. Constrained sequences never
    speculate (scheduler._room), so each has exactly one row here."""
    rows: list[int] = []
    matchers = []
    row = 0
    for item in sample_items:
        if item.seq.grammar is not None:
            rows.append(row)
            matchers.append(item.seq.grammar)
        row += 1 + len(item.spec_token_ids)
    if matchers:
        apply_token_bitmask(logits, rows, fill_bitmask(matchers, logits.shape[-1]))
