"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws each token from a generator seeded by (seed, position), so its
tokens depend on its seed alone: not on the other requests in its batch, not on a
preemption, and not on which worker samples which token (a prefill worker samples the
first token, a decode worker the rest). Unseeded random requests share the engine's
generator.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.sched.sequence import TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        # On a CPU, greedy rows take the C kernels' argmax (csrc/model_ops.c), where built.
        self._kernels = cpu_kernels.load() if device.type == "cpu" else None

    def __call__(
        self, logits: torch.Tensor, positions: Seq[int], params: Seq[SamplingParams]
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [N, vocab] (float32).

        `positions[i]` is the position in its sequence of the token row i samples.
        """
        ids = self.sample(logits, positions, params)
        return SamplerOutput(ids, self._logprobs(logits, ids, params))

    def sample(
        self, logits: torch.Tensor, positions: Seq[int], params: Seq[SamplingParams]
    ) -> list[int]:
        """`__call__`'s tokens, without logprobs."""
        token_ids = self._argmax(logits)  # [N]; right for every greedy row
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample_rows(
                logits.index_select(0, rows),
                [positions[i] for i in random_rows],
                [params[i] for i in random_rows],
            )
            token_ids = token_ids.index_copy(0, rows, sampled)
        ids: list[int] = token_ids.tolist()
        return ids

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(dim=-1)`, the same indices (first maximum, first NaN)."""
        if self._kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2:
            return self._kernels.argmax(logits, torch.get_num_threads())
        return logits.argmax(dim=-1)

    def logprobs(
        self,
        logits: torch.Tensor,
        token_ids: list[int],
        params: Seq[SamplingParams],
        rows: list[int],
    ) -> list[TokenLogprobs | None]:
        """The logprobs of `token_ids[i]` (and its top-n) under `logits[rows[i]]`, for
        each i whose params want them."""
        return self._logprobs(logits, token_ids, params, rows)

    def _sample_rows(
        self, logits: torch.Tensor, positions: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        """One token per row, drawn from the row's filtered, tempered distribution.

        Rows without top-k/top-p draw straight from the softmax over the whole vocabulary
        (no sort: sorting 32k logits per row per step cost more than the model's decode
        step on a CPU); the others from their sorted candidates. Every row draws by
        inverse CDF (one uniform number per row, a searchsorted over the row's cumulative
        probabilities), all rows at once, where `torch.multinomial` needed a call per row.
        """
        vocab = logits.shape[-1]
        picks = torch.empty(len(params), dtype=torch.long, device=logits.device)
        filtered = [i for i, p in enumerate(params) if _filters(p, vocab)]
        plain = [i for i, p in enumerate(params) if not _filters(p, vocab)]
        for group, sample in ((plain, self._sample_plain), (filtered, self._sample_filtered)):
            if group:
                rows = torch.tensor(group, device=logits.device)
                picked = sample(
                    logits.index_select(0, rows),
                    [positions[i] for i in group],
                    [params[i] for i in group],
                )
                picks.index_copy_(0, rows, picked)
        return picks

    def _sample_plain(
        self, logits: torch.Tensor, positions: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        # log_softmax + exp: faster than softmax on CPU (docs/measurements.md)
        probs = (logits / temps.unsqueeze(1)).log_softmax(dim=-1).exp_()
        return self._draw(probs, positions, params)

    def _sample_filtered(
        self, logits: torch.Tensor, positions: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # Only the most likely max(top_k) candidates can be drawn: no full sort unless a
        # row filters by top_p alone.
        width = max(top_ks)
        sorted_logits, sorted_ids = (logits / temps.unsqueeze(1)).topk(width, dim=-1)
        ranks = torch.arange(width, device=logits.device)
        top_k = torch.tensor(top_ks, device=logits.device)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Clamped to float32's smallest normal: a tinier top_p rounds to 0 and would drop
        # every token (any top_p > 0 keeps the top one).
        top_p = torch.tensor([p.top_p for p in params], device=logits.device).clamp(
            min=torch.finfo(torch.float32).tiny
        )
        # Drop a token when the tokens ranked above it already reach top_p (keeps >= 1).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        probs = probs.masked_fill(drop, 0.0)
        return sorted_ids.gather(1, self._draw(probs, positions, params).unsqueeze(1)).squeeze(1)

    def _draw(
        self, probs: torch.Tensor, positions: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        """Index i of each row with probability probs[row, i] (rows need not sum to 1).

        A seeded row's uniform number is a hash of (seed, position), so its draw depends
        on nothing else in the batch; the others' come from the engine's generator.
        """
        rows = probs.shape[0]
        u = torch.rand(rows, 1, device=probs.device, generator=self._generator)
        seeded = [
            (i, _seeded_uniform(p.seed, pos))
            for i, (pos, p) in enumerate(zip(positions, params, strict=True))
            if p.seed is not None
        ]
        if seeded:
            index, values = zip(*seeded, strict=True)
            u[list(index), 0] = torch.tensor(values, dtype=u.dtype, device=u.device)
        cdf = probs.cumsum(dim=-1)
        # right=True: the first index whose cdf exceeds u, so never a zero-probability
        # token; the clamp only catches float rounding at the very top of the range.
        picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return picks.clamp_(max=probs.shape[1] - 1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        token_ids: list[int],
        params: Seq[SamplingParams],
        rows_of: list[int] | None = None,
    ) -> list[TokenLogprobs | None]:
        """Logprob of each sampled token and its row's top-n, for rows that want them
        (token i's row is `rows_of[i]`, by default i).

        The one place logprobs are computed: the first token's on a prefill worker (it
        travels to the decode worker in the transfer header) and every later one's.
        Computed on the logits' device for all wanted rows at once, then copied to the
        host in two transfers (values, ids), whatever the number of rows.
        """
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(token_ids)
        if not wanted:
            return result
        device = logits.device
        rows = torch.tensor(
            wanted if rows_of is None else [rows_of[i] for i in wanted], device=device
        )
        logprobs = logits.index_select(0, rows).log_softmax(dim=-1)  # [W, vocab] float32
        chosen_ids = torch.tensor([token_ids[i] for i in wanted], device=device)
        chosen = logprobs.gather(1, chosen_ids.unsqueeze(1))  # [W, 1]
        max_top = max(params[i].logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(max_top, dim=-1)  # [W, max_top], most likely first
        values = torch.cat((chosen, top_vals), dim=1).tolist()
        ids = top_ids.tolist()
        for row, i in enumerate(wanted):
            num_top = params[i].logprobs or 0
            top = tuple(zip(ids[row][:num_top], values[row][1 : 1 + num_top], strict=True))
            result[i] = TokenLogprobs(token_ids[i], values[row][0], top)
        return result


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: NDArray[np.int32]) -> None:
    """Set to -inf, in place, the logits of `rows` whose token the row's mask forbids.

    `bitmask[i]` is row `rows[i]`'s mask (engine/grammar.py's `fill_bitmask`: bit t of
    word w allows token 32w + t). The mask travels to the logits' device once (4 KB per
    row for 32k tokens; on CUDA pinned and asynchronous) and is unpacked there a byte at
    a time through a 256 x 8 table: 16 times faster on CPU than shifting each word 32
    ways (measured on [32, 32000]). Tokens past the mask (a padded vocabulary) are
    forbidden.
    """
    device = logits.device
    mask = torch.from_numpy(bitmask)
    if device.type == "cuda":
        mask = mask.pin_memory()
    # Little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7.
    byte_ids = mask.to(device, non_blocking=True).view(torch.uint8).to(torch.int32)
    forbidden = _forbidden_table(device)[byte_ids].flatten(1)  # [R, words * 32]
    vocab = logits.shape[-1]
    if forbidden.shape[1] < vocab:
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    forbidden = forbidden[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=device)
    masked = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, masked)


_FORBIDDEN_TABLES: dict[torch.device, torch.Tensor] = {}


def _forbidden_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit j of byte b is clear (that token is forbidden), per device."""
    table = _FORBIDDEN_TABLES.get(device)
    if table is None:
        bits = torch.arange(8, device=device)
        table = ((torch.arange(256, device=device).unsqueeze(1) >> bits) & 1).eq(0)
        _FORBIDDEN_TABLES[device] = table
    return table


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p removes any token of a `vocab`-sized distribution."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def _seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position) alone.

    Fibonacci hashing spreads (seed, position) over 64 bits, splitmix64's finaliser mixes
    them; the top 53 bits make the double. A counter-based generator: no state, so a
    prefill worker and a decode worker draw the same number for the same position, and
    no torch.Generator is built per row and step.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53
