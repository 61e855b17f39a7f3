import numpy as np
import pytest

from stats_sources import zipf_probs
from vllm_specplugin.stats import probability_bins, tv_distance, tv_estimate


def test_tv_distance():
    assert tv_distance([0.5, 0.5], [0.6, 0.4]) == pytest.approx(0.1)
    assert tv_distance([1, 0], [0, 1]) == 1.0
    np.testing.assert_allclose(tv_distance([[1, 0], [0.5, 0.5]], [[0, 1], [0.5, 0.5]]), [1.0, 0.0])


def test_tv_estimate_plugin_values():
    r = tv_estimate([30, 20], [0.5, 0.5], n_boot=500, seed=1)
    assert r.tv == pytest.approx(0.1) and r.statistic == r.tv and r.over == "bins"
    assert r.ci_low <= r.tv <= r.ci_high
    # categories mode: unseen categories contribute their exact mass
    r = tv_estimate([3, 0, 1], [0.25, 0.25, 0.5], over="categories", n_boot=200)
    assert r.tv == pytest.approx(0.5 * (0.5 + 0.25 + 0.25))
    # impossible counts add fully
    r = tv_estimate([5, 0, 5], [0.5, 0.5, 0.0], over="categories", n_boot=0)
    assert r.tv == pytest.approx(0.5)
    assert np.isnan(tv_estimate([0, 0], [0.5, 0.5]).tv)


def test_tv_seeded_and_deterministic():
    rng = np.random.default_rng(2)
    p = zipf_probs(512)
    c = rng.multinomial(3000, p)
    a = tv_estimate(c, p, seed=7)
    b = tv_estimate(c, p, seed=7)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)


@pytest.mark.statistical
def test_plugin_upward_bias_documented():
    # Exact sampling (true TV 0): category-level plug-in is far above 0 for
    # sparse tails; bins are much less biased; debiasing shrinks it.
    rng = np.random.default_rng(3)
    p = zipf_probs(512)
    c = rng.multinomial(1000, p)
    cat = tv_estimate(c, p, over="categories", n_boot=300)
    binned = tv_estimate(c, p, over="bins", n_boot=300)
    approx_mean = np.sum(np.sqrt(p * (1 - p) / (2 * np.pi * 1000)))
    assert cat.tv > 0.5 * approx_mean and cat.tv > 2 * binned.tv
    assert cat.tv_debiased < cat.tv


def _coverage(v, n, mix, reps=200):
    p0 = zipf_probs(v)
    p1 = (1 - mix) * p0 + mix * np.roll(p0, 1)
    b = probability_bins(p0, n)
    true_tv = tv_distance(np.bincount(b.bin_of, weights=p1, minlength=b.n_bins), b.bin_probs)
    C = np.random.default_rng(4).multinomial(n, p1, size=reps)
    res = [tv_estimate(c, p0, n_boot=300, seed=i) for i, c in enumerate(C)]
    upper = np.mean([true_tv <= r.ci_high for r in res])
    both = np.mean([r.ci_low <= true_tv <= r.ci_high for r in res])
    return upper, both


@pytest.mark.statistical
@pytest.mark.parametrize("v,n,mix", [(8, 500, 0.2), (64, 5000, 0.2), (64, 5000, 0.0)])
def test_tv_ci_upper_end_is_conservative(v, n, mix):
    # The 97.5% upper end, as an upper confidence bound: nominal >= 0.975.
    # Assert >= 0.93 over 200 seeded replications (false failure < 1e-3 if
    # true coverage is 0.975; measured 1.0 in all three cases).
    upper, _ = _coverage(v, n, mix)
    assert upper >= 0.93


@pytest.mark.statistical
def test_tv_ci_two_sided_coverage_finding():
    # FINDING (documented, not hidden): with many bins at small expected counts
    # the plug-in bias dominates and the percentile interval sits above the
    # truth. Measured: 64 bins, n=5000, true binned TV 0.0496, mean plug-in
    # 0.074 -> two-sided coverage 0.00 (nominal 0.95). With 8 bins, n=500 it
    # is 0.75. Do not use ci_low as evidence of a fault; use the GOF p-value.
    _, both_many = _coverage(64, 5000, 0.2)
    _, both_few = _coverage(8, 500, 0.2)
    assert both_many <= 0.2
    assert 0.6 <= both_few <= 0.9
