"""Seeded synthetic sources shared by the stats tests."""

from __future__ import annotations

import numpy as np


def zipf_probs(v: int = 512, s: float = 1.1) -> np.ndarray:
    """Peaked Zipf-like distribution over ``v`` categories (LM-like tail)."""
    p = 1.0 / np.arange(1, v + 1) ** s
    return p / p.sum()


def worst_case_alternative(bin_of: np.ndarray, bin_probs: np.ndarray, p0: np.ndarray,
                           tv: float) -> np.ndarray:
    """Alternative with binned TV ``>= tv`` and the smallest w (``w ~= 2 tv``).

    ``p1 = p0 (1 + eps s_bin)`` with bin signs balancing the mass, so
    ``|p1 - p0|`` is proportional to ``p0`` over bins: Cauchy-Schwarz equality.
    """
    signs = np.empty(bin_probs.size)
    plus = minus = 0.0
    for b in np.argsort(-bin_probs, kind="stable"):  # greedy balance
        if plus <= minus:
            signs[b], plus = 1.0, plus + bin_probs[b]
        else:
            signs[b], minus = -1.0, minus + bin_probs[b]
    s = np.where(bin_of >= 0, signs[np.maximum(bin_of, 0)], 0.0)
    eps = 2.0 * tv
    while True:  # grow eps until the renormalised binned TV reaches tv
        p1 = p0 * (1.0 + eps * s)
        p1 /= p1.sum()
        b1 = np.bincount(bin_of[bin_of >= 0], weights=p1[bin_of >= 0], minlength=bin_probs.size)
        if 0.5 * np.abs(b1 - bin_probs).sum() >= tv:
            return p1
        eps *= 1.001


class MarkovSource:
    """Order-1 Markov chain over ``v`` tokens with peaked random rows."""

    def __init__(self, v: int = 6, seed: int = 123, concentration: float = 0.7):
        rng = np.random.default_rng(seed)
        self.v = v
        self.init = rng.dirichlet(np.full(v, concentration))
        self.trans = rng.dirichlet(np.full(v, concentration), size=v)

    def conditional(self, prefix: tuple[int, ...]) -> np.ndarray:
        return self.init if not prefix else self.trans[prefix[-1]]

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...], m: int,
               trans: np.ndarray | None = None) -> np.ndarray:
        """Draw sequences of length ``m``; shape ``shape + (m,)``."""
        trans = self.trans if trans is None else trans
        u = rng.random(shape + (m,))
        out = np.empty(shape + (m,), dtype=np.int64)
        out[..., 0] = np.minimum((u[..., 0, None] > np.cumsum(self.init)).sum(-1), self.v - 1)
        cum = np.cumsum(trans, axis=1)
        for t in range(1, m):
            c = cum[out[..., t - 1]]
            out[..., t] = np.minimum((u[..., t, None] > c).sum(-1), self.v - 1)
        return out
