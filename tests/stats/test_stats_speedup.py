import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vllm_specplugin.stats import (acceptance_rate, empirical_acceptance, expected_speedup,
                   expected_tokens_per_step, optimal_gamma)


def test_acceptance_rate():
    assert acceptance_rate([0.5, 0.5], [0.5, 0.5]) == 1.0
    assert acceptance_rate([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert acceptance_rate([0.6, 0.3, 0.1], [0.2, 0.5, 0.3]) == pytest.approx(0.2 + 0.3 + 0.1)
    batch_p = np.array([[0.6, 0.4], [1.0, 0.0]])
    batch_q = np.array([[0.4, 0.6], [0.5, 0.5]])
    assert acceptance_rate(batch_p, batch_q) == pytest.approx((0.8 + 0.5) / 2)


def test_expected_tokens_hand():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.3616
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens_per_step(0.0, 7) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(1 - 1e-12, 3) == pytest.approx(4.0, rel=1e-9)
    assert expected_tokens_per_step(0.3, 0) == 1.0
    np.testing.assert_allclose(expected_tokens_per_step(np.array([0.5, 1.0]), 2), [1.75, 3.0])


def test_expected_speedup_hand():
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(3.3616)
    with pytest.raises(ValueError):
        expected_speedup(1.2, 4, 0.1)
    with pytest.raises(ValueError):
        expected_speedup(0.5, 1.5, 0.1)


def test_optimal_gamma():
    # alpha=0.8, c=0.1: speedups 1.636, 2.033, 2.271, 2.401, 2.460, 2.470, 2.448 ...
    assert optimal_gamma(0.8, 0.1) == 6
    brute = max(range(1, 17), key=lambda g: (expected_speedup(0.8, g, 0.1), -g))
    assert brute == 6
    assert optimal_gamma(0.2, 0.5) == 0  # gamma=1 gives 1.2/1.5 = 0.8 < 1
    assert optimal_gamma(1.0, 0.01, gamma_max=8) == 8
    assert optimal_gamma(0.9, 0.0, gamma_max=5) == 5


def test_empirical_acceptance_hand():
    r = empirical_acceptance([3, 0, 1, 3], gamma=3)
    # accepts 7; judged positions 3 + 1 + 2 + 3 = 9
    assert r.alpha == pytest.approx(7 / 9) and r.n_trials == 9 and r.n_steps == 4
    assert r.mean_tokens_per_step == pytest.approx(11 / 4)
    with pytest.raises(ValueError):
        empirical_acceptance([4], gamma=3)


@pytest.mark.statistical
def test_empirical_acceptance_recovers_alpha():
    # i.i.d. acceptance, alpha=0.7, gamma=4, 20000 steps; check within 4 SE
    # (a false failure has probability ~6e-5).
    rng = np.random.default_rng(5)
    acc = rng.random((20000, 4)) < 0.7
    k = np.where(acc.all(axis=1), 4, np.argmin(acc, axis=1))
    r = empirical_acceptance(k, 4)
    assert abs(r.alpha - 0.7) < 4 * r.stderr
    assert r.mean_tokens_per_step == pytest.approx(expected_tokens_per_step(0.7, 4), abs=0.05)


@settings(max_examples=200, deadline=None, database=None)
@given(a=st.floats(0.0, 0.999), b=st.floats(0.0, 1.0), g=st.integers(0, 30))
def test_tokens_increasing_in_alpha_and_gamma(a, b, g):
    lo, hi = min(a, b), max(a, b)
    assert expected_tokens_per_step(hi, g) >= expected_tokens_per_step(lo, g) - 1e-12
    assert expected_tokens_per_step(a, g + 1) >= expected_tokens_per_step(a, g) - 1e-12
    assert 1.0 <= expected_tokens_per_step(a, g) <= g + 1 + 1e-9


def test_expected_tokens_by_position():
    from vllm_specplugin.stats.speedup import expected_tokens_by_position

    # Equal rates: the i.i.d. form, for every γ up to the last position.
    np.testing.assert_allclose(expected_tokens_by_position([0.8] * 5), expected_tokens_per_step(0.8, np.arange(6)))
    # By hand: 1, 1 + 0.9, 1 + 0.9 + 0.9 * 0.5.
    np.testing.assert_allclose(expected_tokens_by_position([0.9, 0.5]), [1.0, 1.9, 2.35])
    assert expected_tokens_by_position([]).tolist() == [1.0]  # γ = 0 only
    with pytest.raises(ValueError):
        expected_tokens_by_position([0.5, 1.2])
