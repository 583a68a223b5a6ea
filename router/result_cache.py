"""The result cache: a fully determined request's output, kept in the cluster's Redis.

A request is fully determined when its tokens depend on nothing but what it sends: greedy
(temperature 0, or top_k 1), or sampled with a fixed `seed` (the engine keys sampling by
the seed and the position, never by the batch). Such a request, sent again, gets the stored
output without reaching any worker: non-streamed as one response, streamed as the same
chunks the workers sent, replayed at once. Off unless `result_cache_ttl_s` is set.

The key (`ResultCache.plan`) is a SHA-256 over everything that changes the output:

- the model's identity (`model_identity`): the served id, a fingerprint of the checkpoint
  folder (`model_fingerprint`) and of a draft model's, and every engine setting that can
  change a token: dtype, device, quantization, kv_cache_dtype, load_format, the engine's
  seed (dummy weights), speculative, the pools' tensor-parallel sizes and the mode, and
  each LoRA adapter's folder's fingerprint (the request's adapter is one of its params);
- the prompt's token ids (a chat request's are its template's output);
- every `SamplingParams` field (max_tokens as resolved, stop strings and ids, logprobs,
  temperature, top_p, top_k, seed, ignore_eos, ...): a field added there later is in the
  key unless `_NOT_OUTPUT` names it, so a new parameter can never serve a stale output;
- the request's `cache_salt` (or its API key's): tenants with different salts never share
  an entry.

What is stored is the workers' raw output items (token ids, text, finish reason, logprobs
as ids and floats), not a response body: the router formats them for either endpoint, with
or without `return_token_ids`, streamed or not, so those do not split the key.

Bound: every entry lives `result_cache_ttl_s` (Redis expiry), and a sorted set indexes the
entries by store time; a Lua script stores an entry, drops index members older than the TTL
and evicts the oldest entries past `result_cache_max_entries`, atomically, so the bound
holds across any number of router replicas. An entry larger than
`result_cache_max_entry_bytes` is not stored, so the cache holds at most
max_entries x max_entry_bytes. Every key shares one Redis Cluster hash tag.

Never a failure: a Redis that is down or slow (`TIMEOUT_S`) makes a lookup a miss and a
store a no-op; errors, cancelled and truncated outputs are never stored (only a stream that
ended with finish_reason "stop" or "length").

Per request (`cache_directives`): `Cache-Control: no-store` (or the body's
`"result_cache": false`) neither reads nor stores; `Cache-Control: no-cache` does not read
but stores the fresh result. Every response says what happened in `x-pdserve-result-cache`:
`hit`, `miss` (served by the workers, eligible) or `bypass` (not eligible, opted out, or
Redis did not answer). Plain Python: no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.messages import ClientItem
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.speculative import SpeculativeConfig
from pdserve.router.metrics import ModelMetrics

logger = logging.getLogger(__name__)

HEADER = "x-pdserve-result-cache"
TIMEOUT_S = 0.25  # a lookup or store never waits longer on Redis
KEY_PREFIX = "{pdserve:rc}"  # one hash tag: the index and its entries share a slot
INDEX_KEY = f"{KEY_PREFIX}:index"
_SCHEMA = 1  # bump when the key's contents or the entry's format change
# SamplingParams fields that never change the tokens (a scheduling priority, if one is added)
_NOT_OUTPUT: frozenset[str] = frozenset({"priority"})
_FINISHED = ("stop", "length")  # a complete output; "abort" or None never is
_ITEM_FIELDS = ("index", "token_ids", "text", "finish_reason", "logprobs")

# Files up to this size are hashed whole; larger ones by header and sampled windows.
WHOLE_FILE_BYTES = 64 << 20
_WINDOW = 4096
_WINDOWS_PER_FILE = 64  # a large file that is not safetensors

# KEYS[1] the entry, KEYS[2] the index; ARGV: value, TTL (ms), max entries.
# Redis's own clock (TIME, in microseconds) scores the index, so replicas' clocks never
# matter; the entries expire by the same clock, so the members dropped by score are exactly
# the expired ones.
_STORE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%d', now - ttl * 1000))
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
local evicted = 0
if excess > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #old, 2 do
    redis.call('DEL', old[i])
    evicted = evicted + 1
  end
end
redis.call('PEXPIRE', KEYS[2], ttl)
return evicted
"""


# -- the model's identity -------------------------------------------------------------


def model_fingerprint(folder: Path) -> str:
    """A SHA-256 of a checkpoint folder, cheap for multi-GB weights.

    Every regular top-level file (the engine reads nothing else) by name and size; files
    up to `WHOLE_FILE_BYTES` (config.json, the tokenizer's files, generation_config.json,
    the chat template, a small model's weights) hashed whole. A larger safetensors file:
    its header (every tensor's name, dtype, shape and offsets) and, for every tensor, its
    first, middle and last `_WINDOW` bytes. Any other large file: `_WINDOWS_PER_FILE`
    evenly spaced windows. A few MB read for a 70B checkpoint.

    A changed checkpoint cannot share a fingerprint unless every file keeps its name and
    size, the tokenizer and config are byte-identical, every tensor keeps its shape, and
    every sampled window of every tensor is unchanged: retrained or fine-tuned weights
    change every window of every tensor they touch. (An edit confined to unsampled bytes
    of a large tensor would not be seen: serve such a checkpoint under a new
    `served_model_name`, or clear the cache.)
    """
    h = hashlib.sha256(b"pdserve-checkpoint-fingerprint-v1\0")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= WHOLE_FILE_BYTES:
                _hash_range(f, 0, size, h)
            elif path.suffix == ".safetensors" and _hash_safetensors(f, size, h):
                pass
            else:
                _hash_windows(f, 0, size, _WINDOWS_PER_FILE, h)
    return h.hexdigest()


def _hash_range(f: BinaryIO, start: int, end: int, h: Any) -> None:
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)


def _hash_windows(f: BinaryIO, start: int, end: int, count: int, h: Any) -> None:
    """`count` windows of `_WINDOW` bytes spread over [start, end), the last at the end."""
    if end - start <= count * _WINDOW:
        _hash_range(f, start, end, h)
        return
    step = (end - start - _WINDOW) / (count - 1)
    for i in range(count):
        at = start + int(i * step)
        _hash_range(f, at, at + _WINDOW, h)


def _hash_safetensors(f: BinaryIO, size: int, h: Any) -> bool:
    """Header + 3 windows per tensor; False (nothing hashed) for a malformed file."""
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        return False
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        return False
    header = f.read(n)
    try:
        tensors = json.loads(header)
    except ValueError:
        return False
    h.update(head + header)
    base = 8 + n
    for name in sorted(tensors):
        if name == "__metadata__":
            continue
        begin, end = tensors[name]["data_offsets"]
        _hash_windows(f, base + begin, base + end, 3, h)
    return True


def model_identity(config: ClusterConfig) -> str:
    """The part of every key that names the model and how it runs (hex SHA-256).

    Computed once per router replica at start: the checkpoint's fingerprint and every
    engine setting that can change a token. A restarted cluster with another checkpoint
    (or dtype, quantization, ...) has another identity, so it never serves old results.
    """
    assert config.model is not None, "one model's configuration (model_configs())"
    spec = SpeculativeConfig.parse(config.speculative) if config.speculative else None
    draft = spec.draft_model if spec is not None else None
    parts = {
        "model_id": config.model_id,
        "checkpoint": model_fingerprint(Path(config.model)),
        "draft": model_fingerprint(Path(draft)) if draft else None,
        "speculative": config.speculative,
        "dtype": config.dtype,
        "device": config.device.split(":")[0],  # "cuda:1" computes as "cuda:0" does
        "quantization": config.quantization,
        "kv_cache_dtype": config.kv_cache_dtype,
        "load_format": config.load_format,
        "seed": config.seed,
        "mode": config.mode,
        "tp": [config.prefill_tp, config.decode_tp],
        # each LoRA adapter by name and its folder's fingerprint: a request names one
        # (SamplingParams.lora, in the key), and a name reloaded with other weights must
        # not serve the old ones' results
        "lora": {
            name: model_fingerprint(Path(path)) if Path(path).is_dir() else path
            for name, path in sorted(config.lora_modules.items())
        },
    }
    return _digest(parts)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


# -- per request --------------------------------------------------------------------


def is_determined(params: SamplingParams) -> bool:
    """The tokens depend on the request alone: greedy, or seeded sampling."""
    return params.is_greedy or params.seed is not None


def request_key(
    identity: str, prompt_ids: list[int], params: SamplingParams, salt: str | None = None
) -> str:
    """The Redis key of a request's result (see the module docstring for what it covers)."""
    fields = {
        f.name: _plain(getattr(params, f.name))
        for f in dataclasses.fields(params)
        if f.name not in _NOT_OUTPUT
    }
    digest = _digest(
        {"v": _SCHEMA, "model": identity, "prompt": prompt_ids, "params": fields, "salt": salt}
    )
    return f"{KEY_PREFIX}:e:{digest}"


def _plain(value: Any) -> Any:
    """A params field as JSON can hold it (the grammar spec is a dataclass)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def cache_directives(headers: Mapping[str, str], body_opt_in: bool = True) -> tuple[bool, bool]:
    """(read, write) from the request's `Cache-Control` header and body field.

    `no-store` (or the body's `result_cache: false`): neither; `no-cache`: store only.
    """
    directives = {
        d.strip().split("=", 1)[0].lower()
        for d in headers.get("cache-control", "").split(",")
        if d.strip()
    }
    if not body_opt_in or "no-store" in directives:
        return False, False
    return "no-cache" not in directives, True


@dataclass
class CachePlan:
    """What the cache does for one request; `status` is the response header's value."""

    key: str | None  # None: not eligible (not fully determined, or opted out)
    read: bool
    write: bool
    status: str = "bypass"

    @property
    def hit(self) -> bool:
        return self.status == "hit"


class ResultCache:
    """One router replica's view of the cluster's result cache."""

    def __init__(
        self,
        redis: aioredis.Redis,
        identity: str,
        ttl_s: float,
        max_entries: int,
        max_entry_bytes: int,
        metrics: ModelMetrics,
    ) -> None:
        self.redis = redis
        self.identity = identity
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.max_entries = max_entries
        self.max_entry_bytes = max_entry_bytes
        self.metrics = metrics
        self._store = redis.register_script(_STORE)
        self._unavailable = False  # logged once per outage

    @classmethod
    def from_config(
        cls, config: ClusterConfig, redis: aioredis.Redis, metrics: ModelMetrics
    ) -> ResultCache | None:
        """The cache `config` asks for; None when it is off (`result_cache_ttl_s` None)."""
        if config.result_cache_ttl_s is None:
            return None
        return cls(
            redis,
            model_identity(config),
            config.result_cache_ttl_s,
            config.result_cache_max_entries,
            config.result_cache_max_entry_bytes,
            metrics,
        )

    def plan(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        salt: str | None,
        headers: Mapping[str, str],
        body_opt_in: bool = True,
    ) -> CachePlan:
        read, write = cache_directives(headers, body_opt_in)
        if not (read or write) or not is_determined(params):
            return CachePlan(None, False, False)
        return CachePlan(request_key(self.identity, prompt_ids, params, salt), read, write)

    async def replay(self, plan: CachePlan) -> AsyncIterator[ClientItem] | None:
        """The stored output items on a hit, as the workers' stream; None on a miss."""
        if plan.key is None or not plan.read:
            return None
        try:
            raw = await asyncio.wait_for(self.redis.get(plan.key), TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("lookup", exc)
            self.metrics.result_cache_errors.inc()
            plan.read = plan.write = False  # Redis is in trouble: don't pile a store on it
            return None
        self._unavailable = False
        if raw is None:
            plan.status = "miss"
            self.metrics.result_cache_misses.inc()
            return None
        try:
            items = json.loads(raw)["items"]
        except (ValueError, KeyError, TypeError):
            logger.warning("result cache: unreadable entry %s, ignored", plan.key)
            plan.status = "miss"
            self.metrics.result_cache_misses.inc()
            return None
        plan.status = "hit"
        self.metrics.result_cache_hits.inc()
        return _replay(items)

    async def record(
        self, plan: CachePlan, items: AsyncIterator[ClientItem]
    ) -> AsyncGenerator[ClientItem, None]:
        """Pass `items` through; once they end complete, store them (before the end
        reaches the client, so a client that saw the end finds the entry)."""
        kept: list[dict[str, Any]] = []
        finish_reason = None
        try:
            async for item in items:
                if plan.write:
                    kept.append({k: v for k, v in item.items() if k in _ITEM_FIELDS})
                finish_reason = item.get("finish_reason")
                yield item
        finally:
            await items.aclose()  # type: ignore[attr-defined]
        # Only reached when the items ended by themselves: an error or a client that
        # went away leaves through the `finally` above, and nothing is stored.
        if plan.key is not None and plan.write and finish_reason in _FINISHED:
            await self.store(plan.key, kept)

    async def store(self, key: str, items: list[dict[str, Any]]) -> bool:
        """Store one result (bounded, see the module docstring); False if it was not."""
        value = json.dumps({"items": items}, separators=(",", ":")).encode()
        if len(value) > self.max_entry_bytes:
            self.metrics.result_cache_stores.labels("too_large").inc()
            return False
        try:
            await asyncio.wait_for(
                self._store(keys=[key, INDEX_KEY], args=[value, self.ttl_ms, self.max_entries]),
                TIMEOUT_S,
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("store", exc)
            self.metrics.result_cache_stores.labels("error").inc()
            return False
        self.metrics.result_cache_stores.labels("stored").inc()
        self.metrics.result_cache_stored_bytes.inc(len(value))
        return True

    def _failed(self, what: str, exc: BaseException) -> None:
        if not self._unavailable:
            logger.warning("result cache: Redis %s failed (%r); serving without it", what, exc)
        self._unavailable = True


async def _replay(items: list[dict[str, Any]]) -> AsyncGenerator[ClientItem, None]:
    for item in items:  # stored from ClientItems (_ITEM_FIELDS)
        yield cast(ClientItem, item)
