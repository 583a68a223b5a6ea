"""The LoRA adapters loaded into a model's workers at runtime (docs/lora.md).

`POST /v1/load_lora_adapter` loads an adapter into every live worker of both pools; the
cluster must remember it beyond that moment: a worker replica that starts later (scaling
up, a restart) loads it too before it joins the index, and every router replica, not only
the one that took the call, serves requests naming it. Redis, which every part of the
cluster reaches already, holds one hash per model: `pdserve:<model>:lora`, adapter name
-> its folder. Adapters given at start (`lora_modules`) are configuration, not here.

An entry is written before the adapter is loaded into the workers (so that a replica
starting meanwhile loads it as well) and removed if any worker refuses it, or once every
worker unloaded it.
"""

from __future__ import annotations

from typing import Any


def registry_key(model_id: str) -> str:
    return f"pdserve:{model_id}:lora"


class LoRARegistry:
    """One model's runtime adapters on the cluster's Redis (`redis.asyncio` client)."""

    def __init__(self, redis_client: Any, model_id: str) -> None:
        self._redis = redis_client
        self.key = registry_key(model_id)

    async def all(self) -> dict[str, str]:
        """Every runtime adapter of the model: name -> folder."""
        entries = await self._redis.hgetall(self.key)
        return {_text(k): _text(v) for k, v in entries.items()}

    async def get(self, name: str) -> str | None:
        """The folder of adapter `name`, None when no such adapter is loaded."""
        value = await self._redis.hget(self.key, name)
        return None if value is None else _text(value)

    async def add(self, name: str, path: str) -> bool:
        """Record adapter `name`; False, changing nothing, when the name is taken."""
        return bool(await self._redis.hsetnx(self.key, name, path))

    async def remove(self, name: str) -> None:
        await self._redis.hdel(self.key, name)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
