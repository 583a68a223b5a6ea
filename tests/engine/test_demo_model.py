"""The demo model (trained) and the random-weights model, checked against `transformers`.

The trained demo is built once per session (`trained_demo_dir`, about 40 s) and
once more by the determinism test; everything else that only needs a checkpoint uses the
random model, written in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.demo import model as demo_model
from pdserve.demo.model import (
    CACHE_DIR_ENV,
    DEMO_MODEL_VERSION,
    DEMO_SHAPE,
    DEMO_TRAINING,
    SPECIAL_TOKENS,
    default_model_dir,
    resolve_model,
    write_random_model,
)
from pdserve.demo.training import LlamaForTraining
from pdserve.engine import LLM, SamplingParams

if TYPE_CHECKING:
    from tests.conftest import DemoRebuild

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
ROUND_TRIP_TEXTS = [
    "The river winds across the valley.",
    "café ☕ naïve Zürich, 東京",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<b>markup</b> & symbols: 50% off, $3.14 → ∞ 🙂",
]
PROMPTS = ["The river", "Bread", "A machine", "The weather today", "Once upon a time"]
CORPUS = (Path(demo_model.__file__).parent / "data" / "demo_corpus.txt").read_text()
CORPUS_WORDS = set(re.findall(r"[a-z']+", CORPUS.lower()))
TEXT_CHARS = re.compile(r"[A-Za-z\s.,;:!?'\"()\-]")
BUILD_TIMEOUT_S = 600  # one training in a subprocess, on a busy 2-core machine


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _wordlike(text: str) -> tuple[float, float]:
    """(share of characters that are letters, spaces or punctuation, share of the words
    that occur in the demo corpus)."""
    words = re.findall(r"[a-z']+", text.lower())
    chars = len(TEXT_CHARS.findall(text)) / max(1, len(text))
    return chars, sum(word in CORPUS_WORDS for word in words) / max(1, len(words))


# -- the trained demo ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_llm(trained_demo_dir: Path) -> LLM:
    return LLM(trained_demo_dir, dtype="float32", max_model_len=256)


def test_demo_completions_are_words(
    trained_demo_dir: Path, demo_llm: LLM, hf_greedy: Callable[..., Any]
) -> None:
    """The issue's acceptance test: greedy completions read as words, mostly the corpus's;
    and the engine serves the trained model token-exactly as transformers does."""
    llm = demo_llm
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    texts = [out.text for out in outputs]
    chars, known = _wordlike(" ".join(texts))
    assert chars >= 0.8 and known >= 0.8, texts
    for text in texts:
        assert len(re.findall(r"[a-z]+", text.lower())) >= 8, texts  # says something
        assert "\ufffd" not in text, texts
    prompts = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
    assert [list(out.token_ids) for out in outputs] == hf_greedy(trained_demo_dir, prompts, 24)


def test_demo_chat_answers_and_stops(demo_llm: LLM) -> None:
    """Trained on the corpus's questions as chats: it answers in words and ends the turn."""
    llm = demo_llm
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = llm.tokenizer.encode_chat(messages)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=160, temperature=0))
    chars, known = _wordlike(out.text)
    assert chars >= 0.8 and known >= 0.8, out.text
    assert out.finish_reason == "stop", out.text  # <|im_end|>, before max_tokens


def test_demo_loads_with_transformers_as_trained(trained_demo_dir: Path) -> None:
    """The weights mean in transformers what they meant in training (demo_training's
    Llama): the same logits from the same files."""
    model = AutoModelForCausalLM.from_pretrained(trained_demo_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_demo_dir)

    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tokenizer) == model.config.vocab_size == DEMO_SHAPE.vocab_size
    special_ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert special_ids == [0, 1, 2, 3, 4]
    assert model.generation_config.eos_token_id == [2, 4]
    ours = LlamaForTraining(DEMO_TRAINING)
    ours.load_state_dict(load_file(trained_demo_dir / "model.safetensors"))
    ids = torch.tensor([tokenizer("The river widens and slows as it nears the sea.").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), model(ids).logits, rtol=1e-4, atol=1e-4)


def test_demo_build_is_deterministic_and_announced(
    trained_demo_dir: Path, demo_rebuild: DemoRebuild | None
) -> None:
    """A second build, by `pdserve generate` on an empty cache in another process, says it
    is training and writes the very bytes of the first. (The process is `demo_rebuild`,
    started by conftest.py alongside the first build, so that both train at once.)"""
    assert demo_rebuild is not None, "conftest.py starts it when this test is selected"
    cache = demo_rebuild.cache
    result = demo_rebuild.result(BUILD_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "training the demo model (first use, ~" in result.stderr
    assert re.search(r"step \d+/\d+, loss [\d.]+", result.stderr), result.stderr
    built = cache / f"demo-model-{DEMO_MODEL_VERSION}"
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [built.name]
    assert _digests(built) == _digests(trained_demo_dir)
    assert set(_digests(built)) == EXPECTED_FILES
    assert _wordlike(result.stdout)[1] >= 0.8, result.stdout


def test_demo_tokenizer_and_chat_template(trained_demo_dir: Path) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(trained_demo_dir)
    tokenizer = Tokenizer.from_file(str(trained_demo_dir / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == hf_tokenizer(text).input_ids and tokenizer.decode(ids) == text
    messages = [{"role": "user", "content": "Hi"}]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Whole words: the larger vocabulary is what lets a model this small write words.
    assert len(tokenizer.encode(" river", add_special_tokens=False).ids) == 1


# -- the cache --------------------------------------------------------------------------


def test_resolve_model_finds_the_cached_demo(
    trained_demo_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(trained_demo_dir.parent))
    mtime_ns = (trained_demo_dir / "model.safetensors").stat().st_mtime_ns

    assert trained_demo_dir.name == f"demo-model-{DEMO_MODEL_VERSION}"
    assert resolve_model("demo") == trained_demo_dir
    assert resolve_model(None) == trained_demo_dir
    assert (trained_demo_dir / "model.safetensors").stat().st_mtime_ns == mtime_ns
    assert "training" not in capsys.readouterr().err  # cached: nothing to announce
    assert resolve_model("/some/local/folder") == Path("/some/local/folder")
    assert resolve_model(trained_demo_dir.parent) == trained_demo_dir.parent


def test_an_older_version_in_the_cache_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """v1 (random weights) is left alone; the current version is built next to it."""
    old = write_random_model(tmp_path / "demo-model-v1")
    monkeypatch.setattr(demo_model, "write_demo_model", lambda out: write_random_model(out))

    built = default_model_dir(tmp_path)

    assert built == tmp_path / f"demo-model-{DEMO_MODEL_VERSION}" != old
    assert set(p.name for p in built.iterdir()) == EXPECTED_FILES
    assert "training the demo model (first use, ~" in capsys.readouterr().err


def test_racing_default_model_dir_writes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    writes: list[Path] = []

    def counting_write(out_dir: Path) -> Path:  # random weights: the lock is the subject
        writes.append(Path(out_dir))
        return write_random_model(out_dir)

    monkeypatch.setattr(demo_model, "write_demo_model", counting_write)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(writes) == 1
    assert len(set(results)) == 1 and len(results) == 3
    assert set(p.name for p in results[0].iterdir()) == EXPECTED_FILES


# -- the random-weights model ------------------------------------------------------------


def test_random_model_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = _digests(write_random_model(tmp_path / "a", seed=0))
    second = _digests(write_random_model(tmp_path / "b", seed=0))
    other_seed = _digests(write_random_model(tmp_path / "c", seed=1))

    assert set(first) == EXPECTED_FILES
    assert first == second
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


def test_another_process_writes_identical_bytes(tmp_path: Path, random_model_dir: Path) -> None:
    """Rust hash maps are seeded per process: tokenizer training must not depend on that."""
    script = "import sys; from pdserve.demo.model import write_random_model as w; w(sys.argv[1])"
    env = {**os.environ, "RAYON_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], check=True, env=env)
    assert _digests(tmp_path / "m") == _digests(random_model_dir)


def test_rewrite_replaces_folder_and_leaves_no_temp(tmp_path: Path) -> None:
    out = tmp_path / "model"
    write_random_model(out, seed=1)
    write_random_model(out, seed=0)

    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert _digests(out) == _digests(write_random_model(tmp_path / "fresh", seed=0))


def test_random_model_loads_with_transformers(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)

    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 32
    special_ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert special_ids == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    assert model.generation_config.eos_token_id == [2, 4]
    assert len(tokenizer) == model.config.vocab_size == 512
    assert tokenizer.model_max_length == 2048
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, torch.ones_like(norm))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(random_model_dir: Path, text: str) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    tokenizer = Tokenizer.from_file(str(random_model_dir / "tokenizer.json"))

    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert ids == hf_tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text  # skip_special_tokens defaults to True
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    plain_ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert plain_ids == ids[1:]
    assert hf_tokenizer.decode(plain_ids) == text


def test_chat_template_renders_chatml(random_model_dir: Path) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    # The template already holds <s>: rendered chat is encoded without special tokens.
    tokenizer = Tokenizer.from_file(str(random_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids.count(tokenizer.token_to_id("<s>")) == 1
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3
    assert ids.count(tokenizer.token_to_id("<|im_end|>")) == 2


def _greedy_tokens(folder: Path, num_tokens: int = 16) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([[1, 56, 263, 458, 271, 408, 87, 262, 71]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None)
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_make_checkpoint_builds_each_arch(
    make_checkpoint: Callable[..., Path], random_model_dir: Path, arch: str
) -> None:
    folder = make_checkpoint(arch)

    assert make_checkpoint(arch) == folder  # cached within the session
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == 512
    assert (folder / "model.safetensors").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (folder / name).read_bytes() == (random_model_dir / name).read_bytes()
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 4]
    tokens = _greedy_tokens(folder)
    assert len(set(tokens)) >= 4, f"degenerate greedy output {tokens}"
    if arch == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0


def test_make_checkpoint_shards(make_checkpoint: Callable[..., Path]) -> None:
    folder = make_checkpoint("llama", shard=True)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_names = set(index["weight_map"].values())
    assert len(shard_names) > 1
    assert all((folder / name).is_file() for name in shard_names)
    assert not (folder / "model.safetensors").exists()
    assert _greedy_tokens(folder) == _greedy_tokens(make_checkpoint("llama"))
