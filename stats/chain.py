"""Chain-rule exactness test over sampled sequences.

A sampler is exact iff, at every prefix, the next-token distribution equals
the exact conditional. We build the prefix tree of the observed sequences,
check at EVERY node that each sampled next token is possible (exact
probability > 0), and run :func:`~stats.gof.gof_test` on the next-token
counts of each node with enough samples.
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
    """Result at one prefix-tree node (TV and its CI are over the bins).

    ``support_only`` nodes (fewer than ``min_node_samples`` samples, beyond
    ``max_nodes``, or every node of a ``support_only`` test) were checked for
    impossible tokens only: ``df = 0``, ``testable = False``, ``pvalue`` 1 (0
    with an impossible token), ``tv`` and its CI NaN.
    """

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
    support_only: bool = False


@dataclass(frozen=True)
class ChainResult:
    """Global chain-rule test: sum of node statistics ~ chi2(sum df) under H0.

    ``n_tokens`` sampled tokens were checked for support (every token that
    does not follow an impossible one); ``support_only`` is True when no
    chi-square contributes (``df = 0``): the verdict is the support check
    alone, e.g. greedy decoding.
    """

    statistic: float
    df: int
    pvalue: float
    nodes: tuple[NodeResult, ...]
    method: str
    impossible_count: int
    truncated: bool  # max_nodes left nodes to the support check only
    n_tokens: int = 0

    @property
    def n_nodes(self) -> int:
        """Nodes visited (every node's sampled tokens were checked for support)."""
        return len(self.nodes)

    @property
    def n_chi2_nodes(self) -> int:
        """Nodes the chi-square visited (those with one bin add df 0)."""
        return sum(1 for nd in self.nodes if not nd.support_only)

    @property
    def support_only(self) -> bool:
        return self.df == 0


def prefix_groups(samples: np.ndarray, depth: int):
    """``[(n, t, prefix, rows)]`` for every distinct prefix of length t < depth of the rows of
    ``samples`` (``(N, m)`` int64): n rows share it, ``rows`` their indices.

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
        for g in np.nonzero(sizes)[0]:
            idx = order[starts[g]:starts[g] + sizes[g]]
            prefix = tuple(int(x) for x in samples[idx[0], :t])
            out.append((int(sizes[g]), t, prefix, idx))
    return out


def _candidate_nodes(samples: np.ndarray, depth: int):
    """``(n, t, prefix, next_tokens)`` for every prefix of the samples (:func:`prefix_groups`)."""
    return [(n, t, prefix, samples[rows, t]) for n, t, prefix, rows in prefix_groups(samples, depth)]


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


def _support_node(t, prefix, n, toks, probs) -> NodeResult:
    """A node checked for impossible tokens only."""
    in_vocab = toks < probs.size
    bad = int(np.count_nonzero(~in_vocab)) + int(np.count_nonzero(probs[toks[in_vocab]] <= 0))
    nan = float("nan")
    return NodeResult(t, prefix, n, float("inf") if bad else 0.0, 0, 0.0 if bad else 1.0, 1.0,
                      nan, nan, nan, bad, False, support_only=True)


def chain_test(samples, conditional: Conditional, method: str = "pearson", *,
               min_expected: float = 5.0, williams: bool = True,
               max_depth: int | None = None, min_node_samples: int = 10,
               max_nodes: int | None = None, support_only: bool = False,
               tv_ci: bool = True, n_boot: int = 200, confidence: float = 0.95,
               seed=0) -> ChainResult:
    """Test sampled continuations ``samples`` (shape ``(N, m)``) node by node.

    ``conditional(prefix)`` (or ``conditional[prefix]`` for a mapping) returns
    the exact next-token probabilities given the prompt plus ``prefix``.

    Support: EVERY node of the sampled tree is visited and each sampled next
    token with exact probability 0 (or an id beyond the vocabulary) is an
    impossible token: the global p-value is then 0, whatever the sample size
    (one sample suffices). Descendants of a prefix containing an impossible
    token are not queried (their tokens are not counted in ``n_tokens``).

    Chi-square: only nodes with at least ``min_node_samples`` samples, at most
    ``max_nodes`` of them, most-sampled first (ties: shallower, then
    lexicographic prefix); the others are support-only nodes. With
    ``support_only=True`` no chi-square is computed (for deterministic
    samplers, e.g. greedy decoding, where the support check is the test).

    No data is no evidence: samples with no token to check raise
    ``ValueError`` rather than pass.

    Under H0, given the parent counts, each node's counts are multinomial and
    independent of its siblings, so the sum of node statistics is compared to
    chi2(sum of df). Node selection and bins depend only on ancestors' counts;
    the approximation is checked by the calibration tests. ``method`` and
    ``williams`` are as in :func:`~stats.gof.gof_test`. Per-node p-values
    are Holm-corrected over the nodes that carry evidence.
    """
    s = np.asarray(samples)
    if s.ndim != 2 or (s.size and not np.issubdtype(s.dtype, np.integer)):
        raise ValueError("samples must be an integer array of shape (N, m)")
    if s.size and s.min() < 0:
        raise ValueError("tokens must be non-negative")
    if min_node_samples < 1:
        raise ValueError("min_node_samples must be >= 1")
    depth = s.shape[1] if max_depth is None else min(int(max_depth), s.shape[1])
    if s.shape[0] == 0 or depth <= 0:
        raise ValueError(f"no sampled token to check (samples of shape {s.shape}, depth {depth}): "
                         "a check that visits no data cannot pass")
    get = conditional.__getitem__ if isinstance(conditional, Mapping) else conditional
    rng = np.random.default_rng(seed)

    cands = _candidate_nodes(s.astype(np.int64), depth)
    # Parents sort before children (n_parent >= n_child, shallower on ties).
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    eligible = 0 if support_only else sum(1 for c in cands if c[0] >= min_node_samples)
    truncated = max_nodes is not None and eligible > max_nodes
    chi2_left = eligible if max_nodes is None else min(eligible, max_nodes)

    tainted: set[tuple[int, ...]] = set()  # prefixes through an impossible token
    nodes: list[NodeResult] = []
    n_tokens = 0
    for n, t, prefix, toks in cands:
        if prefix[:-1] in tainted or prefix in tainted:
            tainted.add(prefix)
            continue
        probs = np.asarray(get(prefix), dtype=np.float64)
        n_tokens += n
        if n < min_node_samples or chi2_left == 0:
            nd = _support_node(t, prefix, n, toks, probs)
            if nd.impossible_count:
                tainted.update(prefix + (int(k),) for k in np.unique(toks)
                               if k >= probs.size or probs[k] <= 0)
            nodes.append(nd)
            continue
        chi2_left -= 1
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
    return ChainResult(stat, df, p, tuple(nodes), method, imp, truncated, n_tokens)


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
                       any(r.truncated for r in results), sum(r.n_tokens for r in results))
