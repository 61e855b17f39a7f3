"""Total-variation distance, exact and estimated with a bootstrap interval."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._util import as_counts, as_probs
from .gof import probability_bins

__all__ = ["TvResult", "tv_distance", "tv_estimate"]


def tv_distance(p, q) -> float:
    """``0.5 * sum |p - q|`` for two exact probability vectors (row-wise if 2-D)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError("p and q must have the same shape")
    d = 0.5 * np.abs(p - q).sum(axis=-1)
    return float(d) if d.ndim == 0 else d


@dataclass(frozen=True, eq=False)
class TvResult:
    """Plug-in TV between the empirical and exact distribution, with a CI.

    ``tv_debiased = max(0, 2*tv - mean(bootstrap))`` removes the first-order
    upward bias (basic bootstrap bias correction).
    """

    tv: float
    ci_low: float
    ci_high: float
    tv_debiased: float
    n: int
    confidence: float
    n_boot: int
    over: str  # "bins" or "categories"

    @property
    def statistic(self) -> float:
        return self.tv


def _tv_cells(obs, ref, const, n, confidence, n_boot, rng):
    """TV over cells (obs counts vs exact ref probs) + bootstrap percentiles.

    ``const`` is exact mass on cells with zero observed count that are left out
    (their empirical mass is 0 in every resample, so they add a constant).
    """
    if n == 0:
        nan = float("nan")
        return nan, nan, nan, nan
    phat = obs / n
    tv = 0.5 * (np.abs(phat - ref).sum() + const)
    if n_boot <= 0:
        return float(tv), float("nan"), float("nan"), float(tv)
    boot = rng.multinomial(n, phat, size=n_boot) / n
    tvb = 0.5 * (np.abs(boot - ref).sum(axis=1) + const)
    a = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(tvb, [a, 1.0 - a])
    return float(tv), float(lo), float(hi), float(max(0.0, 2.0 * tv - tvb.mean()))


def tv_estimate(counts, probs, *, over: str = "bins", min_expected: float = 5.0,
                confidence: float = 0.95, n_boot: int = 1000, seed=0) -> TvResult:
    """Estimate TV(empirical, probs) with a parametric bootstrap percentile CI.

    Resamples are multinomial from the empirical counts (seeded by ``seed``).
    The plug-in is biased upward: even with exact sampling its mean is about
    ``sum_k sqrt(p_k (1-p_k) / (2 pi n))`` > 0, which is large when many
    categories have small ``n p_k``. The bootstrap values inherit that bias, so
    the CI is shifted up: its upper end is a conservative upper bound for "TV
    is small" claims, but the interval does not cover the truth at its nominal
    rate (measured: 64 bins, n=5000, true TV 0.05 -> coverage 0.00; 8 bins,
    n=500 -> 0.75). Do not read a lower end > 0 as a detected fault -- use
    the GOF p-value for that. (``verification.check`` therefore reports no
    interval: its worst node is also selected by its p-value, which biases
    the plug-in further up.) ``over="bins"`` (default) measures TV over the
    :func:`~stats.gof.probability_bins` bins, which is far less biased but is a
    lower bound on category-level TV; ``over="categories"`` uses raw tokens.
    Counts in zero-probability categories count fully as TV in both modes.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    c = as_counts(counts)
    p = as_probs(probs)
    if c.size != p.size:
        raise ValueError("counts and probs must have the same length")
    n = int(c.sum())
    rng = np.random.default_rng(seed)
    if over == "bins":
        b = probability_bins(p, n, min_expected)
        bc, imp = b.bin_counts(c)
        obs = np.append(bc, imp)
        ref = np.append(b.bin_probs, 0.0)
        const = 0.0
    elif over == "categories":
        # Only observed categories can move in a resample; the rest is constant.
        seen = c > 0
        obs, ref, const = c[seen], p[seen], float(p[~seen].sum())
    else:
        raise ValueError("over must be 'bins' or 'categories'")
    tv, lo, hi, deb = _tv_cells(obs.astype(np.float64), ref, const, n, confidence, n_boot, rng)
    return TvResult(tv, lo, hi, deb, n, float(confidence), int(n_boot), over)
