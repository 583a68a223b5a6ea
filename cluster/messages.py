"""What crosses between the router and the workers: one module of message types.

Every message is a plain dict on the wire (Ray pickles it between processes) and a
`TypedDict` here, so mypy checks both ends against one declaration while the bytes stay
what they were: a router and workers of two adjacent versions still understand each
other during a rolling upgrade, and the per-token path builds no objects of its own.
Optional keys are `NotRequired`; a reader uses `.get` for them.

The decode worker (`decode_worker/deployment.py`) answers a submit with `Accepted` (or
`NoChannel` when the router's channel to it is gone), says `ChannelHello` first on each
token channel, then sends one `OutputItem` per engine step that produced tokens (the
first carries `FirstItemExtras`) or one `ErrorItem`. The prefill worker answers a
prefill call with a `PrefillReport`. Both report their load as `LoadReport`: its index
gauges (each heartbeat, `runtime/index_member.py`) and the exact state `/workers` asks for.

The handles are `Protocol`s over what the router calls (`DecodeHandle`,
`PrefillHandle`): a Ray Serve `DeploymentHandle` in a cluster, an in-process fake in the
router's unit tests. Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, Protocol, TypedDict


def fetch_id(request_id: str) -> str:
    """The transfer id of a request's peer fetch (the KV of its own prefill, if any,
    crosses under the request's id)."""
    return f"{request_id}#fetch"


# -- decode worker -> router -------------------------------------------------------------


class ChannelHello(TypedDict):
    """A token channel's first message: which decode replica the router reached."""

    type: Literal["channel"]
    worker_id: str


class Accepted(TypedDict):
    """The decode replica took the request; with `kv_expected`, its receiver at
    `address` waits for the prompt's KV (only then may the prefill worker push)."""

    type: Literal["accepted"]
    kv_expected: bool
    worker_id: str
    address: str
    # the receiver expects a peer fetch of the prompt's first blocks (the router then
    # tells the holder to push them to `address`)
    fetch_expected: NotRequired[bool]


class NoChannel(TypedDict):
    """The submit named a channel this replica does not hold (it ended or broke)."""

    type: Literal["no_channel"]
    worker_id: str


SubmitReply = Accepted | NoChannel

# (token id, logprob, top [(token id, logprob), ...]) per new token
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


class ClientItem(TypedDict):
    """What the HTTP layer reads of an output item, and all that the result cache
    (`router/result_cache.py`) stores and replays of one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None  # this choice's
    index: NotRequired[int]  # the choice, with n > 1
    logprobs: NotRequired[list[TokenLogprob]]
    cached_tokens: NotRequired[int]  # set by the router: prompt tokens a prefix cache served


class OutputItem(ClientItem):
    """One engine step's new tokens for one request (one choice of it with `n` > 1).

    The first item of an attempt also carries `FirstItemExtras`' keys."""

    type: Literal["output"]
    finished: bool  # the whole request's
    num_output_tokens: int
    # FirstItemExtras, on an attempt's first item
    kv_used: NotRequired[bool]
    num_prompt_tokens: NotRequired[int]
    num_cached_tokens: NotRequired[int]
    decode_queue_s: NotRequired[float]
    local_prefill_s: NotRequired[float]
    local_prefill: NotRequired[str]  # why expected KV was not used
    fetch: NotRequired[str]  # what became of a peer fetch (FirstItemExtras)
    fetched_blocks: NotRequired[int]


class FirstItemExtras(TypedDict):
    """What the first output item of an attempt adds: where its prompt was prefilled and
    how long it queued and computed on the decode worker."""

    kv_used: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    decode_queue_s: float
    local_prefill_s: float


class FetchAccepted(TypedDict):
    """A prefill replica's answer to `expect_fetch`: whether its receiver (at `address`)
    expects the fetch for the `prefill` call that follows."""

    worker_id: str
    address: str
    fetch_expected: bool


class FetchReport(TypedDict):
    """A holder's answer to `push_prefix`: what it sent of the prefix, and how fast."""

    worker_id: str
    num_blocks: int
    num_bytes: int
    seconds: float


class ErrorItem(TypedDict):
    """Serving the request failed on the decode replica (the router may resume it, unless
    `invalid`: the engine refused the request itself, e.g. it names a LoRA adapter
    unloaded meanwhile; another attempt would be refused alike, so the client gets a 400)."""

    type: Literal["error"]
    message: str
    invalid: NotRequired[bool]
    # the replica is leaving its pool and its drain deadline passed (cluster/drain.py):
    # the router resumes the request elsewhere, as after a failure, and counts it
    migrate: NotRequired[bool]


class LoRAReply(TypedDict):
    """A worker replica's answer to `load_lora` / `unload_lora` (docs/lora.md): `error`
    says why not (None: done); `in_use`: an unload refused while requests run with it."""

    worker_id: str
    error: str | None
    in_use: NotRequired[bool]
    unreachable: NotRequired[bool]  # the call itself failed (router side)


StreamItem = OutputItem | ErrorItem

# -- prefill worker -> router --------------------------------------------------------------


class PrefillReport(TypedDict):
    """The prefill worker's answer once the prompt's KV is pushed: the counts and stage
    times the router's metrics and its prefill-rate estimates (`disagg.RateBook`) read."""

    worker_id: str
    first_token: int
    num_prompt_tokens: int
    num_cached_tokens: int  # served by the prefill worker's own prefix cache
    num_blocks_sent: int
    transfer_bytes: int
    transfer_s: float
    queue_s: float
    compute_s: float
    pack_s: float
    # a peer fetch's outcome (`pdserve_kv_fetch_total{outcome}`), when one was expected
    fetch: NotRequired[str]
    fetched_blocks: NotRequired[int]


# -- either worker -> router (heartbeats, /workers) ------------------------------------------


class IndexLoad(TypedDict):
    """The integer gauges each heartbeat publishes to the index (`LLMEngine.load`, plus
    each role's own: `pending_transfers` on decode, `prefill_tokens_per_s` on prefill),
    what placement reads. Engines add keys of their own (TP, speculative decoding), so
    this is the floor, not the whole."""

    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int


class LoadReport(IndexLoad):
    """A worker's exact live state (`/workers`, tests, benchmarks): its gauges and who
    it is."""

    worker_id: str
    role: Literal["prefill", "decode"]
    generation: int
    pid: int
    kv_format: str
    pending_transfers: NotRequired[int]
    local_prefill_fallbacks: NotRequired[int]
    prefill_tokens_per_s: NotRequired[int]
    tensor_parallel: NotRequired[dict[str, Any]]


class WorkerState(TypedDict):
    """One row of the router's `/workers`: who the index says is live, and the worker's
    own `LoadReport` keys when it answered (`answered_by`: the replica that did, another
    one of its pool when the worker is gone), else `error`."""

    worker_id: str
    role: str
    address: str
    answered_by: NotRequired[str | None]
    error: NotRequired[str]


# -- the handles the router calls ------------------------------------------------------------


class RemoteMethod(Protocol):
    """`handle.method`: `.remote(...)` returns an awaitable (a Serve response) or, for a
    streaming call, an async iterator."""

    def remote(self, *args: Any, **kwargs: Any) -> Any: ...


class WorkerHandle(Protocol):
    """What the router calls on either pool's deployment (runtime/replica.py)."""

    @property
    def push_prefix(self) -> RemoteMethod: ...
    @property
    def load_lora(self) -> RemoteMethod: ...
    @property
    def unload_lora(self) -> RemoteMethod: ...
    @property
    def load(self) -> RemoteMethod: ...


class DecodeHandle(WorkerHandle, Protocol):
    """What the router calls on the decode deployment (decode_worker/deployment.py)."""

    @property
    def channel(self) -> RemoteMethod: ...
    @property
    def submit(self) -> RemoteMethod: ...
    @property
    def abort(self) -> RemoteMethod: ...
    @property
    def cancel_kv(self) -> RemoteMethod: ...

    def options(self, *, stream: bool = ...) -> DecodeHandle: ...


class PrefillHandle(WorkerHandle, Protocol):
    """What the router calls on the prefill deployment (prefill_worker/deployment.py)."""

    @property
    def prefill(self) -> RemoteMethod: ...
    @property
    def expect_fetch(self) -> RemoteMethod: ...
    @property
    def cancel_kv(self) -> RemoteMethod: ...
