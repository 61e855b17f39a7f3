import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from vllm_specplugin.stats import holm, holm_reject


def test_holm_hand_example():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 times 4,3,2,1 = 0.02, 0.03, 0.06, 0.04;
    # running max -> 0.02, 0.03, 0.06, 0.06
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_array_equal(holm_reject(p, 0.05), [True, False, False, True])


def test_holm_edge_cases():
    assert holm([]).size == 0
    np.testing.assert_allclose(holm([0.7, 0.9]), [1.0, 1.0])
    np.testing.assert_allclose(holm([0.0, 0.0]), [0.0, 0.0])
    with pytest.raises(ValueError):
        holm([0.5, np.nan])
    with pytest.raises(ValueError):
        holm([1.5])


@settings(max_examples=200, deadline=None, database=None)
@given(arrays(np.float64, st.integers(1, 60), elements=st.floats(0.0, 1.0)))
def test_holm_properties(p):
    adj = holm(p)
    assert np.all(adj >= p) and np.all(adj <= 1.0)
    order = np.argsort(p, kind="stable")
    assert np.all(np.diff(adj[order]) >= 0)  # monotone in the raw p-values
    assert np.all(adj <= np.minimum(1.0, p.size * p) + 1e-15)  # never worse than Bonferroni
