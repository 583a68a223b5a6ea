"""Usage's cached tokens and a request's salt, as the router decides them
(router/prefix_cache.py); the cluster tests (tests/deploy/test_cluster.py) check the
counts end to end."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.router.prefix_cache import CachedTokens, with_default_salt
from pdserve.router.protocol import (
    CompletionRequest,
    ProtocolError,
    parse_request,
    to_sampling_params,
)


def test_a_request_salt_wins_over_its_keys_default() -> None:
    params = SamplingParams()
    assert with_default_salt(params, None) is params
    assert with_default_salt(params, "key-salt").cache_salt == "key-salt"
    own = SamplingParams(cache_salt="own")
    assert with_default_salt(own, "key-salt").cache_salt == "own"


def test_the_salt_field_is_bounded_and_reaches_the_params() -> None:
    body = {"model": "m", "prompt": "x", "cache_salt": "tenant-a"}
    req = parse_request(CompletionRequest, body)
    assert to_sampling_params(req, 1, 64).cache_salt == "tenant-a"
    unsalted = parse_request(CompletionRequest, {**body, "cache_salt": None})
    assert to_sampling_params(unsalted, 1, 64).cache_salt is None
    for bad in ("", "x" * 257, 7):
        with pytest.raises(ProtocolError) as info:
            parse_request(CompletionRequest, {**body, "cache_salt": bad})
        assert info.value.status_code == 400 and info.value.param == "cache_salt"


def test_colocated_or_local_prefill_reports_the_decode_workers_hit() -> None:
    cached = CachedTokens(45)
    assert cached.value == 0  # nothing known before the first token
    cached.first_item({"kv_used": False, "num_cached_tokens": 40}, {})
    assert cached.value == 40


def test_pushed_kv_reports_the_prefill_workers_hit_not_the_blocks_decode_held() -> None:
    """D held 5 blocks (the push skipped them) but P computed all but its own 2."""
    cached = CachedTokens(45)
    report: dict[str, int] = {}
    cached.first_item({"kv_used": True, "num_cached_tokens": 40}, report)
    assert cached.value == 0  # P's report not in yet
    report["num_cached_tokens"] = 16  # the prefill call returned
    assert cached.value == 16


def test_a_resume_does_not_count_again() -> None:
    """The resumed attempt prefills the prompt and the tokens so far on another decode
    worker: its hit is the cluster's recovery, not the request's prompt."""
    cached = CachedTokens(45)
    cached.first_item({"kv_used": False, "num_cached_tokens": 8}, {})
    cached.first_item({"kv_used": False, "num_cached_tokens": 48}, {})
    assert cached.value == 8
    capped = CachedTokens(10)
    capped.first_item({"kv_used": False, "num_cached_tokens": 16}, {})
    assert capped.value == 10  # never more than the prompt
