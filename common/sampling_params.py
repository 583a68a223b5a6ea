"""Per-request sampling parameters (plain Python, validated on construction)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.errors import InvalidRequestError

if TYPE_CHECKING:
    from pdserve.common.grammar import GrammarSpec

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_CACHE_SALT_LEN = 256
# Below this a temperature samples greedily (vLLM's _SAMPLING_EPS): dividing float32
# logits by a smaller one overflows to inf/NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. `top_k` 0 (or -1) and `top_p` 1 disable those filters.
    A `seed` makes the request's tokens depend only on the seed, never on which other
    requests share its batch. `stop` strings end generation and are not emitted.

    `priority` is not about sampling: it orders the engine's waiting queue and picks
    preemption victims (larger is more important, unlike vLLM where smaller goes first;
    see `scheduler.py`). It rides here because these parameters already travel with the
    request to every worker, prefill and decode alike.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Not a sampling setting: the tenant namespace the request's KV blocks are hashed in
    # (common/hashing.py). It rides here because these params reach every engine that
    # hashes the request's blocks (router, prefill and decode workers, resumes).
    cache_salt: str | None = None
    # Not a sampling setting either: the LoRA adapter the request runs with (None: the
    # base model), by the name it was loaded under (LLMEngine.load_lora). Its blocks are
    # hashed in a namespace of their own: no KV is shared across adapters.
    lora: str | None = None
    priority: int = 0
    # Parallel sampling: choices of one request sharing its prompt's KV. The engine
    # serves one sequence per call; its caller forks the others (`LLMEngine.fork_request`,
    # decode_worker/worker.py), choice i seeded `seed + i` (`choice_params`).
    n: int = 1
    # Structured output: the grammar every sampled token must keep the output within
    # (engine/grammar.py). A description, never a compiled object: these params are
    # pickled to the prefill and decode workers, and each compiles (and caches) its own.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for problem in self._problems():
            raise InvalidRequestError(problem)

    def _problems(self) -> list[str]:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                -1 <= self.top_k < 2**31,
                f"top_k must be -1, 0 or positive (below 2**31), got {self.top_k}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            ),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
            ),
            (
                all(0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop),
                f"stop strings must be 1 to {MAX_STOP_STRING_LEN} characters",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (
                self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LEN,
                f"cache_salt must be 1 to {MAX_CACHE_SALT_LEN} characters",
            ),
            (
                self.lora is None or 0 < len(self.lora) <= MAX_CACHE_SALT_LEN,
                f"a LoRA adapter's name must be 1 to {MAX_CACHE_SALT_LEN} characters",
            ),
        ]
        return [message for ok, message in checks if not ok]

    def choice_params(self, index: int) -> SamplingParams:
        """Choice `index`'s own parameters (n = 1): with a request seed S, seeded S + index,
        so choice i of an n-request returns exactly what an n = 1 request with seed S + i
        does; without one, every choice draws independently."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
