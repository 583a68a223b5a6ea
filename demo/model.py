"""The built-in demo model, the default of every `--model`: a tiny Llama trained locally.

`write_demo_model` writes a complete Hugging Face model folder (config, generation config,
safetensors weights, a byte-level BPE tokenizer trained on the packaged demo corpus, and a
ChatML chat template) from nothing but that corpus and a seed, so demos and tests never
touch a model hub. The weights are trained on the corpus (demo_training.py, about 40 s
on one core), so a newcomer's first completion reads as words, mostly the corpus's own,
and a chat reply is a sentence that ends the turn; the same seed gives byte-identical
files on one machine (not across machines: float rounding follows the CPU's kernels).
`default_model_dir` trains it once and caches it under `$PDSERVE_CACHE_DIR`.

`write_random_model` writes the same format with random weights (and a 512-token
vocabulary) in well under a second: the checkpoint for tests and benchmarks that need a
model, not sensible text. Every serving path must produce exactly the tokens
`transformers` does, for either.

This module is runtime code: it uses torch, safetensors, tokenizers and jinja2, never
transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.demo.training import ModelShape, TrainConfig, train_demo_weights

DEMO_MODEL_VERSION = "v2"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"

# NOTE: the order fixes the ids: <unk>=0, <s>=1, </s>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN = SPECIAL_TOKENS
MAX_POSITION_EMBEDDINGS = 2048

# ChatML, with tools as Qwen 2.5 and Hermes render them (in fewer words: a small model's
# context is short): a system turn lists the functions' JSON schemas in <tools></tools>, an
# assistant's calls are JSON objects in <tool_call> tags (the "hermes" tool-call format,
# router/tool_calls.py), and a tool's result is a `tool` turn. Without tools, every
# conversation renders exactly as the plain ChatML template the demo was trained on did.
TOOLS_PREAMBLE = "# Tools\n\nYou may call these functions:\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each call, return a json object within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + repr(TOOLS_PREAMBLE) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + repr(TOOLS_INSTRUCTIONS + "<|im_end|>\n") + " }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The random-weights model (`write_random_model`): what the demo was before it was trained.
RANDOM_SHAPE = ModelShape(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
INIT_STD = 0.02
NORM_NOISE_STD = 0.05

# The trained demo. A 2048-token vocabulary makes three quarters of the corpus's words
# single tokens, so even a model this small mostly emits whole words. The schedule was
# tuned by the loss on the corpus it reaches within the time budget (a newcomer's first
# `pdserve up` waits for it, and CI builds it twice); docs/measurements.md has the runs.
DEMO_SHAPE = dataclasses.replace(RANDOM_SHAPE, vocab_size=2048)
DEMO_TRAINING = TrainConfig(
    shape=DEMO_SHAPE,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    seq_len=128,
    batch_size=8,
    steps=300,
    peak_lr=5e-3,
    final_lr=5e-4,
    warmup_steps=30,
    weight_decay=0.0,  # no decay: memorising the corpus is the point
    init_std=INIT_STD,
    seed=0,
    # NOTE: one thread, always: the bytes depend on the thread count (float reductions
    # split differently); docs/measurements.md has the rest.
    num_threads=1,
)
EXPECTED_TRAIN_S = 40  # on one core of the 2-core CI machine; only for the message

# Files whose presence marks a finished folder (folders appear only by atomic rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_QUESTION_ANSWER = re.compile(r"^Question: (.+)\nAnswer: (.+)$", re.MULTILINE)
_SENTENCE_START = re.compile(r"[.!?][\"')]?[ \t]+|\n+")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))[ \t]+")

Progress = Callable[[str], None]


def print_progress(message: str) -> None:
    """The default progress sink: a line on stderr (stdout may be a pipe a caller reads)."""
    print(message, file=sys.stderr, flush=True)


def write_demo_model(
    out_dir: str | Path, seed: int = 0, progress: Progress | None = print_progress
) -> Path:
    """Train the demo model and write its folder to `out_dir`; return the path.

    Trains for about EXPECTED_TRAIN_S seconds; `progress` gets a line now and then.
    The same seed gives byte-identical files on one machine (see demo_training). The
    files are built in a temporary sibling folder and renamed into place, so a crash
    never leaves a half-written `out_dir`. An existing `out_dir` is replaced.
    """
    return _write_atomically(out_dir, lambda tmp: _write_trained(tmp, seed, progress))


def write_random_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weights Llama folder in the demo's format (vocabulary of 512, the
    same special tokens and chat template) to `out_dir`, in well under a second.

    For tests and benchmarks that need a checkpoint and a tokenizer, not sensible text.
    The same seed gives byte-identical files; the write is atomic as `write_demo_model`'s.
    """
    return _write_atomically(out_dir, lambda tmp: _write_random(tmp, seed))


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Return the cached demo model folder, training it on first use.

    `cache_dir` (default `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`) /
    `demo-model-{DEMO_MODEL_VERSION}`. A file lock makes racing processes train it once;
    all of them return a valid folder. Training prints its progress on stderr.
    """
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve"
    root = Path(cache_dir).expanduser().absolute()
    model_dir = root / f"demo-model-{DEMO_MODEL_VERSION}"
    if _is_complete(model_dir):
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(model_dir.with_name(f".{model_dir.name}.lock")):
        if not _is_complete(model_dir):
            print_progress(f"training the demo model (first use, ~{EXPECTED_TRAIN_S} s)")
            write_demo_model(model_dir)
            print_progress(f"cached the demo model in {model_dir}")
    return model_dir


def copy_demo_model(out_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Copy the cached demo model (training it first if it is not cached) to `out_dir`.

    `pdserve demo-model DIR`: the same bytes as the cache, without a second training.
    The copy is atomic as `write_demo_model`'s.
    """
    source = default_model_dir(cache_dir)

    def copy(tmp: Path) -> None:
        shutil.copytree(source, tmp, dirs_exist_ok=True)

    return _write_atomically(out_dir, copy)


def resolve_model(model: str | Path | None) -> Path:
    """Map a `--model` value to a folder: None or "demo" is the demo model; else a path.

    There are no hub lookups; the checkpoint loader validates the folder.
    """
    if model is None or str(model) == "demo":
        return default_model_dir()
    return Path(model).expanduser()


def _write_atomically(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must stay readable
        write(tmp)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_trained(model_dir: Path, seed: int, progress: Progress | None) -> None:
    tokenizer = _train_tokenizer(DEMO_SHAPE.vocab_size)
    config = dataclasses.replace(DEMO_TRAINING, seed=seed)
    examples = training_examples(tokenizer, _corpus(), config.seq_len)
    started = time.monotonic()

    def report(step: int, loss: float) -> None:
        if progress is not None:
            elapsed = time.monotonic() - started
            progress(f"  step {step}/{config.steps}, loss {loss:.2f}, {elapsed:.0f} s")

    weights = train_demo_weights(examples, config, report)
    _write_folder(model_dir, tokenizer, DEMO_SHAPE, weights)


def _write_random(model_dir: Path, seed: int) -> None:
    tokenizer = _train_tokenizer(RANDOM_SHAPE.vocab_size)
    _write_folder(model_dir, tokenizer, RANDOM_SHAPE, _random_weights(RANDOM_SHAPE, seed))


def _write_folder(
    model_dir: Path, tokenizer: Tokenizer, shape: ModelShape, weights: dict[str, torch.Tensor]
) -> None:
    ids = _write_tokenizer_files(model_dir, tokenizer)
    _write_json(model_dir / "config.json", _model_config(ids, shape))
    save_file(weights, str(model_dir / "model.safetensors"), {"format": "pt"})


def write_random_tokenizer(
    model_dir: Path, vocab_size: int = RANDOM_SHAPE.vocab_size
) -> dict[str, int]:
    """Write the random model's tokenizer files (vocabulary 512, or a tokenizer trained
    the same way to `vocab_size`) and generation config into `model_dir`; return the
    special tokens' ids. In well under a second: for model folders without weights
    (`demo/dummy.py`), and test checkpoints that need another tokenizer."""
    return _write_tokenizer_files(model_dir, _train_tokenizer(vocab_size))


def _write_tokenizer_files(model_dir: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """tokenizer.json, its config, the special tokens and the generation config (eos ids);
    returns the special tokens' ids."""
    tokenizer.save(str(model_dir / "tokenizer.json"), pretty=True)
    ids = {token: _token_id(tokenizer, token) for token in SPECIAL_TOKENS}
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config(ids))
    _write_json(model_dir / "special_tokens_map.json", _special_tokens_map())
    generation_config = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
    }
    _write_json(model_dir / "generation_config.json", generation_config)
    return ids


def _corpus() -> str:
    corpus = resources.files("pdserve.demo.data").joinpath("demo_corpus.txt")
    return corpus.read_text(encoding="utf-8")


def training_examples(tokenizer: Tokenizer, text: str, seq_len: int) -> list[list[int]]:
    """The demo's training examples: token id lists of seq_len + 1 (or fewer at the end).

    Text: a window from every sentence and paragraph start, after <s> as a prompt is, so
    "The river" (no leading space, unlike mid-sentence " The") continues as the corpus
    does. Chat: one-sentence exchanges rendered with the chat template, packed into
    windows: each corpus question with its answer's first sentence, and each sentence of
    a paragraph answered by the next. A reply is one sentence and <|im_end|>, a pattern a
    model this small learns quickly, so a chat answer ends by itself.
    """
    examples = []
    starts = {0} | {match.end() for match in _SENTENCE_START.finditer(text)}
    for start in sorted(starts):
        # The corpus averages under 4 characters a token: 16 a token is plenty (a start
        # this leaves short is near the end, and covered by earlier windows).
        ids = tokenizer.encode(text[start : start + 16 * seq_len]).ids
        if len(ids) > seq_len:
            examples.append(ids[: seq_len + 1])
    template = jinja2.Template(CHAT_TEMPLATE)
    chats: list[int] = []
    for user, assistant in _chat_pairs(text):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rendered = template.render(messages=messages, bos_token=BOS_TOKEN)
        chats += tokenizer.encode(rendered, add_special_tokens=False).ids
    examples += [chats[i : i + seq_len + 1] for i in range(0, len(chats) - 1, seq_len)]
    return examples


def _chat_pairs(text: str) -> list[tuple[str, str]]:
    """(user, assistant) sentence pairs: each question and its answer's first sentence,
    then each pair of consecutive sentences in a paragraph."""
    pairs = []
    for question, answer in _QUESTION_ANSWER.findall(text):
        pairs.append((question, _SENTENCE_END.split(answer, maxsplit=1)[0]))
    for paragraph in text.splitlines():
        if paragraph.startswith(("Question: ", "Answer: ")):
            continue
        sentences = _SENTENCE_END.split(paragraph.strip())
        pairs += itertools.pairwise(sentences)
    return pairs


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    # NOTE: BPE training is deterministic across processes and thread counts (checked with
    # RAYON_NUM_THREADS=1..8): merges are picked by count with ties broken by pair ids.
    text = _corpus()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
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
    if tokenizer.get_vocab_size() != vocab_size:
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


def _model_config(ids: dict[str, int], shape: ModelShape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "rms_norm_eps": DEMO_TRAINING.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": DEMO_TRAINING.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }


def _random_weights(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn = shape.hidden_size, shape.intermediate_size

    def normal(*dims: int) -> torch.Tensor:
        return torch.randn(dims, generator=gen, dtype=torch.float32) * INIT_STD

    def norm_weight() -> torch.Tensor:
        # Not all ones, so a loader that skips a norm weight gives different tokens.
        return 1.0 + torch.randn(hidden, generator=gen) * NORM_NOISE_STD

    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, hidden)}
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.input_layernorm.weight"] = norm_weight()
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_size, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_size)
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm_weight()
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(ffn, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(ffn, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, ffn)
    weights["model.norm.weight"] = norm_weight()
    weights["lm_head.weight"] = normal(shape.vocab_size, hidden)
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
