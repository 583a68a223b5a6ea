"""One streamed completion, timed token by token, with first-token and stall deadlines.

`send_request` posts a `RequestSpec` to `POST /v1/completions` with `stream: true`,
`max_tokens` = its output length and `ignore_eos: true` (exact output lengths on
pdserve; other servers may ignore it), reads the SSE stream and returns a
`RequestRecord`. It never raises for a failed request: the record says why.

Tokens are counted one per chunk that carries text (or `len(token_ids)` where a chunk has
them); the final count is `usage.completion_tokens` when the server sends usage
(`stream_options.include_usage`, which pdserve honours). `return_token_ids` is not asked
for: pdserve would echo the whole prompt in the first chunk, inflating what TTFT measures.

A deadline runs from the send to the first token (`first_token_timeout_s`) and then from
each token to the next (`stall_timeout_s`); when it passes, the response is closed at
once (the server sees the connection go away) and the record's reason is
"first_token_timeout" or "stall".
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.benchmarks.bench_workloads import RequestSpec

FIRST_TOKEN_TIMEOUT = "first_token_timeout"
RESULT_CACHE_HEADER = "x-pdserve-result-cache"  # router/result_cache.py
STALL = "stall"


@dataclass(frozen=True)
class ClientLimits:
    """The client's deadlines, in seconds."""

    first_token_timeout_s: float = 60.0
    stall_timeout_s: float = 30.0


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `start_s` is from the run's start.

    `reason` is "" on success, else "first_token_timeout", "stall", "http_<status>",
    "stream_error" (an error event in the stream), "incomplete" (the stream ended
    without `[DONE]`), "bad_response" (not the SSE/JSON expected) or
    "connection_error"; `error` holds the detail.
    """

    index: int
    kind: str
    start_s: float
    prompt_len: int | None  # sent (None: a text prompt)
    output_len: int  # asked for
    prompt_tokens: int | None = None  # the server's usage, else what was sent
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None  # send to the end of the stream, or to the failure
    success: bool = False
    reason: str = ""
    error: str = ""
    result_cache: str = ""  # pdserve's x-pdserve-result-cache: "hit", "miss", "bypass"
    repeat_of: int | None = None  # the request it resends (`--repeat-fraction`)

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None below 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "tpot_s": self.tpot_s}


class _StreamError(Exception):
    def __init__(self, reason: str, error: str) -> None:
        super().__init__(error)
        self.reason = reason


def request_body(model_id: str, spec: RequestSpec) -> dict[str, Any]:
    body = {
        "model": model_id,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if spec.priority is not None:  # pdserve's and vLLM's extension (orders differ)
        body["priority"] = spec.priority
    return body


def _tokens_in(chunk: dict[str, Any]) -> int:
    """Tokens a completion chunk carries (0 for a usage-only or empty final chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if "token_ids" in choice:
        return len(choice["token_ids"] or [])
    # NOTE: servers that stream one token per chunk may send "" for a token that ends
    # inside a UTF-8 character, so only an empty *final* chunk carries no token.
    return 1 if choice.get("text") or choice.get("finish_reason") is None else 0


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    model_id: str,
    spec: RequestSpec,
    limits: ClientLimits,
    run_start_s: float,
) -> RequestRecord:
    """Send `spec` to `url` (the full completions URL) and time it; never raises."""
    start = time.perf_counter()
    record = RequestRecord(
        index=spec.index,
        kind=spec.kind,
        start_s=start - run_start_s,
        prompt_len=spec.prompt_len,
        output_len=spec.output_len,
        repeat_of=spec.repeat_of,
    )
    stream = _Stream(record, start, limits.stall_timeout_s)
    deadline = asyncio.timeout(limits.first_token_timeout_s)
    try:
        async with deadline:
            await stream.run(session, url, request_body(model_id, spec), deadline)
        record.success = True
    except TimeoutError as exc:
        if not deadline.expired():  # aiohttp's own connect timeout
            record.reason, record.error = "connection_error", repr(exc)
        elif record.ttft_s is None:
            record.reason = FIRST_TOKEN_TIMEOUT
            record.error = f"no first token within {limits.first_token_timeout_s:g}s"
        else:
            record.reason = STALL
            record.error = f"no token for {limits.stall_timeout_s:g}s"
    except _StreamError as exc:
        record.reason, record.error = exc.reason, str(exc)
    except (aiohttp.ClientError, OSError) as exc:
        record.reason, record.error = "connection_error", repr(exc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, UTF-8, shape
        record.reason, record.error = "bad_response", repr(exc)
    record.e2e_s = time.perf_counter() - start
    if record.prompt_tokens is None:
        record.prompt_tokens = spec.prompt_len
    return record


class _Stream:
    """Reads one SSE response into its record, moving the deadline at each token."""

    def __init__(self, record: RequestRecord, start: float, stall_timeout_s: float) -> None:
        self.record = record
        self.start = start
        self.stall_timeout_s = stall_timeout_s
        self.last_token_s: float | None = None

    async def run(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        deadline: asyncio.Timeout,
    ) -> None:
        resp = await session.post(url, json=body)
        self.record.result_cache = resp.headers.get(RESULT_CACHE_HEADER, "")
        done = False
        try:
            if resp.status != 200:
                raise _StreamError(f"http_{resp.status}", (await resp.text())[:500])
            usage_tokens: int | None = None
            while (chunk := await self._next_chunk(resp)) is not None:
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    self.record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                if num_tokens := _tokens_in(chunk):
                    self._on_tokens(num_tokens, deadline)
            if usage_tokens is not None:
                self.record.output_tokens = usage_tokens
            done = True
        finally:
            if done:
                resp.release()
            else:  # abandon it: close the connection so the server stops working on it
                resp.close()

    async def _next_chunk(self, resp: aiohttp.ClientResponse) -> dict[str, Any] | None:
        """The next `data:` event's JSON; None at `[DONE]`."""
        while True:
            line = await resp.content.readline()
            if not line:
                raise _StreamError("incomplete", "the stream ended without [DONE]")
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue  # event separators and SSE comments (keep-alives) carry no token
            data = text[5:].strip()
            if data == "[DONE]":
                return None
            chunk: dict[str, Any] = json.loads(data)
            if "error" in chunk:
                raise _StreamError("stream_error", json.dumps(chunk["error"])[:500])
            return chunk

    def _on_tokens(self, num_tokens: int, deadline: asyncio.Timeout) -> None:
        now = time.perf_counter()
        if self.last_token_s is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last_token_s)
        self.last_token_s = now
        self.record.output_tokens += num_tokens
        deadline.reschedule(asyncio.get_running_loop().time() + self.stall_timeout_s)
