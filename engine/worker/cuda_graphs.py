"""Decode steps as CUDA graphs: the model's launches for a batch size, captured once.

A decode step of a small batch is dominated by kernel launches (a few dozen per layer),
not by the GPU's work; replaying a captured graph launches them all at once (vLLM's
CUDA graph mode). At engine start `CudaGraphRunner.capture` records, for each capture
size (1, 2, 4, 8, then multiples of 8 up to the maximum, `capture_sizes`), one graph of
`model.forward` + `model.logits` over every row, reading static device buffers: token
ids, positions, cache slots, block tables [max batch, ceil(max_model_len / block_size)]
and context lengths. A decode-only step of n sequences takes the smallest capture size
>= n: its inputs are copied into the buffers' first n rows, the rows up to that size
are padding (token 0 at position 0, slot -1 so `reshape_and_cache` writes nothing,
context length 1 over block 0: read, never written), the graph replays and the first n
rows of its logits are sampled outside the graph (`engine/sampler.py`), whose copy of
the sampled tokens is the step's one host-device sync.

What makes a captured graph valid at every replay (read before changing the model's
forward or a kernel launcher):
- no host sync and no host-side value read from the device inside `_forward` (no
  `.item()`, `.tolist()`, `.cpu()`, no tensor built from a device value);
- every launch's grid and constexprs depend only on shapes fixed per capture size: the
  decode kernel's split count (`kernels/paged_decode_attention.py`, `_auto_num_splits`)
  is computed from the batch size and `block_tables.shape[1]` (the full static width),
  never from the context lengths; the other kernels' grids from the token count;
- the tensors a graph reads or writes keep their storage: the static buffers, the
  weights and the KV cache (`ModelRunner.kv_caches`: a graph holds their addresses, so
  the cache must never be reallocated or replaced after capture);
- the graphs share one memory pool, captured largest first; intermediate memory of one
  graph may be another's, which is safe because replays never overlap, and each graph's
  output stays allocated (it is held here).

Inputs reach the buffers by `copy_` from pinned host staging buffers (non_blocking); an
event recorded after the copies is waited on before the staging buffers are refilled
(already passed whenever the previous step synced on its sampled tokens).

On CPU (tests) the runner works in "eager replay" mode (`use_cuda_graph=False`): the same
static buffers and padding, and the captured callable called directly instead of a graph,
so the padding and buffer logic is checked against the plain eager path without a GPU.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence as Seq

import torch

from pdserve.engine.modeling.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeMeta,
    KVCache,
)
from pdserve.engine.modeling.llama import LlamaModel

_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8
# Runs of each size before its capture: compile the Triton kernels' specialisations and
# let cuBLAS pick its algorithms outside the capture.
_WARMUP_RUNS = 2
# The padding rows' values (see the module docstring).
_PAD_TOKEN = 0
_PAD_POSITION = 0
_PAD_SLOT = -1
_PAD_CONTEXT_LEN = 1
_PAD_BLOCK = 0


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to `max_batch_size`, which is always included."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in _SMALL_SIZES if s <= max_batch_size]
    sizes += range(_SIZE_STEP, max_batch_size + 1, _SIZE_STEP)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def padded_size(num_rows: int, sizes: Seq[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `num_rows`; None past the largest."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    """Static buffers and, per capture size, a graph of the model's decode forward.

    Args:
        model, kv_caches, backend: what `ModelRunner` forwards with; the backend must be
            the Triton one (its kernels take the padding rows; the torch backends read
            host-side context lengths, which a graph cannot).
        block_size, max_model_len: the block tables' width, ceil(max_model_len /
            block_size) columns: every decode row fits, and the width never changes.
        max_batch_size: the largest capture size.
        use_cuda_graph: False (CPU tests): no capture, `_forward` runs directly.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        device: torch.device,
        use_cuda_graph: bool = True,
    ) -> None:
        if not backend.uses_triton_ops:
            raise ValueError(f"decode graphs need the Triton attention backend, not {backend.name}")
        if use_cuda_graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.use_cuda_graph = use_cuda_graph
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        rows, cols = self.max_batch_size, self.max_blocks_per_seq
        # Device buffers every graph reads (a graph of size b: their first b rows).
        self.input_ids = torch.full((rows,), _PAD_TOKEN, dtype=torch.int64, device=device)
        self.positions = torch.full((rows,), _PAD_POSITION, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), _PAD_SLOT, dtype=torch.int64, device=device)
        self.block_tables = torch.full((rows, cols), _PAD_BLOCK, dtype=torch.int32, device=device)
        self.context_lens = torch.full((rows,), _PAD_CONTEXT_LEN, dtype=torch.int32, device=device)
        # Host staging: pinned on CUDA, so that the copies are asynchronous.
        pin = device.type == "cuda"
        self._host_ids = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self._host_positions = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self._host_slots = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self._host_context_lens = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        # flat: a step's [b, width] tables are one contiguous block of it
        self._host_tables = torch.empty(rows * cols, dtype=torch.int32, pin_memory=pin)
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output [b, vocab]
        self.steps: Counter[int] = Counter()  # steps run per padded size

    def fits(self, num_rows: int, max_context_len: int) -> bool:
        """Whether a decode step of these rows can run here."""
        return (
            0 < num_rows <= self.max_batch_size
            and max_context_len <= self.max_blocks_per_seq * self.block_size
        )

    def _forward(self, batch_size: int) -> torch.Tensor:
        """What a graph captures: float32 logits [batch_size, vocab] of the buffers' rows."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            num_prefill_tokens=0,
            prefills=[],
            prefill_batch=None,
            decode=DecodeMeta(
                # Full width: the decode kernel's split count depends on it (fixed).
                block_tables=self.block_tables[:batch_size],
                context_lens=self.context_lens[:batch_size],
                # Host values cannot change across replays; the Triton backend never
                # reads them (an empty list fails loudly if a backend ever did).
                context_lens_list=[],
            ),
        )
        hidden = self.model.forward(
            self.input_ids[:batch_size],
            self.positions[:batch_size],
            self.kv_caches,
            self.backend,
            meta,
        )
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one graph per size (largest first); no-op on CPU.

        The buffers hold padding throughout: slot -1 everywhere, so neither the warm-up
        runs nor the capture write the KV cache.
        """
        if not self.use_cuda_graph:
            return
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        for batch_size in reversed(self.sizes):
            # Warm-up on a side stream, as PyTorch's CUDA graph docs require.
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP_RUNS):
                    self._forward(batch_size)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._forward(batch_size)
            self._graphs[batch_size] = graph
            self._logits[batch_size] = logits
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(
        self,
        token_ids: Seq[int],
        positions: Seq[int],
        slots: Seq[int],
        block_tables: Seq[Seq[int]],
        context_lens: Seq[int],
    ) -> torch.Tensor:
        """float32 logits [n, vocab] of n decode rows (one token of a sequence each).

        `block_tables[i]`: the block ids of row i's first ceil(context_lens[i] /
        block_size) blocks. The result is a view of the graph's output: read it before
        the next `run`. Raises ValueError when the rows do not fit (`fits`).
        """
        num_rows = len(token_ids)
        width = max((len(t) for t in block_tables), default=0)
        batch_size = padded_size(num_rows, self.sizes)
        if batch_size is None or num_rows == 0 or width > self.max_blocks_per_seq:
            raise ValueError(
                f"{num_rows} rows of up to {width} blocks do not fit the decode graphs "
                f"({self.max_batch_size} rows of {self.max_blocks_per_seq} blocks)"
            )
        if self._copied is not None:
            # The previous step's copies read the staging buffers: done before refilling.
            self._copied.synchronize()
        # Padding rows are reset at every step: a row real at the step before is not now.
        self._stage(self._host_ids, batch_size, token_ids, _PAD_TOKEN)
        self._stage(self._host_positions, batch_size, positions, _PAD_POSITION)
        self._stage(self._host_slots, batch_size, slots, _PAD_SLOT)
        self._stage(self._host_context_lens, batch_size, context_lens, _PAD_CONTEXT_LEN)
        # Only the step's widest table's columns: the kernel never reads a row's entries
        # past its context length, so older values further right are never read.
        width = max(width, 1)
        host_tables = self._host_tables[: batch_size * width].view(batch_size, width)
        tables = host_tables.numpy()
        tables.fill(_PAD_BLOCK)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        non_blocking = self._copied is not None  # from pinned staging
        for dst, src in (
            (self.input_ids, self._host_ids),
            (self.positions, self._host_positions),
            (self.slot_mapping, self._host_slots),
            (self.context_lens, self._host_context_lens),
        ):
            dst[:batch_size].copy_(src[:batch_size], non_blocking=non_blocking)
        self.block_tables[:batch_size, :width].copy_(host_tables, non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if self.use_cuda_graph:
            self._graphs[batch_size].replay()
            logits = self._logits[batch_size]
        else:
            logits = self._forward(batch_size)
        self.steps[batch_size] += 1
        return logits[:num_rows]

    @staticmethod
    def _stage(host: torch.Tensor, batch_size: int, values: Seq[int], pad_value: int) -> None:
        """The step's values, then `pad_value`, into the first `batch_size` staging rows."""
        out = host[:batch_size].numpy()
        out[: len(values)] = values
        out[len(values) :] = pad_value


def cuda_graphs_enabled(
    enforce_eager: bool, device: torch.device, backend: AttentionBackend
) -> bool:
    """Whether an engine captures decode graphs: on CUDA, with the Triton backend, unless
    `EngineConfig.enforce_eager`."""
    return not enforce_eager and device.type == "cuda" and backend.uses_triton_ops
