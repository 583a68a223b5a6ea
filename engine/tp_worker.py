"""Tensor-parallel worker ranks: local processes that run the model on their shard.

The driver (rank 0, the engine's own process) keeps everything that is not the model:
scheduler, block pool, prefix cache, sampler. `TPWorkers` starts ranks 1..tp-1 as local
processes (`python -m pdserve.engine.tp_worker`, each with one end of a socket pair: no
re-import of the caller's main module, so a plain script needs no `__main__` guard) and
joins them in one process group (`engine/parallel.py`). Each rank owns its slice (its
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
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel import (
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
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for rank in range(1, tp):
            ours, theirs = socket.socketpair()
            argv = [sys.executable, "-m", "pdserve.engine.tp_worker", "--fd", str(theirs.fileno())]
            proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
            conn = Connection(ours.detach())
            conn.send((rank, tp, spec))
            self._procs.append(proc)
            self._conns.append(conn)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, None)
        self.ranks: list[RankMemory] = []
        self.failure: BaseException | None = None
        try:
            self.group = TPGroup(0, tp, spec.init_method, device, self.timeout_s)
        except Exception as exc:
            self._finalizer()
            raise TensorParallelError(f"tensor-parallel ranks did not join: {exc}") from exc
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self.group)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def wait_ready(self) -> list[RankMemory]:
        """Each worker's memory once its shard is loaded (in rank order)."""
        deadline = time.monotonic() + self.timeout_s
        ranks = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            while not conn.poll(0.1):
                if proc.poll() is not None:
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
        for rank, conn in enumerate(self._conns, 1):
            try:
                conn.send(("step", header))
            except OSError as exc:  # the worker's end is closed: it is gone
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone") from exc
        self.group.broadcast(payload)
        self.group.count_step()

    def close(self) -> None:
        """Stop the workers (killing any that do not stop in time), leave the group."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the workers at once (after a failure: they may be wedged), then `close`."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        self._finalizer()


def _recv(conn: Connection, rank: int) -> tuple[str, Any]:
    try:
        kind, value = conn.recv()
    except (EOFError, OSError) as exc:
        raise TensorParallelError(f"tensor-parallel rank {rank} is gone") from exc
    return kind, value


def _shutdown(
    procs: list[subprocess.Popen[bytes]], conns: list[Connection], group: TPGroup | None
) -> None:
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("stop", None))
    deadline = time.monotonic() + _STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel worker %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait(5)
    for conn in conns:
        conn.close()
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


def worker_main(rank: int, world_size: int, spec: WorkerSpec, conn: Connection) -> None:
    """Rank `rank`'s process: build the shard, report ready, run steps until "stop" or
    until the driver is gone (its socket closes) or a collective fails."""
    logging.basicConfig(level=logging.INFO, format=f"tp-rank{rank} %(levelname)s %(message)s")
    config = spec.config
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    group: TPGroup | None = None
    try:
        group = TPGroup(
            rank,
            world_size,
            spec.init_method,
            rank_device(torch.device(config.device), rank),
            config.distributed_timeout_s,
        )
        runner = _build_rank(rank, world_size, spec, group)
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
            payload = torch.empty(payload_len(header), dtype=torch.int64, device=group.device)
            group.broadcast(payload)
            runner.execute_shard(*unpack_step(header, payload))
    except Exception:
        logger.exception("tensor-parallel step failed")
        code = 1
    finally:
        group.destroy()
    if code:
        raise SystemExit(code)


def _build_rank(rank: int, world_size: int, spec: WorkerSpec, group: TPGroup) -> Any:
    # Imported here: llm_engine imports this module.
    from pdserve.engine.llm_engine import _DTYPES, make_attention_backend
    from pdserve.engine.model import load_model
    from pdserve.engine.model_config import load_model_config
    from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache
    from pdserve.engine.sampler import Sampler

    config = spec.config
    model_dir = Path(spec.model_dir)
    model_config = load_model_config(model_dir)
    device = group.device
    model = load_model(
        model_dir,
        model_config,
        _DTYPES[spec.dtype],
        device,
        spec.max_model_len,
        config.load_format,
        config.seed,
        TPShard(model_config, rank, world_size),
    )
    model.tp = group
    return ModelRunner(
        model,
        allocate_kv_cache(model, spec.num_kv_blocks, config.block_size, device),
        config.block_size,
        make_attention_backend(config.attention_backend, device, model.dtype),
        Sampler(config.seed, device),
        device,
    )


if __name__ == "__main__":
    main()
