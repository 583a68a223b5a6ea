"""The `hf_greedy` fixture (tests/conftest.py, tests/hf_reference.py) that every serving
path's tokens are held to: its share-per-process path gives the in-process tokens, and
a shorter request is served from a longer one as its prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

NAME = "hf_reference.py"
PROMPTS = [[5, 17, 99, 3], [250, 4, 4, 31, 8, 77], [12]]


def _reference() -> Any:
    """tests/hf_reference.py, imported by path (the tests folder is no package)."""
    spec = importlib.util.spec_from_file_location("hf_reference", Path(__file__).parent / NAME)
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    return reference


def test_the_shares_give_one_process_tokens_and_shorter_is_a_prefix(
    make_checkpoint: Any, hf_greedy: Any
) -> None:
    model_dir = make_checkpoint(seed=7)
    # a share of the prompts per process (fresh: nothing known of this checkpoint yet)
    want = hf_greedy(model_dir, PROMPTS, 20, processes=True)
    assert all(len(w) == 20 for w in want)
    # in this process, every prompt in order: the shares came back in the prompts' order
    reference = _reference()
    longer = reference.generate(model_dir, PROMPTS, 28)
    assert [t[:20] for t in longer] == want
    # served from what is known: the prefix of the longest computed
    assert hf_greedy(model_dir, [PROMPTS[1], PROMPTS[1]], 9) == [want[1][:9]] * 2


def test_prompts_of_one_length_batched_give_each_prompts_own_tokens(make_checkpoint: Any) -> None:
    """`generate` runs prompts of one length as one batch: each row's tokens are the ones
    that prompt gets alone, back in the prompts' order across interleaved lengths."""
    model_dir = make_checkpoint(seed=7)
    reference = _reference()
    mixed = [PROMPTS[0], PROMPTS[1], [9, 9, 40, 2], PROMPTS[2], [61, 7, 7, 300, 1, 2]]
    together = reference.generate(model_dir, mixed, 24)
    alone = [reference.generate(model_dir, [p], 24)[0] for p in mixed]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(mixed)  # five streams, not one repeated


def test_a_served_run_is_held_to_the_reference_by_one_forward_pass(
    make_checkpoint: Any, hf_greedy: Any
) -> None:
    """`hf_greedy(..., candidates=got)`: transformers' greedy tokens are taken as the
    reference only where its argmax along `prompt + got` picks every token of `got`; a
    candidate one token off gets `generate`'s tokens, not itself."""
    model_dir = make_checkpoint(seed=11)
    reference = _reference()
    want = reference.generate(model_dir, PROMPTS, 30)
    # teacher-forced along generate's own tokens: the same tokens
    assert reference.greedy_along(model_dir, PROMPTS, want) == want
    # one token changed: the argmax there is transformers' token, not ours
    wrong = [list(t) for t in want]
    wrong[1][17] = (wrong[1][17] + 1) % 256
    along = reference.greedy_along(model_dir, PROMPTS, wrong)
    assert along[1][:18] == want[1][:18] != wrong[1][:18]
    # the fixture: right candidates are taken, the wrong one is replaced by generate's
    assert hf_greedy(model_dir, PROMPTS, 30, candidates=wrong) == want
