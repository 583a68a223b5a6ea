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

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, positions: Seq[int], params: Seq[SamplingParams]
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [N, vocab] (float32).

        `positions[i]` is the position in its sequence of the token row i samples.
        """
        token_ids = logits.argmax(dim=-1)  # [N]; right for every greedy row
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample_rows(
                logits.index_select(0, rows),
                [positions[i] for i in random_rows],
                [params[i] for i in random_rows],
            )
            token_ids = token_ids.index_copy(0, rows, sampled)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, ids, params))

    def _sample_rows(
        self, logits: torch.Tensor, positions: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        sorted_logits, sorted_ids = (logits / temps.unsqueeze(1)).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        top_k = torch.tensor(
            [p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device
        )
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
        picks = [
            torch.multinomial(probs[i], 1, generator=self._generator_for(pos, p))
            for i, (pos, p) in enumerate(zip(positions, params, strict=True))
        ]
        return sorted_ids.gather(1, torch.stack(picks)).squeeze(1)

    def _generator_for(self, position: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._generator
        # Fibonacci hashing spreads (seed, position) over the 64-bit seed space.
        seed = (params.seed * 0x9E3779B97F4A7C15 + position) & 0xFFFF_FFFF_FFFF_FFFF
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: list[int], params: Seq[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        """Logprob of each sampled token and its row's top-n, for rows that want them.

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
        rows = torch.tensor(wanted, device=device)
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
