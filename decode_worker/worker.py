"""A decode worker: takes a prefill worker's KV (or prefills itself), streams tokens.

Framework-free (the Ray Serve deployment wraps it). A request expected to arrive with KV
waits for it as long as the router asks (from its estimate of the prefill), at most
`kv_wait_timeout_s`; a transfer that fails, arrives late, or cannot be admitted (its
prefix evicted meanwhile) falls back to local prefill, so the client sees the same
tokens either way (docs/kv-handoff.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineClosedError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sched.sequence import TokenLogprobs
from pdserve.engine.worker.kv_handoff import KVImportError
from pdserve.kv_transfer.base import KVReceiver, ReceivedKV
from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.torch_payload import received_tensors
from pdserve.runtime.fetch_inbox import FetchInbox, import_fetched, prompt_chain

if TYPE_CHECKING:  # ray is imported only where ranks are actors
    from pdserve.runtime.tp_ranks import RankReceivers

logger = logging.getLogger(__name__)


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of a parallel-sampling request (0: the request's
    own id)."""
    return request_id if index == 0 else f"{request_id}-c{index}"


def choice_index(request_id: str, output_id: str) -> int:
    """Which choice of `request_id` an engine output of id `output_id` belongs to."""
    return 0 if output_id == request_id else int(output_id.rsplit("-c", 1)[1])


class DecodeWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        kv_wait_timeout_s: float = 10.0,
        ranks: RankReceivers | None = None,
    ) -> None:
        """`ranks`: a tensor-parallel replica's other ranks, each with its own receiver
        for its own KV heads (runtime/tp_ranks.py); `receiver` is rank 0's."""
        self.engine = engine
        self.receiver = receiver
        self.ranks = ranks
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.num_local_fallbacks = 0
        self.fetches = FetchInbox(engine, receiver, kv_wait_timeout_s)

    async def start(self, start_ranks: Any = None) -> str:
        """Start the transfer receiver(s); return the address announced in the index.

        `start_ranks(local_address)`: with tensor parallelism, starts the other ranks'
        receivers and returns the replica's address (`RankReceivers.start`)."""
        address = await self.receiver.start()
        if start_ranks is not None:
            address = str(await start_ranks(address))
        return address

    def kv_wait(self, wait_s: float | None) -> float:
        """How long to wait for a request's KV: `wait_s`, at most `kv_wait_timeout_s`."""
        return self.fetches.wait_s(wait_s)

    def expect_kv(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        wait_s: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Register a request whose KV a prefill worker will push (before it is told to).

        The receiver takes only this model's KV of this prompt: the push's model id and
        block hashes must match this engine's model id and the prompt's hash chain
        (else KVMismatchError, and the request is prefilled here). `cache_salt`: the
        request's (its params'): the chain is salted with it, as the prefill worker's is;
        `lora`: its LoRA adapter, whose blocks hash in a namespace of their own and
        whose KV crosses under the adapter's model id (`LLMEngine.kv_model_id`).
        """
        chain = self._chain(prompt_token_ids, cache_salt, lora)
        engine = self.engine.engine
        self.receiver.expect(
            request_id,
            self.kv_wait(wait_s),
            model_id=engine.kv_model_id(lora),
            block_hashes=chain,
        )

    def _chain(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, lora: str | None = None
    ) -> list[bytes]:
        """The prompt's block-hash chain in the request's namespace."""
        # immutable settings only: safe off the engine thread
        return prompt_chain(self.engine.engine, prompt_token_ids, cache_salt, lora)

    async def expect_kv_all(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        wait_s: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """`expect_kv` on every rank (awaited: no part may arrive before its rank expects
        it). Raises TransferError, nothing expected anywhere, when a rank refuses."""
        self.expect_kv(request_id, prompt_token_ids, wait_s, cache_salt, lora)
        if self.ranks is None:
            return
        engine = self.engine.engine
        chain = self._chain(prompt_token_ids, cache_salt, lora)
        try:
            model_id = engine.kv_model_id(lora)
            await self.ranks.expect(request_id, self.kv_wait(wait_s), model_id, chain)
        except Exception as exc:
            self.cancel_kv(request_id)
            if isinstance(getattr(exc, "cause", None), TransferError):
                raise exc.cause from exc  # type: ignore[attr-defined]
            raise TransferError(f"a tensor-parallel rank cannot expect KV: {exc!r}") from exc

    def cancel_kv(self, request_id: str) -> None:
        """Forget `request_id`'s KV on every rank: what arrived or arrives is freed.

        With tensor parallelism the other ranks' claimed parts are dropped by the driver,
        down the step socket (after an import it sent, if any: then there is nothing left
        to drop), never by their actors, which could overtake it."""
        self.receiver.cancel(request_id)
        if self.ranks is not None:
            self.ranks.cancel(request_id)
            with contextlib.suppress(EngineClosedError):  # a closed engine holds nothing
                self.engine.submit(lambda e: e.drop_kv(request_id))

    def expect_fetch(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_blocks: int,
        wait_s: float | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Register a peer fetch of the prompt's first `num_blocks` full blocks for
        `request_id` (its KV arrives under `fetch_id(request_id)`, from the worker that
        holds them, pushed when the router tells it). Raises TransferError with tensor
        parallelism (a fetch moves one rank's KV) or when the id is expected already."""
        if self.ranks is not None:
            raise TransferError("a peer fetch does not run with tensor parallelism")
        self.fetches.expect(request_id, prompt_token_ids, num_blocks, wait_s, cache_salt, lora)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        info: dict[str, Any] | None = None,
        kv_wait_s: float | None = None,
        fetch_blocks: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the first one is prefill's token when KV came.

        With `params.n` > 1 (parallel sampling) the outputs of every choice come on this
        stream, each naming its choice's engine id (`choice_id`; `choice_index` maps it
        back): the prompt is imported (or prefilled) once, as choice 0, and the other
        choices fork over its blocks (`LLMEngine.fork_request`).

        `info`, if given, is filled before the first output: "kv_used" (the pushed KV
        was admitted), "first_block" (leading blocks taken from this worker's own cache),
        "ready_s" (time.monotonic() when the KV was claimed, or the call began) and, when
        expected KV was not used, "kv_error" (why: the claim's TransferError or the
        import's KVImportError; the deployment logs and reports it); "kv_bytes" and
        "kv_blocks" when KV was received (tracing).

        `fetch_blocks` (a request that computes its prompt here, `expect_fetch` called):
        the prompt's first blocks come from a peer instead; "fetch" in `info` says what
        became of them: "used" ("fetched_blocks" written), or "fetch_error" holds why
        not (the claim's TransferError, the import's KVImportError), and the prompt is
        computed here as it would have been without the fetch.
        """
        info = {} if info is None else info
        # parallel sampling: choice i (ids `choice_id`) seeded as SamplingParams.choice_params
        n = params.n
        choices_params = [params.choice_params(i) for i in range(n)]
        choice_ids = [choice_id(request_id, i) for i in range(1, n)]
        params = choices_params[0]
        received = await self._claim(request_id, info, kv_wait_s) if kv_expected else None
        fetched = None
        if fetch_blocks and not kv_expected:
            fetched = await self.fetches.claim(request_id, info, kv_wait_s)
        info.update(kv_used=False, first_block=0, ready_s=time.monotonic())
        if received is not None:
            info.update(kv_bytes=received.stats.num_bytes, kv_blocks=received.header.num_blocks)

        payload: list[tuple[Any, Any]] = []
        if received is not None:
            payload = received_tensors(received)
            staging = self.engine.engine.kv_staging
            if staging.on_cuda:  # pinned for an asynchronous import, off the engine thread
                payload = await asyncio.to_thread(
                    lambda: [(heads, staging.pin_for_import(t)) for heads, t in payload]
                )

        def start(engine: LLMEngine) -> RequestOutput | None:
            if received is not None:
                header = received.header
                first_lp = None
                if header.first_token_logprob is not None:
                    first_lp = TokenLogprobs(
                        header.first_token,
                        header.first_token_logprob,
                        header.first_token_top_logprobs,
                    )
                try:
                    first = engine.add_prefilled_request(
                        request_id,
                        prompt_token_ids,
                        header.first_token,
                        params,
                        payload,
                        first_block=header.first_block_index,
                        stream=True,
                        first_logprobs=first_lp,
                    )
                    info.update(kv_used=True, first_block=header.first_block_index)
                    return first
                except KVImportError as exc:
                    info["kv_error"] = exc
                    logger.debug("%s: arrived KV unusable (%s); prefilling here", request_id, exc)
            if kv_expected:  # the KV never came, or could not be used
                self.num_local_fallbacks += 1
            if fetched is not None:
                import_fetched(engine, request_id, fetched, prompt_token_ids, params, info)
            engine.add_request(request_id, prompt_token_ids, params, stream=True)
            return None

        def start_choices(engine: LLMEngine) -> RequestOutput | None:
            """Choice 0 is the request itself (its KV imported, or prefilled here); the
            others fork over its prompt blocks once they are computed. A choice 0 whose
            imported first token ended it (max_tokens 1, a stop) left nothing to fork
            from: the others are then requests of the same prompt, whose blocks it just
            cached, each computing what a fork would (LLMEngine.fork_request)."""
            first = start(engine)
            for i in range(1, n):
                child, child_params = choice_ids[i - 1], choices_params[i]
                if first is not None and first.finished:
                    engine.add_request(child, prompt_token_ids, child_params, stream=True)
                else:
                    engine.fork_request(request_id, child, child_params, True)
            return first

        # the import is done with the received buffer once `start` has run (a pinned copy
        # goes on on its own: engine/worker/kv_staging.py), so the buffer can go back then
        held = [r for r in (received, fetched) if r is not None]

        def release() -> None:
            for r in held:
                r.release()

        # coalesce: a stream that falls behind sends several tokens per message
        if n == 1:
            stream = self.engine.stream(request_id, start, on_started=release, coalesce=True)
        else:
            stream = self.engine.stream(
                request_id, start_choices, on_started=release, choices=choice_ids
            )
        async for out in stream:
            yield out

    async def _claim(
        self, request_id: str, info: dict[str, Any], wait_s: float | None
    ) -> ReceivedKV | None:
        """This rank's received KV, once every rank has claimed its own (None, all of it
        dropped, when any claim failed: the request is prefilled here)."""
        timeout = self.kv_wait(wait_s)
        if self.ranks is None:
            try:
                return await self.receiver.claim(request_id, timeout)
            except TransferError as exc:
                info["kv_error"] = exc
                logger.debug("%s: no usable KV (%s); prefilling here", request_id, exc)
                return None
        ranks = self.ranks
        results: list[Any] = list(
            await asyncio.gather(
                self.receiver.claim(request_id, timeout),
                ranks.claim(request_id, timeout),
                return_exceptions=True,
            )
        )
        mine, theirs = results
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled: the caller's finally cancels the KV
        error: Exception | None = next((r for r in results if isinstance(r, Exception)), None)
        if error is None:
            header = mine.header
            agree = all(
                (c["first_block"], c["num_blocks"], c["first_token"])
                == (header.first_block_index, header.num_blocks, header.first_token)
                for c in theirs
            )
            if agree:
                others = sum(c["num_bytes"] for c in theirs)
                mine.stats = dataclasses.replace(
                    mine.stats, num_bytes=mine.stats.num_bytes + others
                )
                return mine
            error = TransferError(f"{request_id}: the ranks' KV parts disagree: {theirs}")
        if isinstance(mine, ReceivedKV):
            mine.release()
        self.cancel_kv(request_id)
        info["kv_error"] = error
        logger.debug("%s: no usable KV (%s); prefilling here", request_id, error)
        return None

    async def close(self) -> None:
        await self.receiver.close()
        if self.ranks is not None:
            await self.ranks.close()
