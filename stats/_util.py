"""Small shared validators (internal)."""

from __future__ import annotations

import numpy as np

# Exact probabilities typically come from a float32 softmax over ~10^5 tokens,
# whose sum is only accurate to ~1e-5; a looser mismatch means the caller passed
# something that is not a distribution (e.g. truncated without renormalising).
PROB_SUM_TOL = 1e-4


def as_probs(probs, tol: float = PROB_SUM_TOL) -> np.ndarray:
    """Validate a 1-D probability vector and renormalise it in float64."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError("probs must be a non-empty 1-D array")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("probs must be finite and non-negative")
    s = p.sum()
    if abs(s - 1.0) > tol:
        raise ValueError(f"probs sum to {s!r}, not 1 (tolerance {tol})")
    # Leave an already-normalised vector bit-exact so that n*p >= min_expected
    # boundaries behave as the caller computed them.
    return p if abs(s - 1.0) <= 1e-12 else p / s


def as_counts(counts) -> np.ndarray:
    """Validate a 1-D vector of non-negative integer counts."""
    c = np.asarray(counts)
    if c.ndim != 1:
        raise ValueError("counts must be 1-D")
    if c.size and not np.issubdtype(c.dtype, np.integer):
        if not np.all(np.isfinite(c)) or np.any(c != np.round(c)):
            raise ValueError("counts must be integers")
    c = c.astype(np.int64)
    if np.any(c < 0):
        raise ValueError("counts must be non-negative")
    return c


def check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 < alpha < 1.0:
        raise ValueError("alpha must be in (0, 1)")
    return alpha
