"""Speculative decoding with a draft model (`speculative="draft:PATH,k=K"`,
engine/spec_decode/draft.py).

Greedy tokens with a draft must equal `transformers`' whatever the draft proposes: a
smaller random model (proposals mostly rejected), the target's own first layer (some
accepted, some not: the draft's KV is cut back after every rejection) and the target
itself (every proposal accepted, which holds only if the draft's KV is right at every
step: a stale or misplaced draft KV would make it propose something else). Through
prefix caching, chunked prefill (a chunked catch-up too), preemption, a KV import (a
decode worker's request), both CPU backends and TP=2; sampled tokens have the target's
distribution (chi-square over whole short outputs); blocks balance after rejections;
bad drafts are refused at start, naming the problem.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from pdserve.common.errors import CheckpointError
from pdserve.common.hashing import ROOT_HASH, hash_block_chain
from pdserve.common.speculative import SpeculativeConfig
from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sched.sequence import Sequence
from pdserve.engine.spec_decode.draft import DraftProposer

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731 - skip specials
    shared = ids(20)
    return [shared + ids(7), ids(1), ids(45), shared + ids(30), ids(3) * 5, ids(17)]


@pytest.fixture(scope="module")
def target(make_checkpoint: Any, hf_greedy: Any) -> tuple[Path, list[list[int]]]:
    model_dir = make_checkpoint()
    return model_dir, hf_greedy(model_dir, make_prompts(), MAX_TOKENS)


@pytest.fixture(scope="module")
def drafts(
    make_checkpoint: Any, make_draft: Any, target: tuple[Path, list[list[int]]]
) -> dict[str, Path]:
    model_dir, _ = target
    return {
        # another shape (head_dim 8, one KV head, one layer), other random weights
        "small": make_checkpoint(
            hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=1, intermediate_size=64, seed=1
        ),
        "first-layer": make_draft(model_dir, 1),
        "same": model_dir,
    }


def check_pool(engine: LLMEngine, outs: Seq[RequestOutput]) -> None:
    """No block leaked; every cached block holds tokens of some request's final output."""
    engine.block_pool.check_no_leaks()
    bs = engine.config.block_size
    valid = set()
    for out in outs:
        valid.update(
            hash_block_chain(
                out.prompt_token_ids + out.token_ids, bs, engine.hash_namespace, ROOT_HASH
            )
        )
    assert set(engine.block_pool.cached_hashes()) <= valid


def draft_llm(draft: Path, k: int, **kwargs: Any) -> LLM:
    return LLM(
        kwargs.pop("model"),
        dtype="float32",
        speculative=f"draft:{draft},k={k},adaptive=off",
        **kwargs,
    )


# -- configuration -----------------------------------------------------------------------


def test_draft_config_parses_and_refuses_clearly() -> None:
    assert SpeculativeConfig.parse("draft:/models/small") == SpeculativeConfig(
        "draft", 4, 3, True, "/models/small"
    )
    assert SpeculativeConfig.parse(" draft: /m , k=2, adaptive=off") == SpeculativeConfig(
        "draft", 2, 3, False, "/m"
    )
    for spec, message in [
        ("draft", "the draft model's folder must come first"),
        ("draft:k=3", "the draft model's folder must come first"),
        ("draft:/m,n=2", "expected k=K or adaptive=on|off, got 'n=2'"),
        ("draft:/m,k=9", r"k \(tokens proposed per step\) must be in 1\.\.8, got 9"),
    ]:
        with pytest.raises(ValidationError, match=message):
            EngineConfig(speculative=spec)


def test_a_bad_draft_is_refused_at_start(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path], tmp_path: Path
) -> None:
    model_dir, _ = target
    with pytest.raises(CheckpointError, match="speculative draft model /no/such: no such folder"):
        LLM(model_dir, speculative="draft:/no/such")
    bigger = tmp_path / "bigger-vocab"
    shutil.copytree(drafts["small"], bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    with pytest.raises(
        CheckpointError, match="vocab_size 1024 differs from the target model's 512"
    ):
        LLM(model_dir, speculative=f"draft:{bigger}")
    swapped = tmp_path / "other-tokenizer"
    shutil.copytree(drafts["small"], swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(
        CheckpointError, match=r"tokenizer's vocabulary differs .*\(2 tokens have another id"
    ):
        LLM(model_dir, speculative=f"draft:{swapped}")
    no_config = tmp_path / "empty"
    no_config.mkdir()
    with pytest.raises(CheckpointError, match=r"empty: model folder .* has no config\.json"):
        LLM(model_dir, speculative=f"draft:{no_config}")


# -- greedy tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_tokens_equal_transformers_with_prefix_caching(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path], k: int
) -> None:
    """The first-layer draft (partly accepted) at every k; prompts extended by their own
    outputs then hit the prefix cache (a draft catches up from scratch over blocks it
    did not write) and go on exactly as before."""
    model_dir, expected = target
    llm = draft_llm(drafts["first-layer"], k, model=model_dir, block_size=4)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected, f"k={k}"
    stats = llm.engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.proposed_tokens, stats
    assert stats.emitted_tokens == stats.accepted_tokens + stats.verify_rows
    check_pool(llm.engine, outs)
    again = [o.prompt_token_ids + o.token_ids[:9] for o in outs]
    params = SamplingParams(max_tokens=MAX_TOKENS - 9, temperature=0.0, ignore_eos=True)
    outs2 = llm.generate(again, params)
    assert sum(o.num_cached_tokens for o in outs2) > 0
    assert [o.token_ids for o in outs2] == [ref[9:] for ref in expected]
    check_pool(llm.engine, [*outs, *outs2])


@pytest.mark.parametrize(
    ("draft", "config"),
    [
        ("small", {"max_num_batched_tokens": 12, "block_size": 4}),  # chunked, catch-ups too
        ("small", {"enable_prefix_caching": False, "attention_backend": "cpu"}),
        ("first-layer", {"attention_backend": "torch", "max_num_batched_tokens": 12}),
        ("same", {"block_size": 4}),
    ],
    ids=["small-chunked", "small-cpu-kernel", "first-layer-torch", "same"],
)
def test_greedy_tokens_equal_transformers(
    target: tuple[Path, list[list[int]]],
    drafts: dict[str, Path],
    draft: str,
    config: dict[str, Any],
) -> None:
    model_dir, expected = target
    llm = draft_llm(drafts[draft], 4, model=model_dir, **config)
    if "attention_backend" in config:
        assert llm.engine.runner.backend.name == config["attention_backend"]
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.spec_stats()
    assert stats.verify_rows > 0 and stats.draft_forwards > 0
    if draft == "same":  # the draft is the target: every greedy proposal is its token
        assert stats.accepted_tokens == stats.proposed_tokens > 0
    if config.get("max_num_batched_tokens") == 12:
        assert llm.engine.scheduler.stats.num_chunked_prefill_steps > 0
    check_pool(llm.engine, outs)


def test_draft_kv_is_cut_back_after_each_rejection(
    target: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target as its own draft, with some proposals made wrong *inside* the draft
    (a marker token no output holds, from which the draft goes on, writing its KV and
    proposing after it), and some steps without speculation for some sequences. Every
    verify row must accept exactly the proposals before its first marker: that holds
    only if the draft's KV for the rejected tokens is never used again (stale KV would
    make an unmarked proposal differ from the target's)."""
    model_dir, expected = target
    llm = draft_llm(model_dir, 4, model=model_dir, block_size=4)
    proposer = llm.engine.scheduler.proposer
    assert isinstance(proposer, DraftProposer)
    seen = {t for ref in expected for t in ref} | {t for p in make_prompts() for t in p}
    mark = min(set(range(3, 512)) - seen)
    rng = random.Random(3)
    real_logits = proposer.model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = real_logits(hidden)
        for row in range(out.shape[0]):
            if rng.random() < 0.25:
                out[row, mark] = out[row].max() + 1
        return out

    monkeypatch.setattr(proposer.model, "logits", logits)
    # Some steps decode some sequences plainly (no draft forward for them): their next
    # catch-up starts after tokens the draft did not see, past KV of rejected proposals.
    real_room = llm.engine.scheduler._room
    skip = random.Random(4)

    def room(item: Any, k: int, budget: int) -> int:
        return 0 if skip.random() < 0.3 else real_room(item, k, budget)

    monkeypatch.setattr(llm.engine.scheduler, "_room", room)
    rows: list[tuple[tuple[int, ...], list[int]]] = []  # (proposals, emitted tokens)
    real_update = llm.engine.scheduler.update

    def update(out: Any, sampled: Any, on_token: Any = None) -> Any:
        rows.extend((v.spec_token_ids, list(sampled[v.seq.request_id])) for v in out.verifies)
        return real_update(out, sampled, on_token)

    monkeypatch.setattr(llm.engine.scheduler, "update", update)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    marked = 0
    for proposal, emitted in rows:
        first_mark = proposal.index(mark) if mark in proposal else len(proposal)
        assert len(emitted) - 1 == first_mark, (proposal, emitted)
        marked += first_mark < len(proposal)
    assert marked > 5 and len(rows) - marked > 5, (marked, len(rows))
    check_pool(llm.engine, outs)


def test_preemption_resets_the_draft(
    target: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preempted sequence is recomputed into other blocks: the draft's KV of it is gone
    and it catches up from scratch (with the target as its own draft, a stale KV would
    show as a rejected proposal)."""
    model_dir, expected = target
    llm = draft_llm(
        model_dir,
        4,
        model=model_dir,
        num_kv_blocks=28,  # sequences are preempted after they speculated
        block_size=4,
        max_model_len=96,
        enable_prefix_caching=False,  # with it, a recompute may get its own blocks back
    )
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    stats = llm.engine.spec_stats()
    assert stats.accepted_tokens == stats.proposed_tokens > 0
    check_pool(llm.engine, outs)


def test_imported_prompt_kv_the_draft_builds_its_own(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path]
) -> None:
    """A decode worker's request: the prompt's KV arrives from a prefill engine (all of
    it, or only the blocks this engine does not hold), the draft has none of it and
    catches up over the whole prompt (chunked by the step budget). With the target as
    its own draft every proposal must then be accepted; with the first-layer draft the
    tokens are still transformers'."""
    model_dir, expected = target
    prefill = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=4, num_kv_blocks=96))
    for draft in ("same", "first-layer"):
        decode = LLMEngine(
            model_dir,
            EngineConfig(
                dtype="float32",
                block_size=4,
                num_kv_blocks=96,
                max_num_batched_tokens=16,
                speculative=f"draft:{drafts[draft]},k=3,adaptive=off",
            ),
        )
        got: dict[str, list[int]] = {}
        skipped = 0
        for i, prompt in enumerate(make_prompts()):
            rid = f"r{i}"
            prefill.add_request(
                rid,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                hold_kv=True,
            )
            while prefill.has_unfinished:
                prefill.step()
            hashes = hash_block_chain(prompt, 4, decode.hash_namespace)[: (len(prompt) - 1) // 4]
            skip = len(decode.block_pool.get_computed_blocks(hashes))
            skipped += skip
            export = prefill.export_kv(rid, first_block=skip)
            decode.add_prefilled_request(
                rid, prompt, export.first_token, GREEDY, export.payload, first_block=skip
            )
            prefill.release_kv(rid)
            while decode.has_unfinished:
                for out in decode.step():
                    got[out.request_id] = out.token_ids
        assert [got[f"r{i}"] for i in range(len(expected))] == expected, draft
        assert skipped > 0  # prompts 3 found prompt 0's shared blocks cached here
        stats = decode.spec_stats()
        assert stats.verify_rows > 0 and decode.scheduler.stats.num_steps > 0
        if draft == "same":
            assert stats.accepted_tokens == stats.proposed_tokens
        decode.block_pool.check_no_leaks()


def test_tensor_parallel_runs_the_draft_on_rank_0(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path]
) -> None:
    """At TP=2 (2 CPU ranks over gloo) the draft runs whole beside rank 0's shard; the
    verify rows run on every rank as always."""
    model_dir, expected = target
    with draft_llm(
        drafts["first-layer"],
        3,
        model=model_dir,
        num_kv_blocks=128,
        block_size=4,
        tensor_parallel_size=2,
    ) as llm:
        proposer = llm.engine.scheduler.proposer
        assert isinstance(proposer, DraftProposer) and proposer.model.tp is None
        outs = llm.generate(make_prompts(), GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.spec_stats().accepted_tokens > 0
        check_pool(llm.engine, outs)


class FakeCost:
    """A step cost model's coefficients (see test_speculative.py's)."""

    def __init__(self, coefficients: tuple[float, ...]) -> None:
        self.decode_coefficients = coefficients


@pytest.mark.parametrize("cost", ["cheap", "costly"])
def test_adaptive_policy_decides_before_the_draft_runs(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path], cost: str
) -> None:
    """With the adaptive policy (the default) a draft is asked for as many tokens as the
    policy finds worth verifying: all of them when proposals are cheap; when they are
    costly, none is verified, but the draft still makes each sequence's first guess,
    which the policy checks against the token the sequence then gets."""
    model_dir, expected = target
    llm = LLM(model_dir, dtype="float32", speculative=f"draft:{drafts['same']},k=3")
    policy = llm.engine.scheduler.spec_policy
    assert policy is not None
    per_row = 1e-7 if cost == "cheap" else 1.0  # seconds per decode row (and token)
    policy.cost = FakeCost((1e-3, per_row, 0.0, per_row, 0.0))
    observed: list[tuple[int, int]] = []  # (proposed, accepted) the policy learns from
    observe = policy.observe

    def recording(seq: Sequence, proposed: int, accepted: int) -> None:
        observed.append((proposed, accepted))
        observe(seq, proposed, accepted)

    policy.observe = recording  # type: ignore[method-assign]
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.spec_stats()
    assert stats.draft_forwards > 0
    if cost == "cheap":
        assert stats.withheld_tokens == 0 and stats.accepted_tokens == stats.proposed_tokens > 0
    else:
        assert stats.verify_rows == 0 and stats.withheld_tokens > 0
        # every withheld first guess (the target's own token) checked and found right
        assert observed and all(o == (1, 1) for o in observed), observed
    check_pool(llm.engine, outs)


# -- sampled requests --------------------------------------------------------------------


def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path]
) -> None:
    model_dir, _ = target
    prompts = make_prompts()
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i, ignore_eos=True, top_k=5)
        for i in range(len(prompts))
    ]
    plain = LLM(model_dir, dtype="float32").generate(prompts, params)
    llm = draft_llm(drafts["first-layer"], 4, model=model_dir)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    check_pool(llm.engine, outs)


def _chi_square_p(observed: dict[Any, int], expected: dict[Any, float], total: int) -> float:
    assert set(observed) <= set(expected), set(observed) - set(expected)
    stat = sum((observed.get(c, 0) - total * p) ** 2 / (total * p) for c, p in expected.items())
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_sampled_outputs_have_the_targets_distribution(
    target: tuple[Path, list[list[int]]],
) -> None:
    """Whole 4-token outputs of one prompt (temperature 1, top-k 2: 16 possible outputs)
    sampled with the target as its greedy draft (k=3: its argmax proposals accepted now
    and then) must have the probabilities `transformers`' model gives them."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = target
    prompt, trials, n = make_prompts()[5], 3000, 4
    params = [
        SamplingParams(max_tokens=n, temperature=1.0, top_k=2, seed=t, ignore_eos=True)
        for t in range(trials)
    ]
    llm = draft_llm(model_dir, 3, model=model_dir)
    outs = llm.generate([prompt] * trials, params)
    observed: dict[tuple[int, ...], int] = {}
    for out in outs:
        observed[tuple(out.token_ids)] = observed.get(tuple(out.token_ids), 0) + 1
    stats = llm.engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):  # extend every output so far by its two likeliest next tokens
        longer: dict[tuple[int, ...], float] = {}
        for head, p in expected.items():
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + list(head)])).logits[0, -1]
            top = logits.topk(2)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist(), strict=True):
                longer[(*head, token)] = p * q
        expected = longer
    p_value = _chi_square_p(observed, expected, trials)
    assert p_value > 1e-3, (p_value, observed, expected)
    check_pool(llm.engine, outs)


def test_load_reports_the_draft(
    target: tuple[Path, list[list[int]]], drafts: dict[str, Path]
) -> None:
    model_dir, _ = target
    llm = draft_llm(drafts["small"], 2, model=model_dir)
    llm.generate(make_prompts()[:2], GREEDY)
    load, stats = llm.engine.load(), llm.engine.spec_stats()
    assert load["spec_proposed_tokens"] == stats.proposed_tokens > 0
    assert load["spec_draft_forwards"] == stats.draft_forwards > stats.verify_steps
    assert load["spec_draft_forward_us"] > 0
