"""vLLM 0.32's block verification (``rejection_sample_method: "block"``) is exact, by enumeration.

``verification.block_verification`` ports the arithmetic of vLLM's block kernels (Model Runner V2,
Triton only: they cannot run on this CPU build, see the module) to float64 and enumerates every
draft sequence and accepted length of one step. Established here, on prefix-dependent targets and
drafts over 2-6 tokens, targets processed with vLLM's temperature / top-k / top-p, gamma 1-3:

* with draft probabilities (the draft's q as M_s) and without (vLLM's one-hot closed forms, drafts
  drawn from any q) the step is exact: criterion (*) of ``verification.algorithm``, the first
  token's marginal, and the stopped-target joint law, to 1e-12;
* its expected accepted length is never below token-wise verification's with the same q (Sun et
  al.'s claim), equal at gamma = 1, and strictly above it on an explicit case; without draft
  probabilities it is EQUAL to token-wise one-hot verification's (block gains nothing then);
* two wrong variants (the token-wise residual after a block decision; h_i = p_i without the
  look-ahead residual mass) are not exact on explicit cases: the criterion has teeth here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_alg_exact import ATOL, SETTINGS, assert_exact, markov_case  # same directory (pytest rootdir import)

from vllm_specplugin.verification import algorithm as alg
from vllm_specplugin.verification.block_verification import block_decision, block_output_distribution


@SETTINGS
@given(markov_case(), st.booleans())
def test_block_rule_is_exact(case, one_hot):
    vocab, gamma, p_fn, q_fn, _ = case
    dist = block_output_distribution(p_fn, q_fn, gamma, one_hot=one_hot)
    assert_exact(dist, p_fn, vocab, gamma + 1)


@SETTINGS
@given(markov_case())
def test_block_accepts_at_least_as_much_as_tokenwise(case):
    vocab, gamma, p_fn, q_fn, _ = case
    block = alg.acceptance_length_mean(block_output_distribution(p_fn, q_fn, gamma))
    tokenwise = alg.acceptance_length_mean(alg.chain_output_distribution(p_fn, q_fn, gamma))
    assert block >= tokenwise - ATOL
    if gamma == 1:  # one draft: block verification is token-wise verification, law and all
        assert alg.distribution_tv(block_output_distribution(p_fn, q_fn, 1),
                                   alg.chain_output_distribution(p_fn, q_fn, 1)) <= ATOL
    # Without draft probabilities (vLLM's one-hot closed forms) block gains nothing.
    block_onehot = alg.acceptance_length_mean(block_output_distribution(p_fn, q_fn, gamma, one_hot=True))
    tokenwise_onehot = alg.acceptance_length_mean(alg.chain_output_distribution(p_fn, q_fn, gamma, mode="onehot"))
    assert block_onehot == pytest.approx(tokenwise_onehot, abs=1e-10)


def _example(seed: int = 1, vocab: int = 4):
    """Prefix-dependent (last token) target and draft tables, drawn once from a fixed seed."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.7), size=vocab + 1)
    q = rng.dirichlet(np.full(vocab, 0.7), size=vocab + 1)
    return vocab, alg.markov_fn(p), alg.markov_fn(q)


def test_block_gains_over_tokenwise_on_an_example():
    vocab, p_fn, q_fn = _example()
    block = block_output_distribution(p_fn, q_fn, 3)
    tokenwise = alg.chain_output_distribution(p_fn, q_fn, 3)
    assert_exact(block, p_fn, vocab, 4)
    gain = alg.acceptance_length_mean(block) - alg.acceptance_length_mean(tokenwise)
    assert gain > 0.1, gain  # 2.022 against 1.880 tokens per step


@pytest.mark.parametrize("fault", ["unscaled_residual", "h_without_mass"])
def test_wrong_block_variants_are_not_exact(fault):
    vocab, p_fn, q_fn = _example()
    dist = block_output_distribution(p_fn, q_fn, 3, fault=fault)
    assert sum(dist.values()) == pytest.approx(1.0, abs=ATOL)
    assert alg.exactness_deviation(dist, p_fn, vocab) > 0.05


def test_block_decision_matches_vllm_closed_forms_on_a_hand_case():
    """Two drafts, V = 2, by hand: p_1 = min(1, 0.6 / 0.5) = 1, p_2 = min(1, 0.3 / 0.9) = 1/3;
    mass at position 2 = max(0.3 - 0.9, 0) + max(0.7 - 0.1, 0) = 0.6, h_1 = 0.6 / (0.6 + 0) = 1,
    h_2 = p_2 = 1/3: P(tau = 2) = 1/3, P(tau = 1) = 2/3, P(tau = 0) = 0; after tau = 1 the
    residual max(p_1 M_b - M_s, 0) at position 2 is (0, 0.6) -> token 1."""
    p_rows = np.array([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    q_rows = np.array([[0.5, 0.5], [0.9, 0.1]])
    tau, emitted = block_decision(p_rows, q_rows, (0, 0))
    np.testing.assert_allclose(tau, [0.0, 2 / 3, 1 / 3], atol=ATOL)
    np.testing.assert_allclose(emitted[1], [0.0, 1.0], atol=ATOL)
    np.testing.assert_allclose(emitted[2], p_rows[2], atol=ATOL)
