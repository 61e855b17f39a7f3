"""The two-sample chain-rule homogeneity test (stats/two_sample.py): bins, df bound, calibration
under H0 (p-values uniform over seeded synthetic draws) and power (noncentral chi-square
prediction = simulated rejection rate; the TV bound holds)."""

import numpy as np
import pytest
from scipy import stats as sst

from stats_sources import MarkovSource
from vllm_specplugin.stats import homogeneity_test
from vllm_specplugin.stats.power import chain_power
from vllm_specplugin.stats.two_sample import (homogeneity_noncentrality, pooled_bins, two_sample_chain_test,
                                              two_sample_df_bound, two_sample_power_for_tv, two_sample_size_for_tv)

KS_ALPHA = 0.001


def test_pooled_bins_expected_cells_remainder_and_cap():
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 41) ** 1.2
    p /= p.sum()
    ca, cb = rng.multinomial(300, p), rng.multinomial(500, p)
    for cap in (None, 2, 5, 12):
        bin_of = pooled_bins(ca, cb, 5.0, cap)
        n_bins = bin_of.max() + 1
        assert (bin_of[(ca + cb) == 0] == -1).all() and (bin_of[(ca + cb) > 0] >= 0).all()
        pooled = np.bincount(bin_of[bin_of >= 0], weights=(ca + cb)[bin_of >= 0])
        assert (pooled * 300 / 800 >= 5.0).all()  # every expected cell of the 2 x bins table
        if cap is not None:
            assert n_bins <= cap
    assert pooled_bins(ca, cb, 5.0, 5).max() + 1 == 5  # the cap binds here: 4 kept + remainder
    assert (pooled_bins(ca, np.zeros_like(cb)) == -1).all()  # one side empty: nothing to compare


def test_one_position_equals_the_homogeneity_test():
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
    a, b = rng.choice(6, size=400, p=p), rng.choice(6, size=250, p=p)
    one = homogeneity_test(a, b)
    chain = two_sample_chain_test(a[:, None], b[:, None])
    assert chain.df == one.df and chain.statistic == pytest.approx(one.statistic, rel=1e-12)
    assert chain.pvalue == pytest.approx(one.pvalue, rel=1e-9)


def test_no_data_is_no_evidence_and_bad_input():
    with pytest.raises(ValueError, match="no sampled token"):
        two_sample_chain_test(np.zeros((0, 3), int), np.zeros((5, 3), int))
    with pytest.raises(ValueError):
        two_sample_chain_test(np.zeros((5, 3), int), np.zeros((5, 2), int))
    with pytest.raises(ValueError):
        two_sample_chain_test(-np.ones((5, 3), int), np.zeros((5, 3), int))


@pytest.mark.statistical
@pytest.mark.parametrize("caps", [(None, None), (6, 6)])
def test_calibrated_under_the_null(caps):
    """300 seeded pairs (600 vs 900 continuations of 3 tokens, a 10-token Markov source): the chain
    p-values are uniform (KS) and the df never exceeds the cap's bound."""
    max_nodes, max_bins = caps
    source, rng = MarkovSource(v=10, seed=7), np.random.default_rng(2024)
    pvalues, dfs = [], []
    for _ in range(300):
        a, b = source.sample(rng, (600,), 3), source.sample(rng, (900,), 3)
        result = two_sample_chain_test(a, b, max_nodes=max_nodes, max_bins=max_bins)
        pvalues.append(result.pvalue)
        dfs.append(result.df)
    pvalues = np.array(pvalues)
    ks = sst.kstest(pvalues, "uniform").pvalue
    print(f"caps {caps}: KS p {ks:.3f}, rejection at 0.05 {np.mean(pvalues < 0.05):.3f}, df {np.mean(dfs):.1f}")
    assert ks > KS_ALPHA
    assert np.mean(pvalues < 0.05) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 300)
    if max_nodes:
        assert max(dfs) <= two_sample_df_bound(max_nodes, max_bins)


@pytest.mark.statistical
def test_power_matches_the_noncentral_prediction():
    """One position, 4 frequent categories (bins = categories): the simulated rejection rate over
    1000 seeded pairs equals the noncentral chi-square power at the exact noncentrality, and the
    TV bound (w >= 2 TV, effective size n_a n_b / (n_a + n_b)) is below it."""
    p_a = np.array([0.4, 0.3, 0.2, 0.1])
    p_b = np.array([0.34, 0.33, 0.21, 0.12])
    n_a, n_b, alpha, reps = 700, 500, 0.01, 1000
    rng = np.random.default_rng(5)
    rejected = 0
    for _ in range(reps):
        a, b = rng.choice(4, size=n_a, p=p_a), rng.choice(4, size=n_b, p=p_b)
        rejected += two_sample_chain_test(a[:, None], b[:, None]).pvalue < alpha
    predicted = float(chain_power(homogeneity_noncentrality(p_a, p_b, n_a, n_b), 3, alpha))
    tv = 0.5 * np.abs(p_a - p_b).sum()
    bound = two_sample_power_for_tv(n_a, n_b, tv, 3, alpha)
    print(f"simulated {rejected / reps:.3f}, predicted {predicted:.3f}, TV {tv:.3f} bound {bound:.3f}")
    assert abs(rejected / reps - predicted) < 4 * np.sqrt(predicted * (1 - predicted) / reps) + 0.01
    assert bound <= predicted + 1e-12


@pytest.mark.statistical
def test_chain_power_matches_simulation_for_a_deviation_after_the_first_token():
    """The speculative case: the first token has the same law on both sides, the transitions differ
    (as a fault of a speculative sampler shows from token 2 on). Predicted: the summed
    noncentrality over the position-2 nodes at their expected sizes, df 3 + 4 * 3."""
    source = MarkovSource(v=4, seed=11, concentration=5.0)  # no rare category: bins = categories
    faulty = source.trans ** 2.0
    faulty /= faulty.sum(axis=1, keepdims=True)
    n, alpha, reps = 800, 0.01, 400
    rng = np.random.default_rng(9)
    rejected, dfs = 0, []
    for _ in range(reps):
        a, b = source.sample(rng, (n,), 2, trans=faulty), source.sample(rng, (n,), 2)
        result = two_sample_chain_test(a, b)
        rejected += result.pvalue < alpha
        dfs.append(result.df)
    assert set(dfs) <= {14, 15} and np.mean(np.array(dfs) == 15) > 0.8  # a rare bin merges now and then
    lam = sum(homogeneity_noncentrality(faulty[x], source.trans[x], n * source.init[x], n * source.init[x])
              for x in range(4))
    predicted = float(chain_power(lam, 15, alpha))
    print(f"simulated {rejected / reps:.3f}, predicted {predicted:.3f} (noncentrality {lam:.1f})")
    assert abs(rejected / reps - predicted) < 4 * np.sqrt(predicted * (1 - predicted) / reps) + 0.02


def test_sample_size_reaches_the_power():
    df, level = two_sample_df_bound(6, 6), 0.01 / 4
    n = two_sample_size_for_tv(0.1, df, level, 0.9)
    assert two_sample_power_for_tv(n, n, 0.1, df, level) >= 0.9
    assert two_sample_power_for_tv(n - 2, n - 2, 0.1, df, level) < 0.9
    with pytest.raises(ValueError):
        two_sample_df_bound(0, 6)
