import numpy as np
import pytest
from scipy import stats as sst

from stats_sources import MarkovSource
from vllm_specplugin.stats import chain_test, combine_chain_results, gof_test


def _uniform_provider(v, calls=None, zero=()):
    def cond(prefix):
        if calls is not None:
            calls.append(prefix)
        p = np.ones(v)
        p[list(zero)] = 0.0
        return p / p.sum()
    return cond


def test_tree_nodes_order_and_counts():
    s = np.array([[0, 1], [0, 1], [0, 2], [1, 0]])
    calls = []
    r = chain_test(s, _uniform_provider(3, calls), min_node_samples=1, tv_ci=False)
    assert [(nd.position, nd.prefix, nd.n) for nd in r.nodes] == [
        (0, (), 4), (1, (0,), 3), (1, (1,), 1)]
    assert calls == [(), (0,), (1,)]
    # min_node_samples only gates the chi-square: the node (1,) with one sample is still
    # visited, as a support-only node.
    r = chain_test(s, _uniform_provider(3), min_node_samples=2, tv_ci=False)
    assert [(nd.prefix, nd.support_only) for nd in r.nodes] == [((), False), ((0,), False), ((1,), True)]
    assert r.n_chi2_nodes == 2 and r.n_tokens == 8
    r = chain_test(s, _uniform_provider(3), min_node_samples=1, max_depth=1, tv_ci=False)
    assert [nd.prefix for nd in r.nodes] == [()] and r.n_tokens == 4


def test_global_is_sum_of_nodes_and_holm():
    src = MarkovSource()
    s = src.sample(np.random.default_rng(0), (800,), 3)
    r = chain_test(s, src.conditional, n_boot=100)
    ev = [nd for nd in r.nodes if nd.testable]
    assert r.statistic == pytest.approx(sum(nd.statistic for nd in ev))
    assert r.df == sum(nd.df for nd in ev)
    assert r.pvalue == pytest.approx(sst.chi2.sf(r.statistic, r.df))
    assert all(nd.pvalue_holm >= nd.pvalue for nd in r.nodes)
    root = r.nodes[0]
    ref = gof_test(np.bincount(s[:, 0], minlength=6), src.init)
    assert root.prefix == () and root.statistic == pytest.approx(ref.statistic)
    assert all(nd.tv_ci_low <= nd.tv_ci_high for nd in r.nodes if not nd.support_only)
    # deterministic given the seed
    r2 = chain_test(s, src.conditional, n_boot=100)
    np.testing.assert_array_equal([nd.tv_ci_high for nd in r.nodes], [nd.tv_ci_high for nd in r2.nodes])


def test_mapping_provider_equals_callable():
    src = MarkovSource()
    s = src.sample(np.random.default_rng(1), (300,), 2)
    table = {(): src.init, **{(k,): src.trans[k] for k in range(6)}}
    a = chain_test(s, src.conditional, "g", tv_ci=False)
    b = chain_test(s, table, "g", tv_ci=False)
    assert a.statistic == b.statistic and a.df == b.df and a.method == "g"


def test_impossible_token_fails_and_stops_descent():
    rng = np.random.default_rng(2)
    s = rng.integers(0, 3, size=(300, 3))
    s[0, 0] = 3  # token 3 has probability 0 at the root

    def cond(prefix):
        if prefix and prefix[0] == 3:
            raise AssertionError("queried below an impossible token")
        p = np.array([1, 1, 1, 0.0])
        return p / 3

    r = chain_test(s, cond, min_node_samples=1, tv_ci=False)
    assert r.pvalue == 0.0 and r.statistic == np.inf and r.impossible_count == 1
    assert r.nodes[0].impossible_count == 1 and r.nodes[0].pvalue_holm == 0.0
    # token ids beyond the vocabulary are impossible too
    s2 = rng.integers(0, 3, size=(100, 1))
    s2[5, 0] = 9
    assert chain_test(s2, lambda _: np.full(3, 1 / 3), tv_ci=False).impossible_count == 1


def test_max_nodes_visits_most_sampled_first():
    src = MarkovSource()
    s = src.sample(np.random.default_rng(3), (500,), 3)
    full = chain_test(s, src.conditional, tv_ci=False)
    capped = chain_test(s, src.conditional, max_nodes=5, tv_ci=False)
    assert capped.truncated and not full.truncated and capped.n_chi2_nodes == 5
    chi2 = [nd.prefix for nd in capped.nodes if not nd.support_only]
    assert chi2 == [nd.prefix for nd in full.nodes[:5]]
    # the nodes beyond the cap are still checked for support
    assert capped.n_nodes == full.n_nodes and capped.n_tokens == full.n_tokens == s.size
    ns = [nd.n for nd in full.nodes]
    assert ns == sorted(ns, reverse=True)


def test_combine_chain_results():
    src = MarkovSource()
    rng = np.random.default_rng(4)
    rs = [chain_test(src.sample(rng, (400,), 2), src.conditional, tv_ci=False) for _ in range(3)]
    c = combine_chain_results(rs)
    assert c.statistic == pytest.approx(sum(r.statistic for r in rs))
    assert c.df == sum(r.df for r in rs)
    assert c.pvalue == pytest.approx(sst.chi2.sf(c.statistic, c.df))
    assert c.n_nodes == sum(r.n_nodes for r in rs)
    assert {nd.prompt_index for nd in c.nodes} == {0, 1, 2}
    # Holm over the larger family is at least as conservative
    first = {nd.prefix: nd.pvalue_holm for nd in c.nodes if nd.prompt_index == 0}
    assert all(first[nd.prefix] >= nd.pvalue_holm for nd in rs[0].nodes)
    with pytest.raises(ValueError):
        combine_chain_results([rs[0], chain_test(np.zeros((20, 1), int), src.conditional, "g")])


def test_support_is_checked_at_every_node_whatever_its_size():
    # Greedy-like data: one sample per prompt, so every node has n = 1 (below
    # min_node_samples). An impossible token deep in the sequence must fail the test.
    zero_at = {5: 7}  # after 5 tokens, token 7 is impossible

    def cond(prefix):
        p = np.full(10, 0.1)
        if len(prefix) in zero_at:
            p[zero_at[len(prefix)]] = 0.0
        return p / p.sum()

    ok = np.arange(32).reshape(1, 32) % 10
    ok[0, 5] = 3
    r = chain_test(ok, cond, tv_ci=False)
    assert r.pvalue == 1.0 and r.impossible_count == 0 and r.df == 0
    assert r.n_tokens == 32 and r.n_nodes == 32 and all(nd.support_only for nd in r.nodes)
    bad = ok.copy()
    bad[0, 5] = 7
    r = chain_test(bad, cond, tv_ci=False)
    assert r.pvalue == 0.0 and r.impossible_count == 1 and r.statistic == np.inf
    assert r.n_tokens == 6  # the tokens after the impossible one are not queried
    (worst,) = [nd for nd in r.nodes if nd.impossible_count]
    assert worst.prefix == tuple(bad[0, :5]) and worst.pvalue_holm == 0.0
    # same with the samples spread over several prompts (combined)
    rs = [chain_test(x, cond, tv_ci=False) for x in (ok, bad, ok)]
    c = combine_chain_results(rs)
    assert c.pvalue == 0.0 and c.n_tokens == 32 + 6 + 32


def test_support_only_mode():
    src = MarkovSource()
    s = src.sample(np.random.default_rng(8), (400,), 3)
    r = chain_test(s, src.conditional, support_only=True)
    assert r.support_only and r.df == 0 and r.pvalue == 1.0 and r.n_chi2_nodes == 0
    assert r.n_tokens == s.size and all(nd.support_only for nd in r.nodes)
    full = chain_test(s, src.conditional, tv_ci=False)
    assert not full.support_only and r.n_nodes == full.n_nodes


def test_no_data_fails_rather_than_passes():
    src = MarkovSource()
    for empty in (np.zeros((0, 3), dtype=int), np.zeros((5, 0), dtype=int)):
        with pytest.raises(ValueError, match="no sampled token"):
            chain_test(empty, src.conditional)
    with pytest.raises(ValueError, match="no sampled token"):
        chain_test(np.zeros((5, 2), dtype=int), src.conditional, max_depth=0)


@pytest.mark.statistical
def test_chain_detects_perturbed_conditional():
    # Sampler wrong only after token 3 (row moved: TV 0.128, w 0.57). N=3000,
    # alpha=0.01. Node (3,) gets ~1000 samples -> noncentrality ~330 on 5 df,
    # power ~1 even after Holm over ~30 nodes. Measured: global p 1e-94,
    # node (3,) Holm p 8e-82.
    src = MarkovSource()
    bad = src.trans.copy()
    bad[3] = 0.7 * bad[3] + 0.3 * np.roll(bad[3], 1)
    s = src.sample(np.random.default_rng(5), (3000,), 3, trans=bad)
    r = chain_test(s, src.conditional, tv_ci=False)
    assert r.pvalue < 0.01
    worst = min(r.nodes, key=lambda nd: nd.pvalue_holm)
    assert worst.prefix[-1:] == (3,) and worst.pvalue_holm < 0.01
