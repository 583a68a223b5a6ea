"""What a prefill and a decode replica share: the engine, the index membership, shutdown.

A replica process runs one `LLMEngine` on its own thread (`AsyncEngine`), registers in
the prefix index under its Ray Serve replica id, heartbeats its load and publishes its
KV events. Leaving its pool (a scale-down) it drains: out of the index at once, its
requests finishing or, past the drain deadline, moving elsewhere (cluster/drain.py). On
shutdown (`serve.shutdown`, SIGTERM) it leaves the index first, so placement stops
choosing it, then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import redis.asyncio as aioredis
import torch

from pdserve.cluster.config import ClusterConfig, parse_cpu_set
from pdserve.cluster.drain import DrainNotices
from pdserve.cluster.lora_registry import LoRARegistry
from pdserve.cluster.messages import FetchReport, LoadReport, LoRAReply
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.common.kv_events import KVEvent
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.adapter import LoRAError, LoRAInUseError
from pdserve.kv_transfer import make_sender
from pdserve.kv_transfer.base import KVSender, ReceiverConfig, tune_malloc
from pdserve.kv_transfer.errors import HolderGoneError
from pdserve.kv_transfer.torch_payload import layout_of
from pdserve.runtime.index_member import IndexMember, LastKnownLoad
from pdserve.runtime.prefix_push import push_prefix

if TYPE_CHECKING:
    from pdserve.runtime.tp_ranks import RayRankLauncher

logger = logging.getLogger(__name__)
_AUTOSCALING_STATS = (
    "queued_prefill_tokens",
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_total",
)


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process (and so the threads it starts later) to `cpus`."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def resolve_transfer_host(host: str) -> str:
    """ "auto" -> this node's address as Ray knows it (the pod IP on KubeRay)."""
    if host != "auto":
        return host
    import ray.util

    return str(ray.util.get_node_ip_address())


def replica_id() -> str:
    """This process's Ray Serve replica id (the worker id the index and router use)."""
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


class WorkerReplica:
    """Base of the two worker deployments; `role` is "prefill" or "decode"."""

    role = ""

    def __init__(self, config: dict[str, Any], worker_id: str | None = None) -> None:
        self.config = ClusterConfig.model_validate(config)
        cpus = self.config.prefill_cpus if self.role == "prefill" else self.config.decode_cpus
        if cpus:
            pin_process(parse_cpu_set(cpus))
        threads = self.config.threads(self.role)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        tune_malloc()  # KV transfers allocate a buffer per message (kv_transfer/base.py)
        self.worker_id = worker_id or replica_id()
        engine_config = self.config.engine_config(self.role)
        # tensor parallel: ranks 1.. are actors in this replica's placement group
        self.rank_launcher: RayRankLauncher | None = None
        if engine_config.tensor_parallel_size > 1:
            from pdserve.runtime.tp_ranks import RayRankLauncher

            resources = (
                self.config.prefill_resources
                if self.role == "prefill"
                else self.config.decode_resources
            )
            self.rank_launcher = RayRankLauncher(
                num_cpus=self.config.replica_num_cpus,
                num_gpus=self.config.replica_num_gpus,
                resources=dict(resources),
                start_timeout_s=engine_config.distributed_timeout_s,
            )
        if self.config.model is None:  # each of ClusterConfig.model_configs() has one
            raise ValueError("a worker replica's config names no model folder")
        model, launcher = self.config.model, self.rank_launcher
        # built on the engine thread: its OpenMP team is then the process's only one
        # (engine/async_engine.py, AsyncEngine)
        self.engine = AsyncEngine(
            lambda: LLMEngine(model, engine_config, rank_launcher=launcher),
            hold_above_streams=self.config.stream_hold_above,
        )
        self.redis = aioredis.Redis.from_url(
            self.config.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        self.index = PrefixIndex(
            self.redis,
            self.config.model_id,
            self.config.worker_lease_s,
            stream_len=self.config.index_events_len(),
        )
        self.member: IndexMember | None = None
        self.drain_notices = DrainNotices(self.redis, self.config.model_id)
        self.drain_deadline: float | None = None  # set once it leaves its pool
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_again = False
        self._prefix_sender: KVSender | None = None  # made at this replica's first push

    async def load_lora_modules(self) -> None:
        """Load every LoRA adapter of the configuration (`lora_modules`), then those
        loaded into the cluster at runtime (cluster/lora_registry.py), before this
        replica joins the index: a replica serves each adapter from its first request.
        An adapter of the configuration that does not fit the model fails the replica's
        start, naming it; a runtime one is logged and skipped (its load is refused, or
        was, by every other worker too, and its entry goes)."""
        for name, path in self.config.lora_modules.items():
            await self.engine.call(_loader(name, path))
        try:
            runtime = await LoRARegistry(self.redis, self.config.model_id).all()
        except Exception as exc:  # Redis down: joining the index waits for it anyway
            logger.warning("could not read the runtime LoRA adapters (%r); none loaded", exc)
            return
        for name, path in sorted(runtime.items()):
            reply = await self.load_lora(name, path)
            if reply["error"] is not None:
                logger.warning("runtime LoRA adapter %r not loaded: %s", name, reply["error"])

    async def load_lora(self, name: str, path: str, target_replica: str | None = None) -> LoRAReply:
        """Load adapter `name` from folder `path` (`POST /v1/load_lora_adapter`, which
        the router calls on every live worker of both pools). Loading it again from the
        same folder is a no-op: a replica that started meanwhile loaded it already."""
        engine = self.engine.engine  # the registry of names only: read off the loop
        loaded = engine.loras.get(name)
        if loaded is not None and loaded.path == str(Path(path)):
            return {"worker_id": self.worker_id, "error": None}
        try:
            await self.engine.call(_loader(name, path))
        except LoRAError as exc:
            return {"worker_id": self.worker_id, "error": str(exc)}
        except Exception as exc:  # not the adapter's fault as far as it knows: logged
            logger.exception("loading LoRA adapter %r from %s failed", name, path)
            return {"worker_id": self.worker_id, "error": f"{type(exc).__name__}: {exc}"}
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return {"worker_id": self.worker_id, "error": None}

    async def unload_lora(self, name: str, target_replica: str | None = None) -> LoRAReply:
        """Unload adapter `name` (`POST /v1/unload_lora_adapter`); refused (`in_use`)
        while a request runs with it. One not loaded here is no error: the unload's goal
        holds."""

        def unload(engine: LLMEngine) -> None:
            if name in engine.loras:
                engine.unload_lora(name)

        try:
            await self.engine.call(unload)
        except LoRAInUseError as exc:
            return {"worker_id": self.worker_id, "error": str(exc), "in_use": True}
        except LoRAError as exc:
            return {"worker_id": self.worker_id, "error": str(exc)}
        return {"worker_id": self.worker_id, "error": None}

    def prefix_sender(self) -> KVSender:
        """The sender of this replica's peer-fetch pushes (the prefill role uses its own)."""
        if self._prefix_sender is None:
            cfg = self.config
            self._prefix_sender = make_sender(cfg.transport, tls=cfg.transfer_tls())
        return self._prefix_sender

    async def push_prefix(
        self,
        fetch: str,
        prompt_token_ids: list[int],
        num_blocks: int,
        first_block: int,
        address: str,
        cache_salt: str | None = None,
        target_replica: str | None = None,
        lora: str | None = None,
    ) -> FetchReport:
        """Peer fetch, holder side (runtime/prefix_push.py): push blocks `first_block`..
        of the prompt's first `num_blocks` full blocks that this replica holds to the
        receiver at `address`, as transfer `fetch`. Raises the transfer's typed error, or
        `NotHeldError` when it holds none of them, `HolderGoneError` when this replica is
        not `target_replica` (the named holder is gone): the receiver then computes them."""
        if target_replica is not None and target_replica != self.worker_id:
            raise HolderGoneError(
                f"{fetch}: holder {target_replica} is gone; replica {self.worker_id} pushes"
                " nothing in its place"
            )
        cfg = self.config
        engine = self.engine.engine  # immutable settings only: safe off the engine thread
        stats = await push_prefix(
            self.engine,
            self.prefix_sender(),
            layout_of(engine.runner.kv_cache, engine.config.kv_cache_dtype),
            cfg.cluster_token,
            fetch,
            prompt_token_ids,
            num_blocks,
            first_block,
            address,
            cache_salt,
            lora,
            lease_ms=int(cfg.kv_wait_timeout_s * 1000),
            timeout_s=cfg.transfer_timeout_s,
        )
        return {
            "worker_id": self.worker_id,
            "num_blocks": stats.num_blocks,
            "num_bytes": stats.num_bytes,
            "seconds": stats.seconds,
        }

    def receiver_config(self) -> ReceiverConfig:
        """The KV receiver's settings for this replica's engine (a decode worker's
        handoffs and either pool's peer fetches)."""
        cfg = self.config
        engine = self.engine.engine  # immutable settings only
        return ReceiverConfig(
            cluster_token=cfg.cluster_token,
            layout=layout_of(engine.runner.kv_cache, engine.config.kv_cache_dtype),
            kv_heads=engine.kv_head_range,
            host=resolve_transfer_host(cfg.transfer_host),
            max_lease_s=max(cfg.kv_wait_timeout_s, 1.0),
            expect_timeout_s=cfg.kv_wait_timeout_s,
        )

    async def index_load(self) -> dict[str, int]:
        """The gauges each heartbeat publishes (the router's /metrics shows them)."""
        return await self.engine.call(lambda e: e.load())

    async def join_index(self, address: str) -> None:
        async def drain() -> list[KVEvent]:
            # NOTE: not through the engine thread: a request's last token must not wait
            # for the next step boundary before its blocks are published
            return self.engine.drain_kv_events()

        load = LastKnownLoad(
            self.index_load,
            self.config.heartbeat_s,
            self.engine.step_running_s,
            self.config.stall_timeout_s,
        )
        self.member = IndexMember(
            self.index,
            self.worker_id,
            self.role,
            address,
            load,
            drain,
            self.engine.kv_snapshot,
            self.config.heartbeat_s,
            kv_format=self.kv_format,
            drain_deadline=functools.partial(self.drain_notices.deadline, self.worker_id),
            on_drain=self.begin_drain,
        )
        await self.member.start()

    def begin_drain(self, deadline: float) -> None:
        """This replica leaves its pool (cluster/drain.py): it left the index; its
        requests run on until `deadline` (Unix seconds). A decode replica then moves
        those still running (`DecodeServer.begin_drain`)."""
        self.drain_deadline = deadline
        logger.info(
            "%s %s drains: %.1f s left for its requests",
            self.role,
            self.worker_id,
            deadline - time.time(),
        )

    @property
    def kv_format(self) -> str:
        """What the index checks every worker of the model agrees on: the format of the KV
        blocks it sends or takes (KV cache dtype, block size); "float32/16", "int8/16"."""
        engine = self.engine.engine
        dtype: str = engine.config.kv_cache_dtype
        if dtype == "auto":
            dtype = str(engine.dtype).removeprefix("torch.")
        return f"{dtype}/{engine.config.block_size}"

    async def flush_events(self) -> None:
        """Publish the pending KV events now (a request's blocks, before its last item
        leaves: a follow-up request is placed by them), waiting at most `heartbeat_s`.

        With Redis unreachable a publish waits for its socket timeout (seconds), which must
        not hold a stream's last token (measured: the router then took the silent stream
        of a worker out of the index for a dead one, and resumed it elsewhere). The flush
        goes on in the background, one at a time: a caller that comes while one runs
        makes it flush once more after, which covers that caller's events too."""
        if self.member is None:
            return
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.create_task(self._flush_loop())
        else:
            self._flush_again = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._flush_task), self.config.heartbeat_s)

    async def _flush_loop(self) -> None:
        assert self.member is not None
        while True:
            self._flush_again = False
            await self.member.flush()  # logs a Redis error, never raises one
            if not self._flush_again:
                return

    async def load(self, target_replica: str | None = None) -> LoadReport:
        """Exact live state of this worker (the router's `/workers`, tests, benchmarks)."""
        load: dict[str, Any] = await self.engine.call(lambda e: e.load())
        generation = self.member.generation if self.member is not None else None
        out = {
            **load,
            "worker_id": self.worker_id,
            "role": self.role,
            "generation": generation or 0,
            "pid": os.getpid(),
            "kv_format": self.kv_format,
        }
        if self.rank_launcher is not None:
            out["tensor_parallel"] = await self.engine.call(_parallel_load)
        return cast(LoadReport, out)  # the engine's gauges hold IndexLoad's keys

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics hook (`deploy/autoscaling.py` reads them)."""
        load = await self.engine.call(lambda e: e.load())
        return {name: float(load[name]) for name in _AUTOSCALING_STATS}

    async def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine thread (a failed step: with tensor
        parallelism, also a lost rank) makes the replica unhealthy; it leaves the index
        at once, so placement stops choosing it before Serve replaces it."""
        if self.engine.closed:
            if self.member is not None:
                with contextlib.suppress(Exception):  # Redis down: the lease ends it
                    await self.member.stop()
                self.member = None
            raise RuntimeError("the engine thread has stopped")

    async def shutdown(self) -> None:
        if self.member is not None:
            await self.member.stop()
        if self._prefix_sender is not None:
            with contextlib.suppress(Exception):  # shutting down: the rest must stop too
                await self._prefix_sender.close()
        await self.engine.close()
        await self.redis.aclose()


def _parallel_load(engine: LLMEngine) -> dict[str, Any]:
    """A tensor-parallel replica's ranks for `/workers`: each rank's pid, weight and KV
    bytes, and the driver's collective time per step."""
    stats = engine.parallel_stats()
    workers = engine.tp_workers
    pids = [os.getpid(), *(workers.pids if workers is not None else [])]
    return {
        "size": stats.tensor_parallel_size,
        "ranks": [
            {
                "rank": r.rank,
                "pid": pid,
                "weight_bytes": r.weight_bytes,
                "sharded_weight_bytes": r.sharded_weight_bytes,
                "replicated_weight_bytes": r.replicated_weight_bytes,
                "kv_cache_bytes": r.kv_cache_bytes,
            }
            for r, pid in zip(stats.ranks, pids, strict=True)
        ],
        "steps": stats.steps,
        "all_reduce_ms_per_step": round(stats.all_reduce_s_per_step * 1000, 3),
        "collective_ms_per_step": round(stats.collective_s_per_step * 1000, 3),
    }


def _loader(name: str, path: str) -> Callable[[LLMEngine], None]:
    def load(engine: LLMEngine) -> None:
        engine.load_lora(name, path)

    return load
