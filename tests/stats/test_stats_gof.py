import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats as sst

from stats_sources import zipf_probs
from vllm_specplugin.stats import counts_from_samples, gof_test, probability_bins, williams_q


# ---------------------------------------------------------------- binning rules
def test_bins_hand_example_own_remainder():
    p = np.array([0.0625, 0.5, 0.25, 0.0625, 0.125])  # dyadic: exact products
    b = probability_bins(p, n=80, min_expected=5.0)
    # expected: 5, 40, 20, 5, 10 -> all kept (>= is inclusive); order by prob
    # descending, ties by index
    assert b.n_bins == 5 and b.remainder_bin is None
    np.testing.assert_array_equal(b.bin_of, [3, 0, 1, 4, 2])
    b = probability_bins(p, n=48, min_expected=5.0)
    # expected: 3, 24, 12, 3, 6 -> keep 1,2,4; remainder {0,3} has 6 >= 5
    assert b.n_bins == 4 and b.remainder_bin == 3 and not b.remainder_merged
    np.testing.assert_array_equal(b.bin_of, [3, 0, 1, 3, 2])
    np.testing.assert_allclose(b.bin_probs, [0.5, 0.25, 0.125, 0.125])


def test_bins_remainder_merged_into_smallest_kept():
    p = np.array([0.6, 0.35, 0.03, 0.02])
    b = probability_bins(p, n=100, min_expected=5.0)
    # expected 60, 35, 3, 2: remainder 5 -> own bin (>= 5)
    assert b.n_bins == 3 and not b.remainder_merged
    b = probability_bins(p, n=90, min_expected=5.0)
    # expected 54, 31.5, 2.7, 1.8: remainder 4.5 < 5 -> merged into bin of 0.35
    assert b.n_bins == 2 and b.remainder_merged and b.remainder_bin == 1
    np.testing.assert_array_equal(b.bin_of, [0, 1, 1, 1])
    np.testing.assert_allclose(b.bin_probs, [0.6, 0.4])


def test_bins_zero_probability_and_untestable():
    p = np.array([0.0, 0.5, 0.5, 0.0])
    b = probability_bins(p, n=4, min_expected=5.0)
    # nothing kept: a single bin with the whole support; zeros excluded
    assert b.n_bins == 1 and b.remainder_bin == 0
    np.testing.assert_array_equal(b.bin_of, [-1, 0, 0, -1])
    assert probability_bins(p, n=0).n_bins == 1


def test_bins_validation():
    with pytest.raises(ValueError):
        probability_bins([0.5, 0.4], 10)  # does not sum to 1
    with pytest.raises(ValueError):
        probability_bins([1.5, -0.5], 10)
    with pytest.raises(ValueError):
        probability_bins([0.5, 0.5], 10, min_expected=0)


def test_bins_large_vocab_fast():
    p = zipf_probs(100_000, 1.05)
    t = time.perf_counter()
    b = probability_bins(p.astype(np.float32), 50_000)
    assert time.perf_counter() - t < 0.5
    assert b.expected.min() >= 5.0 and abs(b.bin_probs.sum() - 1) < 1e-9


prob_vectors = arrays(np.float64, st.integers(1, 150),
                      elements=st.one_of(st.just(0.0), st.floats(1e-6, 1.0))
                      ).filter(lambda a: a.sum() > 0).map(lambda a: a / a.sum())


@settings(max_examples=150, deadline=None, database=None)
@given(p=prob_vectors, n=st.integers(0, 100_000), me=st.floats(0.5, 20.0))
def test_bins_properties(p, n, me):
    b = probability_bins(p, n, me)
    support = p > 0
    # partition of the support into non-empty bins; impossible -> -1
    assert np.all(b.bin_of[~support] == -1)
    assert np.all((b.bin_of[support] >= 0) & (b.bin_of[support] < b.n_bins))
    assert np.all(np.bincount(b.bin_of[support], minlength=b.n_bins) > 0)
    np.testing.assert_allclose(b.bin_probs.sum(), 1.0, rtol=1e-9)
    np.testing.assert_allclose(np.bincount(b.bin_of[support], weights=p[support],
                                           minlength=b.n_bins), b.bin_probs, rtol=1e-9, atol=1e-15)
    if b.n_bins >= 2:
        assert np.all(n * b.bin_probs >= me)


# ---------------------------------------------------------------- gof_test
@pytest.mark.parametrize("method,lam", [("pearson", "pearson"), ("g", "log-likelihood")])
def test_gof_matches_scipy(method, lam):
    rng = np.random.default_rng(0)
    p = zipf_probs(512)
    c = rng.multinomial(2000, p)
    r = gof_test(c, p, method, williams=False)
    b = probability_bins(p, 2000)
    ref = sst.power_divergence(b.bin_counts(c)[0], 2000 * b.bin_probs, lambda_=lam)
    assert r.statistic == pytest.approx(ref.statistic, rel=1e-10)
    assert r.pvalue == pytest.approx(ref.pvalue, rel=1e-8)
    assert r.df == b.n_bins - 1 and r.testable and r.impossible_count == 0
    assert r.williams_q == 1.0


def test_gof_williams_correction():
    rng = np.random.default_rng(1)
    p = zipf_probs(512)
    c = rng.multinomial(2000, p)
    raw = gof_test(c, p, "g", williams=False)
    cor = gof_test(c, p, "g")
    q = williams_q(raw.bin_probs, 2000)
    assert cor.williams_q == pytest.approx(q) and q > 1
    assert cor.statistic == pytest.approx(raw.statistic / q)
    assert cor.pvalue == pytest.approx(sst.chi2.sf(raw.statistic / q, raw.df))


def test_gof_hand_values():
    # Pearson: (30-25)^2/25 + (20-25)^2/25 = 2, df 1
    r = gof_test([30, 20], [0.5, 0.5], "pearson")
    assert r.statistic == pytest.approx(2.0) and r.df == 1
    assert r.pvalue == pytest.approx(sst.chi2.sf(2.0, 1))
    assert r.tv == pytest.approx(0.1)
    np.testing.assert_array_equal(r.bin_counts, [30, 20])


def test_gof_impossible_tokens_fail_decisively():
    p = np.array([0.5, 0.5, 0.0])
    r = gof_test([500, 499, 1], p)
    assert r.impossible_count == 1 and r.pvalue == 0.0 and r.statistic == np.inf
    assert r.tv == pytest.approx(0.5 * (0.0 + 0.001 + 0.001))
    # even when the node is otherwise untestable
    r = gof_test([1, 0, 1], p)
    assert not r.testable and r.pvalue == 0.0 and r.impossible_count == 1


def test_gof_untestable():
    r = gof_test([3, 2], [0.5, 0.5])
    assert not r.testable and r.df == 0 and r.pvalue == 1.0 and r.statistic == 0.0
    with pytest.raises(ValueError):
        gof_test([1, 2], [0.5, 0.5], method="kl")
    with pytest.raises(ValueError):
        gof_test([1, 2, 3], [0.5, 0.5])


def test_counts_from_samples():
    np.testing.assert_array_equal(counts_from_samples([0, 2, 2, 1, 2], 4), [1, 1, 3, 0])
    with pytest.raises(ValueError):
        counts_from_samples([4], 4)
