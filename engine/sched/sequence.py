"""A request's state inside the engine (plain Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common.hashing import ROOT_HASH, BlockHash, hash_block_chain
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sched.block_pool import KVBlock

if TYPE_CHECKING:
    from pdserve.engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its KV was freed and will be recomputed
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (OpenAI `logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, its KV blocks and how far its KV is computed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    hash_namespace: bytes
    arrival_s: float = field(default_factory=time.monotonic)  # time.monotonic() when added
    first_scheduled_s: float | None = None  # time.monotonic() of its first admission
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    hold_kv: bool = False  # prefill role: keep the blocks referenced after finishing
    # Structured output: where the output stands in its grammar (params.grammar's);
    # advanced by every appended token, so the engine that appends it stays in step.
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> bool:
        """Append a generated token; False when the grammar forbids it (the sequence
        then stops: scheduler.stop_reason)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        return self.grammar is None or self.grammar.advance(token_id)

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of the tokens so far (extended lazily)."""
        num_hashed = len(self.block_hashes)
        if num_hashed < self.num_tokens // block_size:
            parent = self.block_hashes[-1] if num_hashed else ROOT_HASH
            tokens = self.all_token_ids[num_hashed * block_size :]
            self.block_hashes += hash_block_chain(tokens, block_size, self.hash_namespace, parent)
        return self.block_hashes
