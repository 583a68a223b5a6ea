"""Peer fetch between two decode workers in one process (no Ray): the holder pushes a
prompt's prefix over a KV transport, the receiver imports it and computes the rest.

Its tokens must be those of computing the whole prompt (transformers'), and each way a
fetch can fail leaves the receiver computing the prompt with the same tokens and the
reason in its info: the router told it to stop waiting (the holder's push failed or the
holder died), nothing came in time, the holder lost the blocks, the bytes were damaged
on the way. The transports are the loopback one (every check of the receiver's core)
and real gRPC and UCX on 127.0.0.1, in float32 and with an 8-bit KV cache.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.messages import fetch_id
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.base import KVReceiver, KVSender, ReceiverConfig
from pdserve.kv_transfer.errors import (
    ChecksumMismatchError,
    NotHeldError,
    TransferError,
    TransferTimeoutError,
    UnknownRequestError,
)
from pdserve.kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from pdserve.kv_transfer.torch_payload import layout_of
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.runtime.fetch_inbox import FetchInbox
from pdserve.runtime.prefix_push import push_prefix

TOKEN = "cluster-token"
BLOCK = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
WITHIN_S = 60.0  # a wait no loaded CI machine outlasts, for KV that will come


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


def _conversation() -> tuple[list[int], list[int]]:
    rng = random.Random(23)
    history = [rng.randrange(3, 512) for _ in range(83)]  # 10 full blocks
    return history, [*history, *(rng.randrange(3, 512) for _ in range(7))]


class Pair:
    """A holder and a receiver, each a DecodeWorker over its own engine."""

    def __init__(self, holder: DecodeWorker, receiver: DecodeWorker, sender: KVSender):
        self.holder, self.receiver, self.sender = holder, receiver, sender
        self.address = ""

    async def serve(
        self, request_id: str, prompt: list[int], fetch_blocks: int = 0, wait_s: float = WITHIN_S
    ) -> tuple[list[int], dict[str, Any]]:
        """The receiver's tokens for `prompt`, and its info (a fetch expected already)."""
        info: dict[str, Any] = {}
        last = None
        stream = self.receiver.generate(
            request_id, prompt, GREEDY, info=info, kv_wait_s=wait_s, fetch_blocks=fetch_blocks
        )
        async for out in stream:
            last = out
        assert last is not None
        return last.token_ids, info

    async def serve_on_holder(self, prompt: list[int]) -> None:
        """The holder serves `prompt` to its end: its blocks stay in its prefix cache."""

        def add(engine: LLMEngine) -> None:
            engine.add_request("h", prompt, GREEDY)

        async for _ in self.holder.engine.stream("h", add):
            pass

    async def push(self, request_id: str, prompt: list[int], num_blocks: int) -> Any:
        """The holder's push (runtime/prefix_push.py), as its replica makes it."""
        engine = self.holder.engine
        layout = layout_of(engine.engine.runner.kv_cache, engine.engine.config.kv_cache_dtype)
        fetch = fetch_id(request_id)
        return await push_prefix(
            engine, self.sender, layout, TOKEN, fetch, prompt, num_blocks, 0, self.address
        )


def _engine(model_dir: Path, kv_dtype: str = "auto") -> AsyncEngine:
    config = EngineConfig(
        dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_cache_dtype=kv_dtype
    )
    return AsyncEngine(LLMEngine(model_dir, config))


@asynccontextmanager
async def pair(
    model_dir: Path,
    receiver: Callable[[ReceiverConfig], KVReceiver],
    sender: KVSender,
    kv_dtype: str = "auto",
) -> AsyncIterator[Pair]:
    engines = [_engine(model_dir, kv_dtype), _engine(model_dir, kv_dtype)]
    layout = layout_of(engines[1].engine.runner.kv_cache, engines[1].engine.config.kv_cache_dtype)
    config = ReceiverConfig(TOKEN, layout, host="127.0.0.1")
    unused = LoopbackReceiver(LoopbackHub(), config)
    holder = DecodeWorker(engines[0], unused, kv_wait_timeout_s=WITHIN_S)
    recv = DecodeWorker(engines[1], receiver(config), kv_wait_timeout_s=WITHIN_S)
    p = Pair(holder, recv, sender)
    p.address = await recv.start()
    try:
        yield p
        assert recv.receiver.num_pending == 0
        for e in engines:
            e.engine.block_pool.check_no_leaks()
    finally:
        await recv.close()
        await sender.close()
        for e in engines:
            await e.close()


def _loopback() -> tuple[Callable[[ReceiverConfig], KVReceiver], KVSender]:
    hub = LoopbackHub()
    return (lambda config: LoopbackReceiver(hub, config)), LoopbackSender(hub)


def _transport(name: str) -> tuple[Callable[[ReceiverConfig], KVReceiver], KVSender]:
    if name == "loopback":
        return _loopback()
    return (lambda config: make_receiver(name, config)), make_sender(name)


@pytest.mark.parametrize(
    ("transport", "kv_dtype"),
    [("loopback", "auto"), ("grpc", "auto"), ("ucx", "auto"), ("grpc", "int8"), ("ucx", "int8")],
)
def test_a_fetched_prefix_serves_the_reference_tokens(
    model_dir: Path, hf_greedy: Any, transport: str, kv_dtype: str
) -> None:
    history, turn = _conversation()
    quantized = {} if kv_dtype == "auto" else {"kv_cache_dtype": kv_dtype}
    reference = hf_greedy(model_dir, [turn], MAX_TOKENS, **quantized)[0]

    async def run() -> None:
        async with pair(model_dir, *_transport(transport), kv_dtype=kv_dtype) as p:
            # the holder served the history; the receiver never saw it
            await p.serve_on_holder([*history, 1])
            n = (len(turn) - 1) // BLOCK
            p.receiver.expect_fetch("r", turn, n)
            served = asyncio.create_task(p.serve("r", turn, fetch_blocks=n))
            stats = await p.push("r", turn, n)
            tokens, info = await served
            assert tokens == reference
            assert info["fetch"] == "used" and info["fetched_blocks"] == 10
            assert stats.num_blocks == 10 and stats.num_bytes == info["fetch_bytes"]

    asyncio.run(asyncio.wait_for(run(), 120))


def _serve_without(
    model_dir: Path, hf_greedy: Any, act: Callable[[Pair, int], Any], wait_s: float = WITHIN_S
) -> dict[str, Any]:
    """Serve the turn with a fetch that `act(pair, num_blocks)` spoils; assert the
    reference tokens; return the receiver's info."""
    _, turn = _conversation()
    reference = hf_greedy(model_dir, [turn], MAX_TOKENS)[0]

    async def run() -> dict[str, Any]:
        async with pair(model_dir, *_loopback()) as p:
            n = (len(turn) - 1) // BLOCK
            p.receiver.expect_fetch("r", turn, n, wait_s=wait_s)
            served = asyncio.create_task(p.serve("r", turn, fetch_blocks=n, wait_s=wait_s))
            await act(p, n)
            tokens, info = await served
            assert tokens == reference
            assert "fetch" not in info and info.get("fetched_blocks", 0) == 0
            return info

    return asyncio.run(asyncio.wait_for(run(), 120))


def test_a_holder_that_fails_mid_fetch_leaves_the_receiver_computing(
    model_dir: Path, hf_greedy: Any
) -> None:
    """The router, seeing the holder's push fail (or the holder die), tells the receiver
    to stop waiting: it computes the prompt at once, and says why."""

    async def holder_failed(p: Pair, n: int) -> None:
        p.receiver.cancel_kv(fetch_id("r"))

    info = _serve_without(model_dir, hf_greedy, holder_failed)
    assert isinstance(info["fetch_error"], UnknownRequestError)


def test_a_fetch_that_never_comes_is_waited_out(model_dir: Path, hf_greedy: Any) -> None:
    async def nothing(p: Pair, n: int) -> None:
        return None

    info = _serve_without(model_dir, hf_greedy, nothing, wait_s=0.2)
    assert isinstance(info["fetch_error"], TransferTimeoutError)


def test_a_holder_that_lost_the_blocks_sends_nothing(model_dir: Path, hf_greedy: Any) -> None:
    async def evicted(p: Pair, n: int) -> None:
        with pytest.raises(NotHeldError):  # it never held them: as if evicted
            await p.push("r", _conversation()[1], n)
        p.receiver.cancel_kv(fetch_id("r"))  # what the router does with that error

    info = _serve_without(model_dir, hf_greedy, evicted)
    assert isinstance(info["fetch_error"], UnknownRequestError)


def test_damaged_bytes_are_refused_and_computed(model_dir: Path, hf_greedy: Any) -> None:
    """A block corrupted on the way fails its checksum: the sender hears it, and the
    receiver computes the prompt."""
    history, turn = _conversation()

    async def corrupt(p: Pair, n: int) -> None:
        await p.serve_on_holder([*history, 1])
        real = p.sender

        class Flipping(LoopbackSender):
            async def send(self, address: str, header: Any, payload: Any, **kw: Any) -> Any:
                damaged = bytearray(memoryview(payload).cast("B"))
                damaged[len(damaged) // 2] ^= 0xFF
                return await real.send(address, header, bytes(damaged), **kw)

        p.sender = Flipping(LoopbackHub())
        with pytest.raises(TransferError) as caught:
            await p.push("r", turn, n)
        assert isinstance(caught.value, ChecksumMismatchError)

    info = _serve_without(model_dir, hf_greedy, corrupt)
    assert isinstance(info["fetch_error"], ChecksumMismatchError)


@pytest.mark.parametrize(("transport", "kv_dtype"), [("loopback", "auto"), ("grpc", "int8")])
def test_a_prefill_worker_fetches_the_prefix_then_prefills_and_pushes_the_rest(
    model_dir: Path, hf_greedy: Any, transport: str, kv_dtype: str
) -> None:
    """Disaggregated: the holder (a decode worker that served the history) pushes the
    history's blocks to a prefill worker's receiver; the prefill worker writes them into
    its pool, computes only the rest of the prompt, and pushes the prompt's KV to the
    decode worker, which streams the reference tokens."""
    history, turn = _conversation()
    quantized = {} if kv_dtype == "auto" else {"kv_cache_dtype": kv_dtype}
    reference = hf_greedy(model_dir, [turn], MAX_TOKENS, **quantized)[0]

    async def run() -> None:
        make_recv, sender = _transport(transport)
        async with pair(model_dir, make_recv, sender, kv_dtype=kv_dtype) as p:
            await p.serve_on_holder([*history, 1])
            # the prefill worker: an engine of its own, with a receiver for fetches
            p_engine = _engine(model_dir, kv_dtype)
            layout = layout_of(p_engine.engine.runner.kv_cache, kv_dtype)
            p_recv = make_recv(ReceiverConfig(TOKEN, layout, host="127.0.0.1"))
            inbox = FetchInbox(p_engine, p_recv, WITHIN_S)
            prefill = PrefillWorker(p_engine, sender, TOKEN, fetches=inbox)
            try:
                d_address, p.address = p.address, await p_recv.start()  # the holder pushes to P
                n = (len(turn) - 1) // BLOCK
                inbox.expect("r", turn, n)
                p.receiver.expect_kv("r", turn, WITHIN_S)

                async def decode() -> list[int]:
                    stream = p.receiver.generate("r", turn, GREEDY, kv_expected=True)
                    return [out async for out in stream][-1].token_ids

                served = asyncio.create_task(decode())
                stats = await p.push("r", turn, n)
                info: dict[str, Any] = {}
                result = await prefill.prefill("r", turn, GREEDY, d_address, 0, n, WITHIN_S, info)
                assert await served == reference
                # the holder has the history's 10 full blocks of the 11 asked for
                assert info["fetch"] == "used" and info["fetched_blocks"] == 10 == stats.num_blocks
                assert result.num_cached_tokens == 10 * BLOCK  # computed only the rest
                assert p_recv.num_pending == 0
                p_engine.engine.block_pool.check_no_leaks()
            finally:
                await p_recv.close()
                await p_engine.close()

    asyncio.run(asyncio.wait_for(run(), 120))
