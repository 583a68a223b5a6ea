"""A tiny, deterministic Llama checkpoint built locally: the default of every `--model`.

`write_demo_model` writes a complete Hugging Face model folder (config, generation config,
safetensors weights, a byte-level BPE tokenizer trained on the packaged demo corpus, and a
ChatML chat template) from nothing but a seed, so demos and tests never touch a model hub.
The same seed gives byte-identical files. The weights are random: the model talks
gibberish, but every serving path must produce exactly the tokens `transformers` does.

This module is runtime code: it uses torch, safetensors and tokenizers, never transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEMO_MODEL_VERSION = "v1"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"

# NOTE: the order fixes the ids: <unk>=0, <s>=1, </s>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN = SPECIAL_TOKENS
VOCAB_SIZE = 512

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 352
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITION_EMBEDDINGS = 2048
INIT_STD = 0.02
NORM_NOISE_STD = 0.05

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files whose presence marks a finished folder (folders appear only by atomic rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def write_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo model folder to `out_dir` and return its path.

    The files are built in a temporary sibling folder and renamed into place, so a crash
    never leaves a half-written `out_dir`. An existing `out_dir` is replaced.
    """
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must stay readable
        _write_files(tmp, seed)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    """Return the cached demo model folder, writing it on first use.

    `$PDSERVE_CACHE_DIR` (else `~/.cache/pdserve`) / `demo-model-{DEMO_MODEL_VERSION}`.
    A file lock makes racing processes write it once; all of them return a valid folder.
    """
    cache_dir = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve")
    model_dir = cache_dir.expanduser().absolute() / f"demo-model-{DEMO_MODEL_VERSION}"
    if _is_complete(model_dir):
        return model_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(model_dir.with_name(f".{model_dir.name}.lock")):
        if not _is_complete(model_dir):
            write_demo_model(model_dir)
    return model_dir


def resolve_model(model: str | Path | None) -> Path:
    """Map a `--model` value to a folder: None or "demo" is the demo model; else a path.

    There are no hub lookups; the checkpoint loader validates the folder.
    """
    if model is None or str(model) == "demo":
        return default_model_dir()
    return Path(model).expanduser()


def _write_files(model_dir: Path, seed: int) -> None:
    tokenizer = _train_tokenizer()
    tokenizer.save(str(model_dir / "tokenizer.json"), pretty=True)
    ids = {token: _token_id(tokenizer, token) for token in SPECIAL_TOKENS}
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(model_dir / "special_tokens_map.json", _special_tokens_map())
    _write_json(model_dir / "config.json", _model_config(ids))
    generation_config = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
    }
    _write_json(model_dir / "generation_config.json", generation_config)
    save_file(_random_weights(seed), str(model_dir / "model.safetensors"), {"format": "pt"})


def _train_tokenizer() -> Tokenizer:
    # NOTE: BPE training is deterministic across processes and thread counts (checked with
    # RAYON_NUM_THREADS=1..8): merges are picked by count with ties broken by pair ids.
    corpus = resources.files("pdserve.engine.data").joinpath("demo_corpus.txt")
    text = corpus.read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    # The same template transformers builds from add_bos_token=True, add_eos_token=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer has {tokenizer.get_vocab_size()} tokens")
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"demo tokenizer lacks {token!r}")
    return int(token_id)


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added_tokens = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK_TOKEN,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
    }


def _model_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD

    def norm_weight() -> torch.Tensor:
        # Not all ones, so a loader that skips a norm weight gives different tokens.
        return 1.0 + torch.randn(HIDDEN_SIZE, generator=gen) * NORM_NOISE_STD

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.input_layernorm.weight"] = norm_weight()
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_size, HIDDEN_SIZE)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, q_size)
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    weights["model.norm.weight"] = norm_weight()
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return weights


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


def _move_into_place(tmp: Path, out: Path) -> None:
    try:
        tmp.rename(out)  # atomic; fails if `out` exists and is not empty
        return
    except OSError:
        if not out.exists():
            raise
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        out.rename(old / out.name)
        tmp.rename(out)
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
