"""Draft-side sampling with the request's own processing, so q is the distribution drafted from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPSILON = 1e-5  # vLLM treats temperature below this as greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as vLLM's sampler applies them; float32 probs [..., V].

    Greedy requests get the one-hot at the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[..., -1] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def processed_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`processed_probs` for a batch [B, V] whose rows have their own parameters."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    rows_by_params: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        rows_by_params.setdefault(p, []).append(row)
    for p, rows in rows_by_params.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = processed_probs(logits[index], p)
    return out


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, drawn from that row's probabilities by inverting its CDF with one
    uniform (far cheaper than per-token noise over a whole vocabulary). Rows with a generator
    draw their uniform from it."""
    cdf = probs.cumsum(-1)
    uniform = torch.rand(probs.shape[0], 1, device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator, device=probs.device)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    tokens = tokens.clamp_(max=probs.shape[-1] - 1)
    # Rounding at the very top of the CDF can land past the last token with probability > 0.
    missed = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if missed.any():
        last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).float().argmax(-1)
        tokens = torch.where(missed, last_nonzero, tokens)
    return tokens
