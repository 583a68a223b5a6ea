"""The request side of the prefix cache: a request's salt, and its cached prompt tokens.

`cache_salt` (docs/prefix-index.md, "Salted namespaces"): a request's own field, else its
API key's default, is hashed into the namespace of every block hash of the request, on
the router (prefix-index lookups) and on every worker (registration, the KV handoff's
checks). Requests with different salts therefore never share a KV block.

`usage.prompt_tokens_details.cached_tokens` is OpenAI's meaning: the prompt tokens the
cluster did not have to compute because their KV was in a prefix cache. Exactly:

- the prefix-cache hit of the engine that computed the request's prompt KV on its first
  admission: the prefill worker's when its pushed KV was used, else the decode worker's
  (colocated mode; a disaggregated request prefilled on the decode worker by policy or
  after a failed transfer);
- blocks a decode worker already held, so that the push skipped them, do not count on
  their own: the prefill worker computed the whole prompt (minus its own hit) anyway, so
  they saved transfer (`pdserve_kv_transfer_blocks_total`), not compute;
- only the attempt that produced the request's first token counts: a resumed stream
  (the prompt and the tokens so far prefilled again on another decode worker) is the
  cluster's recovery, not a second prompt, and changes nothing;
- an engine never reuses the block holding the prompt's last token when the prompt ends
  on a block boundary: that token is computed to sample the first output token, so a
  fully cached prompt of n tokens reports ((n - 1) // block_size) * block_size.

Plain Python (the router imports no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.cluster.messages import OutputItem
from pdserve.common.sampling_params import SamplingParams


def with_default_salt(params: SamplingParams, default: str | None) -> SamplingParams:
    """`params` with `cache_salt` set to the API key's `default` when the request set
    none (a request's own salt always wins)."""
    if params.cache_salt is not None or default is None:
        return params
    return dataclasses.replace(params, cache_salt=default)


class CachedTokens:
    """Which engine's prefix-cache hit a request's usage reports (see the module doc).

    `first_item(item, report)`: the first output item of the request (the attempt that
    produced it), and that attempt's prefill report, a dict the prefill call fills with
    "num_cached_tokens" when it ends (it may end after the first token; the router waits
    for it before the last item).
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self._first: OutputItem | None = None
        self._report: dict[str, Any] = {}

    def first_item(self, item: OutputItem, report: dict[str, Any]) -> None:
        if self._first is None:
            self._first = item
            self._report = report

    @property
    def value(self) -> int:
        """The prompt tokens served from a prefix cache (0 until the first token)."""
        first = self._first
        if first is None:
            return 0
        if first.get("kv_used"):  # the prefill worker computed the prompt's KV
            cached = self._report.get("num_cached_tokens", 0)
        else:  # the decode worker did
            cached = first.get("num_cached_tokens", 0)
        return max(0, min(int(cached), self.num_prompt_tokens))
