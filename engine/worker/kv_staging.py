"""Where the KV handoff meets the device: a request's blocks packed into host memory for the
wire, and arrived blocks written back into the cache (docs/kv-handoff.md, "Devices").

This module is THE one place that names the handoff's device assumptions. Everything
around it (engine/worker/kv_handoff.py, the prefill and decode workers, kv_transfer/) handles host
tensors and bytes only. The assumptions:

1. The engine's cache is one tensor [layers, 2, blocks, kv_heads, block_size, head_dim] on
   one device (CPU or one CUDA device), each block one contiguous chunk (kernels/kv_pack.py).
2. An export is a contiguous host (CPU) tensor in the wire layout
   [layers, 2, n, kv_heads, block_size, head_dim]: kv_pack's buffer, byte for byte.
   `kv_transfer/torch_payload.py` views it as bytes and refuses a tensor on any device.
3. On CUDA the pack runs on the compute (current) stream, so it is ordered after the steps
   that wrote the blocks and before any later step that rewrites them. The device->host
   copy runs on one side stream, behind an event recorded after the pack, into pinned host
   memory: the engine thread returns at once and the next step is not blocked.
   `StagedKV.wait()` blocks until the copy is done (call it off the event loop). Every
   copy goes on that one side stream, so a staging region handed back while its copy was
   still in flight is rewritten only after that copy (stream order). A payload crosses the
   device in chunks of whole layers of at most DEVICE_CHUNK_BYTES (one layer, if one is
   larger): each chunk is packed only once the previous one's copy is done (the compute
   stream waits for it on the device, never the host), so an export holds at most one
   chunk of device memory, which the memory profile keeps out of the KV pool.
4. Pinned staging memory is one area of `staging_bytes` (EngineConfig.kv_staging_mb),
   allocated at the first export (an engine that never exports pins nothing) and reused
   across requests: regions handed out first fit, returned by `StagedKV.release()` from
   any thread (or when the StagedKV is garbage-collected unreleased). A payload that does
   not fit gets a one-off pinned allocation (counted in `num_one_off`, logged at debug
   level), never a failure.
5. An import from pinned memory (`pin_for_import`, which the decode worker runs off the
   engine thread: the receiver's buffer is pageable) is asynchronous: on the side stream,
   after an event of the compute stream (the blocks' earlier users), each chunk of layers
   is copied to the device and unpacked into its blocks, and an event is recorded. The
   engine thread returns at once; the first step that touches one of those blocks makes
   the compute stream wait for that event (`await_imports`: on the device, and only for
   the imports its sequences use). The pinned source and the device chunk stay alive until
   the event is passed. From pageable memory (no staging region was free) the copy is
   synchronous, chunk by chunk, as before: the caller may reuse the buffer once
   `import_blocks` returns either way.
6. Block ids are CPU int64 tensors, checked on the host (range; no repeats on import); the
   kernel launcher moves them to the device.
7. On CPU none of 3-5 applies (imports are synchronous, `await_imports` has nothing to
   wait for): an export is today's gather (`ref_kv_pack`, index_select),
   an import today's scatter (`ref_kv_unpack`, index_copy_); no staging, no extra copy,
   nothing CUDA is touched. `use_kernels=True` forces the Triton kernels anyway (an
   engine on the Triton attention backend does, run under TRITON_INTERPRET=1, which takes
   CPU tensors), and with them the staging area (plain, unpinned memory on CPU) that the
   kernel packs into directly.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

# NOTE: kernels/kv_pack.py (and with it Triton) is imported only where the kernels run:
# a CPU install has no Triton, and its path is plain torch (`_gather` / `_scatter`).

logger = logging.getLogger(__name__)

_ALIGN = 256  # bytes: region offsets (any item size divides it; DMA-friendly)
# The most device memory one KV export or import copies through at a time: a larger
# payload crosses in chunks of blocks. The memory profile keeps this much per direction
# out of the KV pool (engine/worker/memory_profile.py).
DEVICE_CHUNK_BYTES = 256 << 20


def layer_chunks(num_layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """[l0, l1) ranges of layers, each at most DEVICE_CHUNK_BYTES (or one layer)."""
    per_chunk = max(1, DEVICE_CHUNK_BYTES // max(layer_bytes, 1))
    return [(l0, min(l0 + per_chunk, num_layers)) for l0 in range(0, num_layers, per_chunk)]


def handoff_device_bytes(payload_bytes: int, num_layers: int) -> int:
    """The most device memory one export or import of `payload_bytes` holds at a time."""
    layer_bytes = -(-payload_bytes // num_layers)
    (l0, l1), *_ = layer_chunks(num_layers, layer_bytes)
    return min(payload_bytes, (l1 - l0) * layer_bytes)


class StagedKV:
    """One export's payload in host memory: `wait()` before reading it, `release()` after.

    On CUDA the device->host copy may still run when the export returns: `ready()` says
    whether it is done, `wait()` blocks until it is (a CUDA event) and returns the tensor.
    `release()` hands the staging region back for reuse; it is idempotent, and the tensor
    must not be read after it (`wait()` then raises). Without a device copy or a staging
    region (the CPU path) both are cheap no-ops beyond that bookkeeping.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        copied: torch.cuda.Event | None = None,
        region: tuple[_HostArena, int, int] | None = None,
    ) -> None:
        self._tensor = tensor
        self._copied = copied
        self._released = False
        self._region = region
        self._finalizer: weakref.finalize[..., StagedKV] | None = None
        if region is not None:
            # an export dropped unreleased (e.g. a cancelled prefill) still gives its region
            # back when collected; counted in the arena's `num_dropped`
            arena, offset, size = region
            self._finalizer = weakref.finalize(self, arena.give, offset, size, dropped=True)
            self._finalizer.atexit = False

    @property
    def in_staging(self) -> bool:
        """Whether this payload occupies (until released) a region of the staging area."""
        return self._finalizer is not None

    def ready(self) -> bool:
        """Whether the payload is in host memory now (no wait)."""
        return self._copied is None or self._copied.query()

    def wait(self) -> torch.Tensor:
        """Block until the payload is in host memory; return it (contiguous, on CPU)."""
        if self._released:
            raise RuntimeError("the export was released: its payload may be overwritten")
        if self._copied is not None:
            self._copied.synchronize()
        return self._tensor

    def release(self) -> None:
        """Hand the staging region back (any thread; a second call does nothing)."""
        self._released = True
        # detach() succeeds once, whichever thread asks first (or the collector)
        if self._finalizer is not None and self._finalizer.detach() is not None:
            assert self._region is not None
            arena, offset, size = self._region
            arena.give(offset, size)


class _HostArena:
    """First-fit regions of one host buffer (pinned on CUDA), allocated at first use.

    `take` runs under a lock (the engine thread); `give` only appends to a deque (atomic),
    so a release from the event loop or a garbage collection never waits on, or
    re-enters, the lock; the next `take` folds the given-back regions in.
    """

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity - capacity % _ALIGN
        self._pin = pin
        self._buffer: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._given: collections.deque[tuple[int, int, bool]] = collections.deque()
        self._lock = threading.Lock()
        self._num_dropped = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int, int] | None:
        """A uint8 view of `nbytes` and its (offset, size), or None when none is free."""
        size = max(-(-nbytes // _ALIGN) * _ALIGN, _ALIGN)
        if size > self.capacity:
            return None
        with self._lock:
            self._reclaim()
            i = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if i is None:
                return None
            offset, free = self._free[i]
            if free == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, free - size)
            if self._buffer is None:
                self._buffer = torch.empty(
                    self.capacity, dtype=torch.uint8, device="cpu", pin_memory=self._pin
                )
            return self._buffer[offset : offset + nbytes], offset, size

    def give(self, offset: int, size: int, dropped: bool = False) -> None:
        """Return a region (any thread); `dropped`: its export was collected unreleased."""
        self._given.append((offset, size, dropped))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(size for _, size in self._free)

    @property
    def num_dropped(self) -> int:
        """Regions that came back by garbage collection, their export never released."""
        with self._lock:
            self._reclaim()
            return self._num_dropped

    def _reclaim(self) -> None:  # under the lock
        if not self._given:
            return
        while self._given:
            offset, size, dropped = self._given.popleft()
            bisect.insort(self._free, (offset, size))
            if dropped:
                self._num_dropped += 1
                logger.debug("a KV export was dropped unreleased: its staging region is back")
        merged: list[tuple[int, int]] = []
        for offset, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged


class PendingImports:
    """Asynchronous imports whose copy may still run: the blocks each writes, its event,
    and what it reads (kept alive until the event is passed).

    `order(block_ids, stream)` makes `stream()` wait for the imports into any of
    `block_ids` (all: None) that it does not wait for yet, and lets go of those whose
    event is passed. Plain bookkeeping over anything with `query()` and a stream with
    `wait_event()`: a CPU test drives it with stand-ins.
    """

    def __init__(self) -> None:
        # (blocks, event, what it keeps alive, whether the compute stream waits for it)
        self._pending: list[tuple[frozenset[int], Any, tuple[Any, ...], bool]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, block_ids: Sequence[int], event: Any, keep: tuple[Any, ...] = ()) -> None:
        self._pending.append((frozenset(block_ids), event, keep, False))

    def order(self, block_ids: Collection[int] | None, stream: Callable[[], Any]) -> int:
        """Returns how many imports the stream was made to wait for."""
        if not self._pending:
            return 0
        waited = 0
        still = []
        for blocks, event, keep, ordered in self._pending:
            if event.query():  # copied: its source and device chunk may go
                continue
            touched = block_ids is None or not blocks.isdisjoint(block_ids)
            if touched and not ordered:
                stream().wait_event(event)
                waited += 1
                ordered = True
            still.append((blocks, event, keep, ordered))
        self._pending = still
        return waited


class KVStaging:
    """The engine's KV handoff to and from host memory (see the module docstring).

    `use_kernels`: pack/unpack with the Triton kernels (kernels/kv_pack.py); None means
    exactly when the cache is on CUDA (the engine forces them on CPU with the Triton
    attention backend: engine/llm_engine.py). Exports are staged (packed into the staging
    area) on CUDA, and on CPU when the kernels are forced. `kernel_blocks_packed` and
    `kernel_blocks_unpacked` count the blocks the kernels moved (a head slice's, gathered
    in torch, is not counted): what a worker reports to show which path its handoffs took.
    """

    def __init__(
        self, kv_cache: torch.Tensor, staging_bytes: int, *, use_kernels: bool | None = None
    ) -> None:
        if staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got {staging_bytes}")
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.on_cuda = self.device.type == "cuda"
        self.use_kernels = self.on_cuda if use_kernels is None else use_kernels
        self.staged = self.on_cuda or self.use_kernels
        self.arena = _HostArena(staging_bytes, pin=self.on_cuda)
        self._side_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.imports = PendingImports()  # asynchronous imports not yet waited for
        self.num_one_off = 0  # staged exports that did not fit the staging area
        self.kernel_blocks_packed = 0
        self.kernel_blocks_unpacked = 0

    def payload_shape(
        self, num_blocks: int, heads: tuple[int, int] | None = None
    ) -> tuple[int, ...]:
        """The wire layout of `num_blocks` blocks of this cache (of its KV heads
        [heads[0], heads[1]) only, when given)."""
        num_layers, _, _, num_kv_heads, block_size, head_dim = self.kv_cache.shape
        if heads is not None:
            num_kv_heads = heads[1] - heads[0]
        return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)

    def _heads_view(self, heads: tuple[int, int] | None) -> torch.Tensor:
        """The cache, or its KV heads [h0, h1) (this cache's own head indices)."""
        if heads is None or heads == (0, self.kv_cache.shape[3]):
            return self.kv_cache
        h0, h1 = heads
        if not 0 <= h0 < h1 <= self.kv_cache.shape[3]:
            raise ValueError(f"KV heads [{h0}, {h1}) outside this cache's {self.kv_cache.shape[3]}")
        return self.kv_cache[:, :, :, h0:h1]

    def export_blocks(
        self, block_ids: Sequence[int] | torch.Tensor, heads: tuple[int, int] | None = None
    ) -> StagedKV:
        """Pack blocks `block_ids` (every layer) into a host tensor in the wire layout.

        `heads`: only KV heads [h0, h1) of this cache (a tensor-parallel handoff sends
        each decode rank its heads, engine/worker/kv_handoff.py); one gather either way.
        Raises ValueError on ids or heads out of range. On CUDA the copy to host may
        still run when this returns: `StagedKV.wait()` before reading, `release()` when
        done.
        """
        ids = self._check_ids(block_ids, allow_repeats=True)
        cache = self._heads_view(heads)
        # NOTE: the Triton kernels address the whole cache; a head slice gathers in torch
        kernels = self.use_kernels and cache is self.kv_cache
        if kernels:
            self.kernel_blocks_packed += ids.numel()
        if not self.staged:  # CPU: today's path, one gather into a fresh tensor
            return StagedKV(_gather(cache, ids))
        shape = self.payload_shape(ids.numel(), heads)
        host, region = self._host_tensor(shape)
        if not self.on_cuda:  # CPU, kernels forced: pack straight into the staging area
            if kernels:
                from pdserve.kernels.kv_pack import kv_pack

                kv_pack(self.kv_cache, ids, out=host)
            else:
                torch.index_select(cache, 2, ids, out=host)
            return StagedKV(host, None, region)
        side = self._side_stream
        assert side is not None
        compute = torch.cuda.current_stream(self.device)
        device_ids = ids.to(self.device)
        copied: torch.cuda.Event | None = None
        for l0, l1 in layer_chunks(cache.shape[0], math.prod(shape[1:]) * cache.element_size()):
            if copied is not None:  # one chunk on the device at a time (module docstring)
                compute.wait_event(copied)
            if kernels:
                from pdserve.kernels.kv_pack import kv_pack

                packed = kv_pack(self.kv_cache[l0:l1], ids)
            else:
                packed = _gather(cache[l0:l1], device_ids)
            packed_event = torch.cuda.Event()
            packed_event.record(compute)
            side.wait_event(packed_event)
            with torch.cuda.stream(side):
                host[l0:l1].copy_(packed, non_blocking=True)  # pinned: truly asynchronous
                copied = torch.cuda.Event(blocking=True)  # a waiting thread sleeps, not spins
                copied.record(side)
            # the caching allocator must not hand `packed` out again before the copy read it
            packed.record_stream(side)
        return StagedKV(host, copied, region)

    def pin_for_import(self, payload: torch.Tensor) -> torch.Tensor:
        """`payload` in pinned memory, for an asynchronous import (CUDA; any thread: the
        decode worker calls it off the engine thread). The copy owns a staging region
        until it is collected; `payload` itself as is off CUDA, when it is pinned already,
        or when no region is free (then the import copies synchronously)."""
        if not self.on_cuda or payload.is_pinned():
            return payload
        taken = self.arena.take(payload.numel() * payload.element_size())
        if taken is None:
            return payload
        view, offset, size = taken
        pinned = view.view(payload.dtype).view(payload.shape)
        pinned.copy_(payload)
        weakref.finalize(pinned, self.arena.give, offset, size).atexit = False
        return pinned

    def import_blocks(
        self,
        payload: torch.Tensor,
        block_ids: Sequence[int] | torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Write `payload` (wire layout, host memory) into blocks `block_ids` (into KV
        heads [h0, h1) of this cache only, when `heads` is given).

        `payload`'s memory may be reused once this returns: from pageable memory the copy
        is synchronous; from pinned memory (`pin_for_import`) it is asynchronous, the
        source kept alive until it is done, and a step that reads the blocks waits for it
        on the device (`await_imports`). Raises ValueError on a payload of the wrong
        shape or dtype, ids out of range or repeated.
        """
        ids = self._check_ids(block_ids, allow_repeats=False)
        self.check_payload(payload, ids.numel(), heads)
        cache = self._heads_view(heads)
        kernels = self.use_kernels and cache is self.kv_cache
        if kernels:
            self.kernel_blocks_unpacked += ids.numel()
        if not self.on_cuda:  # synchronous, in place: no copy
            self._unpack(payload, cache, ids, kernels)
            return
        device_ids = ids.to(self.device)
        chunks = layer_chunks(cache.shape[0], payload[:1].numel() * payload.element_size())
        if not payload.is_pinned():  # pageable: each chunk's `.to` waits for its copy
            for l0, l1 in chunks:
                buffer = payload[l0:l1].to(self.device)
                self._unpack(buffer, cache[l0:l1], device_ids, kernels, layers=(l0, l1))
            return
        side = self._side_stream
        assert side is not None
        users = torch.cuda.Event()  # the steps that used these blocks before they were freed
        users.record(torch.cuda.current_stream(self.device))
        side.wait_event(users)
        with torch.cuda.stream(side):
            for l0, l1 in chunks:
                buffer = payload[l0:l1].to(self.device, non_blocking=True)
                self._unpack(buffer, cache[l0:l1], device_ids, kernels, layers=(l0, l1))
            done = torch.cuda.Event()
            done.record(side)
        # NOTE: `buffer` is freed here, in the side stream's order: the caching allocator
        # hands it out again only to work queued behind this import on that stream.
        self.imports.add(ids.tolist(), done, keep=(payload, device_ids))

    def await_imports(self, block_ids: Collection[int] | None = None) -> None:
        """Make the compute stream wait for the imports still copying into `block_ids`
        (every pending one: None) before the work queued next; call it before a step."""
        self.imports.order(block_ids, lambda: torch.cuda.current_stream(self.device))

    def _unpack(
        self,
        buffer: torch.Tensor,
        cache: torch.Tensor,
        ids: torch.Tensor,
        kernels: bool,
        layers: tuple[int, int] | None = None,
    ) -> None:
        if kernels:
            from pdserve.kernels.kv_pack import kv_unpack

            target = self.kv_cache if layers is None else self.kv_cache[layers[0] : layers[1]]
            kv_unpack(buffer.contiguous(), target, ids)
        else:
            _scatter(buffer, cache, ids)

    def check_payload(
        self, payload: torch.Tensor, num_blocks: int, heads: tuple[int, int] | None = None
    ) -> None:
        """Raise ValueError unless `payload` is `num_blocks` blocks of this cache's layout
        (of its KV heads `heads`, when given)."""
        shape = self.payload_shape(num_blocks, heads)
        if tuple(payload.shape) != shape or payload.dtype != self.kv_cache.dtype:
            raise ValueError(
                f"payload {tuple(payload.shape)} {payload.dtype} is not {num_blocks} blocks of "
                f"this cache: {shape} {self.kv_cache.dtype}"
            )

    def _host_tensor(
        self, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, tuple[_HostArena, int, int] | None]:
        dtype = self.kv_cache.dtype
        nbytes = math.prod(shape) * dtype.itemsize  # kernels/kv_pack.py: kv_pack_num_bytes
        taken = self.arena.take(nbytes)
        if taken is not None:
            view, offset, size = taken
            return view.view(dtype).view(shape), (self.arena, offset, size)
        self.num_one_off += 1
        logger.debug(
            "KV export of %d bytes does not fit the free staging area (%d of %d bytes); "
            "one-off host allocation (%d so far)",
            nbytes,
            self.arena.free_bytes,
            self.arena.capacity,
            self.num_one_off,
        )
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.on_cuda), None

    def _check_ids(
        self, block_ids: Sequence[int] | torch.Tensor, *, allow_repeats: bool
    ) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            ids = block_ids.to("cpu", torch.int64)
        else:
            ids = torch.tensor(list(block_ids), dtype=torch.int64, device="cpu")  # checked here
        if ids.dim() != 1:
            raise ValueError(f"block ids must be 1-D; got shape {tuple(ids.shape)}")
        num_blocks = self.kv_cache.shape[2]
        if ids.numel() > 0:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= num_blocks:
                raise ValueError(f"block ids must lie in [0, {num_blocks}); got {low}..{high}")
            if not allow_repeats and torch.unique(ids).numel() != ids.numel():
                raise ValueError("block ids to import into must not repeat a block id")
        return ids


def _gather(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """kernels/kv_pack.py's `ref_kv_pack`, without importing Triton."""
    return kv_cache.index_select(2, ids.long()).contiguous()


def _scatter(buffer: torch.Tensor, kv_cache: torch.Tensor, ids: torch.Tensor) -> None:
    """kernels/kv_pack.py's `ref_kv_unpack`, without importing Triton."""
    kv_cache.index_copy_(2, ids.long(), buffer)
