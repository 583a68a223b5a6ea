"""The demo model folder and the checkpoint fixtures, checked against `transformers`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import demo_model
from pdserve.engine.demo_model import (
    DEMO_MODEL_VERSION,
    SPECIAL_TOKENS,
    default_model_dir,
    resolve_model,
    write_demo_model,
)

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


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = _digests(write_demo_model(tmp_path / "a", seed=0))
    second = _digests(write_demo_model(tmp_path / "b", seed=0))
    other_seed = _digests(write_demo_model(tmp_path / "c", seed=1))

    assert set(first) == EXPECTED_FILES
    assert first == second
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


def test_another_process_writes_identical_bytes(tmp_path: Path, demo_model_dir: Path) -> None:
    """Rust hash maps are seeded per process: tokenizer training must not depend on that."""
    script = (
        "import sys; from pdserve.engine.demo_model import write_demo_model as w; w(sys.argv[1])"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], check=True, env=env)
    assert _digests(tmp_path / "m") == _digests(demo_model_dir)


def test_rewrite_replaces_folder_and_leaves_no_temp(tmp_path: Path) -> None:
    out = tmp_path / "model"
    write_demo_model(out, seed=1)
    write_demo_model(out, seed=0)

    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert _digests(out) == _digests(write_demo_model(tmp_path / "fresh", seed=0))


def test_loads_with_transformers(demo_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)

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
def test_tokenizer_round_trips(demo_model_dir: Path, text: str) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))

    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert ids == hf_tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text  # skip_special_tokens defaults to True
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    plain_ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert plain_ids == ids[1:]
    assert hf_tokenizer.decode(plain_ids) == text


def test_chat_template_renders_chatml(demo_model_dir: Path) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
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
    tokenizer = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
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
    make_checkpoint: Callable[..., Path], demo_model_dir: Path, arch: str
) -> None:
    folder = make_checkpoint(arch)

    assert make_checkpoint(arch) == folder  # cached within the session
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == 512
    assert (folder / "model.safetensors").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (folder / name).read_bytes() == (demo_model_dir / name).read_bytes()
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


def test_resolve_model_uses_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    expected = tmp_path / f"demo-model-{DEMO_MODEL_VERSION}"

    assert resolve_model("demo") == expected
    assert set(p.name for p in expected.iterdir()) == EXPECTED_FILES
    mtime_ns = (expected / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None) == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime_ns  # not rewritten
    assert resolve_model("/some/local/folder") == Path("/some/local/folder")
    assert resolve_model(tmp_path) == tmp_path


def test_racing_default_model_dir_writes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    writes: list[Path] = []
    real_write = demo_model.write_demo_model

    def counting_write(out_dir: Path, seed: int = 0) -> Path:
        writes.append(Path(out_dir))
        return real_write(out_dir, seed)

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
