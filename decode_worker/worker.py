"""A decode worker: takes a prefill worker's KV (or prefills itself), streams tokens.

Framework-free (the Ray Serve deployment wraps it). A request expected to arrive with KV
waits for it as long as the router asks (from its estimate of the prefill), at most
`kv_wait_timeout_s`; a transfer that fails, arrives late, or cannot be admitted (its
prefix evicted meanwhile) falls back to local prefill, so the client sees the same
tokens either way (docs/kv-handoff.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.hashing import hash_block_chain
from pdserve.engine.kv_handoff import KVImportError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs
from pdserve.kv_transfer.base import KVReceiver, ReceivedKV
from pdserve.kv_transfer.errors import TransferError
from pdserve.kv_transfer.torch_payload import payload_tensor

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self, engine: AsyncEngine, receiver: KVReceiver, kv_wait_timeout_s: float = 10.0
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.num_local_fallbacks = 0

    async def start(self) -> str:
        """Start the transfer receiver; return its address (announced in the index)."""
        return await self.receiver.start()

    def kv_wait(self, wait_s: float | None) -> float:
        """How long to wait for a request's KV: `wait_s`, at most `kv_wait_timeout_s`."""
        return self.kv_wait_timeout_s if wait_s is None else min(wait_s, self.kv_wait_timeout_s)

    def expect_kv(
        self, request_id: str, prompt_token_ids: Sequence[int], wait_s: float | None = None
    ) -> None:
        """Register a request whose KV a prefill worker will push (before it is told to).

        The receiver takes only this model's KV of this prompt: the push's model id and
        block hashes must match this engine's model id and the prompt's hash chain
        (else KVMismatchError, and the request is prefilled here).
        """
        engine = self.engine.engine  # immutable settings only: safe off the engine thread
        chain = hash_block_chain(prompt_token_ids, engine.config.block_size, engine.hash_namespace)
        self.receiver.expect(
            request_id, self.kv_wait(wait_s), model_id=engine.model_id, block_hashes=chain
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        info: dict[str, Any] | None = None,
        kv_wait_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the first one is prefill's token when KV came.

        `info`, if given, is filled before the first output: "kv_used" (the pushed KV
        was admitted), "first_block" (leading blocks taken from this worker's own cache),
        "ready_s" (time.monotonic() when the KV was claimed, or the call began) and, when
        expected KV was not used, "kv_error" (why: the claim's TransferError or the
        import's KVImportError; the deployment logs and reports it); "kv_bytes" and
        "kv_blocks" when KV was received (tracing).
        """
        info = {} if info is None else info
        received = await self._claim(request_id, info, kv_wait_s) if kv_expected else None
        info.update(kv_used=False, first_block=0, ready_s=time.monotonic())
        if received is not None:
            info.update(kv_bytes=received.stats.num_bytes, kv_blocks=received.header.num_blocks)

        def start(engine: LLMEngine) -> RequestOutput | None:
            if received is not None:
                header = received.header
                payload = payload_tensor(received.payload, header.layout)
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
            engine.add_request(request_id, prompt_token_ids, params, stream=True)
            return None

        # the import copies the payload into the cache synchronously (engine/kv_staging.py),
        # so the received buffer can go back as soon as `start` has run
        release = received.release if received is not None else None
        # coalesce: a stream that falls behind sends several tokens per message
        stream = self.engine.stream(request_id, start, on_started=release, coalesce=True)
        async for out in stream:
            yield out

    async def _claim(
        self, request_id: str, info: dict[str, Any], wait_s: float | None
    ) -> ReceivedKV | None:
        try:
            return await self.receiver.claim(request_id, self.kv_wait(wait_s))
        except TransferError as exc:
            info["kv_error"] = exc
            logger.debug("%s: no usable KV (%s); prefilling here", request_id, exc)
            return None

    async def close(self) -> None:
        await self.receiver.close()
