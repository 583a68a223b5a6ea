"""Sampling parameters end to end on the demo model: seeds, filters, stops, logprobs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.common.errors import InvalidRequestError, PromptTooLongError
from pdserve.engine import LLM, SamplingParams

PROMPTS = ["The river bends", "Bread needs time", "A machine that hums at night"]


@pytest.fixture(scope="module")
def llm(demo_model_dir: Path) -> LLM:
    return LLM(demo_model_dir, dtype="float32", max_model_len=256)


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_seeded_sampling_ignores_batch_composition(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[0]], seeded)
    others = [
        SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True),
        seeded,
        SamplingParams(max_tokens=20, temperature=1.2, seed=3, ignore_eos=True),
    ]
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], others)
    assert batch[1].token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    (different,) = llm.generate([PROMPTS[0]], other_seed)
    assert different.token_ids != alone.token_ids
    llm.engine.block_pool.check_no_leaks()


def test_filters_that_leave_one_token_are_greedy(llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[0]], greedy())
    for params in (
        SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1e-4, seed=1, ignore_eos=True),
    ):
        (out,) = llm.generate([PROMPTS[0]], params)
        assert out.token_ids == ref.token_ids, params


def test_top_k_restricts_to_the_k_most_likely(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=5.0, top_k=3, seed=5, logprobs=3)
    (out,) = llm.generate([PROMPTS[2]], params)
    assert out.logprobs is not None
    for step in out.logprobs:
        assert step.token_id in {token_id for token_id, _ in step.top}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"logprobs": 21},
        {"stop": ["x"] * 17},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_params_raise_clear_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_string_ends_generation_and_is_not_emitted(llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[1]], greedy(32))
    stop = ref.text[6:9]
    cut = ref.text.find(stop)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop])
    (out,) = llm.generate([PROMPTS[1]], params)
    assert out.text == ref.text[:cut]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < len(ref.token_ids)


def test_streamed_text_concatenates_and_holds_back_stop_strings(llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[1]], greedy(32))
    stop = ref.text[10:14]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop])
    engine = llm.engine
    engine.add_request("stream-1", PROMPTS[1], params, stream=True)
    deltas, last = [], None
    while engine.has_unfinished:
        for out in engine.step():
            deltas.append(out.new_text)
            last = out
    assert last is not None and last.finished
    assert "".join(deltas) == ref.text[: ref.text.find(stop)] == last.text
    engine.block_pool.check_no_leaks()


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    (ref,) = llm.generate([PROMPTS[0]], greedy(24))
    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    (out,) = llm.generate([PROMPTS[0]], params)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    (short,) = llm.generate([PROMPTS[0]], greedy(3))
    assert short.token_ids == ref.token_ids[:3]
    assert short.finish_reason == "length"


def test_logprobs_match_transformers(demo_model_dir: Path, llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    prompt = llm.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=4)
    (out,) = llm.generate([prompt], params)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert out.logprobs is not None and len(out.logprobs) == 6
    for step, logits in zip(out.logprobs, ref.logits, strict=True):
        ref_logprobs = logits[0].float().log_softmax(-1)
        top_vals, top_ids = ref_logprobs.topk(4)
        assert [t for t, _ in step.top] == top_ids.tolist()
        assert step.token_id == top_ids[0].item()
        assert step.logprob == pytest.approx(ref_logprobs[step.token_id].item(), abs=1e-4)
        for (_, value), expected in zip(step.top, top_vals.tolist(), strict=True):
            assert value == pytest.approx(expected, abs=1e-4)


def test_text_and_token_prompts_agree(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_text, by_ids = llm.generate([PROMPTS[0], ids], greedy(8))
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids


def test_bad_prompts_are_refused_and_nothing_runs(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], greedy())
    with pytest.raises(PromptTooLongError):
        llm.generate([PROMPTS[0], [5] * 256], greedy())
    assert not llm.engine.has_unfinished
    llm.engine.block_pool.check_no_leaks()


def test_seeded_tokens_survive_preemption(demo_model_dir: Path) -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=11 + i, ignore_eos=True)
        for i in range(3)
    ]
    roomy = LLM(demo_model_dir, dtype="float32", max_model_len=128)
    tight = LLM(demo_model_dir, dtype="float32", max_model_len=128, num_kv_blocks=9)
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    got = [o.token_ids for o in tight.generate(PROMPTS, params)]
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert got == expected
    tight.engine.block_pool.check_no_leaks()


def test_extreme_but_legal_sampling_values_never_break_a_step() -> None:
    """Found by fuzzing the router: each of these once raised inside the engine's step."""
    from pdserve.engine.sampler import Sampler

    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=1e-300, seed=1),  # 0 in float32: greedy
        SamplingParams(top_p=5e-324, seed=2),  # 0 in float32: keeps the top token
        SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3),
    ]
    out = sampler(logits, [0, 0, 0], params)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == int(logits[1].argmax())
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**70)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.9),
    ],
    ids=["plain", "top_k", "top_p", "both"],
)
@pytest.mark.parametrize("seed", [None, 11])
def test_draws_follow_the_filtered_tempered_distribution(
    params: SamplingParams, seed: int | None
) -> None:
    """Each token is drawn with its probability (5-sigma bounds), from the engine's
    generator or, seeded, across positions."""
    from pdserve.engine.sampler import Sampler

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    # The reference: tempered softmax, top-k, then top-p on the sorted probabilities.
    probs = (logits / params.temperature).softmax(-1)
    if params.top_k:
        probs[probs.argsort(descending=True)[params.top_k :]] = 0
        probs /= probs.sum()
    order = probs.argsort(descending=True)
    above = probs[order].cumsum(0) - probs[order]
    probs[order[above >= params.top_p]] = 0
    probs /= probs.sum()

    n = 40_000
    params = dataclasses.replace(params, seed=seed)
    out = Sampler(0, torch.device("cpu"))(logits.repeat(n, 1), list(range(n)), [params] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    sigma = (n * probs * (1 - probs)).sqrt()
    assert counts[probs == 0].sum() == 0
    assert ((counts - n * probs).abs() <= 5 * sigma + 1e-9).all(), (counts / n, probs)


def test_a_seeded_draw_does_not_depend_on_the_other_rows_filters() -> None:
    from pdserve.engine.sampler import Sampler

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=7)
    alone = Sampler(0, torch.device("cpu"))(logits[:1], [3], [seeded]).token_ids
    for other in (SamplingParams(top_k=50, seed=1), SamplingParams(top_p=0.5), seeded):
        batch = Sampler(1, torch.device("cpu"))(logits, [3, 9, 4], [seeded, other, other])
        assert batch.token_ids[0] == alone[0]
