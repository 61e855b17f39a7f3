"""Multiple-testing correction (Holm 1979), valid under any dependence."""

from __future__ import annotations

import numpy as np

__all__ = ["holm", "holm_reject"]


def holm(pvalues) -> np.ndarray:
    """Holm step-down adjusted p-values, in the input order.

    ``adj_(i) = max_{j<=i} min(1, (m - j + 1) p_(j))`` over ascending p-values;
    ``adj >= p``, monotone in ``p``, capped at 1.
    """
    p = np.asarray(pvalues, dtype=np.float64).ravel()
    if np.any(np.isnan(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError("p-values must lie in [0, 1]")
    m = p.size
    order = np.argsort(p, kind="stable")
    adj = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adj
    return out


def holm_reject(pvalues, alpha: float = 0.05) -> np.ndarray:
    """Boolean rejections of Holm's procedure at family-wise level ``alpha``."""
    return holm(pvalues) <= alpha
