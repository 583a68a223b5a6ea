"""Speculative decoding's settings: `EngineConfig.speculative` parsed, and the check
that a draft model fits its target. Torch-free: the router and the cluster's preflight
read them (the proposers are engine/spec_decode/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import CheckpointError
from pdserve.common.model_config import ModelConfig, load_model_config

MAX_PROPOSAL_LEN = 8
MAX_NGRAM = 16
DEFAULT_PROPOSAL_LEN = 4
DEFAULT_NGRAM = 3
_FORMS = (
    "'ngram', 'ngram:k=K' or 'ngram:k=K,n=N[,adaptive=on|off]' (prompt lookup), or"
    " 'draft:PATH[,k=K][,adaptive=on|off]' (a draft model's folder)"
)
_SWITCH = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Parsed `EngineConfig.speculative`.

    `method`: "ngram" (prompt lookup) or "draft" (a draft model, `draft_model` its folder).
    `num_speculative_tokens` (k): the most tokens proposed for one sequence in one step.
    `max_ngram` (n): the longest suffix the prompt-lookup proposer matches (it tries n,
    n-1, ..., 1).
    `adaptive`: verify only as many of a proposal's tokens as pay for themselves, from
    each sequence's acceptance so far and the engine's measured step costs
    (`SpecPolicy`); off: verify every proposed token.
    """

    method: str
    num_speculative_tokens: int = DEFAULT_PROPOSAL_LEN
    max_ngram: int = DEFAULT_NGRAM
    adaptive: bool = True
    draft_model: str | None = None

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """`"ngram"`, `"ngram:k=4"`, `"ngram:k=4,n=3"`, `"ngram:k=4,adaptive=off"` (k in
        1..8, n in 1..16, adaptive on or off, by default k=4, n=3, adaptive on);
        `"draft:PATH"`, `"draft:PATH,k=4,adaptive=off"` (PATH a draft model's folder,
        checked when the engine starts: `check_draft_checkpoint`).

        Raises ValueError naming what is wrong.
        """
        method, _, rest = spec.strip().partition(":")
        method = method.strip()
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative={spec!r}: unknown method {method!r}; use {_FORMS}")
        parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
        draft_model = None
        if method == "draft":
            draft_model = parts.pop(0) if parts else ""
            if not draft_model or "=" in draft_model:
                raise ValueError(
                    f"speculative={spec!r}: the draft model's folder must come first"
                    f" ('draft:PATH[,k=K][,adaptive=on|off]')"
                )
        keys = ("k", "n", "adaptive") if method == "ngram" else ("k", "adaptive")
        expected = "k=K, n=N or adaptive=on|off" if method == "ngram" else "k=K or adaptive=on|off"
        values: dict[str, int] = {}
        adaptive: bool | None = None
        for part in parts:
            key, eq, raw = (s.strip() for s in part.partition("="))
            if key not in keys or not eq:
                raise ValueError(
                    f"speculative={spec!r}: expected {expected}, got {part!r}; use {_FORMS}"
                )
            if key in values or (key == "adaptive" and adaptive is not None):
                raise ValueError(f"speculative={spec!r}: {key} is given twice")
            if key == "adaptive":
                if raw.lower() not in _SWITCH:
                    raise ValueError(
                        f"speculative={spec!r}: adaptive must be on or off, got {raw!r}"
                    )
                adaptive = _SWITCH[raw.lower()]
                continue
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(
                    f"speculative={spec!r}: {key} must be an integer, got {raw!r}"
                ) from None
        k = values.get("k", DEFAULT_PROPOSAL_LEN)
        n = values.get("n", DEFAULT_NGRAM)
        if not 1 <= k <= MAX_PROPOSAL_LEN:
            raise ValueError(
                f"speculative={spec!r}: k (tokens proposed per step) must be in"
                f" 1..{MAX_PROPOSAL_LEN}, got {k}"
            )
        if not 1 <= n <= MAX_NGRAM:
            raise ValueError(
                f"speculative={spec!r}: n (longest n-gram matched) must be in 1..{MAX_NGRAM},"
                f" got {n}"
            )
        return cls(method, k, n, True if adaptive is None else adaptive, draft_model)


def check_draft_checkpoint(draft_dir: Path, target: ModelConfig, target_dir: Path) -> ModelConfig:
    """The draft model's config, once its folder is found fit to propose for `target`
    (whose folder is `target_dir`): a supported checkpoint (config.json) of the same
    vocabulary size, and, when both folders have a tokenizer.json, the same vocabulary
    (token -> id). Proposals are token ids: a draft with other ids would propose
    nonsense, so it is refused rather than left to be rejected every step.

    Raises CheckpointError naming the folder and the problem. Loads no tensor (the
    cluster's preflight runs it where torch is not imported).
    """
    what = f"speculative draft model {draft_dir}"
    if not draft_dir.is_dir():
        raise CheckpointError(f"{what}: no such folder")
    try:
        draft = load_model_config(draft_dir)
    except CheckpointError as exc:
        raise CheckpointError(f"{what}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"{what}: vocab_size {draft.vocab_size} differs from the target model's"
            f" {target.vocab_size}; a draft must share the target's vocabulary"
        )
    mine, theirs = draft_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
        from tokenizers import Tokenizer as HFTokenizer

        ours = HFTokenizer.from_file(str(mine)).get_vocab(with_added_tokens=True)
        theirs_vocab = HFTokenizer.from_file(str(theirs)).get_vocab(with_added_tokens=True)
        if ours != theirs_vocab:
            differ = sum(ours.get(t) != theirs_vocab.get(t) for t in ours.keys() | theirs_vocab)
            raise CheckpointError(
                f"{what}: its tokenizer's vocabulary differs from the target model's"
                f" ({differ} tokens have another id or none); a draft must share the"
                " target's tokenizer"
            )
    return draft
