"""The request streams of `pdserve bench`: what each request sends and asks for.

A workload turns a seed and the served model's limits (`ModelInfo`) into a stream of
`RequestSpec`s. Synthetic workloads are endless (the caller stops after `--num-requests`
or `--duration`); a trace ends with its file. Synthetic prompts are token-id lists drawn
from a seeded RNG over the whole vocabulary, so the server tokenizes nothing and the
prompt length is exact; the same seed gives the same requests in the same order.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class ModelInfo:
    """What a workload needs of the served model (from `GET /v1/models` or flags)."""

    model_id: str
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    `prompt` is token ids (synthetic workloads, traces with `prompt_token_ids`) or text
    (traces with `prompt`); `prompt_len` is None for text, whose length only the server
    knows. `arrival_s` is the trace's timestamp (seconds from its start), else None.
    """

    index: int
    prompt: list[int] | str
    output_len: int
    kind: str = ""
    arrival_s: float | None = None
    repeat_of: int | None = None  # `with_repeats`: the index of the request it resends
    priority: int | None = None  # the request's `priority` field (None: not sent)

    @property
    def prompt_len(self) -> int | None:
        return None if isinstance(self.prompt, str) else len(self.prompt)


class Workload:
    """Base of the workloads: `requests(model, seed)` yields `RequestSpec`s in order.

    Implementations are frozen dataclasses of their parameters (recorded in bench.json).
    `requests` raises ValueError when the parameters cannot fit the model's context.
    """

    name: ClassVar[str] = ""

    def requests(self, model: ModelInfo, seed: int) -> Iterator[RequestSpec]:
        raise NotImplementedError


def _token_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _check_fits(name: str, prompt_len: int, output_len: int, model: ModelInfo) -> None:
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"{name}: prompt and output lengths must be >= 1")
    if prompt_len + output_len > model.max_model_len:
        raise ValueError(
            f"{name}: {prompt_len} prompt + {output_len} output tokens exceed the model's "
            f"context of {model.max_model_len}"
        )


@dataclass(frozen=True)
class SharedPrefix(Workload):
    """`num_prefixes` long system prompts, each request one of them + its own suffix."""

    name: ClassVar[str] = "shared-prefix"
    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 32
    output_len: int = 64

    def requests(self, model: ModelInfo, seed: int) -> Iterator[RequestSpec]:
        if self.num_prefixes < 1:
            raise ValueError(f"{self.name}: num_prefixes must be >= 1")
        _check_fits(self.name, self.prefix_len + self.suffix_len, self.output_len, model)
        rng = random.Random(seed)
        prefixes = [
            _token_ids(rng, model.vocab_size, self.prefix_len) for _ in range(self.num_prefixes)
        ]
        for i in itertools.count():
            k = rng.randrange(self.num_prefixes)
            prompt = prefixes[k] + _token_ids(rng, model.vocab_size, self.suffix_len)
            yield RequestSpec(i, prompt, self.output_len, kind=f"prefix-{k}")


@dataclass(frozen=True)
class Mixed(Workload):
    """Long-prompt/short-output requests (a `long_fraction` of them) among the opposite."""

    name: ClassVar[str] = "mixed"
    long_fraction: float = 0.5
    long_prompt_len: int = 512
    short_output_len: int = 8
    short_prompt_len: int = 32
    long_output_len: int = 128

    def requests(self, model: ModelInfo, seed: int) -> Iterator[RequestSpec]:
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"{self.name}: long_fraction must be in [0, 1]")
        _check_fits(self.name, self.long_prompt_len, self.short_output_len, model)
        _check_fits(self.name, self.short_prompt_len, self.long_output_len, model)
        rng = random.Random(seed)
        for i in itertools.count():
            if rng.random() < self.long_fraction:
                prompt_len, output_len, kind = (
                    self.long_prompt_len,
                    self.short_output_len,
                    "long-prompt",
                )
            else:
                prompt_len, output_len, kind = (
                    self.short_prompt_len,
                    self.long_output_len,
                    "long-output",
                )
            yield RequestSpec(i, _token_ids(rng, model.vocab_size, prompt_len), output_len, kind)


@dataclass(frozen=True)
class ShareGPTLike(Workload):
    """Log-normal prompt and output lengths (medians and a shape `sigma`), like chat logs.

    Lengths are clipped so that prompt + output fits the model's context: the output to
    at most half of it, then the prompt to the rest.
    """

    name: ClassVar[str] = "sharegpt-like"
    prompt_len: int = 128
    output_len: int = 128
    sigma: float = 0.8

    def requests(self, model: ModelInfo, seed: int) -> Iterator[RequestSpec]:
        if self.prompt_len < 1 or self.output_len < 1 or self.sigma < 0:
            raise ValueError(f"{self.name}: medians must be >= 1 and sigma >= 0")
        if model.max_model_len < 2:
            raise ValueError(f"{self.name}: the model's context ({model.max_model_len}) is < 2")
        rng = random.Random(seed)
        for i in itertools.count():
            output_len = self._draw(rng, self.output_len, max(model.max_model_len // 2, 1))
            prompt_len = self._draw(rng, self.prompt_len, model.max_model_len - output_len)
            prompt = _token_ids(rng, model.vocab_size, prompt_len)
            yield RequestSpec(i, prompt, output_len, kind="sharegpt-like")

    def _draw(self, rng: random.Random, median: int, high: int) -> int:
        return min(max(round(rng.lognormvariate(math.log(median), self.sigma)), 1), high)


@dataclass(frozen=True)
class Trace(Workload):
    """A JSONL trace replayed in order, one request per line.

    Each line: `timestamp` (seconds, non-decreasing), `output_len` (tokens), and either
    `prompt` (text) or `prompt_token_ids` (a list of ints). Blank lines are skipped.
    """

    name: ClassVar[str] = "trace"
    path: str = ""

    def requests(self, model: ModelInfo, seed: int) -> Iterator[RequestSpec]:
        specs = load_trace(Path(self.path))  # read it all first: a bad line fails early
        yield from specs


def load_trace(path: Path) -> list[RequestSpec]:
    """Parse a JSONL trace. Raises ValueError naming the line of a malformed entry."""
    specs: list[RequestSpec] = []
    last_s = 0.0
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            specs.append(_trace_entry(json.loads(line), len(specs)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{line_no}: bad trace entry ({exc!r})") from exc
        arrival = specs[-1].arrival_s or 0.0
        if arrival < last_s:
            raise ValueError(f"{path}:{line_no}: timestamps must not decrease")
        last_s = arrival
    if not specs:
        raise ValueError(f"{path}: the trace is empty")
    return specs


def _trace_entry(entry: dict[str, object], index: int) -> RequestSpec:
    prompt: list[int] | str
    if "prompt_token_ids" in entry:
        ids = entry["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        prompt = ids
    else:
        prompt = entry["prompt"]  # type: ignore[assignment]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
    output_len = entry["output_len"]
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError("output_len must be an int >= 1")
    timestamp = float(entry["timestamp"])  # type: ignore[arg-type]
    if timestamp < 0:
        raise ValueError("timestamp must be >= 0")
    return RequestSpec(index, prompt, output_len, kind="trace", arrival_s=timestamp)


def with_repeats(specs: Iterator[RequestSpec], fraction: float, seed: int) -> Iterator[RequestSpec]:
    """`specs`, with each request after the first replaced, with probability `fraction`,
    by a resend of an earlier one (its prompt and output length; seeded, uniform over
    the requests sent so far): what a result cache serves (`--repeat-fraction`)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the repeat fraction must be in [0, 1), got {fraction}")
    rng = random.Random(f"repeats-{seed}")
    sent: list[RequestSpec] = []
    for index in itertools.count():
        if sent and rng.random() < fraction:
            was = rng.choice(sent)
            yield dataclasses.replace(was, index=index, repeat_of=was.index, arrival_s=None)
            continue
        spec = next(specs, None)
        if spec is None:
            return
        spec = dataclasses.replace(spec, index=index)
        sent.append(spec)
        yield spec


def parse_workload(name: str, **params: object) -> Workload:
    """The workload called `name` (`trace:PATH` for a trace) with its known `params`.

    Unknown params are ignored, so a caller may pass every workload flag at once; None
    values take the workload's default. Raises ValueError for an unknown name.
    """
    if name.startswith("trace:"):
        return Trace(path=name.split(":", 1)[1])
    classes: dict[str, type[Workload]] = {
        cls.name: cls for cls in (SharedPrefix, Mixed, ShareGPTLike)
    }
    if name not in classes:
        raise ValueError(
            f"unknown workload {name!r}; expected one of {sorted(classes)} or trace:PATH"
        )
    cls = classes[name]
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return cls(**{k: v for k, v in params.items() if k in fields and v is not None})
