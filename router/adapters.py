"""The LoRA adapters a router serves, and loading and unloading them at runtime.

An adapter is served on one base model (a served model of this router): those of the
configuration (`lora_modules`, loaded by every worker at start) and those loaded at
runtime through `POST /v1/load_lora_adapter` (vLLM's API), which the cluster's Redis
remembers (cluster/lora_registry.py). Every router replica reads that registry when a
request names a model it does not know, and for `/v1/models`: an adapter loaded through
one router replica is served by all.

A load is all or nothing: the registry entry is written first (a worker replica starting
meanwhile loads the adapter too), then every live worker of both pools loads it; if any
refuses it (`LoRAError`: a missing folder, a rank above the maximum, a shape the base does
not have) it is unloaded from the others, the entry removed, and the client gets the
worker's reason as a 400. An unload likewise: every worker unloads it, or, if one still
serves a request with it, it is loaded again where it went and the client gets a 409.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from redis.exceptions import RedisError

from pdserve.cluster.lora_registry import LoRARegistry
from pdserve.cluster.messages import LoRAReply
from pdserve.router.models import ServedModel
from pdserve.router.protocol import (
    LoadLoRAAdapterRequest,
    ProtocolError,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger(__name__)


class Adapters:
    """Adapter name -> the served model it runs on, for one router replica.

    Args:
        by_model: The router's served models.
        redis_client: The cluster's Redis (`redis.asyncio`).
        reserved: Names no adapter may take (served model ids, routed names).
    """

    def __init__(
        self, by_model: Mapping[str, ServedModel], redis_client: Any, reserved: Collection[str]
    ) -> None:
        self.by_model = by_model
        self.static = {
            name: model_id
            for model_id, served in by_model.items()
            for name in served.config.lora_modules
        }
        self.runtime: dict[str, str] = {}
        self.registries = {m: LoRARegistry(redis_client, m) for m in by_model}
        self.reserved = set(reserved)
        self.allowed = all(served.config.allow_runtime_lora for served in by_model.values())

    def get(self, name: str) -> str | None:
        """The served model adapter `name` runs on (None: no such adapter known here)."""
        return self.static.get(name) or self.runtime.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.static or name in self.runtime

    def items(self) -> list[tuple[str, str]]:
        return sorted({**self.runtime, **self.static}.items())

    async def refresh(self) -> bool:
        """Read the runtime adapters from the registry; True when they changed. Raises
        RedisError (or OSError, TimeoutError) when Redis does not answer."""
        runtime: dict[str, str] = {}
        for model_id, registry in self.registries.items():
            for name in await registry.all():
                runtime.setdefault(name, model_id)
        changed = runtime != self.runtime
        self.runtime = runtime
        return changed

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Load `req`'s adapter into every live worker of its model; the reply's text.
        Raises ProtocolError: 400 (a taken name, an adapter a worker refused), 503."""
        self._check_allowed()
        served = self._base(req.base_model_name)
        name, path = req.lora_name, req.lora_path
        if name in self.reserved:
            raise ProtocolError(
                f"{name!r} names a served model; an adapter needs a name of its own",
                param="lora_name",
            )
        await self._refresh_or_503()
        registry = self.registries[served.model_id]
        if name in self or not await _redis(registry.add(name, path)):
            raise ProtocolError(
                f"the LoRA adapter {name!r} has already been loaded", param="lora_name"
            )
        changes = served.core.metrics.lora_loads
        try:
            workers, replies = await served.core.broadcast_lora(True, name, path)
            failed = [r for r in replies if r["error"] is not None]
            if failed or not workers:
                await self._undo_load(served, name, replies)
                raise _load_error(name, failed)
        except BaseException:
            changes.labels("load", "failed").inc()
            await _redis(registry.remove(name))
            raise
        changes.labels("load", "done").inc()
        self.runtime[name] = served.model_id
        logger.info("LoRA adapter %r loaded from %s on %d workers", name, path, len(workers))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Unload `req`'s adapter from every live worker; the reply's text. Raises
        ProtocolError: 400 (an adapter of the configuration), 404, 409 (in use), 503."""
        self._check_allowed()
        name = req.lora_name
        await self._refresh_or_503()
        if name in self.static:
            raise ProtocolError(
                f"the LoRA adapter {name!r} was given at start (lora_modules): it is unloaded"
                " by removing it there",
                param="lora_name",
            )
        model_id = self.runtime.get(name)
        if model_id is None:
            raise ProtocolError(
                f"the LoRA adapter {name!r} cannot be found",
                status_code=404,
                param="lora_name",
                code="model_not_found",
            )
        served, registry = self.by_model[model_id], self.registries[model_id]
        path = await _redis(registry.get(name))
        _, replies = await served.core.broadcast_lora(False, name)
        failed = [r for r in replies if r["error"] is not None]
        changes = served.core.metrics.lora_loads
        if failed:
            if path is not None:  # back where it went: an unload is all or nothing
                await served.core.broadcast_lora(True, name, path)
            in_use = [r for r in failed if r.get("in_use")]
            changes.labels("unload", "in_use" if in_use else "failed").inc()
            if in_use:
                raise ProtocolError(
                    f"the LoRA adapter {name!r} still serves requests on {len(in_use)}"
                    " worker(s); unload it once they finish",
                    status_code=409,
                    param="lora_name",
                    code="adapter_in_use",
                )
            raise ProtocolError(
                f"the LoRA adapter {name!r} could not be unloaded: {failed[0]['error']}",
                status_code=503,
                code="upstream_unavailable",
            )
        await _redis(registry.remove(name))
        changes.labels("unload", "done").inc()
        self.runtime.pop(name, None)
        logger.info("LoRA adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise ProtocolError(
                "loading LoRA adapters at runtime is off: the cluster starts with"
                " allow_runtime_lora (pdserve up --allow-runtime-lora) to let API clients"
                " name folders its workers read; adapters given at start are --lora",
                status_code=403,
                code="runtime_lora_off",
            )

    def _base(self, base_model_name: str | None) -> ServedModel:
        if base_model_name is None:
            if len(self.by_model) == 1:
                return next(iter(self.by_model.values()))
            raise ProtocolError(
                f"this router serves {sorted(self.by_model)}: name the adapter's base in"
                " base_model_name",
                param="base_model_name",
            )
        served = self.by_model.get(base_model_name)
        if served is None:
            raise ProtocolError(
                f"the model {base_model_name!r} is not served here",
                status_code=404,
                param="base_model_name",
                code="model_not_found",
            )
        return served

    async def _refresh_or_503(self) -> None:
        try:
            await self.refresh()
        except (RedisError, OSError, TimeoutError) as exc:
            raise _redis_down(exc) from exc

    @staticmethod
    async def _undo_load(served: ServedModel, name: str, replies: list[LoRAReply]) -> None:
        """Unload from the workers that loaded it (best effort: a worker left with it
        only holds memory; no request reaches it without the registry's entry)."""
        if any(r["error"] is None for r in replies):
            _, undone = await served.core.broadcast_lora(False, name)
            for r in undone:
                if r["error"] is not None:
                    logger.warning("LoRA adapter %r left on %s: %s", name, r["worker_id"], r)


def _load_error(name: str, failed: list[LoRAReply]) -> ProtocolError:
    refused = [r for r in failed if not r.get("unreachable")]
    if refused:  # the adapter itself: every worker of the model would refuse it alike
        return ProtocolError(str(refused[0]["error"]), param="lora_path")
    why = failed[0]["error"] if failed else "no live worker"
    return ProtocolError(
        f"the LoRA adapter {name!r} could not be loaded into every worker ({why}); retry"
        " once the pools are up",
        status_code=503,
        code="upstream_unavailable",
    )


def _redis_down(exc: BaseException) -> ProtocolError:
    return ProtocolError(
        f"the cluster's Redis, which holds the runtime adapters, did not answer ({exc!r})",
        status_code=503,
        code="upstream_unavailable",
    )


async def _redis(awaitable: Any) -> Any:
    """`await awaitable`, a Redis call: a 503 ProtocolError when Redis does not answer."""
    try:
        return await awaitable
    except (RedisError, OSError, TimeoutError) as exc:
        raise _redis_down(exc) from exc
