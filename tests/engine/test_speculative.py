"""Speculative decoding with prompt-lookup proposals (engine/speculative.py): the
configuration, the proposer against its brute-force definition, the acceptance rule."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.hashing import hash_namespace
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import NgramProposer, SpeculativeConfig, accept, propose_from

NS = hash_namespace("test-model")


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "k", "n"),
    [("ngram", 4, 3), ("ngram:k=1", 1, 3), ("ngram:k=8,n=1", 8, 1), (" ngram : n=5 , k=2 ", 2, 5)],
)
def test_speculative_config_parses(spec: str, k: int, n: int) -> None:
    config = EngineConfig(speculative=spec).speculative_config
    assert config == SpeculativeConfig("ngram", k, n)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ngram:k=0", r"k \(tokens proposed per step\) must be in 1\.\.8, got 0"),
        ("ngram:k=9", "must be in 1..8, got 9"),
        ("ngram:n=0", r"n \(longest n-gram matched\) must be in 1\.\.16, got 0"),
        ("ngram:k=four", "k must be an integer, got 'four'"),
        ("ngram:m=2", "expected k=K or n=N, got 'm=2'"),
        ("ngram:k", "expected k=K or n=N, got 'k'"),
        ("ngram:k=2,k=3", "k is given twice"),
        ("medusa:k=2", "unknown method 'medusa'"),
        ("draft:/models/tiny,k=4", "draft-model proposals are not implemented yet"),
    ],
)
def test_speculative_config_refuses_clearly(spec: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(speculative=spec)


# -- the proposer ----------------------------------------------------------------------


def scan_proposal(tokens: list[int], n: int, k: int) -> list[int]:
    """The definition, by brute force: for j = n..1 the most recent earlier occurrence
    of the last j tokens; the k tokens after it, the copy continuing past the end."""
    length = len(tokens)
    for j in range(min(n, length - 1), 0, -1):
        suffix = tokens[length - j :]
        for start in range(length - j - 1, -1, -1):
            if tokens[start : start + j] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + j + i])
                return extended[length:]
    return []


def test_proposer_examples() -> None:
    assert propose_from([5, 6, 7], [], 3, 4) == []
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    proposer = NgramProposer(4, 3)
    seq = Sequence("r", tokens, SamplingParams(), frozenset(), NS)
    assert proposer.propose(seq, 4) == [9, 2, 3, 4]  # the 3-gram (1, 2, 3) wins over (2, 3)
    assert proposer.propose(seq, 2) == [9, 2]
    seq.append_token(9)  # (3, 9) matched at 2..3; (1, 2, 3, 9) is too long for n=3
    assert proposer.propose(seq, 3) == [2, 3, 4]
    # A repeating tail: the copy goes on from its own start.
    periodic = Sequence("p", [4, 7, 8, 7, 8], SamplingParams(), frozenset(), NS)
    assert proposer.propose(periodic, 5) == [7, 8, 7, 8, 7]


def test_proposer_equals_the_definition_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(300):
        n, k, vocab = rng.randint(1, 4), rng.randint(1, 6), rng.randint(2, 12)
        proposer = NgramProposer(k, n)
        seq = Sequence(f"r{trial}", [rng.randrange(vocab)], SamplingParams(), frozenset(), NS)
        for _ in range(rng.randint(1, 60)):  # grown a token at a time, like a decode
            assert proposer.propose(seq, k) == scan_proposal(seq.all_token_ids, n, k)
            seq.append_token(rng.randrange(vocab))


# -- the acceptance rule ---------------------------------------------------------------


def test_accept_keeps_the_agreeing_prefix_and_the_target_after_it() -> None:
    assert accept([7], []) == [7]
    assert accept([1, 2, 3, 4], [1, 2, 3]) == [1, 2, 3, 4]  # all accepted + bonus
    assert accept([1, 5, 3, 4], [1, 2, 3]) == [1, 5]  # the target's token at the mismatch
    assert accept([6, 2, 3, 4], [1, 2, 3]) == [6]
