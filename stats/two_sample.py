"""Two-sample chain-rule homogeneity test: are two samplers' continuations the same law?

For when no exact reference exists (``stats.chain`` needs one): sample the same prompt N_a times
from sampler A (e.g. a speculative server) and N_b times from sampler B (a plain one) and test, at
every prefix node of the *pooled* prefix tree, that the next-token law after that prefix is the
same in both (a 2 x bins homogeneity chi-square, as :func:`stats.homogeneity.homogeneity_test`).

Chain rule. Two laws of m-token continuations are equal iff, at every prefix, their next-token
conditionals are equal. Under H0, given the tokens before a node, the node's next tokens in A and
in B are independent multinomials with one common law, so each node's statistic is asymptotically
chi2(bins - 1) conditionally on its ancestors, and the sum over nodes is compared with
chi2(sum of df) (the same argument as ``stats.chain``; checked by the calibration tests).

Bins come from the node's *pooled* counts (no exact probabilities exist). This is valid: under H0
the pooled counts are sufficient for the unknown common law and, given them, the A/B split is
hypergeometric whatever the bins. Categories in descending pooled count (ties: smaller token id)
keep a bin of their own while their smallest expected cell ``pooled * min(n_a, n_b) / (n_a + n_b)``
is >= ``min_expected``; the rest form a remainder bin (merged into the smallest kept bin when its
own expected cell would be below ``min_expected``). ``max_bins`` caps the bins of a node (the
categories beyond go to the remainder) and ``max_nodes`` the nodes with a chi-square (largest
pooled count first, then shallower, then lexicographic prefix): together they bound the df,
``max_nodes * (max_bins - 1)``, BEFORE any sample is drawn, which is what a power computed before
the run needs (power decreases in df). Node selection and bins use pooled counts only.

Power. A node with n_a and n_b samples whose laws differ has noncentrality
``n_a n_b / (n_a + n_b) * sum (p_a - p_b)**2 / pbar`` with ``pbar`` the pooled law
(:func:`homogeneity_noncentrality`). Since ``sum pbar = 1``, Cauchy-Schwarz gives
``sum (p_a - p_b)**2 / pbar >= (sum |p_a - p_b|)**2 = (2 TV)**2``: power computed at
``w = 2 TV`` with the effective size ``n_a n_b / (n_a + n_b)`` (N / 2 for equal samples) is a lower
bound for every alternative whose binned TV at that node is >= TV (:func:`two_sample_power_for_tv`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy import stats as _st

from .chain import prefix_groups
from .multitest import holm
from .power import chain_power, sample_size_for_tv

__all__ = ["TwoSampleNode", "TwoSampleChainResult", "pooled_bins", "two_sample_chain_test",
           "homogeneity_noncentrality", "two_sample_power_for_tv", "two_sample_df_bound",
           "two_sample_size_for_tv"]

_METHODS = ("pearson", "g")


@dataclass(frozen=True)
class TwoSampleNode:
    """One prefix node: ``n_a``/``n_b`` samples of each sampler reached it. ``testable`` nodes had
    a chi-square (>= 2 bins, within ``max_nodes``); the others have ``df`` 0 and ``pvalue`` 1."""

    position: int  # 0-based: the node predicts token position + 1
    prefix: tuple[int, ...]
    n_a: int
    n_b: int
    statistic: float
    df: int
    pvalue: float
    pvalue_holm: float
    tv: float  # plug-in TV between the two binned samples (NaN when not testable)
    testable: bool
    prompt_index: int = 0


@dataclass(frozen=True)
class TwoSampleChainResult:
    statistic: float
    df: int
    pvalue: float
    nodes: tuple[TwoSampleNode, ...]
    method: str
    n_a: int
    n_b: int
    truncated: bool  # max_nodes left eligible nodes without a chi-square

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_chi2_nodes(self) -> int:
        return sum(1 for nd in self.nodes if nd.testable)


def pooled_bins(counts_a, counts_b, min_expected: float = 5.0, max_bins: int | None = None) -> np.ndarray:
    """Bin of each category (``-1``: seen in neither sample) from the pooled counts (module doc)."""
    ca, cb = np.asarray(counts_a, dtype=np.int64), np.asarray(counts_b, dtype=np.int64)
    if ca.shape != cb.shape or ca.ndim != 1:
        raise ValueError("counts must be 1-D of the same length")
    if min_expected <= 0:
        raise ValueError("min_expected must be positive")
    if max_bins is not None and max_bins < 2:
        raise ValueError("max_bins must be >= 2")
    n_a, n_b = int(ca.sum()), int(cb.sum())
    pooled = ca + cb
    bin_of = np.full(pooled.size, -1, dtype=np.int64)
    if n_a == 0 or n_b == 0:
        return bin_of
    scale = min(n_a, n_b) / (n_a + n_b)  # smallest expected cell of a category = pooled * scale
    order = np.argsort(-pooled, kind="stable")
    ps = pooled[order]
    n_pos = int(np.count_nonzero(ps > 0))
    n_keep = int(np.count_nonzero(ps * scale >= min_expected))  # a prefix of `order`
    if max_bins is not None and n_keep > (max_bins if n_pos == n_keep else max_bins - 1):
        n_keep = max_bins - 1  # the categories beyond go to the remainder bin
    bin_of[order[:n_keep]] = np.arange(n_keep)
    if n_pos > n_keep:
        rest = int(ps[n_keep:n_pos].sum())
        if n_keep == 0 or rest * scale >= min_expected:
            bin_of[order[n_keep:n_pos]] = n_keep
        else:
            bin_of[order[n_keep:n_pos]] = n_keep - 1  # merged into the smallest kept bin
    return bin_of


def _table_statistic(table: np.ndarray, method: str) -> float:
    rows = table.sum(axis=1, keepdims=True)
    cols = table.sum(axis=0, keepdims=True)
    expected = rows * cols / table.sum()
    if method == "g":
        with np.errstate(divide="ignore", invalid="ignore"):
            return 2.0 * float(np.sum(np.where(table > 0, table * np.log(table / expected), 0.0)))
    return float(np.sum((table - expected) ** 2 / expected))


def two_sample_chain_test(samples_a, samples_b, method: str = "pearson", *, min_expected: float = 5.0,
                          min_node_samples: int = 10, max_nodes: int | None = None,
                          max_bins: int | None = None, max_depth: int | None = None) -> TwoSampleChainResult:
    """Chain-rule two-sample test of ``samples_a`` (``(N_a, m)``) against ``samples_b``
    (``(N_b, m)``): module docstring. A node is eligible when both samplers reached it and
    ``n_a + n_b >= min_node_samples``; the ``max_nodes`` largest eligible nodes with >= 2 bins get
    a chi-square. Per-node p-values are Holm-adjusted over the testable nodes. No data is no
    evidence: empty samples raise ``ValueError``."""
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}")
    a, b = np.asarray(samples_a), np.asarray(samples_b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError("samples must be integer arrays of shape (N_a, m) and (N_b, m)")
    for s in (a, b):
        if s.size and (not np.issubdtype(s.dtype, np.integer) or s.min() < 0):
            raise ValueError("tokens must be non-negative integers")
    depth = a.shape[1] if max_depth is None else min(int(max_depth), a.shape[1])
    if a.shape[0] == 0 or b.shape[0] == 0 or depth <= 0:
        raise ValueError(f"no sampled token to compare (shapes {a.shape} and {b.shape}): a check that "
                         "visits no data cannot pass")
    if max_nodes is not None and max_nodes < 1:
        raise ValueError("max_nodes must be >= 1")
    both = np.concatenate([a, b]).astype(np.int64)
    in_a = np.arange(both.shape[0]) < a.shape[0]
    vocab = int(both.max()) + 1
    candidates = [(n, t, prefix, both[rows[in_a[rows]], t], both[rows[~in_a[rows]], t])
                  for n, t, prefix, rows in prefix_groups(both, depth)]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    nodes, left = [], max_nodes
    nan = float("nan")
    for n, t, prefix, ta, tb in candidates:
        if left == 0 or len(ta) == 0 or len(tb) == 0 or n < min_node_samples:
            nodes.append(TwoSampleNode(t, prefix, len(ta), len(tb), 0.0, 0, 1.0, 1.0, nan, False))
            continue
        ca, cb = np.bincount(ta, minlength=vocab), np.bincount(tb, minlength=vocab)
        bin_of = pooled_bins(ca, cb, min_expected, max_bins)
        n_bins = int(bin_of.max()) + 1
        if n_bins < 2:
            nodes.append(TwoSampleNode(t, prefix, len(ta), len(tb), 0.0, 0, 1.0, 1.0, nan, False))
            continue
        seen = bin_of >= 0
        table = np.vstack([np.bincount(bin_of[seen], weights=ca[seen], minlength=n_bins),
                           np.bincount(bin_of[seen], weights=cb[seen], minlength=n_bins)])
        stat = _table_statistic(table, method)
        tv = 0.5 * float(np.abs(table[0] / len(ta) - table[1] / len(tb)).sum())
        df = n_bins - 1
        nodes.append(TwoSampleNode(t, prefix, len(ta), len(tb), stat, df, float(_st.chi2.sf(stat, df)),
                                   1.0, tv, True))
        if left is not None:
            left -= 1
    truncated = max_nodes is not None and left == 0 and any(
        not nd.testable and nd.n_a and nd.n_b and nd.n_a + nd.n_b >= min_node_samples for nd in nodes)
    return _finish(nodes, method, a.shape[0], b.shape[0], truncated)


def _finish(nodes, method, n_a, n_b, truncated) -> TwoSampleChainResult:
    testable = [i for i, nd in enumerate(nodes) if nd.testable]
    adjusted = holm([nodes[i].pvalue for i in testable]) if testable else np.zeros(0)
    nodes = list(nodes)
    for i, p in zip(testable, adjusted):
        nodes[i] = replace(nodes[i], pvalue_holm=float(p))
    stat = float(sum(nodes[i].statistic for i in testable))
    df = int(sum(nodes[i].df for i in testable))
    pvalue = float(_st.chi2.sf(stat, df)) if df > 0 else 1.0
    return TwoSampleChainResult(stat, df, pvalue, tuple(nodes), method, n_a, n_b, truncated)


def homogeneity_noncentrality(p_a, p_b, n_a: float, n_b: float) -> float:
    """Noncentrality of the 2 x K homogeneity chi-square with ``n_a`` and ``n_b`` samples from laws
    ``p_a`` and ``p_b`` (over the same bins): ``n_a n_b / (n_a + n_b) * sum (p_a - p_b)**2 / pbar``,
    ``pbar = (n_a p_a + n_b p_b) / (n_a + n_b)``."""
    pa, pb = np.asarray(p_a, dtype=np.float64), np.asarray(p_b, dtype=np.float64)
    if pa.shape != pb.shape:
        raise ValueError("p_a and p_b must have the same shape")
    pbar = (n_a * pa + n_b * pb) / (n_a + n_b)
    pos = pbar > 0
    return float(n_a * n_b / (n_a + n_b) * np.sum((pa[pos] - pb[pos]) ** 2 / pbar[pos]))


def two_sample_power_for_tv(n_a: float, n_b: float, tv: float, df: int, alpha: float = 0.01) -> float:
    """Guaranteed power of a level-``alpha`` decision on a chi-square with ``df`` (summed) degrees of
    freedom against a binned TV >= ``tv`` between the two laws at one node reached by ``n_a`` and
    ``n_b`` samples (``w >= 2 tv``; no deviation assumed elsewhere)."""
    if not 0.0 < tv <= 1.0:
        raise ValueError("tv must be in (0, 1]")
    if n_a <= 0 or n_b <= 0:
        raise ValueError("sample sizes must be positive")
    return float(chain_power(n_a * n_b / (n_a + n_b) * (2.0 * tv) ** 2, df, alpha))


def two_sample_df_bound(max_nodes: int, max_bins: int) -> int:
    """The most df one chain test can have with these caps (per prompt)."""
    if max_nodes < 1 or max_bins < 2:
        raise ValueError("max_nodes must be >= 1 and max_bins >= 2")
    return int(max_nodes * (max_bins - 1))


def two_sample_size_for_tv(tv: float, df: int, alpha: float = 0.01, power: float = 0.99) -> int:
    """Smallest N per sampler (equal sizes, effective size N / 2) with guaranteed power at ``tv``."""
    return 2 * sample_size_for_tv(tv, df, alpha, power)
