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


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, device: torch.device
) -> list[KVCache]:
    cfg = model.config
    shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=model.dtype, device=device),
            torch.zeros(shape, dtype=model.dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
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
        result = self.sampler(logits, ids, [item.seq.params for item in sample_items])
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
        slots: list[torch.Tensor] = []
        prefills: list[PrefillMeta] = []
        sample_rows: list[int] = []
        sample_items: list[ScheduledSeq] = []
        for item in out.prefills:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            block_ids = self._tensor([b.block_id for b in seq.blocks])
            pos = torch.arange(start + n, device=self.device)
            seq_slots = block_ids[pos // bs] * bs + pos % bs  # [start + n]
            slots.append(seq_slots[start:])
            query_start = len(tokens)
            prefills.append(PrefillMeta(query_start, n, start + n, seq_slots if start else None))
            tokens.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if item.samples:
                sample_rows.append(query_start + n - 1)
                sample_items.append(item)
        num_prefill_tokens = len(tokens)
        decode_meta = self._decode_meta(out.decodes)
        for item in out.decodes:
            pos_i = item.start
            tokens.append(item.seq.all_token_ids[pos_i])
            positions.append(pos_i)
            if item.samples:  # NOTE: a 1-token prefill chunk rides here and does not sample
                sample_rows.append(len(tokens) - 1)
                sample_items.append(item)
        if out.decodes:
            slots.append(
                self._tensor(
                    [
                        item.seq.blocks[item.start // bs].block_id * bs + item.start % bs
                        for item in out.decodes
                    ]
                )
            )
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            num_prefill_tokens=num_prefill_tokens,
            prefills=prefills,
            decode=decode_meta,
        )
        return self._tensor(tokens), self._tensor(positions), meta, sample_rows, sample_items

    def _decode_meta(self, decodes: list[ScheduledSeq]) -> DecodeMeta | None:
        if not decodes:
            return None
        bs = self.block_size
        context_lens = [item.start + 1 for item in decodes]
        max_len = max(context_lens)
        max_blocks = -(-max_len // bs)
        tables = [[b.block_id for b in item.seq.blocks[:max_blocks]] for item in decodes]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)
        j = torch.arange(max_len, device=self.device)  # [L]
        mask = j.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
        slots = block_tables[:, j // bs].long() * bs + j % bs  # [B, L]
        return DecodeMeta(
            block_tables=block_tables,
            context_lens=lens,
            max_context_len=max_len,
            slots=slots.masked_fill(~mask, 0),
            mask=mask.view(len(decodes), 1, 1, max_len),
        )
