"""Runs one scheduler step on the model: builds flat inputs, forwards, samples.

The only engine module besides the model that touches tensors. One step = one forward
over every scheduled token (prefill chunks first, then decode tokens) and one sampling
call for the sequences whose step completes their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeMeta,
    KVCache,
    PrefillBatch,
    PrefillMeta,
)
from pdserve.engine.model import LlamaModel
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import TokenLogprobs


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]  # request id -> sampled token
    logprobs: dict[str, TokenLogprobs]


def allocate_kv_cache(
    model: LlamaModel, num_blocks: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """All layers' KV cache as one tensor [layers, 2, blocks, kv_heads, block_size, D]."""
    cfg = model.config
    shape = (cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    return torch.zeros(shape, dtype=model.dtype, device=device)


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
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [layers, 2, blocks, KVH, bs, D]: what a transfer packs
        self.kv_caches = layer_views(kv_cache)
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        input_ids, positions, meta, sample_rows, sample_items = self._prepare(out)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, self.backend, meta)
        if not sample_items:
            return StepResult({}, {})
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))  # [N, vocab] float32
        ids = [item.seq.request_id for item in sample_items]
        sampled_at = [item.seq.num_tokens for item in sample_items]  # the new token's position
        result = self.sampler(logits, sampled_at, [item.seq.params for item in sample_items])
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs, strict=True) if lp}
        return StepResult(dict(zip(ids, result.token_ids, strict=True)), logprobs)

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
        # Decodes ordered by context length: the torch backend attends to runs of similar
        # lengths together, padding each run only to its own longest context.
        decodes = sorted(out.decodes, key=lambda item: item.start)
        for item in decodes:
            pos = item.start
            tokens.append(item.seq.all_token_ids[pos])
            positions.append(pos)
            slots.append(item.seq.blocks[pos // bs].block_id * bs + pos % bs)
            if item.samples:  # NOTE: a 1-token prefill chunk rides here and does not sample
                sample_rows.append(len(tokens) - 1)
                sample_items.append(item)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_prefill_tokens=num_prefill_tokens,
            prefills=prefills,
            prefill_batch=self._prefill_batch(prefills),
            decode=self._decode_meta(decodes),
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

    def _decode_meta(self, decodes: list[ScheduledSeq]) -> DecodeMeta | None:
        if not decodes:
            return None
        context_lens = [item.start + 1 for item in decodes]
        max_blocks = -(-context_lens[-1] // self.block_size)
        tables = [[b.block_id for b in item.seq.blocks[:max_blocks]] for item in decodes]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        return DecodeMeta(
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            context_lens_list=context_lens,
        )
