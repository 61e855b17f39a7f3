"""Algorithm-level exactness of speculative rejection sampling, proved by enumeration.

Everything here is exact arithmetic up to float64 rounding (``verification.algorithm`` enumerates
every draft sequence and accept/reject branch of one speculative step); nothing is sampled.

What the tests establish:

* Honest probabilistic verification (accept ``min(1, p/q)``, resample ``norm(max(0, p - q))``, bonus
  ``~ p``) is exact for prefix-dependent ("Markov") targets and drafts over small vocabularies, with
  targets processed by vLLM's temperature / top-k / top-p (including greedy T=0) and drafts with
  zeros, peaked and flat rows, gamma 1..3: every next-token conditional given the emitted prefix
  equals the target (criterion (*) in ``verification.algorithm``), the first token's marginal is
  the target's, and the step's joint law equals plain target sampling stopped by the implied
  prefix-only hazard.
* Honest one-hot verification (vLLM with ``draft_probs=None``) is exact for ANY draft rule:
  deterministic (argmax of a draft model, repeat-the-last-token) or sampled from any distribution.
* Each fault (resample from p, lossy threshold, wrong q, ignored temperature, accept all) is NOT
  exact on explicit small cases, with the size of the deviation checked against a closed form, so
  the criterion is shown to have teeth.
* ``speculative_token_law``, the closed form the statistical tier uses to compute a fault's effect
  at the engine's contexts, equals the enumerated first-token marginal for every rule and fault,
  and, for a position-independent rule, the enumerated law of every later drafted position given
  the emitted prefix.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_specplugin.verification import algorithm as alg

ATOL = 1e-12
SETTINGS = settings(derandomize=True, deadline=None, max_examples=100, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

NEG_INF = -math.inf


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def logit_rows(draw, vocab: int, allow_neg_inf: bool = True):
    """One row of logits: flat, peaked or mixed, with -inf entries (zero probability) allowed."""
    shape = draw(st.sampled_from(["flat", "peaked", "mixed", "ties"]))
    if shape == "flat":
        row = [draw(st.floats(-0.05, 0.05)) for _ in range(vocab)]
    elif shape == "peaked":
        row = [draw(st.floats(-1, 1)) for _ in range(vocab)]
        row[draw(st.integers(0, vocab - 1))] += draw(st.floats(4, 12))
    elif shape == "ties":
        row = [float(draw(st.integers(-2, 2))) for _ in range(vocab)]
    else:
        row = [draw(st.floats(-4, 4)) for _ in range(vocab)]
    if allow_neg_inf:
        for i in range(vocab):
            if draw(st.integers(0, 4)) == 0:
                row[i] = NEG_INF
        if all(v == NEG_INF for v in row):
            row[draw(st.integers(0, vocab - 1))] = 0.0
    return row


@st.composite
def markov_case(draw):
    """A target (processed as vLLM does) and a draft, both depending on the last emitted token."""
    vocab = draw(st.integers(2, 6))
    gamma = draw(st.integers(1, 3))
    temperature = draw(st.one_of(st.just(0.0), st.floats(0.3, 2.0)))
    top_k = draw(st.sampled_from([0, -1, 1, 2, 3, vocab]))
    top_p = draw(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.3]))
    target_logits = np.array([draw(logit_rows(vocab)) for _ in range(vocab + 1)])
    draft_logits = np.array([draw(logit_rows(vocab)) for _ in range(vocab + 1)])
    draft_temperature = draw(st.floats(0.3, 2.0))
    p_table = np.array([alg.process_logits(r, temperature, top_k, top_p) for r in target_logits])
    q_table = np.array([alg.softmax(r / draft_temperature) for r in draft_logits])
    return vocab, gamma, alg.markov_fn(p_table), alg.markov_fn(q_table), q_table


def assert_exact(dist, p_fn, vocab, max_len):
    assert sum(dist.values()) == pytest.approx(1.0, abs=ATOL)
    assert all(1 <= len(s) <= max_len for s in dist)
    # (*) every next-token conditional given the emitted prefix is the target's.
    assert alg.exactness_deviation(dist, p_fn, vocab) <= ATOL
    # The s = () case, stated on its own: the first emitted token is ~ p_fn(()).
    np.testing.assert_allclose(alg.first_token_distribution(dist, vocab), p_fn(()), atol=ATOL)
    # Equivalent joint form: the law is target sampling stopped by a prefix-only hazard.
    hazards = alg.implied_stop_hazards(dist)
    plain = alg.stopped_target_distribution(p_fn, lambda s: hazards.get(s, 1.0), max_len, vocab)
    assert alg.distribution_tv(dist, plain) <= ATOL


# ---------------------------------------------------------------------------------------------
# Honest rules are exact
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(markov_case())
def test_probabilistic_rule_is_exact(case):
    vocab, gamma, p_fn, q_fn, _ = case
    dist = alg.chain_output_distribution(p_fn, q_fn, gamma, mode="probabilistic")
    assert_exact(dist, p_fn, vocab, gamma + 1)


@SETTINGS
@given(markov_case(), st.sampled_from(["argmax", "repeat_last", "sampled"]))
def test_onehot_rule_is_exact_for_any_draft_rule(case, rule):
    """vLLM's one-hot verification does not care how the draft was chosen (even deterministic)."""
    vocab, gamma, p_fn, q_fn, q_table = case
    if rule == "argmax":
        draft = alg.deterministic_draft(lambda s: int(np.argmax(q_fn(s))), vocab)
    elif rule == "repeat_last":
        draft = alg.deterministic_draft(lambda s: s[-1] if s else vocab - 1, vocab)
    else:
        draft = q_fn  # random draft, verified as if q were one-hot: still exact
    dist = alg.chain_output_distribution(p_fn, draft, gamma, mode="onehot")
    assert_exact(dist, p_fn, vocab, gamma + 1)


@SETTINGS
@given(markov_case())
def test_honest_rule_never_emits_a_token_the_target_excludes(case):
    """Tokens masked by top-k/top-p (or non-argmax under greedy) have probability exactly 0."""
    vocab, gamma, p_fn, q_fn, _ = case
    for mode in ("probabilistic", "onehot"):
        dist = alg.chain_output_distribution(p_fn, q_fn, gamma, mode=mode)
        for seq in dist:
            for t, y in enumerate(seq):
                assert p_fn(seq[:t])[y] > 0, (mode, seq)


def test_greedy_is_the_argmax_rule():
    """At T=0 the processed target is one-hot, and both rules reduce to vLLM's greedy kernel:
    accept while draft == argmax, then emit the argmax."""
    logits = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 3.0], [0.0, 0.0, 1.0], [1.0, 5.0, 0.0]])
    p_fn = alg.markov_fn([alg.process_logits(r, 0.0) for r in logits])
    for draft in ([1, 0], [1, 1], [2, 0]):
        q_fn = alg.deterministic_draft(lambda s, d=draft: d[len(s)], 3)
        for mode in ("probabilistic", "onehot"):
            dist = alg.chain_output_distribution(p_fn, q_fn, 2, mode=mode)
            assert len(dist) == 1
            (seq,) = dist
            expected = []
            for d in draft + [None]:
                nxt = int(np.argmax(p_fn(tuple(expected))))
                expected.append(nxt)
                if d != nxt:
                    break
            assert seq == tuple(expected)


# ---------------------------------------------------------------------------------------------
# Faults are caught
# ---------------------------------------------------------------------------------------------


def iid(p):
    """A target/draft that ignores the prefix."""
    p = np.asarray(p, dtype=np.float64)
    return lambda prefix: p


def first_token_closed_form(p, q_draw, q_verify, tau=1.0, resample_from_p=False):
    """First-token law of one probabilistic step (gamma >= 1), written independently."""
    p, q_draw, q_verify = (np.asarray(a, float) for a in (p, q_draw, q_verify))
    with np.errstate(divide="ignore", invalid="ignore"):
        acc = np.where(q_verify > 0, np.minimum(1.0, p / (tau * q_verify)), 0.0)
    residual = p if resample_from_p else np.maximum(p - q_verify, 0.0)
    residual = residual / residual.sum()
    return q_draw * acc + (q_draw * (1 - acc)).sum() * residual


def first_token_tv(dist, p):
    return 0.5 * float(np.abs(alg.first_token_distribution(dist, len(p)) - p).sum())


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_fault_resample_from_p(gamma):
    """Resampling from p instead of the residual double-counts accepted mass.

    First token: min(p, q) + (1 - beta) p with beta = sum min(p, q); TV = 1/2 sum|min(p,q) - beta p|
    (0.25 for p = (1/2, 1/2), q = (1, 0))."""
    p, q = np.array([0.5, 0.5]), np.array([1.0, 0.0])
    dist = alg.chain_output_distribution(iid(p), iid(q), gamma, fault="resample_from_p")
    assert first_token_tv(dist, p) == pytest.approx(0.25, abs=ATOL)
    assert alg.exactness_deviation(dist, iid(p), 2) >= 0.25 - ATOL
    honest = alg.chain_output_distribution(iid(p), iid(q), gamma)
    assert alg.exactness_deviation(honest, iid(p), 2) <= ATOL
    # A non-degenerate case, against the closed form.
    p3, q3 = alg.softmax([1.0, 0.0, -1.0]), alg.softmax([-1.0, 0.5, 1.0])
    dist = alg.chain_output_distribution(iid(p3), iid(q3), gamma, fault="resample_from_p")
    np.testing.assert_allclose(alg.first_token_distribution(dist, 3),
                               first_token_closed_form(p3, q3, q3, resample_from_p=True), atol=ATOL)
    assert first_token_tv(dist, p3) > 0.05


@pytest.mark.parametrize("tau", [0.5, 0.8])
def test_fault_lossy_threshold(tau):
    """Accepting with min(1, p / (tau q)), tau < 1, over-accepts the draft.

    With p = (1/2, 1/2), q = (0.8, 0.2) and tau = 0.5 every draft is accepted, so the first token is
    ~ q: TV = 0.3."""
    p, q = np.array([0.5, 0.5]), np.array([0.8, 0.2])
    dist = alg.chain_output_distribution(iid(p), iid(q), 1, fault="lossy_threshold", fault_arg=tau)
    expected = first_token_closed_form(p, q, q, tau=tau)
    np.testing.assert_allclose(alg.first_token_distribution(dist, 2), expected, atol=ATOL)
    tv = 0.5 * float(np.abs(expected - p).sum())
    assert tv > 0.05
    if tau == 0.5:
        assert tv == pytest.approx(0.3, abs=ATOL)
    assert alg.exactness_deviation(dist, iid(p), 2) >= tv - ATOL


@pytest.mark.parametrize("gamma", [1, 2])
def test_fault_wrong_q_other_temperature(gamma):
    """Drafts sampled from q at T=0.5 but verified with q at T=1.0 (the draft model's
    'probabilities' recomputed at the wrong temperature)."""
    draft_logits = [2.0, 0.0, -1.0, 0.5]
    q_draw = alg.process_logits(draft_logits, 0.5)
    q_verify = alg.process_logits(draft_logits, 1.0)
    p = alg.process_logits([1.0, 0.5, 0.0, 0.8], 1.0)
    dist = alg.chain_output_distribution(iid(p), iid(q_draw), gamma, fault="wrong_q",
                                         fault_arg=iid(q_verify))
    expected = first_token_closed_form(p, q_draw, q_verify)
    np.testing.assert_allclose(alg.first_token_distribution(dist, 4), expected, atol=ATOL)
    assert first_token_tv(dist, p) > 0.05
    # Sanity: with the right q the same case is exact.
    honest = alg.chain_output_distribution(iid(p), iid(q_draw), gamma, fault="wrong_q",
                                           fault_arg=iid(q_draw))
    assert alg.exactness_deviation(honest, iid(p), 4) <= ATOL


def test_fault_wrong_q_simple_case():
    """p = (1/2, 1/2), drafts ~ (0.8, 0.2) verified as if q = (1/2, 1/2): all accepted, TV = 0.3."""
    p, q, qv = np.array([0.5, 0.5]), np.array([0.8, 0.2]), np.array([0.5, 0.5])
    dist = alg.chain_output_distribution(iid(p), iid(q), 1, fault="wrong_q", fault_arg=iid(qv))
    assert first_token_tv(dist, p) == pytest.approx(0.3, abs=ATOL)


@pytest.mark.parametrize("mode", ["probabilistic", "onehot"])
def test_fault_ignore_temperature(mode):
    """Verifying with the T=1 target when the request asked T=0.5 yields the T=1 law exactly:
    it is exact for the wrong target and off the requested one by TV(p_T1, p_T0.5)."""
    logits = np.array([[1.5, 0.0, -0.5], [0.0, 1.0, 0.2], [2.0, 2.0, -1.0], [-1.0, 0.0, 1.0]])
    p_req = alg.markov_fn([alg.process_logits(r, 0.5) for r in logits])
    p_raw = alg.markov_fn([alg.process_logits(r, 1.0) for r in logits])
    q_fn = alg.markov_fn([alg.softmax(r) for r in logits[::-1]])
    dist = alg.chain_output_distribution(p_req, q_fn, 2, mode=mode, fault="ignore_temperature",
                                         fault_arg=p_raw)
    assert alg.exactness_deviation(dist, p_raw, 3) <= ATOL  # it samples the T=1 target...
    tv = 0.5 * float(np.abs(p_raw(()) - p_req(())).sum())
    assert tv > 0.1
    assert first_token_tv(dist, p_req(())) == pytest.approx(tv, abs=ATOL)  # ...not the requested
    assert alg.exactness_deviation(dist, p_req, 3) >= tv - ATOL


def test_fault_detected_by_joint_form():
    """The joint criterion (stopped target sampling with implied hazards) also flags a fault, and
    catches a fault that only shows at the SECOND position."""
    vocab = 3
    rows = ([2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0])
    p_table = [alg.softmax([0.0, 0.0, 0.0])] + [alg.softmax(r) for r in rows]
    p_fn = alg.markov_fn(p_table)
    # The draft matches the target at the first position (q = p there, so nothing can go wrong
    # at position 1) but not later.
    q_fn = alg.markov_fn([p_table[0]] + [alg.softmax([0.0, 1.0, -1.0])] * 3)
    dist = alg.chain_output_distribution(p_fn, q_fn, 2, fault="resample_from_p")
    np.testing.assert_allclose(alg.first_token_distribution(dist, vocab), p_fn(()), atol=ATOL)
    assert alg.exactness_deviation(dist, p_fn, vocab) > 0.01
    hazards = alg.implied_stop_hazards(dist)
    plain = alg.stopped_target_distribution(p_fn, lambda s: hazards.get(s, 1.0), 3, vocab)
    assert alg.distribution_tv(dist, plain) > 0.01


# ---------------------------------------------------------------------------------------------
# process_logits conventions (pure; the vLLM cross-check is in test_alg_process_logits.py)
# ---------------------------------------------------------------------------------------------


def test_process_logits_conventions():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(alg.process_logits(logits, 1.0), [0.4, 0.3, 0.2, 0.1], atol=ATOL)
    # top-p keeps the smallest top set with mass >= p; dropped mass exactly 1 - p is dropped.
    np.testing.assert_allclose(alg.process_logits(logits, 1.0, top_p=0.7), [4 / 7, 3 / 7, 0, 0],
                               atol=1e-9)
    np.testing.assert_allclose(alg.process_logits(logits, 1.0, top_p=0.71),
                               [4 / 9, 3 / 9, 2 / 9, 0], atol=1e-9)
    # top-k 0 / -1 / V are off; ties at the k-th value are all kept.
    for k in (0, -1, 4):
        np.testing.assert_allclose(alg.process_logits(logits, 1.0, top_k=k),
                                   [0.4, 0.3, 0.2, 0.1], atol=ATOL)
    tied = np.array([1.0, 0.0, 1.0, 2.0])
    assert np.count_nonzero(alg.process_logits(tied, 1.0, top_k=2)) == 3
    # top-p ties straddling the boundary: the lower index is dropped first.
    out = alg.process_logits(np.zeros(4), 1.0, top_p=0.5)
    np.testing.assert_allclose(out, [0, 0, 0.5, 0.5], atol=ATOL)
    # Greedy: first argmax.
    np.testing.assert_array_equal(alg.process_logits([0.0, 3.0, 3.0], 0.0), [0, 1, 0])
    # Temperature before top-p: T=2 flattens, so p=0.7 needs more tokens.
    assert np.count_nonzero(alg.process_logits(logits, 2.0, top_p=0.7)) == 3


@pytest.mark.parametrize("fault,arg", [("resample_from_p", None), ("lossy_threshold", 0.8),
                                       ("wrong_q", "T*1.5"), ("ignore_temperature", "T=1"),
                                       ("accept_all", None)])
def test_faults_are_caught_on_generic_cases(fault, arg):
    """Not just hand-picked cases: on 40 generic (full-support, seeded) Markov cases every fault
    shows a deviation > 1e-4 in criterion (*), while the honest rule shows <= 1e-12."""
    rng = np.random.default_rng(1234)
    for _ in range(40):
        vocab, gamma = int(rng.integers(3, 6)), int(rng.integers(1, 4))
        t_logits = rng.normal(0, 1.5, (vocab + 1, vocab))
        d_logits = rng.normal(0, 1.5, (vocab + 1, vocab))
        p_fn = alg.markov_fn([alg.process_logits(r, 0.7) for r in t_logits])
        q_fn = alg.markov_fn([alg.softmax(r) for r in d_logits])
        fault_arg = {
            "wrong_q": alg.markov_fn([alg.softmax(r / 1.5) for r in d_logits]),
            "ignore_temperature": alg.markov_fn([alg.process_logits(r, 1.0) for r in t_logits]),
        }.get(fault, arg)
        honest = alg.chain_output_distribution(p_fn, q_fn, gamma)
        assert alg.exactness_deviation(honest, p_fn, vocab) <= ATOL
        bad = alg.chain_output_distribution(p_fn, q_fn, gamma, fault=fault, fault_arg=fault_arg)
        assert alg.exactness_deviation(bad, p_fn, vocab) > 1e-4


RULES = [(None, None), ("resample_from_p", None), ("lossy_threshold", 0.5), ("wrong_q", "q2"),
         ("ignore_temperature", "p2"), ("accept_all", None)]


@pytest.mark.parametrize("mode", alg.MODES)
def test_closed_form_token_law_equals_enumeration(mode):
    """First token of a step: closed form == enumeration, on 150 seeded cases with zeros in p and q."""
    rng = np.random.default_rng(99)
    for case in range(150):
        vocab = int(rng.integers(2, 6))
        p, q = rng.dirichlet(np.full(vocab, 0.7)), rng.dirichlet(np.full(vocab, 0.7))
        if case % 3 == 0:
            p[rng.integers(vocab)] = 0.0
        if case % 4 == 0:
            q[rng.integers(vocab)] = 0.0
        p, q = p / p.sum(), q / q.sum()
        other = {"q2": rng.dirichlet(np.ones(vocab)), "p2": rng.dirichlet(np.ones(vocab))}
        for fault, arg in RULES:
            if mode == "onehot" and fault in ("wrong_q", "lossy_threshold"):
                continue  # no q in one-hot verification
            value = other.get(arg, arg)
            fn_arg = (lambda s, v=value: v) if arg in other else value
            dist = alg.chain_output_distribution(lambda s: p, lambda s: q, 2, mode=mode, fault=fault,
                                                 fault_arg=fn_arg)
            closed = alg.speculative_token_law(p, q, mode=mode, fault=fault, fault_arg=value)
            np.testing.assert_allclose(closed, alg.first_token_distribution(dist, vocab), atol=ATOL,
                                       err_msg=f"{mode} {fault}")
    # honest rules give p exactly
    np.testing.assert_allclose(alg.speculative_token_law(p, q, mode=mode), p, atol=ATOL)


def test_closed_form_holds_at_later_drafted_positions():
    """Given the emitted prefix s (|s| < gamma), a drafted position's token has the closed-form law at
    the context s: so a fault's law at every speculative position of the engine's output is
    ``speculative_token_law(p(s), q(s))`` (what ``verification.check.speculative_law`` uses)."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        vocab, gamma = int(rng.integers(3, 5)), 3
        t_logits, d_logits = rng.normal(0, 1.5, (vocab + 1, vocab)), rng.normal(0, 1.5, (vocab + 1, vocab))
        p_fn = alg.markov_fn([alg.process_logits(r, 0.8) for r in t_logits])
        q_fn = alg.markov_fn([alg.softmax(r) for r in d_logits])
        q2_fn = alg.markov_fn([alg.softmax(2.0 * r) for r in d_logits])
        for fault, arg, arg_at in [("resample_from_p", None, lambda s: None),
                                   ("lossy_threshold", 0.5, lambda s: 0.5),
                                   ("wrong_q", q2_fn, q2_fn)]:
            dist = alg.chain_output_distribution(p_fn, q_fn, gamma, fault=fault, fault_arg=arg)
            for s, law in alg.next_token_conditionals(dist, vocab).items():
                if len(s) >= gamma:
                    continue  # the bonus position: honest (p), beyond the statistical tier's m
                closed = alg.speculative_token_law(p_fn(s), q_fn(s), fault=fault, fault_arg=arg_at(s))
                np.testing.assert_allclose(law, closed, atol=1e-10, err_msg=f"{fault} {s}")
