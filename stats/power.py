"""Power and sample size of chi-square GOF tests (noncentral chi-square).

Under a fixed alternative ``p1`` the Pearson/G statistics are approximately
``ncx2(df, n * w**2)`` with Cohen's ``w**2 = sum (p1 - p0)**2 / p0``.

Worst case over alternatives at a given TV: by Cauchy-Schwarz, since
``sum p0 = 1``,
``(2 TV)**2 = (sum |p1-p0|)**2 = (sum |p1-p0|/sqrt(p0) * sqrt(p0))**2
<= sum (p1-p0)**2/p0 * sum p0 = w**2``, i.e. ``w >= 2 TV``, with equality when
``|p1 - p0|`` is proportional to ``p0``. Power is increasing in ``w``, so power
computed at ``w = 2 TV`` is a lower bound for every alternative with TV >= tv.
Caveats: the TV that counts is the TV *between the binned distributions*
(mass moved inside a bin is invisible), and power decreases in ``df``, so pass
an upper bound on ``bins - 1``.

The chain-rule test (``stats.chain``) decides on the SUM of its node
statistics, ``~ chi2(sum df)`` under H0 and ``~ ncx2(sum df, sum n_i w_i^2)``
under an alternative: :func:`chain_power` is the power of that decision, not
of any one node's test. A deviation at one node is diluted by the df of all
the others.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, stats as _st

from ._util import check_alpha

__all__ = ["cohens_w", "chisquare_power", "power_for_tv", "sample_size_for_tv",
           "min_detectable_tv", "chain_power", "chain_power_for_tv"]


def cohens_w(p0, p1) -> float:
    """Cohen's effect size ``w = sqrt(sum (p1 - p0)^2 / p0)``.

    ``inf`` if ``p1`` puts mass where ``p0`` has none.
    """
    p0, p1 = np.asarray(p0, dtype=np.float64), np.asarray(p1, dtype=np.float64)
    if p0.shape != p1.shape:
        raise ValueError("p0 and p1 must have the same shape")
    d2 = (p1 - p0) ** 2
    if np.any((p0 == 0) & (d2 > 0)):
        return float("inf")
    pos = p0 > 0
    return float(np.sqrt(np.sum(d2[pos] / p0[pos])))


def chisquare_power(n, w, df: int, alpha: float = 0.01):
    """Power of a level-``alpha`` chi-square test with noncentrality ``n w^2``.

    Vectorised over ``n`` and ``w``; returns a float for scalar input.
    """
    alpha = check_alpha(alpha)
    if df < 1:
        raise ValueError("df must be >= 1")
    crit = _st.chi2.isf(alpha, df)
    nc = np.asarray(n, dtype=np.float64) * np.asarray(w, dtype=np.float64) ** 2
    # ncx2 with nc == 0 is the central chi2; guard it explicitly.
    out = np.where(nc > 0, _st.ncx2.sf(crit, df, np.maximum(nc, 1e-300)), alpha)
    return float(out) if out.ndim == 0 else out


def power_for_tv(n, tv: float, df: int, alpha: float = 0.01):
    """Guaranteed (worst-case, ``w = 2 tv``) power at sample size ``n``."""
    return chisquare_power(n, 2.0 * tv, df, alpha)


def _noncentrality_for_power(df: int, alpha: float, power: float) -> float:
    crit = _st.chi2.isf(alpha, df)
    f = lambda lam: _st.ncx2.sf(crit, df, lam) - power  # noqa: E731
    hi = 1.0
    while f(hi) < 0:
        hi *= 2.0
    return optimize.brentq(f, 1e-12, hi, xtol=1e-10)


def sample_size_for_tv(tv: float, df: int, alpha: float = 0.01,
                       power: float = 0.99) -> int:
    """Smallest ``N`` whose worst-case power at TV ``tv`` is >= ``power``.

    Valid for any alternative with (binned) TV >= ``tv`` since ``w >= 2 TV``.
    """
    alpha = check_alpha(alpha)
    if not alpha < power < 1.0:
        raise ValueError("power must be in (alpha, 1)")
    if not 0.0 < tv <= 1.0:
        raise ValueError("tv must be in (0, 1]")
    w2 = (2.0 * tv) ** 2
    n = max(1, math.ceil(_noncentrality_for_power(df, alpha, power) / w2))
    # Root finding is approximate: step to the exact boundary (power is
    # increasing in n).
    while chisquare_power(n, 2.0 * tv, df, alpha) < power:
        n += 1
    while n > 1 and chisquare_power(n - 1, 2.0 * tv, df, alpha) >= power:
        n -= 1
    return int(n)


def min_detectable_tv(n: int, df: int, alpha: float = 0.01,
                      power: float = 0.99) -> float:
    """Smallest TV detected with at least ``power`` at sample size ``n``."""
    alpha = check_alpha(alpha)
    lam = _noncentrality_for_power(df, alpha, power)
    return float(math.sqrt(lam / n) / 2.0)


def chain_power(noncentrality, df: int, alpha: float = 0.01):
    """Power of the level-``alpha`` combined chi-square test on ``df`` (summed) degrees of freedom
    at (summed) noncentrality ``sum_i n_i w_i**2``. Vectorised over ``noncentrality``."""
    return chisquare_power(noncentrality, 1.0, df, alpha)


def chain_power_for_tv(node_sizes, tv: float, df: int, alpha: float = 0.01) -> float:
    """Guaranteed power of the combined chain test (``df`` = its summed df) against a binned TV
    >= ``tv`` at each node of ``node_sizes`` samples (``w >= 2 tv`` per node, so the
    noncentrality is at least ``sum(node_sizes) * (2 tv)**2``); no deviation assumed elsewhere."""
    if not 0.0 < tv <= 1.0:
        raise ValueError("tv must be in (0, 1]")
    sizes = np.asarray(node_sizes, dtype=np.float64)
    return float(chain_power(float(sizes.sum()) * (2.0 * tv) ** 2, df, alpha))
