"""The cluster-wide prefix index: which worker holds which KV blocks, kept in Redis.

Workers publish the STORED/REMOVED events of their block pools; the router asks, in one
round trip, how many leading blocks of a prompt's hash chain each live worker holds
(docs/prefix-index.md). Plain Python: no torch anywhere.

Redis schema, every key prefixed ``pdserve:{model_id}:``:

    block:{hash_hex}          SET  "{worker_id}:{generation}" of each worker holding the block
    worker:{worker_id}        HASH role, address, generation, kv_format, load fields; TTL =
                                   the lease
    workers                   SET  worker ids believed live (pruned lazily)
    generation                STRING counter; INCR gives every registration a new generation
    registrations             SET  "{worker_id}:{generation}" not yet reaped
    held:{worker_id}:{gen}    SET  hash_hex the registration published (the reverse index
                                   that lets reap() find its block entries without SCAN)
    tier:{worker_id}:{gen}    HASH hash_hex -> "h" (host memory) or "d" (disk) for the
                                   registration's blocks held only in a lower tier; a
                                   block absent here is in the device pool
    events                    STREAM what changed, for routers that keep the index in memory
                                   (`index_follower.py`): one entry per register, publish or
                                   deregister, fields n (sequence), k (kind), m (member),
                                   o (ops: `TIER_OPS`); trimmed to about `stream_len` entries (none
                                   written when it is 0)
    events_seq                STRING the last entry's n: a router that sees n jump knows it
                                   missed entries (trimmed, or Redis restarted)
    epoch                     STRING a random id set by the first router that follows the
                                   index: gone or changed, Redis was restarted or emptied

Leases and generations: register() takes a fresh generation from one model-wide counter
(monotonic, so an id is never reused, and no per-worker counter outlives its worker) and
writes the worker hash with a TTL of ``lease_s``; heartbeat() renews it. A block entry
counts only while its member's generation equals the ``generation`` field of a live
worker hash. So when a lease expires (the hash is gone) or a worker restarts and
registers again (the hash now carries a newer generation), all its old entries stop
counting at once, even though they still sit in the block sets; a restarted worker gets
credit only for what it publishes under its new generation. heartbeat() and publish()
check the generation atomically (Lua) and return False once it is stale: the worker must
register again and republish its whole cache. Dead entries are removed lazily by match()
(on the blocks it walks) and fully by reap() (periodically, or deregister()).

KV format: a worker registers the format of its KV blocks (`WorkerInfo.kv_format`, e.g.
"int8/16": the KV cache dtype and block size). Blocks cross only between workers of one
format, so register() refuses a worker whose format differs from any live worker's of
the model (`KVFormatMismatchError`), atomically with the registration: a prefill pool
with fp8 KV and a decode pool with bf16 KV never both join one cluster. Once every
worker of the old format is gone (a lease lapses within `lease_s`), a new format may.

NOTE: scripts build worker keys from a prefix instead of declaring them in KEYS, because
match() discovers workers inside the script. That needs a standalone Redis (or one
primary), as docs/prefix-index.md says; Redis Cluster would need hash tags.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis.asyncio as aioredis

from pdserve.common.hashing import BlockHash
from pdserve.common.kv_events import TIER_OPS, KVEvent

__all__ = [
    "ROLES",
    "KVFormatMismatchError",
    "MatchResult",
    "PrefixIndex",
    "ReapResult",
    "StreamEvent",
    "WorkerInfo",
    "split_member",
]

ROLES = ("prefill", "decode")
OP_LEN = 17
"""An op in a stream entry: '+' (stored, in the device pool), 'h' or 'd' (held only in
host memory or on disk), '-' (removed), then the block's first 8 hash bytes in hex, which
is all a router's in-memory view keys a block by."""
_RESERVED_FIELDS = frozenset({"role", "address", "generation", "kv_format"})
_REAP_BATCH = 512

# KEYS: generation counter, workers set, registrations set, worker key, events stream,
# events sequence.
# ARGV: worker_id, lease_ms, kv_format, worker key prefix, stream length, field, value, ...
# (role, address, kv_format, load). Returns the generation, or {other worker id, its
# kv_format} when a live worker (other than this id) registered another non-empty format.
_REGISTER_LUA = """
if ARGV[3] ~= '' then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if id ~= ARGV[1] then
      local other = redis.call('HGET', ARGV[4] .. id, 'kv_format')
      if other and other ~= '' and other ~= ARGV[3] then return {id, other} end
    end
  end
end
local gen = redis.call('INCR', KEYS[1])
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'generation', gen, unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1] .. ':' .. gen)
if ARGV[5] ~= '0' then
  local n = redis.call('INCR', KEYS[6])
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*',
             'n', n, 'k', 'r', 'm', ARGV[1] .. ':' .. gen)
end
return gen
"""

# KEYS: worker key. ARGV: generation, lease_ms, field, value, ... (load).
_HEARTBEAT_LUA = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: worker key, held set, events stream, events sequence, tier hash, block key per op.
# ARGV: generation, member, stream length, the ops as the stream carries them (`_ops`),
# then per op its character (`TIER_OPS`) and the block's hash_hex. Ops apply in order.
_PUBLISH_LUA = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
for j = 6, #KEYS do
  local op, hex = ARGV[2 * j - 7], ARGV[2 * j - 6]
  if op == '-' then
    redis.call('SREM', KEYS[j], ARGV[2])
    redis.call('SREM', KEYS[2], hex)
    redis.call('HDEL', KEYS[5], hex)
  else
    redis.call('SADD', KEYS[j], ARGV[2])
    redis.call('SADD', KEYS[2], hex)
    if op == '+' then
      redis.call('HDEL', KEYS[5], hex)
    else
      redis.call('HSET', KEYS[5], hex, op)
    end
  end
end
if ARGV[3] ~= '0' and ARGV[4] ~= '' then
  local n = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*',
             'n', n, 'k', 'p', 'm', ARGV[2], 'o', ARGV[4])
end
return 1
"""

# KEYS: worker key, workers set, events stream, events sequence.
# ARGV: worker_id, generation or '', stream length.
_DEREGISTER_LUA = """
local gen = redis.call('HGET', KEYS[1], 'generation')
if ARGV[2] ~= '' and gen ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
if gen and ARGV[3] ~= '0' then
  local n = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*',
             'n', n, 'k', 'd', 'm', ARGV[1] .. ':' .. gen)
end
return 1
"""

# KEYS: workers set, then the chain's block keys, first block first.
# ARGV: worker key prefix, role filter ('' = any), tier key prefix, then the chain's
# hash_hex, first block first.
# Returns {worker_id, matched_blocks, {field, value, ...}, host blocks, disk blocks} per
# live worker of the role (of its matched blocks, those held only in a lower tier).
_MATCH_LUA = """
local live_gen, wanted, fields_of = {}, {}, {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)  -- lease expired
  else
    local role
    for i = 1, #fields, 2 do
      if fields[i] == 'generation' then live_gen[id] = fields[i + 1] end
      if fields[i] == 'role' then role = fields[i + 1] end
    end
    if ARGV[2] == '' or role == ARGV[2] then
      wanted[#wanted + 1] = id
      fields_of[id] = fields
    end
  end
end
local counts, num_running = {}, #wanted
for _, id in ipairs(wanted) do counts[id] = 0 end
for i = 2, #KEYS do
  if num_running == 0 then break end
  local num_advanced = 0
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[i])) do
    local id, gen = string.match(member, '^(.*):(%d+)$')
    if id == nil or live_gen[id] ~= gen then
      redis.call('SREM', KEYS[i], member)  -- dead or stale generation: reap lazily
    elseif counts[id] == i - 2 then
      counts[id] = i - 1
      num_advanced = num_advanced + 1
    end
  end
  num_running = num_advanced
end
local out = {}
for _, id in ipairs(wanted) do
  local host, disk = 0, 0
  local tier_key = ARGV[3] .. id .. ':' .. (live_gen[id] or '')
  if counts[id] > 0 and redis.call('EXISTS', tier_key) == 1 then
    local first, last = 4, 3 + counts[id]
    while first <= last do  -- in batches: unpack() is bounded by Lua's stack
      local upto = math.min(first + 999, last)
      for _, t in ipairs(redis.call('HMGET', tier_key, unpack(ARGV, first, upto))) do
        if t == 'h' then host = host + 1 elseif t == 'd' then disk = disk + 1 end
      end
      first = upto + 1
    end
  end
  out[#out + 1] = {id, counts[id], fields_of[id], host, disk}
end
return out
"""


# KEYS: workers set, epoch key. ARGV: worker key prefix, an epoch to set if none is.
# Returns {epoch, {worker_id, lease ms left, {field, value, ...}} per live worker}.
_LIVE_LUA = """
redis.call('SET', KEYS[2], ARGV[2], 'NX')
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. id
  local fields = redis.call('HGETALL', key)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)  -- lease expired
  else
    out[#out + 1] = {id, redis.call('PTTL', key), fields}
  end
end
return {redis.call('GET', KEYS[2]), out}
"""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the index sees it.

    generation is 0 until registered; register() ignores it and returns the new one.
    load holds integer gauges (e.g. queued_prefill_tokens, running, free_blocks,
    total_blocks); their names must not be role, address, generation or kv_format.
    kv_format: the format of the worker's KV blocks ("" = not checked; see the module
    docstring).
    """

    worker_id: str
    role: str
    address: str
    generation: int = 0
    load: dict[str, int] = field(default_factory=dict)
    kv_format: str = ""


class KVFormatMismatchError(ValueError):
    """A worker's KV format differs from a live worker's of the same model."""


class MatchResult(NamedTuple):
    """A live worker and how many leading blocks of the queried chain it holds; of those,
    how many only in host memory and only on disk (the rest are in its device pool)."""

    worker: WorkerInfo
    matched_blocks: int
    host_blocks: int = 0
    disk_blocks: int = 0


class ReapResult(NamedTuple):
    """What reap() removed: dead registrations and their block-set entries."""

    num_registrations: int
    num_entries: int


class PrefixIndex:
    """Async client of the Redis prefix index of one model (schema: module docstring).

    Args:
        redis_client: A redis.asyncio client (decode_responses either way).
        model_id: The model's id; indexes of different models never mix.
        lease_s: How long a registration lives without a heartbeat.
        stream_len: About how many entries the events stream keeps (a router further
            behind than that takes a new snapshot); 0 writes no stream, for clusters whose
            routers match in Redis (`ClusterConfig.router_index`).

    Raises:
        ValueError: model_id is empty, lease_s is under 1 ms or stream_len negative.
    """

    def __init__(
        self,
        redis_client: aioredis.Redis,
        model_id: str,
        lease_s: float = 10.0,
        stream_len: int = 0,
    ):
        if not model_id:
            raise ValueError("model_id must be non-empty")
        if lease_s < 0.001:
            raise ValueError(f"lease_s must be >= 0.001, got {lease_s}")
        if stream_len < 0:
            raise ValueError(f"stream_len must be >= 0, got {stream_len}")
        self._redis = redis_client
        self.model_id = model_id
        self.lease_ms = int(lease_s * 1000)
        self.stream_len = stream_len
        self._prefix = f"pdserve:{model_id}:"
        self._register = redis_client.register_script(_REGISTER_LUA)
        self._heartbeat = redis_client.register_script(_HEARTBEAT_LUA)
        self._publish = redis_client.register_script(_PUBLISH_LUA)
        self._deregister = redis_client.register_script(_DEREGISTER_LUA)
        self._match = redis_client.register_script(_MATCH_LUA)
        self._live = redis_client.register_script(_LIVE_LUA)

    def key(self, suffix: str) -> str:
        """Returns the full Redis key for a schema suffix, e.g. key("workers")."""
        return self._prefix + suffix

    async def register(self, worker: WorkerInfo) -> int:
        """Registers (or re-registers) a worker under a fresh generation; one round trip.

        Returns:
            The new generation: pass it to heartbeat(), publish() and deregister().

        Raises:
            ValueError: Empty worker_id, unknown role, or a bad load field.
            KVFormatMismatchError: A live worker of this model registered another
                `kv_format`; nothing was written.

        Side effects: a previous registration of the same id becomes stale at once, so
        none of its block entries count until the worker republishes.
        """
        if not worker.worker_id:
            raise ValueError("worker_id must be non-empty")
        if worker.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {worker.role!r}")
        fields: list[str | int] = ["role", worker.role, "address", worker.address]
        fields += ["kv_format", worker.kv_format, *_load_args(worker.load)]
        keys = [self.key(s) for s in ("generation", "workers", "registrations")]
        keys += [self._worker_key(worker.worker_id), *self._stream_keys()]
        args: list[str | int] = [worker.worker_id, self.lease_ms, worker.kv_format]
        args += [self.key("worker:"), self.stream_len]
        result = await self._register(keys, [*args, *fields])
        if isinstance(result, list):
            other, other_format = (_text(v) for v in result)
            raise KVFormatMismatchError(
                f"worker {worker.worker_id} ({worker.role}) has KV format"
                f" {worker.kv_format!r}, but live worker {other} of model {self.model_id!r}"
                f" has {other_format!r}: prefill and decode workers exchange KV blocks, so"
                " every worker of a model must use the same KV cache dtype and block size"
                " (pdserve up --kv-cache-dtype, --block-size)"
            )
        return int(result)

    async def heartbeat(self, worker_id: str, generation: int, load: Mapping[str, int]) -> bool:
        """Renews the lease and updates load fields, atomically; one round trip.

        Returns:
            False if the registration expired or was superseded; nothing was written and
            the worker must register() again and republish its cache.

        Raises:
            ValueError: A load field is reserved or not an int.
        """
        args = [generation, self.lease_ms, *_load_args(load)]
        return bool(await self._heartbeat([self._worker_key(worker_id)], args))

    async def publish(self, worker_id: str, generation: int, events: Sequence[KVEvent]) -> bool:
        """Applies a worker's block-pool events in order; one round trip, atomic.

        STORED adds "worker_id:generation" to each block's set, REMOVED takes it out;
        DEMOTED_HOST and DEMOTED_DISK keep it there and note the block's tier (STORED and
        REMOVED clear it).

        Returns:
            False if the registration is gone or stale; nothing was written (re-register
            and republish).
        """
        keys = [self._worker_key(worker_id), self._held_key(worker_id, generation)]
        keys += [*self._stream_keys(), self._tier_key(worker_id, generation)]
        ops: list[str] = []
        pairs: list[str | int] = []
        for event in events:
            op = TIER_OPS[event.kind]
            for block_hash in event.block_hashes:
                hash_hex = block_hash.hex()
                keys.append(self._block_key(hash_hex))
                pairs += [op, hash_hex]
                ops.append(op + hash_hex[: OP_LEN - 1])
        args = [generation, f"{worker_id}:{generation}", self.stream_len, "".join(ops), *pairs]
        return bool(await self._publish(keys, args))

    async def deregister(self, worker_id: str, generation: int | None = None) -> bool:
        """Removes a worker now (graceful shutdown) and reaps its entries.

        Args:
            generation: If given, only that registration is removed, so a late call from
                an old process cannot remove its restarted successor.

        Returns:
            Whether a registration was removed.
        """
        keys = [self._worker_key(worker_id), self.key("workers"), *self._stream_keys()]
        removed = await self._deregister(
            keys, [worker_id, "" if generation is None else generation, self.stream_len]
        )
        await self._reap(only_worker_id=worker_id)
        return bool(removed)

    async def live_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Returns the live workers (of one role, if given), sorted by id; one round trip."""
        return [result.worker for result in (await self.match([], role)).values()]

    async def match(
        self, block_hashes: Sequence[BlockHash], role: str | None = None
    ) -> dict[str, MatchResult]:
        """Counts, per live worker, the leading blocks of a hash chain it holds.

        One round trip (a Lua script). Counting stops at a worker's first missing block.
        Entries of expired or superseded registrations never count; those met on the
        walked blocks are removed on the way.

        Args:
            block_hashes: A prompt's chained full-block hashes, first block first.
            role: "prefill" or "decode" to see only that pool; None for all.

        Returns:
            worker_id -> MatchResult for every live worker of the role, sorted by id;
            a worker holding none of the chain has matched_blocks 0.
        """
        hexes = [h.hex() for h in block_hashes]
        keys = [self.key("workers"), *(self._block_key(h) for h in hexes)]
        rows = await self._match(keys, [self.key("worker:"), role or "", self.key("tier:"), *hexes])
        results = [_match_result(row) for row in rows]
        return {r.worker.worker_id: r for r in sorted(results, key=lambda r: r.worker.worker_id)}

    async def reap(self) -> ReapResult:
        """Removes every block entry of expired or superseded registrations.

        Meant for a periodic task; cost is proportional to the dead entries, in batches
        of pipelined commands, so Redis never blocks on one long script.
        """
        return await self._reap(only_worker_id=None)

    async def _reap(self, only_worker_id: str | None) -> ReapResult:
        members = [_text(m) for m in await self._redis.smembers(self.key("registrations"))]
        regs = [split_member(m) for m in members]
        if only_worker_id is not None:
            regs = [reg for reg in regs if reg[0] == only_worker_id]
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id, _ in regs:
                pipe.hget(self._worker_key(worker_id), "generation")
            live_gens = await pipe.execute()
        # NOTE: a dead registration never comes back (generations only grow; publish
        # checks liveness atomically), so reaping it races with nothing.
        dead = [reg for reg, gen in zip(regs, live_gens, strict=True) if _int(gen) != reg[1]]
        num_entries = 0
        for worker_id, generation in dead:
            num_entries += await self._reap_registration(worker_id, generation)
        return ReapResult(len(dead), num_entries)

    async def _reap_registration(self, worker_id: str, generation: int) -> int:
        held_key = self._held_key(worker_id, generation)
        member = f"{worker_id}:{generation}"
        num_entries = 0
        batch: list[str] = []
        async for hash_hex in self._redis.sscan_iter(held_key, count=_REAP_BATCH):
            batch.append(_text(hash_hex))
            if len(batch) >= _REAP_BATCH:
                num_entries += await self._srem_entries(batch, member)
                batch = []
        num_entries += await self._srem_entries(batch, member)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(held_key, self._tier_key(worker_id, generation))
            pipe.srem(self.key("registrations"), member)
            await pipe.execute()
        return num_entries

    async def _srem_entries(self, hashes_hex: Iterable[str], member: str) -> int:
        async with self._redis.pipeline(transaction=False) as pipe:
            for hash_hex in hashes_hex:
                pipe.srem(self._block_key(hash_hex), member)
            return sum(await pipe.execute())

    # -- the events stream, for routers that follow the index in memory ----------------

    async def stream_position(self) -> tuple[int, str]:
        """The events stream's last entry: (its sequence number, its id); (0, "0-0") when
        the stream is empty. One atomic round trip."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self.key("events_seq"))
            pipe.xrevrange(self.key("events"), count=1)
            seq, last = await pipe.execute()
        if not last:
            return (_int(seq) or 0), "0-0"
        entry_id, fields = last[0]
        return int(_field(fields, "n")), _text(entry_id)

    async def live_table(self) -> tuple[str, list[tuple[WorkerInfo, int]]]:
        """Every live worker with the milliseconds left on its lease, and the index's
        epoch: a random id the first caller sets, which a restarted (emptied) Redis no
        longer has, so a router that sees it change knows its view is of another index.
        One round trip."""
        epoch, rows = await self._live(
            [self.key("workers"), self.key("epoch")], [self.key("worker:"), uuid.uuid4().hex]
        )
        table = [(_match_result((r[0], 0, r[2])).worker, int(r[1])) for r in rows]
        return _text(epoch), sorted(table, key=lambda row: row[0].worker_id)

    async def events_seq(self) -> int:
        """The sequence number of the stream's newest entry (0 before the first)."""
        return _int(await self._redis.get(self.key("events_seq"))) or 0

    async def read_events(
        self, after_id: str, block_ms: int, count: int = 1024
    ) -> list[StreamEvent]:
        """The stream's entries after `after_id`, oldest first, waiting up to `block_ms`
        for the first (0: return at once)."""
        reply: Any = await self._redis.xread(
            {self.key("events"): after_id}, count=count, block=block_ms or None
        )
        if not reply:
            return []
        return [_stream_event(entry_id, fields) for entry_id, fields in reply[0][1]]

    async def held(self, registrations: Sequence[tuple[str, int]]) -> list[list[str]]:
        """The blocks (hash hex) each registration published, in one pipelined trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id, generation in registrations:
                pipe.smembers(self._held_key(worker_id, generation))
            replies = await pipe.execute()
        return [[_text(h) for h in reply] for reply in replies]

    async def tiers(self, registrations: Sequence[tuple[str, int]]) -> list[dict[str, str]]:
        """Each registration's blocks held only in a lower tier (hash hex -> "h" or "d"),
        in one pipelined trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id, generation in registrations:
                pipe.hgetall(self._tier_key(worker_id, generation))
            replies = await pipe.execute()
        return [{_text(k): _text(v) for k, v in reply.items()} for reply in replies]

    def _stream_keys(self) -> list[str]:
        return [self.key("events"), self.key("events_seq")]

    def _worker_key(self, worker_id: str) -> str:
        return self._prefix + "worker:" + worker_id

    def _block_key(self, hash_hex: str) -> str:
        return self._prefix + "block:" + hash_hex

    def _held_key(self, worker_id: str, generation: int) -> str:
        return f"{self._prefix}held:{worker_id}:{generation}"

    def _tier_key(self, worker_id: str, generation: int) -> str:
        return f"{self._prefix}tier:{worker_id}:{generation}"


def _load_args(load: Mapping[str, int]) -> list[str | int]:
    """Flattens load gauges into HSET arguments; raises ValueError for a bad field."""
    args: list[str | int] = []
    for name, value in load.items():
        if name in _RESERVED_FIELDS or not name:
            raise ValueError(f"load field name {name!r} is empty or reserved")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"load field {name!r} must be an int, got {value!r}")
        args += [name, value]
    return args


def _match_result(row: Sequence[Any]) -> MatchResult:
    worker_id, matched_blocks, flat = row[:3]
    host, disk = (int(v) for v in row[3:5]) if len(row) >= 5 else (0, 0)
    fields = {_text(k): _text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
    worker = WorkerInfo(
        worker_id=_text(worker_id),
        role=fields.pop("role"),
        address=fields.pop("address"),
        generation=int(fields.pop("generation")),
        kv_format=fields.pop("kv_format", ""),
        load={name: int(value) for name, value in fields.items()},
    )
    return MatchResult(worker, int(matched_blocks), host, disk)


class StreamEvent(NamedTuple):
    """One entry of the events stream.

    kind: "r" (registered: drop the worker's older generations), "p" (published: `ops`),
    "d" (deregistered). member: "worker_id:generation". ops: `OP_LEN` characters each.
    entry_id: Redis's id, "<ms>-<n>", whose first part is Redis's clock at the write.
    """

    seq: int
    kind: str
    member: str
    ops: str
    entry_id: str


def _field(fields: Mapping[Any, Any], name: str) -> str:
    value = fields.get(name)
    if value is None:
        value = fields.get(name.encode())
    return "" if value is None else _text(value)


def _stream_event(entry_id: bytes | str, fields: Mapping[Any, Any]) -> StreamEvent:
    return StreamEvent(
        seq=int(_field(fields, "n")),
        kind=_field(fields, "k"),
        member=_field(fields, "m"),
        ops=_field(fields, "o"),
        entry_id=_text(entry_id),
    )


def split_member(member: str) -> tuple[str, int]:
    """Splits "worker_id:generation"; the id may itself contain ':'."""
    worker_id, _, generation = member.rpartition(":")
    return worker_id, int(generation)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _int(value: bytes | str | None) -> int | None:
    return None if value is None else int(value)
