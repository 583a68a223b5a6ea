"""The decode role as a Ray Serve deployment.

Each replica runs a KV receiver on its own port (announced in the prefix index as its
address), takes requests that wait for their KV under a lease, runs continuous batching
with preemption, and streams outputs back to the router (a Ray Serve streaming call).
A transfer that fails, arrives late or is cancelled by the router makes it prefill the
request locally; colocated mode always does. KV events go to the index.

Stream items are plain dicts (the router imports no torch): first
`{"type": "accepted", "kv_expected": bool, "worker_id": str}` once the receiver expects
the request (only then may the prefill worker push), then one `{"type": "output", ...}`
per step that produced tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.cluster.replica import WorkerReplica, resolve_transfer_host
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import make_receiver
from pdserve.kv_transfer.base import ReceiverConfig
from pdserve.kv_transfer.torch_payload import layout_of


class DecodeServer(WorkerReplica):
    role = "decode"

    # Ray Serve awaits an async constructor (type checkers want __init__ to be sync).
    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]
        super().__init__(config)
        cfg = self.config
        receiver = make_receiver(
            cfg.transport,
            ReceiverConfig(
                cluster_token=cfg.cluster_token,
                layout=layout_of(self.engine.engine.runner.kv_cache),
                host=resolve_transfer_host(cfg.transfer_host),
                max_lease_s=max(cfg.kv_wait_timeout_s, 1.0),
                expect_timeout_s=cfg.kv_wait_timeout_s,
            ),
            tls=cfg.transfer_tls(),
        )
        self.worker = DecodeWorker(self.engine, receiver, cfg.kv_wait_timeout_s)
        self.address = await self.worker.start()
        await self.join_index(self.address)

    def expects_kv(self, target_replica: str | None) -> bool:
        return self.config.mode == "disagg" and target_replica == self.worker_id

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_expected: bool = False,
        target_replica: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream a request. KV is awaited only if the router placed it here for a push."""
        kv_expected = kv_expected and self.expects_kv(target_replica)
        if kv_expected:
            self.worker.expect_kv(request_id, prompt_token_ids)
        try:
            yield {"type": "accepted", "kv_expected": kv_expected, "worker_id": self.worker_id}
            info: dict[str, Any] = {}
            first = True
            async for out in self.worker.generate(
                request_id, prompt_token_ids, params, kv_expected, info
            ):
                item = _output_item(out)
                if first:
                    item.update(_first_item_extras(out, info, self.config.block_size))
                    first = False
                if out.finished:
                    await self.flush_events()
                yield item
        finally:
            if kv_expected:
                self.worker.receiver.cancel(request_id)  # idempotent; frees late KV

    async def cancel_kv(self, request_id: str, target_replica: str | None = None) -> None:
        """The prefill for `request_id` failed: stop waiting and prefill locally now."""
        self.worker.receiver.cancel(request_id)

    async def load(self, target_replica: str | None = None) -> dict[str, Any]:
        load = await super().load(target_replica)
        return {
            **load,
            "pending_transfers": self.worker.receiver.num_pending,
            "local_prefill_fallbacks": self.worker.num_local_fallbacks,
        }

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await self.worker.close()
        await self.shutdown()


def _output_item(out: RequestOutput) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "output",
        "token_ids": out.new_token_ids,
        "text": out.new_text,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "num_output_tokens": len(out.token_ids),
    }
    if out.logprobs is not None:
        new = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :]
        item["logprobs"] = [(lp.token_id, lp.logprob, list(lp.top)) for lp in new]
    return item


def _first_item_extras(out: RequestOutput, info: dict[str, Any], block_size: int) -> dict[str, Any]:
    now = time.monotonic()
    ready = info.get("ready_s", now)
    if info.get("kv_used"):
        # Prompt blocks this worker already held (not sent); prefill happened elsewhere.
        cached, queue_s, compute_s = info["first_block"] * block_size, now - ready, 0.0
    else:
        scheduled = out.first_scheduled_s or ready
        cached = out.num_cached_tokens
        queue_s, compute_s = max(scheduled - ready, 0.0), max(now - scheduled, 0.0)
    return {
        "kv_used": bool(info.get("kv_used")),
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": cached,
        "decode_queue_s": queue_s,
        "local_prefill_s": compute_s,
    }
