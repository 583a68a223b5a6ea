"""Structured output: grammars that constrain which tokens a request may sample.

The engine is llguidance (guidance-ai's Rust parser, also behind vLLM's and SGLang's
`guidance` backends). Chosen over xgrammar, measured on this repository's tokenizers
(benchmarks/structured.py): both compile our schemas in milliseconds and fill a batch-32
mask in well under a millisecond (xgrammar 0.07 ms, llguidance 0.2 ms with its thread
pool, against decode steps of tens of milliseconds), but llguidance imports neither
torch nor transformers, so the router (which never imports torch) validates a grammar
itself and answers a bad one with a 400 before any worker sees it, and it builds its
token tables from the checkpoint's `tokenizer.json` with no `transformers` at run time.

Three layers, reusable beyond JSON (tool calls build on them):

- `GrammarSpec` (pdserve/common/grammar.py): what the request asked for (kind + source
  text). Small, frozen and
  picklable: it rides in `SamplingParams` to the prefill and decode workers. Never a
  compiled object.
- `GrammarCompiler`: one per engine; turns a spec into a matcher, caching the compiled
  grammar per spec (LRU) so a repeated schema costs one copy.
- `GrammarMatcher`: one per request; `advance` with each accepted token, `fill_mask`
  for the next one, `rollback`, `is_terminated`.

`fill_bitmask` fills the masks of a batch of matchers at once (numpy int32, 32 tokens a
word, bit set = allowed); the sampler applies it to the logits on their own device
(engine/sampler.py, `apply_token_bitmask`). Plain Python and numpy here: no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import llguidance
import numpy as np
from numpy.typing import NDArray

from pdserve.common.errors import InvalidRequestError
from pdserve.common.grammar import (
    DEFAULT_CACHE_SIZE,
    KINDS,
    MAX_CHOICES,
    MAX_SOURCE_CHARS,
    GrammarKind,
    GrammarSpec,
)

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "KINDS",
    "MAX_CHOICES",
    "MAX_SOURCE_CHARS",
    "GrammarCompiler",
    "GrammarKind",
    "GrammarMatcher",
    "GrammarSpec",
    "fill_bitmask",
]


class GrammarMatcher:
    """One request's position in its grammar.

    `advance` takes each token the request appends (the first one included, on whichever
    worker sampled it); `fill_mask` writes the tokens allowed next. Terminated once the
    grammar is complete and nothing but EOS may follow, or once EOS is taken: the
    sequence then finishes (scheduler.stop_reason).
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher
        self.num_tokens = 0

    def advance(self, token_id: int) -> bool:
        """Take `token_id`; False when the grammar forbids it (the matcher is then in
        error and `is_terminated`)."""
        ok = bool(self._m.consume_token(token_id))
        self.num_tokens += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` advanced (speculative verification's rejects)."""
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def fill_mask(self, row: NDArray[np.int32]) -> None:
        """Write the allowed-next-token bits into `row` (one int32 per 32 tokens)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


class GrammarCompiler:
    """Makes matchers for one tokenizer; compiled grammars cached per spec (LRU).

    The token tables are built on the first constrained request (tenths of a second for
    a 32k vocabulary), so engines that never see one never pay it. Thread-safe: the
    workers' engine thread and an import thread may ask at once.
    """

    def __init__(
        self,
        tokenizer_json: str | Path,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = str(tokenizer_json)
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled grammar of `spec` (a matcher at its start: copy it, never advance
        it). Raises InvalidRequestError for a grammar the engine refuses."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return template
            self.misses += 1
            template = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
            if template.is_error():
                raise InvalidRequestError(
                    f"invalid {spec.kind.replace('_', ' ')}: {template.get_error()}"
                )
            self._cache[spec] = template
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return template

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec).deep_copy())


_executor: llguidance.LLExecutor | None = None


def fill_bitmask(matchers: Sequence[GrammarMatcher], vocab_size: int) -> NDArray[np.int32]:
    """The next-token masks of `matchers`, row i matcher i's: [len, ceil(vocab/32)] int32,
    bit t of word w set when token 32w + t is allowed. A batch's rows are filled in
    parallel by llguidance's thread pool (one per process, made on first use)."""
    global _executor
    words = (vocab_size + 31) // 32
    bitmask = np.empty((len(matchers), words), dtype=np.int32)
    if len(matchers) == 1:
        matchers[0].fill_mask(bitmask[0])
        return bitmask
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr(
        [(m._m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4, len(matchers)
    )
    return bitmask
