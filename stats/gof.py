"""Goodness of fit of observed token counts against exact probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import special as _sp

from ._util import PROB_SUM_TOL, as_counts, as_probs

__all__ = ["Binning", "GofResult", "probability_bins", "gof_test", "counts_from_samples",
           "williams_q"]

_METHODS = ("g", "pearson")


def williams_q(bin_probs: np.ndarray, n: int) -> float:
    """Williams (1976) divisor ``q = 1 + (sum 1/p_b - 1) / (6 n (k - 1))`` for G."""
    k = bin_probs.size
    return 1.0 + (float(np.sum(1.0 / bin_probs)) - 1.0) / (6.0 * n * (k - 1))


def _divergence(obs: np.ndarray, exp: np.ndarray, method: str) -> float:
    """G or Pearson statistic.

    Same values as ``scipy.stats.power_divergence`` (checked in the tests),
    but ~100x cheaper (its wrapper costs ~0.3 ms): the chain test calls this
    once per tree node, the calibration suites thousands of times.
    """
    if method == "g":
        return 2.0 * float(_sp.xlogy(obs, obs / exp).sum())
    return float(((obs - exp) ** 2 / exp).sum())


@dataclass(frozen=True, eq=False)
class Binning:
    """Partition of the support of ``probs`` into bins for a sample of size ``n``.

    ``bin_of[k]`` is the bin of category ``k``, or ``-1`` when ``probs[k] == 0``
    (impossible categories belong to no bin; observing one is a violation).
    """

    bin_of: np.ndarray
    bin_probs: np.ndarray
    n: int
    min_expected: float
    remainder_bin: int | None  # bin holding the pooled rare categories, if any
    remainder_merged: bool  # True if the remainder was merged into a kept bin

    @property
    def n_bins(self) -> int:
        return int(self.bin_probs.size)

    @property
    def expected(self) -> np.ndarray:
        return self.n * self.bin_probs

    def bin_counts(self, counts) -> tuple[np.ndarray, int]:
        """Return ``(counts per bin, count in impossible categories)``."""
        c = as_counts(counts)
        if c.size != self.bin_of.size:
            raise ValueError("counts and probs must have the same length")
        ok = self.bin_of >= 0
        bc = np.bincount(self.bin_of[ok], weights=c[ok], minlength=self.n_bins)
        return bc.astype(np.int64), int(c[~ok].sum())


def probability_bins(probs, n: int, min_expected: float = 5.0, *,
                     prob_tol: float = PROB_SUM_TOL) -> Binning:
    """Bin categories using only the exact probabilities and the sample size.

    Rule: sort categories by probability, descending (ties by index). Each
    category with ``n*p >= min_expected`` is its own bin, in that order. The
    other positive-probability categories are pooled into one remainder bin
    (last). If the remainder's expected count is below ``min_expected`` it is
    merged into the smallest kept bin; with no kept bin it is the only bin.
    Hence every bin has expected count >= ``min_expected`` whenever there
    are at least two bins. Zero-probability categories get bin ``-1``.

    Binning never looks at observed counts, so the bins are fixed under H0 and
    the chi-square reference distribution stays valid.
    """
    if min_expected <= 0:
        raise ValueError("min_expected must be positive")
    if n < 0:
        raise ValueError("n must be non-negative")
    p = as_probs(probs, prob_tol)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    n_keep = int(np.count_nonzero(n * ps >= min_expected))  # a prefix of `order`
    n_pos = int(np.count_nonzero(ps > 0))

    bin_of = np.full(p.size, -1, dtype=np.int64)
    bin_of[order[:n_keep]] = np.arange(n_keep)
    bin_probs = ps[:n_keep].copy()
    remainder_bin, merged = None, False
    if n_pos > n_keep:
        rest = float(ps[n_keep:n_pos].sum())
        if n_keep == 0 or n * rest >= min_expected:
            remainder_bin = n_keep
            bin_probs = np.append(bin_probs, rest)
        else:
            # Merging into the smallest kept bin keeps that bin >= min_expected
            # and perturbs the fewest probabilities.
            remainder_bin, merged = n_keep - 1, True
            bin_probs[-1] += rest
        bin_of[order[n_keep:n_pos]] = remainder_bin
    return Binning(bin_of, bin_probs, int(n), float(min_expected), remainder_bin, merged)


@dataclass(frozen=True, eq=False)
class GofResult:
    """Result of :func:`gof_test`. ``tv`` is the plug-in TV over the bins."""

    statistic: float
    pvalue: float
    df: int
    n: int
    method: str
    testable: bool
    impossible_count: int
    williams_q: float  # divisor applied to G (1.0 for Pearson / uncorrected)
    bin_probs: np.ndarray
    bin_counts: np.ndarray
    tv: float
    binning: Binning

    @property
    def n_bins(self) -> int:
        return int(self.bin_probs.size)


def gof_test(counts, probs, method: str = "pearson", min_expected: float = 5.0, *,
             williams: bool = True, prob_tol: float = PROB_SUM_TOL) -> GofResult:
    """Test observed category ``counts`` against exact ``probs``.

    ``method`` is ``"g"`` (likelihood ratio) or ``"pearson"``. Bins come from
    :func:`probability_bins`; ``df = bins - 1``. With fewer than two bins the
    test is untestable (``testable=False``, ``df=0``, ``pvalue=1``). Any
    count in a zero-probability category is an exactness violation, not noise:
    ``impossible_count > 0`` forces ``statistic=inf`` and ``pvalue=0``.

    Calibration (tests/stats/test_stats_calibration.py): with many bins at
    expected counts near 5, raw G is anti-conservative (its mean exceeds df by
    about ``sum_b 1/(6 n p_b)``): 8-10% rejections at alpha=0.05 with 419 bins
    (``test_finding_raw_g_anticonservative_with_many_sparse_bins``). So G is
    divided by Williams' ``q`` unless ``williams=False`` (with it: ~6%);
    Pearson, the default, needs no correction at ``min_expected=5``
    (``test_gof_null_uniform_pvalues``). ``min_expected < 5`` is miscalibrated
    for both methods (``test_finding_min_expected_below_5_is_miscalibrated``).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS)}")
    c = as_counts(counts)
    n = int(c.sum())
    binning = probability_bins(probs, n, min_expected, prob_tol=prob_tol)
    bc, impossible = binning.bin_counts(c)
    # TV over bins plus the impossible cell (exact mass 0 there).
    tv = (0.5 * (np.abs(bc / n - binning.bin_probs).sum() + impossible / n)
          if n else float("nan"))
    testable = binning.n_bins >= 2
    df = binning.n_bins - 1 if testable else 0
    q = williams_q(binning.bin_probs, n) if (testable and method == "g" and williams) else 1.0
    if impossible:
        stat, pval = float("inf"), 0.0
    elif testable:
        stat = _divergence(bc.astype(np.float64), n * binning.bin_probs, method) / q
        pval = float(_sp.chdtrc(df, stat))  # chi2.sf without the rv overhead
    else:
        stat, pval = 0.0, 1.0
    return GofResult(stat, pval, df, n, method, testable, impossible, q,
                     binning.bin_probs, bc, float(tv), binning)


def counts_from_samples(samples, vocab_size: int) -> np.ndarray:
    """Count integer token samples into a length-``vocab_size`` vector."""
    s = np.asarray(samples).ravel()
    if s.size and (s.min() < 0 or s.max() >= vocab_size):
        raise ValueError("samples out of range [0, vocab_size)")
    return np.bincount(s.astype(np.int64), minlength=vocab_size)
