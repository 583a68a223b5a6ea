"""Tests for the cluster-wide prefix hash: golden vectors, chaining, cross-process use,
and per-request salts (`SamplingParams.cache_salt`) in the engine."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from typing import Any

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.hashing import (
    ROOT_HASH,
    hash_block,
    hash_block_chain,
    hash_namespace,
)
from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

# Golden vectors: changing any of these changes every hash in a running cluster's index.
GOLDEN_ROOT = "1f142b353d30eaca06dcac0c446c09ff0671eec93b395cb9034c1341a85780d0"
GOLDEN_DEMO_NAMESPACE = "c47ea3743147701998e52fc0a1e3bb5b67eb1b3c8cd4456ec675c73946c69836"
GOLDEN_DEMO_CHAIN = [
    "ed86b33fafb8869f95959b82cb47ca0e3af2be9fda5b72343dc3575708821921",
    "8d606e91d306cfb7ccca34371689fda938089526824c6672b312db77ee9643d4",
]

DEMO = hash_namespace("demo")


def test_golden_root_hash() -> None:
    assert ROOT_HASH.hex() == GOLDEN_ROOT
    assert hashlib.sha256(b"pdserve/block-hash/v1").hexdigest() == GOLDEN_ROOT


def test_golden_namespace() -> None:
    assert hash_namespace("demo").hex() == GOLDEN_DEMO_NAMESPACE
    assert hash_namespace("demo", None) == hash_namespace("demo", "")


def test_golden_chain() -> None:
    chain = hash_block_chain(range(32), 16, DEMO)
    assert [h.hex() for h in chain] == GOLDEN_DEMO_CHAIN


def test_chain_matches_spelled_out_scheme() -> None:
    namespace = hashlib.sha256(struct.pack("<I", 4) + b"demo" + struct.pack("<I", 0)).digest()
    assert namespace == DEMO
    first = hashlib.sha256(ROOT_HASH + struct.pack("<16I", *range(16)) + namespace).digest()
    second = hashlib.sha256(first + struct.pack("<16I", *range(16, 32)) + namespace).digest()
    assert hash_block_chain(list(range(32)), 16, DEMO) == [first, second]
    assert hash_block(ROOT_HASH, range(16), DEMO) == first
    assert hash_block(first, range(16, 32), DEMO) == second


def test_only_full_blocks_are_hashed() -> None:
    assert hash_block_chain(range(31), 16, DEMO) == hash_block_chain(range(16), 16, DEMO)
    assert len(hash_block_chain(range(33), 16, DEMO)) == 2
    assert hash_block_chain(range(15), 16, DEMO) == []
    assert hash_block_chain([], 16, DEMO) == []


def test_chain_extends_from_parent() -> None:
    full = hash_block_chain(range(48), 16, DEMO)
    tail = hash_block_chain(range(16, 48), 16, DEMO, parent=full[0])
    assert tail == full[1:]


def test_salt_changes_hashes() -> None:
    salted = hash_namespace("demo", "tenant-a")
    assert salted != DEMO
    assert salted != hash_namespace("demo", "tenant-b")
    assert hash_block_chain(range(16), 16, salted) != hash_block_chain(range(16), 16, DEMO)


def test_model_id_changes_hashes() -> None:
    other = hash_namespace("demo-2")
    assert hash_block_chain(range(16), 16, other) != hash_block_chain(range(16), 16, DEMO)


def test_namespace_fields_are_length_prefixed() -> None:
    assert hash_namespace("ab", "c") != hash_namespace("a", "bc")
    assert hash_namespace("démo") != hash_namespace("demo")


def test_different_parents_differ() -> None:
    other_parent = hashlib.sha256(b"other").digest()
    assert hash_block(ROOT_HASH, range(16), DEMO) != hash_block(other_parent, range(16), DEMO)


def test_same_tokens_in_different_blocks_differ() -> None:
    first, second = hash_block_chain([7] * 32, 16, DEMO)
    assert first != second


def test_token_ids_use_all_32_bits() -> None:
    assert hash_block(ROOT_HASH, [2**32 - 1], DEMO) != hash_block(ROOT_HASH, [2**16 - 1], DEMO)


@pytest.mark.parametrize("bad_token", [-1, 2**32])
def test_out_of_range_token_raises(bad_token: int) -> None:
    with pytest.raises(ValueError, match="2\\*\\*32"):
        hash_block(ROOT_HASH, [1, bad_token], DEMO)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        hash_block_chain([1, bad_token], 2, DEMO)


def test_bad_block_size_raises() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_block_chain(range(16), 0, DEMO)


_CHILD = (
    "from pdserve.common.hashing import hash_block_chain, hash_namespace; "
    "print(','.join(h.hex() for h in hash_block_chain(range(32), 16, hash_namespace('demo'))))"
)


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_same_chain_across_processes(hash_seed: str) -> None:
    """A hash that depended on the process (e.g. Python's hash()) would differ here."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    in_process = [h.hex() for h in hash_block_chain(range(32), 16, DEMO)]
    assert result.stdout.strip().split(",") == in_process == GOLDEN_DEMO_CHAIN


def test_salted_namespace_matches_spelled_out_scheme() -> None:
    salt = "tenant-a"
    payload = struct.pack("<I", 4) + b"demo" + struct.pack("<I", len(salt)) + salt.encode()
    assert hash_namespace("demo", salt) == hashlib.sha256(payload).digest()


# -- per-request salts in the engine (cache_salt rides in SamplingParams) ------------------

SALT_BLOCK = 4


def _salt_engine(make_checkpoint: Any) -> LLMEngine:
    model_dir = make_checkpoint(num_heads=4, num_kv_heads=2)
    config = EngineConfig(dtype="float32", block_size=SALT_BLOCK, num_kv_blocks=64)
    return LLMEngine(model_dir, config)


def _run(eng: LLMEngine, rid: str, prompt: list[int], salt: str | None) -> RequestOutput:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, cache_salt=salt)
    eng.add_request(rid, prompt, params)
    last = None
    while eng.has_unfinished:
        for out in eng.step():
            last = out
    assert last is not None and last.finished
    return last


def test_a_request_salt_gives_its_blocks_their_own_namespace(make_checkpoint: Any) -> None:
    """The same prompt under two salts registers disjoint block hashes and never hits
    the other's blocks; the same salt again hits every block the engine may reuse (all
    but the one holding the prompt's last token, which is computed again to sample)."""
    eng = _salt_engine(make_checkpoint)
    prompt = list(range(10, 10 + 6 * SALT_BLOCK))  # 6 full blocks, ends on a boundary
    chain = {
        salt: hash_block_chain(prompt, SALT_BLOCK, hash_namespace(eng.model_id, salt))
        for salt in (None, "tenant-a", "tenant-b")
    }
    assert eng.namespace_for(None) == eng.hash_namespace == hash_namespace(eng.model_id)
    assert _run(eng, "a1", prompt, "tenant-a").num_cached_tokens == 0
    cached = set(eng.block_pool.cached_hashes())
    assert set(chain["tenant-a"]) <= cached
    assert not (set(chain["tenant-b"]) | set(chain[None])) & cached
    assert _run(eng, "b1", prompt, "tenant-b").num_cached_tokens == 0
    assert set(chain["tenant-b"]) <= set(eng.block_pool.cached_hashes())
    assert not set(chain["tenant-a"]) & set(chain["tenant-b"])
    assert _run(eng, "n1", prompt, None).num_cached_tokens == 0  # unsalted: its own too
    full_hit = (len(prompt) - 1) // SALT_BLOCK * SALT_BLOCK
    for rid, salt in (("a2", "tenant-a"), ("b2", "tenant-b"), ("n2", None)):
        assert _run(eng, rid, prompt, salt).num_cached_tokens == full_hit == 20
    # a shared prefix hits its full blocks only, under the same salt only
    longer = [*prompt[: 3 * SALT_BLOCK + 2], 7, 8, 9]
    assert _run(eng, "a3", longer, "tenant-a").num_cached_tokens == 3 * SALT_BLOCK
    assert _run(eng, "c1", longer, "tenant-c").num_cached_tokens == 0
    eng.block_pool.check_no_leaks()


def test_unsalted_hashes_are_unchanged(make_checkpoint: Any) -> None:
    """No salt: a sequence hashes exactly as before salts existed (the index format)."""
    eng = _salt_engine(make_checkpoint)
    prompt = list(range(40, 40 + 3 * SALT_BLOCK + 1))
    _run(eng, "r", prompt, None)
    want = hash_block_chain(prompt, SALT_BLOCK, hash_namespace(eng.model_id))
    assert set(want) <= set(eng.block_pool.cached_hashes())


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_a_bad_salt_is_refused(salt: str) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
