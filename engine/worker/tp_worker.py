"""Tensor-parallel worker ranks: local processes that run the model on their shard.

The driver (rank 0, the engine's own process) keeps everything that is not the model:
scheduler, block pool, prefix cache, sampler. `TPWorkers` starts ranks 1..tp-1 as local
processes (`python -m pdserve.engine.worker.rank_main`, each with one end of a socket pair: no
re-import of the caller's main module, so a plain script needs no `__main__` guard) and
joins them in one process group (`engine/worker/parallel.py`). Each rank owns its slice (its
KV heads) of every KV block, under the same block ids, so block tables stay on the driver
and travel with each step.

A step: the driver writes its header (a few ints, `parallel.pack_step`) to each worker's
socket, then broadcasts the payload (one int64 tensor: ids, positions, slots, block tables,
context lengths, rows that sample); every rank runs the forward on its shard, joining the
all-reduces, and sends its slice of the logits to the driver, which samples. The socket
is also how a worker idles: it waits there between steps (no collective, so no timeout while
the engine has nothing to do), and reads end-of-file when the driver's process is gone,
and then exits; a driver that dies mid-step closes its sockets, and the worker's
collective fails at once. Inside a step every wait is a collective, under the group's
timeout.

Shutdown: `close()` (and a finalizer, for an engine dropped or an interpreter exiting)
sends each worker "stop", waits for it, and kills what does not exit in time.

How ranks start is the launcher's business (`RankLauncher`): `ProcessLauncher` (local
processes, `distributed_executor_backend="mp"`, offline use) here; the cluster's Ray
launcher (runtime/tp_ranks.py: actors in the replica's placement group) hands each rank a
`RankKVStore` as well, through which the rank's KV slices meet its own KV transport: the
driver's "export" / "import" / "drop" messages, ordered with the steps on the same
socket, make every rank pack or write its KV heads of a request's blocks (the KV handoff
of a tensor-parallel replica, rank to rank; engine/worker/kv_handoff.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch

from pdserve.common.engine_config import EngineConfig
from pdserve.engine.modeling.attention import AttentionMetadata
from pdserve.engine.worker.device_hygiene import enter_from_env
from pdserve.engine.worker.kv_handoff import ExportedPart, HeadRange, export_ranges
from pdserve.engine.worker.kv_staging import KVStaging
from pdserve.engine.worker.parallel import (
    RankMemory,
    TensorParallelError,
    TPGroup,
    TPShard,
    free_port,
    pack_step,
    payload_len,
    rank_device,
    unpack_step,
)

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to build its shard of the driver's engine."""

    model_dir: str
    config: EngineConfig
    dtype: str  # resolved: "float32", "bfloat16" or "float16"
    max_model_len: int
    num_kv_blocks: int
    init_method: str


class RankHandle(Protocol):
    """A started worker rank, as its launcher made it."""

    conn: Connection  # the driver's end of the rank's control socket
    pid: int | None  # the rank's process, where the launcher knows it

    def exited(self) -> bool:
        """Whether the rank is known to be gone (False when unknown)."""

    def stop(self, timeout_s: float) -> None:
        """After "stop" was sent: wait for the rank to end, at most `timeout_s`, then
        make sure it has (kill)."""

    def kill(self) -> None:
        """End the rank at once."""


class RankLauncher(Protocol):
    def start(self, rank: int, world_size: int, spec: WorkerSpec) -> RankHandle:
        """Start rank `rank`; it runs `worker_main(rank, world_size, spec, conn, ...)`."""


class _ProcessRank:
    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.proc, self.conn = proc, conn
        self.pid: int | None = proc.pid

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker %d did not stop; killing it", self.pid)
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


class ProcessLauncher:
    """Ranks as local processes (`python -m pdserve.engine.worker.rank_main`), each with one end
    of a socket pair: no re-import of the caller's main module, so a plain script needs no
    `__main__` guard."""

    def start(self, rank: int, world_size: int, spec: WorkerSpec) -> RankHandle:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        ours, theirs = socket.socketpair()
        argv = [
            sys.executable,
            "-m",
            "pdserve.engine.worker.rank_main",
            "--fd",
            str(theirs.fileno()),
        ]
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        conn = Connection(ours.detach())
        conn.send((rank, world_size, spec))
        return _ProcessRank(proc, conn)


class RankKVStore:
    """A rank's KV slices in flight between its step thread and its KV transport.

    The step thread (`worker_main`) puts what the driver's "export" packed and takes what
    an "import" writes; the transport side (any thread) takes exports to send and puts
    claimed parts to import. Keyed by request id.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._exports: dict[str, list[ExportedPart]] = {}
        self._imports: dict[str, list[tuple[HeadRange, Any, Any]]] = {}
        self._dropped: set[str] = set()

    # step thread
    def put_export(self, key: str, parts: list[ExportedPart]) -> None:
        with self._cond:
            if key in self._dropped:  # its send was given up before the pack ran
                self._dropped.discard(key)
                for part in parts:
                    part.staged.release()
                return
            self._exports[key] = parts
            self._cond.notify_all()

    def take_import(self, key: str) -> list[tuple[HeadRange, Any, Any]]:
        """The claimed parts of `key`: (global heads, payload tensor, release callback)."""
        with self._cond:
            parts = self._imports.pop(key, None)
        if parts is None:
            raise TensorParallelError(f"no claimed KV of {key!r} on this rank to import")
        return parts

    # transport side
    def wait_export(self, key: str, timeout_s: float) -> list[ExportedPart]:
        """This rank's packed parts of `key` (the caller releases them), once packed."""
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._exports, timeout_s):
                self._dropped.add(key)
                raise TimeoutError(f"the KV of {key!r} was not packed in {timeout_s:g} s")
            return self._exports.pop(key)

    def put_import(self, key: str, parts: list[tuple[HeadRange, Any, Any]]) -> None:
        with self._cond:
            self.drop_import(key)
            self._imports[key] = parts

    def drop(self, key: str) -> None:
        """Forget `key`'s export and claimed parts, releasing them (idempotent)."""
        with self._cond:
            for part in self._exports.pop(key, []):
                part.staged.release()
            self.drop_import(key)

    def drop_import(self, key: str) -> None:
        with self._cond:
            for _, _, release in self._imports.pop(key, []):
                release()

    @property
    def num_held(self) -> int:
        """Exports and imports held (0 when idle: leak check)."""
        with self._cond:
            return len(self._exports) + len(self._imports)


class TPWorkers:
    """The driver's handle on ranks 1..tp-1, and the group they share with it.

    Raises TensorParallelError when a rank fails to start (its traceback in the message)
    or the rendezvous times out.
    """

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        dtype: str,
        max_model_len: int,
        num_kv_blocks: int,
        device: torch.device,
        launcher: RankLauncher | None = None,
    ) -> None:
        self.world_size = tp = config.tensor_parallel_size
        self.timeout_s = config.distributed_timeout_s
        spec = WorkerSpec(
            str(model_dir),
            config,
            dtype,
            max_model_len,
            num_kv_blocks,
            f"tcp://127.0.0.1:{free_port()}",
        )
        launcher = launcher or ProcessLauncher()
        self._ranks: list[RankHandle] = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._ranks, None)
        self.ranks: list[RankMemory] = []
        self.failure: BaseException | None = None
        try:
            for rank in range(1, tp):
                handle = launcher.start(rank, tp, spec)
                self._ranks.append(handle)
                self._conns.append(handle.conn)
            # NCCL wants the driver's device with its index ("cuda" alone names none)
            self.group = TPGroup(0, tp, spec.init_method, rank_device(device, 0), self.timeout_s)
        except Exception as exc:
            self._finalizer()
            raise TensorParallelError(f"tensor-parallel ranks did not join: {exc}") from exc
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._ranks, self.group)

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self._ranks]

    def wait_ready(self) -> list[RankMemory]:
        """Each worker's memory once its shard is loaded (in rank order)."""
        deadline = time.monotonic() + self.timeout_s
        ranks = []
        for rank, (handle, conn) in enumerate(zip(self._ranks, self._conns, strict=True), 1):
            while not conn.poll(0.1):
                if handle.exited():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited at start")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} not ready in {self.timeout_s:g} s"
                    )
            kind, value = _recv(conn, rank)
            if kind != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start:\n{value}")
            ranks.append(value)
        self.ranks = ranks
        return ranks

    def send_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: list[int],
    ) -> None:
        """Hand every worker this step's inputs: the header down its socket, the payload in
        one broadcast."""
        if self.failure is not None:
            raise TensorParallelError("the tensor-parallel group failed earlier") from self.failure
        header, payload = pack_step(input_ids, positions, meta, sample_rows)
        self._send_all("step", header)
        self.group.broadcast(payload)
        self.group.count_step()

    def export_kv(self, key: str, block_ids: list[int], ranges: Sequence[HeadRange] | None) -> None:
        """Make every worker pack its KV heads of `block_ids` for receivers owning
        `ranges` (engine/worker/kv_handoff.py `export_ranges`) into its `RankKVStore`."""
        self._send_all("export", (key, block_ids, None if ranges is None else list(ranges)))

    def import_kv(self, key: str, block_ids: list[int]) -> None:
        """Make every worker write its claimed parts of `key` into `block_ids`."""
        self._send_all("import", (key, block_ids))

    def drop_kv(self, key: str) -> None:
        """Make every worker forget `key`'s export and claimed parts."""
        self._send_all("drop", key)

    def _send_all(self, kind: str, value: Any) -> None:
        if self.failure is not None:
            raise TensorParallelError("the tensor-parallel group failed earlier") from self.failure
        for rank, conn in enumerate(self._conns, 1):
            try:
                conn.send((kind, value))
            except OSError as exc:  # the worker's end is closed: it is gone
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone") from exc

    def close(self) -> None:
        """Stop the workers (killing any that do not stop in time), leave the group."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the workers at once (after a failure: they may be wedged), then `close`."""
        for handle in self._ranks:
            handle.kill()
        self._finalizer()


def _recv(conn: Connection, rank: int) -> tuple[str, Any]:
    try:
        kind, value = conn.recv()
    except (EOFError, OSError) as exc:
        raise TensorParallelError(f"tensor-parallel rank {rank} is gone") from exc
    return kind, value


def _shutdown(ranks: list[RankHandle], group: TPGroup | None) -> None:
    for handle in ranks:
        with contextlib.suppress(OSError, ValueError):
            handle.conn.send(("stop", None))
    deadline = time.monotonic() + _STOP_WAIT_S
    for handle in ranks:
        handle.stop(max(deadline - time.monotonic(), 0.1))
    for handle in ranks:
        handle.conn.close()
    if group is not None:
        with contextlib.suppress(Exception):
            group.destroy()


# -- the worker process ----------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description="a tensor-parallel worker rank (internal)")
    parser.add_argument("--fd", type=int, required=True, help="the driver's socket")
    args = parser.parse_args()
    conn = Connection(args.fd)
    try:
        rank, world_size, spec = conn.recv()
    except EOFError:
        raise SystemExit(1) from None
    worker_main(rank, world_size, spec, conn)


def worker_main(
    rank: int,
    world_size: int,
    spec: WorkerSpec,
    conn: Connection,
    store: RankKVStore | None = None,
    on_built: Any = None,
) -> None:
    """Rank `rank`'s process: build the shard, report ready, run steps until "stop" or
    until the driver is gone (its socket closes) or a collective fails.

    `store`: where this rank's KV slices meet its transport (the Ray launcher's); KV
    messages fail the rank without one. `on_built(runner, shard)`: called once the shard
    is loaded (the Ray launcher keeps the layout for its receiver)."""
    logging.basicConfig(level=logging.INFO, format=f"tp-rank{rank} %(levelname)s %(message)s")
    enter_from_env()  # tests: this rank's device mistakes raise (engine/worker/device_hygiene.py)
    config = spec.config
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    group: TPGroup | None = None
    device = torch.device(config.device)
    if config.distributed_executor_backend == "ray" and device.type == "cuda":
        device = torch.device("cuda", 0)  # Ray gives each rank's actor its own GPU
    else:
        device = rank_device(device, rank)
    try:
        group = TPGroup(rank, world_size, spec.init_method, device, config.distributed_timeout_s)
        runner, shard = _build_rank(rank, world_size, spec, group)
        staging = KVStaging(
            runner.kv_cache,
            config.kv_staging_mb << 20,
            use_kernels=True if _triton_off_cuda(config) else None,
        )
        if on_built is not None:
            on_built(runner, shard)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        if group is not None:
            group.destroy()
        raise SystemExit(1) from None
    sharded, replicated = runner.model.weight_bytes()
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    conn.send(("ready", RankMemory(rank, sharded + replicated, sharded, replicated, kv_bytes)))
    code = 0
    try:
        while True:
            try:
                kind, header = conn.recv()
            except EOFError:  # the driver is gone
                logger.warning("the driver is gone; exiting")
                code = 1
                break
            if kind == "stop":
                break
            if kind != "step":
                _kv_message(kind, header, staging, shard, store)
                continue
            payload = torch.empty(payload_len(header), dtype=torch.int64, device=group.device)
            staging.await_imports()  # its parts of arrived KV, before any step reads them
            group.broadcast(payload)
            runner.execute_shard(*unpack_step(header, payload))
            group.count_step()  # lets its collectives' timing events go (engine/worker/parallel.py)
    except Exception:
        logger.exception("tensor-parallel step failed")
        code = 1
    finally:
        group.destroy()
    if code:
        raise SystemExit(code)


def _kv_message(
    kind: str, value: Any, staging: KVStaging, shard: TPShard, store: RankKVStore | None
) -> None:
    """The driver's KV handoff messages (see the module docstring), on the step thread."""
    if store is None:
        raise TensorParallelError(f"{kind!r}: this rank has no KV transport (launcher)")
    own = shard.kv_head_range
    if kind == "export":
        key, ids, ranges = value
        # a replicated KV head is sent by the lowest rank holding it, once
        lowest = own[0] * shard.tp // shard.config.num_kv_heads if shard.kv_replicated else -1
        parts = [
            ExportedPart(r, staging.export_blocks(ids, (r[0] - own[0], r[1] - own[0])))
            for r in export_ranges(own, lowest in (-1, shard.rank), ranges)
        ]
        store.put_export(key, parts)
    elif kind == "import":
        key, ids = value
        for (start, end), payload, release in store.take_import(key):
            try:
                staging.import_blocks(payload, ids, (start - own[0], end - own[0]))
            finally:
                release()
    elif kind == "drop":
        store.drop(value)
    else:
        raise TensorParallelError(f"unknown message {kind!r} from the driver")


def _triton_off_cuda(config: EngineConfig) -> bool:
    from pdserve.engine.llm_engine import triton_off_cuda  # llm_engine imports this module

    return triton_off_cuda(config)


def _build_rank(
    rank: int, world_size: int, spec: WorkerSpec, group: TPGroup
) -> tuple[Any, TPShard]:
    # Imported here: llm_engine imports this module.
    from pdserve.common.model_config import load_model_config
    from pdserve.engine.llm_engine import (
        _DTYPES,
        int8_on_triton,
        make_attention_backend,
        triton_off_cuda,
    )
    from pdserve.engine.modeling.llama import load_model
    from pdserve.engine.sampler import Sampler
    from pdserve.engine.worker.model_runner import ModelRunner, allocate_kv_cache

    config = spec.config
    model_dir = Path(spec.model_dir)
    model_config = load_model_config(model_dir)
    device = group.device
    shard = TPShard(model_config, rank, world_size)
    model = load_model(
        model_dir,
        model_config,
        _DTYPES[spec.dtype],
        device,
        spec.max_model_len,
        config.load_format,
        config.seed,
        shard,
        config.quantization,
    )
    model.tp = group
    if triton_off_cuda(config):  # every kernel on Triton, as the driver's (llm_engine.py)
        int8_on_triton(model)
    runner = ModelRunner(
        model,
        allocate_kv_cache(
            model, spec.num_kv_blocks, config.block_size, device, config.kv_cache_dtype
        ),
        config.block_size,
        make_attention_backend(
            config.attention_backend, device, model.dtype, config.kv_cache_dtype
        ),
        Sampler(config.seed, device),
        device,
    )
    return runner, shard
