"""The disk KV tier: one arena file per worker, each slot a checksummed block.

Under the host tier (`engine/worker/kv_host_tier.py`), written through: every block the
host tier takes is also written here, so the disk holds everything the host does and
more (its own budget, `kv_disk_gib`), and a worker restarted on the same directory finds
its blocks again (block hashes name a model and its cache salt, so a hash can only match
the prompt it was computed for).

The file is `kv-<layout>-<n>.arena` in the directory, `<layout>` a digest of one block's
shape and dtype (an 8-bit cache, another block size or another model's layout writes a
file of its own), `<n>` the first such file no other process holds (an exclusive
`flock`, released when the process ends): workers sharing a directory each write their
own, and a restarted one takes over whichever is free. It holds `capacity` slots; a
slot is a 64-byte header and one block's bytes as the cache holds them:

    header: magic (8 bytes) | block hash (32) | crc32 of the payload (4) | stamp (8) | pad
    payload: the block, [layers, 2, kv_heads, block_size, row] in the cache's dtype

At start the headers are scanned and every slot with the magic is held again, newest
stamp last in the LRU. A slot is written payload first, header last, with `pwrite` (into
the page cache: the kernel writes it to the device in the background); a slot whose
payload does not match its checksum when read (a torn write, a bad disk, an edit) is
dropped, counted (`corrupt`), and its prompt is computed instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.common.hashing import BlockHash

_MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8s32sIQ")
HEADER_BYTES = 64


@dataclass
class DiskStats:
    written: int = 0
    hits: int = 0  # blocks read back (and found intact)
    corrupt: int = 0  # blocks whose checksum failed
    dropped: int = 0  # dropped for room
    recovered: int = 0  # blocks found at start
    read_s: float = 0.0  # wall time of the reads that found their block intact


class DiskKVTier:
    def __init__(
        self,
        directory: str | Path,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        capacity: int,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a disk KV tier needs at least one slot, got {capacity}")
        self.block_shape = block_shape
        self.dtype = dtype
        self.capacity = capacity
        self.payload_bytes = _numel(block_shape) * dtype.itemsize
        self.slot_bytes = HEADER_BYTES + self.payload_bytes
        layout = hashlib.sha256(f"{block_shape}|{dtype}".encode()).hexdigest()[:16]
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path, self._fd = _take_file(directory, f"kv-{layout}")
        if os.fstat(self._fd).st_size < capacity * self.slot_bytes:
            os.ftruncate(self._fd, capacity * self.slot_bytes)  # sparse until written
        self._slots: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # (slot, crc)
        self._stamp = 0
        self.stats = DiskStats()
        self._free: list[int] = []
        self._recover()
        used = {slot for slot, _ in self._slots.values()}
        self._free = [s for s in range(capacity - 1, -1, -1) if s not in used]

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> list[BlockHash]:
        """Write one block (its bytes as the cache holds them); the hashes dropped for
        room. A hash already here is only made the most recently used."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return []
        dropped: list[BlockHash] = []
        if self._free:
            slot = self._free.pop()
        else:
            victim, (slot, _) = self._slots.popitem(last=False)
            dropped.append(victim)
            self.stats.dropped += 1
        payload = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(payload)
        self._stamp += 1
        offset = slot * self.slot_bytes
        _pwrite_all(self._fd, _HEADER.pack(b"\0" * 8, b"", 0, 0), offset)  # invalid first
        _pwrite_all(self._fd, payload, offset + HEADER_BYTES)
        _pwrite_all(self._fd, _HEADER.pack(_MAGIC, block_hash, crc, self._stamp), offset)
        self._slots[block_hash] = (slot, crc)
        self.stats.written += 1
        return dropped

    def read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's bytes as a tensor of `block_shape`, or None where its checksum
        fails (the slot is dropped then) or it is not here."""
        entry = self._slots.get(block_hash)
        if entry is None:
            return None
        slot, crc = entry
        start = time.perf_counter()
        data = os.pread(self._fd, self.payload_bytes, slot * self.slot_bytes + HEADER_BYTES)
        if len(data) != self.payload_bytes or zlib.crc32(data) != crc:
            self.stats.corrupt += 1
            self._forget(block_hash)
            return None
        self._slots.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.read_s += time.perf_counter() - start
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(self.dtype).view(self.block_shape)

    def clear(self) -> list[BlockHash]:
        dropped = list(self._slots)
        for block_hash in dropped:
            self._forget(block_hash)
        return dropped

    def _forget(self, block_hash: BlockHash) -> None:
        slot, _ = self._slots.pop(block_hash)
        _pwrite_all(self._fd, b"\0" * 8, slot * self.slot_bytes)
        self._free.append(slot)

    def _recover(self) -> None:
        found: list[tuple[int, BlockHash, int, int]] = []
        for slot in range(self.capacity):
            header = os.pread(self._fd, _HEADER.size, slot * self.slot_bytes)
            if len(header) < _HEADER.size:
                break
            magic, block_hash, crc, stamp = _HEADER.unpack(header)
            if magic == _MAGIC:
                found.append((stamp, block_hash, slot, crc))
        for stamp, block_hash, slot, crc in sorted(found):
            if block_hash in self._slots:  # a stale duplicate: keep the newer
                self._forget(block_hash)
            self._slots[block_hash] = (slot, crc)
            self._stamp = max(self._stamp, stamp)
        self.stats.recovered = len(self._slots)


_MAX_FILES = 256


def _take_file(directory: Path, stem: str) -> tuple[Path, int]:
    for n in range(_MAX_FILES):
        path = directory / f"{stem}-{n}.arena"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return path, fd
    raise RuntimeError(f"{directory}: {_MAX_FILES} KV arenas already in use by other processes")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
