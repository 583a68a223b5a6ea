"""Tensor parallelism: the process group, the shard arithmetic and a step's inputs on the wire.

Megatron-style, over `torch.distributed` (NCCL on CUDA, gloo on CPU):

- attention: rank r holds query heads [r*H/tp, (r+1)*H/tp) (q|k|v column-parallel, fused
  per rank) and the KV heads they read; the output projection is row-parallel (its
  columns of those heads) followed by one all-reduce;
- MLP: gate|up column-parallel, down row-parallel followed by one all-reduce;
- embedding and LM head vocab-parallel: rank r holds rows [r*Vp, (r+1)*Vp) with
  Vp = ceil(V/tp) (the last shard padded with zero rows); embedding lookups outside the
  shard give zeros and one all-reduce sums the shards; each rank computes its slice of
  the logits and the driver gathers them for sampling;
- KV heads: split when tp divides them; when tp > num_kv_heads (MQA, GQA with few KV
  heads) rank r holds KV head r * num_kv_heads // tp, replicated across tp/num_kv_heads
  ranks: its query heads are exactly the ones that read that head.

Every collective runs with the group's `timeout` (EngineConfig.distributed_timeout_s):
a rank that dies or stalls makes the others raise, never wait forever. The driver (rank
0) times its collectives (`CollectiveTimes`): the all-reduce share of a step.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.common.model_config import ModelConfig
from pdserve.common.model_config import check_tensor_parallel as check_tensor_parallel
from pdserve.engine.modeling.attention import AttentionMetadata, DecodeMeta, PrefillMeta

# check_tensor_parallel lives in model_config (no torch) so that the cluster's preflight
# runs the same check; re-exported here, where the shard arithmetic is.


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, stalled past the timeout or is gone."""


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `tp` holds of a model of shape `config`."""

    config: ModelConfig
    rank: int
    tp: int

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.tp

    @property
    def kv_replicated(self) -> bool:
        """Whether each rank holds one KV head that other ranks hold too."""
        return self.tp > self.config.num_kv_heads

    @property
    def num_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.config.num_kv_heads // self.tp

    @property
    def head_range(self) -> tuple[int, int]:
        return self.rank * self.num_heads, (self.rank + 1) * self.num_heads

    @property
    def kv_head_range(self) -> tuple[int, int]:
        if self.kv_replicated:
            head = self.rank * self.config.num_kv_heads // self.tp
            return head, head + 1
        return self.rank * self.num_kv_heads, (self.rank + 1) * self.num_kv_heads

    @property
    def ffn_range(self) -> tuple[int, int]:
        per = self.config.intermediate_size // self.tp
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.tp)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """This rank's vocabulary rows [start, end) (end <= vocab_size: the rest is padding)."""
        start = min(self.rank * self.vocab_per_rank, self.config.vocab_size)
        return start, min(start + self.vocab_per_rank, self.config.vocab_size)

    def slice_of(self, name: str) -> tuple[int, int, int, bool] | None:
        """(dim, start, end, sharded) of checkpoint tensor `name` on this rank, or None for
        a replicated tensor (norms, a row-parallel layer's bias on ranks > 0 aside).

        `sharded` False: the slice is a replicated one (KV heads shared by several ranks).
        """
        d = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab_range, True)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            h0, h1 = self.head_range
            return 0, h0 * d, h1 * d, True
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            k0, k1 = self.kv_head_range
            return 0, k0 * d, k1 * d, not self.kv_replicated
        if name.endswith("self_attn.o_proj.weight"):
            h0, h1 = self.head_range
            return 1, h0 * d, h1 * d, True
        if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
            return (0, *self.ffn_range, True)
        if name.endswith("mlp.down_proj.weight"):
            return (1, *self.ffn_range, True)
        return None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(i + r) for a driver on cuda:i; the CPU for every rank."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Collectives timed by CUDA events whose times are not yet read, at most (see count_step).
MAX_PENDING_EVENTS = 1024


@dataclass
class CollectiveTimes:
    """Seconds this rank spent in collectives, and the steps they were spent over."""

    steps: int = 0
    all_reduce_s: float = 0.0
    all_reduces: int = 0
    broadcast_s: float = 0.0
    gather_s: float = 0.0
    _pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class TPGroup:
    """This process's rank in the engine's tensor-parallel group, and its collectives.

    The default process group of `torch.distributed` (one engine with tp > 1 per
    process), made with an explicit timeout; every collective below is timed. On CUDA the
    collectives run on the current stream and are timed by CUDA events, read when the
    times are read (`times()`).
    """

    def __init__(
        self, rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float
    ) -> None:
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already belongs to a torch.distributed group: one engine with"
                " tensor_parallel_size > 1 per process"
            )
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            self.backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        self._times = CollectiveTimes()
        self._cuda = device.type == "cuda"

    def _start(self) -> float | torch.cuda.Event:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _stop(self, kind: str, start: float | torch.cuda.Event) -> None:
        t = self._times
        if isinstance(start, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            t._pending.append((kind, start, end))
            return
        seconds = time.perf_counter() - start
        if kind == "all_reduce":
            t.all_reduce_s += seconds
        elif kind == "broadcast":
            t.broadcast_s += seconds
        else:
            t.gather_s += seconds

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        start = self._start()
        dist.all_reduce(tensor)
        self._times.all_reduces += 1
        self._stop("all_reduce", start)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The driver's `tensor`, into `tensor` on every rank (in place); returns it."""
        start = self._start()
        dist.broadcast(tensor, src=0)
        self._stop("broadcast", start)
        return tensor

    def gather_columns(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """On the driver: every rank's `tensor` [N, w] side by side, cut to `width` columns.
        On the other ranks: `tensor` itself (sent to the driver)."""
        start = self._start()
        tensor = tensor.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.gather(tensor, parts, dst=0)
            tensor = torch.cat(parts, dim=1)[:, :width]
        else:
            dist.gather(tensor, None, dst=0)
        self._stop("gather", start)
        return tensor

    def count_step(self) -> None:
        """A step ended: its collectives' events that are done are read and let go.

        Every rank counts its steps, and only the driver ever reads `times()`: without
        this, a rank kept two events per collective (~130 a step for 32 layers) forever.
        Events still running stay, at most MAX_PENDING_EVENTS pairs (past that the oldest
        are waited for: they finished steps ago)."""
        self._times.steps += 1
        self._fold(wait=False)

    def times(self) -> CollectiveTimes:
        """The accumulated times (CUDA events resolved first: this waits for them)."""
        self._fold(wait=True)
        return self._times

    def _fold(self, wait: bool) -> None:
        """Add the pending events' times; all of them (`wait`) or those already done."""
        t = self._times
        keep_from = 0
        for i, (kind, start, end) in enumerate(t._pending):
            over = len(t._pending) - i > MAX_PENDING_EVENTS
            if not (wait or over or end.query()):
                keep_from = i
                break
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
            if kind == "all_reduce":
                t.all_reduce_s += seconds
            elif kind == "broadcast":
                t.broadcast_s += seconds
            else:
                t.gather_s += seconds
        else:
            keep_from = len(t._pending)
        del t._pending[:keep_from]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes: weights (split into sharded and replicated) and its KV cache."""

    rank: int
    weight_bytes: int
    sharded_weight_bytes: int
    replicated_weight_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True)
class ParallelStats:
    """`LLMEngine.parallel_stats()`: per-rank memory and the driver's collective times."""

    tensor_parallel_size: int
    ranks: list[RankMemory]
    steps: int
    all_reduce_s: float  # total, on the driver
    all_reduces: int
    broadcast_s: float
    gather_s: float

    @property
    def all_reduce_s_per_step(self) -> float:
        return self.all_reduce_s / self.steps if self.steps else 0.0

    @property
    def collective_s_per_step(self) -> float:
        """All the driver's collectives (all-reduce, step broadcast, logits gather) per step."""
        total = self.all_reduce_s + self.broadcast_s + self.gather_s
        return total / self.steps if self.steps else 0.0


# -- a step's inputs on the wire -------------------------------------------------------------

# StepHeader fields, in order: what the worker needs to size and cut the payload.
HEADER_FIELDS = (
    "num_tokens",
    "num_prefill_tokens",
    "num_prefills",
    "prefill_table_len",
    "num_decodes",
    "decode_max_blocks",
    "num_sample_rows",
)


def payload_len(header: tuple[int, ...]) -> int:
    t, _, p, table_len, b, max_blocks, n = header
    return 3 * t + 4 * p + table_len + b * max_blocks + b + n


def pack_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    sample_rows: list[int],
) -> tuple[tuple[int, ...], torch.Tensor]:
    """(header, payload): the step's inputs as a few ints and one int64 tensor on the
    inputs' device: ids, positions, slots | per prefill (query_start, query_len,
    context_len, table length) | prefill block tables | decode block tables | decode
    context lengths | rows that sample."""
    device = input_ids.device
    prefill_info = [
        v
        for p in meta.prefills
        for v in (p.query_start, p.query_len, p.context_len, p.block_table.numel())
    ]
    parts = [input_ids, positions, meta.slot_mapping]
    parts.append(torch.tensor(prefill_info, dtype=torch.int64, device=device))
    parts.extend(p.block_table.to(torch.int64) for p in meta.prefills)
    decode = meta.decode
    if decode is not None:
        parts.append(decode.block_tables.to(torch.int64).view(-1))
        parts.append(decode.context_lens.to(torch.int64))
    parts.append(torch.tensor(sample_rows, dtype=torch.int64, device=device))
    header = (
        input_ids.numel(),
        meta.num_prefill_tokens,
        len(meta.prefills),
        sum(p.block_table.numel() for p in meta.prefills),
        0 if decode is None else decode.block_tables.shape[0],
        0 if decode is None else decode.block_tables.shape[1],
        len(sample_rows),
    )
    return header, torch.cat(parts)


def unpack_step(
    header: tuple[int, ...], payload: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`pack_step`'s inverse: (input_ids, positions, metadata without prefill_batch,
    sample rows)."""
    t, num_prefill_tokens, p, table_len, b, max_blocks, n = header
    host = payload.cpu() if payload.device.type != "cpu" else payload
    at = 0

    def take(count: int, source: torch.Tensor = payload) -> torch.Tensor:
        nonlocal at
        out = source[at : at + count]
        at += count
        return out

    input_ids, positions, slots = take(t), take(t), take(t)
    info = take(4 * p, host).view(p, 4).tolist()
    prefills = []
    for query_start, query_len, context_len, blocks in info:
        prefills.append(PrefillMeta(query_start, query_len, context_len, take(blocks)))
    assert sum(row[3] for row in info) == table_len
    decode = None
    if b:
        tables = take(b * max_blocks).view(b, max_blocks).to(torch.int32)
        lens_list = host[at : at + b].tolist()
        lens = take(b).to(torch.int32)
        decode = DecodeMeta(tables, lens, lens_list)
    rows = take(n)
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_prefill_tokens=num_prefill_tokens,
        prefills=prefills,
        prefill_batch=None,
        decode=decode,
    )
    return input_ids, positions, meta, rows
