"""The one prefix-hash function used cluster-wide (router, Redis index, prefill, decode).

Scheme (docs/prefix-index.md, "Block hashes"):

    namespace = sha256(u32le(len(model_id)) || model_id || u32le(len(salt)) || salt)
    h_0       = ROOT_HASH = sha256(b"pdserve/block-hash/v1")
    h_i       = sha256(h_{i-1} || u32le(token) for each token of block i || namespace)

All strings are UTF-8; the namespace fields are length-prefixed so that ("ab", "c") and
("a", "bc") differ. Only full blocks are hashed: a partial trailing block may still grow,
so it cannot be shared. Chaining makes a block's hash identify its whole prefix, so two
blocks with equal hashes hold the same KV.

Why not Python's ``hash()``: it is salted per process (PYTHONHASHSEED), so a hash computed
by the router would never match one computed by a worker, which silently gives a 0%
cross-process prefix-cache hit rate. Every byte fed to sha256 here is canonical and
independent of the process, the platform's endianness and the Python version; a
golden-vector test pins the output.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte sha256 digest identifying a full block and its whole prefix."""

ROOT_HASH: bytes = hashlib.sha256(b"pdserve/block-hash/v1").digest()

_MAX_TOKEN_ID = 2**32


def lora_model_id(model_id: str, lora: str) -> str:
    """The id a LoRA adapter's blocks are hashed under: its base model's and its own
    name, so that no KV block is ever shared across adapters or with the base."""
    return f"{model_id}\x00lora\x00{lora}"


LORA_GAUGE_PREFIX = "lora:"
"""A worker's load gauge `lora:NAME`: 1 while adapter NAME is resident on its device, 0
while only in its host memory (engine `load()`; placement reads it)."""


def request_namespace(model_id: str, cache_salt: str | None, lora: str | None) -> bytes:
    """The namespace of one request's blocks: its model's (or its LoRA adapter's on that
    model), salted with its `cache_salt`; what the router and every engine hash it in."""
    return hash_namespace(model_id if lora is None else lora_model_id(model_id, lora), cache_salt)


def hash_namespace(model_id: str, cache_salt: str | None = None) -> bytes:
    """Returns the canonical namespace bytes mixed into every block hash.

    Args:
        model_id: The model's id; blocks of different models never share a hash.
        cache_salt: Optional per-tenant salt isolating caches; None means "".

    Returns:
        A 32-byte digest of the length-prefixed UTF-8 model id and salt.
    """
    model = model_id.encode("utf-8")
    salt = (cache_salt or "").encode("utf-8")
    payload = struct.pack("<I", len(model)) + model + struct.pack("<I", len(salt)) + salt
    return hashlib.sha256(payload).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], namespace: bytes) -> BlockHash:
    """Hashes one block chained onto its parent's hash.

    Args:
        parent: Hash of the previous block, or ROOT_HASH for the first block.
        token_ids: The block's token ids, each in [0, 2**32).
        namespace: Output of hash_namespace().

    Returns:
        sha256(parent || u32le(each token) || namespace), 32 bytes.

    Raises:
        ValueError: A token id is outside [0, 2**32).
    """
    return hashlib.sha256(parent + _pack_tokens(token_ids) + namespace).digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes,
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Hashes the full blocks of a token sequence, each chained onto the one before.

    Args:
        token_ids: The sequence's token ids, each in [0, 2**32).
        block_size: Tokens per block; a partial trailing block is not hashed.
        namespace: Output of hash_namespace().
        parent: Hash the first block chains onto (ROOT_HASH for a sequence's start;
            the last known block hash to extend an existing chain).

    Returns:
        One hash per full block, len(token_ids) // block_size of them.

    Raises:
        ValueError: block_size < 1, or a token id of a full block is outside [0, 2**32).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full_tokens = len(token_ids) // block_size * block_size
    packed = _pack_tokens(token_ids[:num_full_tokens])
    block_bytes = 4 * block_size
    hashes: list[BlockHash] = []
    for start in range(0, len(packed), block_bytes):
        parent = hashlib.sha256(parent + packed[start : start + block_bytes] + namespace).digest()
        hashes.append(parent)
    return hashes


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Packs token ids as little-endian u32; raises ValueError for one out of range."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < _MAX_TOKEN_ID)]
        raise ValueError(f"token ids must be ints in [0, 2**32), got {bad[:4]!r}") from exc
