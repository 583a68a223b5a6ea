"""Tensor-parallel replicas in the cluster: ranks 1.. as Ray actors, KV moved rank to rank.

A prefill or decode replica with TP=N is N processes: the Serve replica is rank 0 (the
engine's driver: scheduler, block tables, prefix cache, sampling) and ranks 1..N-1 are
`TPRank` actors, one in each further bundle of the replica's placement group
(deploy/app.py gives a TP pool N bundles, STRICT_PACK: one node, one GPU each on GPU
nodes). `RayRankLauncher` starts them for the engine (engine/worker/tp_worker.py's
`RankLauncher`); each actor runs the rank's step loop on a thread, its control socket a
`multiprocessing.connection` on 127.0.0.1 (same node) with a fresh key.

The KV handoff never gathers through one rank. Every rank owns a range of the model's KV
heads and runs its own KV transport:
- a decode replica's every rank runs a receiver; the replica announces all of them, with
  their head ranges, as one address (`join_targets`), which the router passes on as it is;
- a prefill replica's every rank packs its overlap with each decode rank's heads
  (engine/worker/kv_handoff.py `export_ranges`; a KV head replicated over several prefill ranks
  is sent once, by the lowest) and sends it straight to that decode rank, the head range
  in the transfer header, which the receiver checks (kv_transfer/base.py);
- a decode rank's receiver assembles the parts that tile its heads; the driver admits
  the request once every rank has claimed its parts, and each rank writes its own into
  the blocks the driver allocated (the "import" message, ordered with the steps).

Losing a rank fails the replica: the next collective raises (gloo sees the peer's socket
close at once; NCCL and a stalled rank within `distributed_timeout_s`), the engine stops,
the replica fails its health check and leaves the index, and Serve replaces it; the
router resumes its streams elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.worker.kv_handoff import HeadRange
from pdserve.engine.worker.tp_worker import RankHandle, RankKVStore, WorkerSpec, worker_main
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.base import KVReceiver, KVSender, ReceiverConfig
from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.tls import TLSConfig
from pdserve.kv_transfer.torch_payload import layout_of, received_tensors
from pdserve.runtime.kv_targets import join_targets, send_parts

logger = logging.getLogger(__name__)

# -- the rank actor ------------------------------------------------------------------------


def _noop() -> None:
    pass


class TPRank:
    """A tensor-parallel rank > 0 of a replica, with its own KV transport (a Ray actor)."""

    def __init__(self) -> None:
        self.store = RankKVStore()
        self.own: HeadRange | None = None
        self.layout: Any = None
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        self._built = threading.Event()

    def open(self, rank: int, world_size: int, spec: WorkerSpec, authkey: bytes) -> tuple[Any, int]:
        """Listen for the driver's control socket, then run the rank on a thread.
        Returns (the listener's address, this process's pid)."""
        listener = Listener(("127.0.0.1", 0), authkey=authkey)

        def run() -> None:
            try:
                conn = listener.accept()
            finally:
                listener.close()
            try:
                worker_main(rank, world_size, spec, conn, self.store, self._on_built)
            except SystemExit as exc:
                logger.warning("tensor-parallel rank %d ended (%s)", rank, exc.code)
            finally:
                conn.close()

        threading.Thread(target=run, name=f"tp-rank{rank}", daemon=True).start()
        return listener.address, os.getpid()

    def _on_built(self, runner: Any, shard: Any) -> None:
        self.own = shard.kv_head_range
        self.layout = layout_of(runner.kv_cache, runner.backend.kv_cache_dtype)
        self._built.set()

    async def start_receiver(self, transport: str, config: dict[str, Any], tls: Any) -> str:
        """Start this rank's KV receiver (for its own heads); return its address."""
        if not await asyncio.to_thread(self._built.wait, 600):
            raise RuntimeError("the rank's shard was not built")
        assert self.own is not None
        self.receiver = make_receiver(
            transport, ReceiverConfig(layout=self.layout, kv_heads=self.own, **config), tls=tls
        )
        return await self.receiver.start()

    async def expect(
        self, request_id: str, wait_s: float, model_id: str, block_hashes: list[bytes]
    ) -> None:
        assert self.receiver is not None
        self.receiver.expect(request_id, wait_s, model_id=model_id, block_hashes=block_hashes)

    async def claim(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """Wait for this rank's parts of `request_id`, keep them for the driver's "import";
        what arrived (TransferError when nothing usable did)."""
        assert self.receiver is not None
        received = await self.receiver.claim(request_id, timeout_s)
        parts: list[tuple[HeadRange, Any, Any]] = [
            (heads, tensor, _noop) for heads, tensor in received_tensors(received)
        ]
        parts[-1] = (*parts[-1][:2], received.release)  # one release frees every buffer
        self.store.put_import(request_id, parts)
        header = received.header
        return {
            "num_bytes": received.stats.num_bytes,
            "num_blocks": header.num_blocks,
            "first_block": header.first_block_index,
            "first_token": header.first_token,
        }

    async def cancel(self, request_id: str) -> None:
        """Forget what is expected, arriving or buffered for `request_id`. Parts already
        claimed stay for the driver's "import" or "drop", which come down the step socket
        in order with everything else the driver tells this rank (a drop from here could
        overtake an import the driver already sent)."""
        if self.receiver is not None:
            self.receiver.cancel(request_id)

    async def start_sender(self, transport: str, tls: Any) -> None:
        if not await asyncio.to_thread(self._built.wait, 600):
            raise RuntimeError("the rank's shard was not built")
        self.sender = make_sender(transport, tls=tls)

    async def send(
        self,
        request_id: str,
        targets: list[tuple[str, HeadRange]],
        header: dict[str, Any],
        timeout_s: float,
    ) -> list[tuple[int, float]]:
        """Send this rank's packed parts of `request_id` to the receivers owning their
        heads; (bytes, seconds) per transfer. Raises the first transfer's error."""
        assert self.sender is not None
        parts = await asyncio.to_thread(self.store.wait_export, request_id, timeout_s)
        try:
            return await send_parts(
                self.sender, request_id, parts, targets, header, self.layout, timeout_s
            )
        finally:
            for part in parts:
                part.staged.release()

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.sender is not None:
            await self.sender.close()


# -- the launcher (the driver's side) ------------------------------------------------------


@dataclass
class _ActorRank:
    actor: Any
    conn: Connection
    pid: int | None

    def exited(self) -> bool:
        return False  # a dead actor closes its socket: the driver reads end-of-file

    def stop(self, timeout_s: float) -> None:
        # the rank's thread ends on "stop"; the actor itself goes with its bundle's lease
        self.kill()

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # already gone
            logger.debug("killing a tensor-parallel rank: %r", exc)


@dataclass
class RayRankLauncher:
    """Starts ranks 1.. as `TPRank` actors in bundle r of the current placement group
    (none: wherever Ray puts them, the driver's node not guaranteed; tests only), asking
    each for what its bundle holds."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    start_timeout_s: float = 300.0
    actors: list[Any] = field(default_factory=list)  # rank order: ranks 1..N-1

    def start(self, rank: int, world_size: int, spec: WorkerSpec) -> RankHandle:
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "max_concurrency": 1000,
        }
        if self.resources:
            options["resources"] = dict(self.resources)
        group = ray.util.get_current_placement_group()
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            )
        actor: Any = ray.remote(TPRank).options(**options).remote()
        authkey = secrets.token_bytes(32)
        address, pid = ray.get(
            actor.open.remote(rank, world_size, spec, authkey), timeout=self.start_timeout_s
        )
        conn = Client(address, authkey=authkey)
        self.actors.append(actor)
        return _ActorRank(actor, conn, pid)


# -- the roles' view of their ranks --------------------------------------------------------


@dataclass
class RankReceivers:
    """A decode replica's ranks 1..: their receivers, expected and claimed together."""

    actors: list[Any]
    ranges: list[HeadRange]  # every rank's KV heads, rank 0 first
    call_timeout_s: float = 30.0

    async def start(
        self, transport: str, config: ReceiverConfig, tls: TLSConfig | None, local: str
    ) -> str:
        """Start every rank's receiver; the replica's address (`join_targets`), `local`
        being rank 0's own receiver address."""
        fields = {
            "cluster_token": config.cluster_token,
            "host": config.host,
            "max_lease_s": config.max_lease_s,
            "expect_timeout_s": config.expect_timeout_s,
        }
        addresses = await asyncio.wait_for(
            asyncio.gather(*(a.start_receiver.remote(transport, fields, tls) for a in self.actors)),
            self.call_timeout_s,
        )
        return join_targets(list(zip([local, *addresses], self.ranges, strict=True)))

    async def expect(
        self, request_id: str, wait_s: float, model_id: str, block_hashes: list[bytes]
    ) -> None:
        await asyncio.wait_for(
            asyncio.gather(
                *(a.expect.remote(request_id, wait_s, model_id, block_hashes) for a in self.actors)
            ),
            self.call_timeout_s,
        )

    async def claim(self, request_id: str, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's claim of its parts (see `TPRank.claim`). Raises TransferError
        when any rank's failed (its own error when it was one); the caller then has the
        driver drop what the others claimed (`LLMEngine.drop_kv`)."""
        calls = [a.claim.remote(request_id, timeout_s) for a in self.actors]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.cancel(request_id)
            cause = getattr(errors[0], "cause", None) or errors[0]
            if isinstance(cause, TransferError):
                raise cause
            raise TransferError(f"a tensor-parallel rank failed to claim its KV: {cause!r}")
        return [r for r in results if isinstance(r, dict)]

    def cancel(self, request_id: str) -> None:
        """Tell every rank's receiver to forget `request_id` (not awaited: idempotent,
        ordered after any earlier call on each actor)."""
        for actor in self.actors:
            actor.cancel.remote(request_id)

    async def close(self) -> None:
        await asyncio.gather(*(a.close.remote() for a in self.actors), return_exceptions=True)


@dataclass
class RankSenders:
    """A prefill replica's ranks 1..: each sends its own packed parts."""

    actors: list[Any]

    async def start(self, transport: str, tls: TLSConfig | None, timeout_s: float = 60.0) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(a.start_sender.remote(transport, tls) for a in self.actors)),
            timeout_s,
        )

    async def send(
        self,
        request_id: str,
        targets: list[tuple[str, HeadRange]],
        header: dict[str, Any],
        timeout_s: float,
    ) -> list[tuple[int, float]]:
        """Every rank's transfers, (bytes, seconds) each. Raises the first failure (its
        TransferError when it was one) once all are done."""
        calls = [a.send.remote(request_id, targets, header, timeout_s) for a in self.actors]
        start = time.monotonic()
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: list[tuple[int, float]] = []
        for result in results:
            if isinstance(result, BaseException):
                cause = getattr(result, "cause", None) or result
                if isinstance(cause, TransferError):
                    raise cause
                raise TransferError(
                    f"{request_id}: a tensor-parallel rank's send failed after "
                    f"{time.monotonic() - start:.3f} s: {cause!r}"
                )
            out.extend(result)
        return out

    async def close(self) -> None:
        await asyncio.gather(*(a.close.remote() for a in self.actors), return_exceptions=True)
