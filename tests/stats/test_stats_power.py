import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats as sst

from vllm_specplugin.stats import (chisquare_power, cohens_w, min_detectable_tv, power_for_tv,
                   sample_size_for_tv, tv_distance)


def test_cohens_w_hand():
    assert cohens_w([0.5, 0.5], [0.6, 0.4]) == pytest.approx(0.2)  # = 2 TV (equality)
    assert cohens_w([0.25] * 4, [0.4, 0.1, 0.25, 0.25]) == pytest.approx(np.sqrt(0.18))
    assert cohens_w([0.5, 0.5, 0.0], [0.5, 0.4, 0.1]) == np.inf
    assert cohens_w([0.5, 0.5, 0.0], [0.5, 0.5, 0.0]) == 0.0


def test_chisquare_power_hand():
    # classic: df=1, alpha=0.05, noncentrality 7.849 gives 80% power
    assert chisquare_power(7.849, 1.0, 1, 0.05) == pytest.approx(0.80, abs=1e-3)
    assert chisquare_power(0, 0.3, 5, 0.01) == pytest.approx(0.01)
    crit = sst.chi2.isf(0.01, 9)
    assert chisquare_power(1000, 0.1, 9, 0.01) == pytest.approx(sst.ncx2.sf(crit, 9, 10.0))
    assert power_for_tv(1000, 0.05, 9, 0.01) == chisquare_power(1000, 0.1, 9, 0.01)


def test_power_monotone():
    n = np.arange(10, 5000, 10)
    pw = chisquare_power(n, 0.1, 20, 0.01)
    assert np.all(np.diff(pw) > 0)  # increasing in n
    w = np.linspace(0.01, 0.5, 50)
    assert np.all(np.diff(chisquare_power(500, w, 20, 0.01)) > 0)  # in w
    by_df = [chisquare_power(500, 0.15, df, 0.01) for df in (1, 5, 20, 100)]
    assert np.all(np.diff(by_df) < 0)  # decreasing in df
    assert chisquare_power(500, 0.15, 5, 0.05) > chisquare_power(500, 0.15, 5, 0.01)


@pytest.mark.parametrize("tv,df,alpha,power", [(0.05, 511, 0.01, 0.99), (0.1, 9, 0.05, 0.8),
                                               (0.01, 100, 0.001, 0.9), (0.5, 1, 0.01, 0.99)])
def test_sample_size_is_smallest(tv, df, alpha, power):
    n = sample_size_for_tv(tv, df, alpha, power)
    assert power_for_tv(n, tv, df, alpha) >= power
    assert n == 1 or power_for_tv(n - 1, tv, df, alpha) < power
    # min_detectable_tv is the (continuous) inverse
    assert min_detectable_tv(n, df, alpha, power) <= tv
    assert min_detectable_tv(n - 1, df, alpha, power) > tv if n > 1 else True


def test_sample_size_validation():
    with pytest.raises(ValueError):
        sample_size_for_tv(0.0, 5)
    with pytest.raises(ValueError):
        sample_size_for_tv(0.1, 5, alpha=0.5, power=0.4)


dists = arrays(np.float64, st.integers(2, 80),
               elements=st.floats(1e-3, 1.0)).map(lambda a: a / a.sum())


@settings(max_examples=200, deadline=None, database=None)
@given(p0=dists, data=st.data())
def test_w_at_least_twice_tv(p0, data):
    raw = data.draw(arrays(np.float64, p0.size, elements=st.floats(0.0, 1.0)))
    if raw.sum() == 0:
        raw[0] = 1.0
    p1 = raw / raw.sum()
    assert cohens_w(p0, p1) >= 2 * tv_distance(p0, p1) * (1 - 1e-12)
