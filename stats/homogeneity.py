"""Two-sample homogeneity test (use when only a reference *sampler* exists)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

from .gof import probability_bins

__all__ = ["HomogeneityResult", "homogeneity_test"]

_METHODS = {"g": "log-likelihood", "pearson": "pearson"}


@dataclass(frozen=True, eq=False)
class HomogeneityResult:
    """Result of :func:`homogeneity_test`. ``tv`` is between the binned samples."""

    statistic: float
    pvalue: float
    df: int
    n_a: int
    n_b: int
    method: str
    testable: bool
    bin_counts: np.ndarray  # shape (2, n_bins)
    tv: float

    @property
    def n_bins(self) -> int:
        return int(self.bin_counts.shape[1])


def _category_ids(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Map samples (tokens, or rows = whole sequences) to dense category ids."""
    if a.ndim != b.ndim or a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[1] != b.shape[1]):
        raise ValueError("samples must both be 1-D tokens or 2-D (N, m) sequences")
    both = np.concatenate([a, b], axis=0)
    if both.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    _, inv = np.unique(both, axis=0, return_inverse=True)
    inv = inv.ravel()
    return inv[: len(a)], inv[len(a):], int(inv.max()) + 1


def homogeneity_test(samples_a, samples_b, min_expected: float = 5.0,
                     method: str = "pearson") -> HomogeneityResult:
    """Chi-square test that two samples come from the same distribution.

    Samples are 1-D token arrays, or 2-D ``(N, m)`` arrays whose rows (whole
    continuations) are the categories. Uses
    ``scipy.stats.chi2_contingency(correction=False)``.

    Binning exception: bins are chosen from the *pooled* counts (no exact
    probabilities exist here). This is still valid because the pooled counts
    are symmetric in the two samples: under H0 they are sufficient for the
    unknown common distribution, and conditionally on them the split between
    the samples is hypergeometric whatever the bins are. Categories are binned
    by :func:`~stats.gof.probability_bins` applied to the pooled frequencies
    with ``n = min(n_a, n_b)``, so every cell's expected count
    ``pooled_k * n_i / (n_a + n_b)`` is >= ``min_expected``; rare categories
    go to a remainder bin.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS)}")
    a, b = np.asarray(samples_a), np.asarray(samples_b)
    ia, ib, k = _category_ids(a, b)
    n_a, n_b = len(ia), len(ib)
    if n_a == 0 or n_b == 0:
        return HomogeneityResult(0.0, 1.0, 0, n_a, n_b, method, False,
                                 np.zeros((2, 0), np.int64), float("nan"))
    ca = np.bincount(ia, minlength=k)
    cb = np.bincount(ib, minlength=k)
    pooled = (ca + cb) / (n_a + n_b)
    binning = probability_bins(pooled, min(n_a, n_b), min_expected)
    table = np.vstack([binning.bin_counts(ca)[0], binning.bin_counts(cb)[0]])
    tv = 0.5 * float(np.abs(table[0] / n_a - table[1] / n_b).sum())
    if binning.n_bins < 2:
        return HomogeneityResult(0.0, 1.0, 0, n_a, n_b, method, False, table, tv)
    res = _st.chi2_contingency(table, correction=False, lambda_=_METHODS[method])
    return HomogeneityResult(float(res.statistic), float(res.pvalue), int(res.dof),
                             n_a, n_b, method, True, table, tv)
