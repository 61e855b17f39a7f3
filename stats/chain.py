"""Chain-rule exactness test over sampled sequences.

A sampler is exact iff, at every prefix, the next-token distribution equals
the exact conditional. We build the prefix tree of the observed sequences and
run :func:`~stats.gof.gof_test` on the next-token counts of each node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import stats as _st

from .gof import gof_test
from .multitest import holm
from .tv import _tv_cells

__all__ = ["NodeResult", "ChainResult", "chain_test", "combine_chain_results"]

Conditional = Callable[[tuple[int, ...]], np.ndarray] | Mapping[tuple[int, ...], np.ndarray]


@dataclass(frozen=True)
class NodeResult:
    """GOF result at one prefix-tree node (TV and its CI are over the bins)."""

    position: int
    prefix: tuple[int, ...]
    n: int
    statistic: float
    df: int
    pvalue: float
    pvalue_holm: float
    tv: float
    tv_ci_low: float
    tv_ci_high: float
    impossible_count: int
    testable: bool
    prompt_index: int = 0


@dataclass(frozen=True)
class ChainResult:
    """Global chain-rule test: sum of node statistics ~ chi2(sum df) under H0."""

    statistic: float
    df: int
    pvalue: float
    nodes: tuple[NodeResult, ...]
    method: str
    impossible_count: int
    truncated: bool  # max_nodes stopped the traversal early

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)


def _candidate_nodes(samples: np.ndarray, depth: int, min_node_samples: int):
    """Yield ``(n, t, prefix, next_tokens)`` for every prefix with enough samples.

    Group ids are refined one position at a time; ``np.unique`` on
    (parent id, token) keys keeps groups in lexicographic prefix order.
    """
    N = samples.shape[0]
    gid = np.zeros(N, dtype=np.int64)
    base = int(samples.max()) + 1 if samples.size else 1
    out = []
    for t in range(depth):
        if t > 0:
            _, gid = np.unique(gid * base + samples[:, t - 1], return_inverse=True)
            gid = gid.ravel()
        order = np.argsort(gid, kind="stable")
        sizes = np.bincount(gid)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for g in np.nonzero(sizes >= min_node_samples)[0]:
            idx = order[starts[g]:starts[g] + sizes[g]]
            prefix = tuple(int(x) for x in samples[idx[0], :t])
            out.append((int(sizes[g]), t, prefix, samples[idx, t]))
    return out


def _global(stats_, dfs, impossible):
    stat, df = float(np.sum(stats_)), int(np.sum(dfs))
    if impossible:
        return float("inf"), df, 0.0
    return stat, df, (float(_st.chi2.sf(stat, df)) if df > 0 else 1.0)


def _apply_holm(nodes: list[NodeResult]) -> list[NodeResult]:
    # Family = nodes that carry evidence (testable, or impossible tokens seen).
    fam = [i for i, nd in enumerate(nodes) if nd.testable or nd.impossible_count]
    adj = holm([nodes[i].pvalue for i in fam]) if fam else np.zeros(0)
    out = [replace(nd, pvalue_holm=1.0) for nd in nodes]
    for i, a in zip(fam, adj):
        out[i] = replace(nodes[i], pvalue_holm=float(a))
    return out


def chain_test(samples, conditional: Conditional, method: str = "pearson", *,
               min_expected: float = 5.0, williams: bool = True,
               max_depth: int | None = None, min_node_samples: int = 10,
               max_nodes: int | None = None,
               tv_ci: bool = True, n_boot: int = 200, confidence: float = 0.95,
               seed=0) -> ChainResult:
    """Test sampled continuations ``samples`` (shape ``(N, m)``) node by node.

    ``conditional(prefix)`` (or ``conditional[prefix]`` for a mapping) returns
    the exact next-token probabilities given the prompt plus ``prefix``.
    Nodes with fewer than ``min_node_samples`` samples are not visited (use 1
    for an exhaustive support check); at most ``max_nodes`` nodes are visited,
    most-sampled first (ties: shallower, then lexicographic prefix).
    Descendants of a prefix containing an impossible token are not queried.

    Under H0, given the parent counts, each node's counts are multinomial and
    independent of its siblings, so the sum of node statistics is compared to
    chi2(sum of df). Node selection and bins depend only on ancestors' counts;
    the approximation is checked by the calibration tests. ``method`` and
    ``williams`` are as in :func:`~stats.gof.gof_test`. Per-node p-values
    are Holm-corrected; any impossible token makes the global p-value 0.
    """
    s = np.asarray(samples)
    if s.ndim != 2 or (s.size and not np.issubdtype(s.dtype, np.integer)):
        raise ValueError("samples must be an integer array of shape (N, m)")
    if s.size and s.min() < 0:
        raise ValueError("tokens must be non-negative")
    if min_node_samples < 1:
        raise ValueError("min_node_samples must be >= 1")
    depth = s.shape[1] if max_depth is None else min(int(max_depth), s.shape[1])
    get = conditional.__getitem__ if isinstance(conditional, Mapping) else conditional
    rng = np.random.default_rng(seed)

    cands = _candidate_nodes(s.astype(np.int64), depth, min_node_samples) if s.shape[0] else []
    # Parents sort before children (n_parent >= n_child, shallower on ties).
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    truncated = max_nodes is not None and len(cands) > max_nodes
    if truncated:
        cands = cands[:max_nodes]

    tainted: set[tuple[int, ...]] = set()  # prefixes through an impossible token
    nodes: list[NodeResult] = []
    for n, t, prefix, toks in cands:
        if prefix[:-1] in tainted or prefix in tainted:
            tainted.add(prefix)
            continue
        probs = np.asarray(get(prefix), dtype=np.float64)
        counts = np.bincount(toks, minlength=probs.size)
        if counts.size > probs.size:  # token ids beyond the vocab are impossible
            probs = np.pad(probs, (0, counts.size - probs.size))
        r = gof_test(counts, probs, method, min_expected, williams=williams)
        if r.impossible_count:
            bad = np.nonzero((counts > 0) & (probs == 0))[0]
            tainted.update(prefix + (int(k),) for k in bad)
        lo = hi = float("nan")
        if tv_ci:
            obs = np.append(r.bin_counts, r.impossible_count).astype(np.float64)
            ref = np.append(r.bin_probs, 0.0)
            _, lo, hi, _ = _tv_cells(obs, ref, 0.0, n, confidence, n_boot, rng)
        nodes.append(NodeResult(t, prefix, n, r.statistic, r.df, r.pvalue, 1.0,
                                r.tv, lo, hi, r.impossible_count, r.testable))

    nodes = _apply_holm(nodes)
    imp = sum(nd.impossible_count for nd in nodes)
    ev = [nd for nd in nodes if nd.testable and not nd.impossible_count]
    stat, df, p = _global([nd.statistic for nd in ev], [nd.df for nd in ev], imp)
    return ChainResult(stat, df, p, tuple(nodes), method, imp, truncated)


def combine_chain_results(results: Sequence[ChainResult]) -> ChainResult:
    """Combine independent per-prompt chain tests: sum statistics and df, Holm
    over all nodes. ``NodeResult.prompt_index`` records each node's source."""
    if not results:
        raise ValueError("need at least one result")
    methods = {r.method for r in results}
    if len(methods) != 1:
        raise ValueError("all results must use the same method")
    nodes = [replace(nd, prompt_index=i) for i, r in enumerate(results) for nd in r.nodes]
    nodes = _apply_holm(nodes)
    imp = sum(r.impossible_count for r in results)
    ev = [nd for nd in nodes if nd.testable and not nd.impossible_count]
    stat, df, p = _global([nd.statistic for nd in ev], [nd.df for nd in ev], imp)
    return ChainResult(stat, df, p, tuple(nodes), methods.pop(), imp,
                       any(r.truncated for r in results))
