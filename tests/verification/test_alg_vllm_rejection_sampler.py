"""Fixed-seed statistical tests of vLLM's OWN rejection sampler on CPU.

``vllm.v1.sample.rejection_sampler.rejection_sample`` is called directly (C++ CPU fallbacks
registered as a worker does, plus the project's expand-kernel repair) on a batch of R identical
requests with gamma = 2 drafts each. Targets do not depend on the prefix, so exactness reduces to:
every emitted position j, given that it is emitted, holds a token ~ p_{j+1} (criterion (*) of
``verification.algorithm`` with prefix-free p). Each position is a Pearson chi-square GOF test
(``stats.gof_test``) against the exact p, at alpha = 0.01; sample sizes come from
``stats.sample_size_for_tv(tv=0.05, df, alpha=0.01, power=0.99)`` so that a TV deviation of 0.05
is missed with probability <= 1%, and a token with target probability 0 fails outright.

Proved (statistically, deterministic seeds): honest probabilistic verification (draft_probs
given), one-hot verification (``draft_probs=None``) with sampled drafts and with deterministic
drafts, and the full temperature/top-k/top-p pipeline (``apply_sampling_constraints`` + repaired
expand kernel) reproduce the processed target. Teeth: passing draft_probs at the wrong temperature,
or skipping the temperature/top-k/top-p processing, IS rejected; and the faulty output still
matches the law predicted by the enumerative model, so the model and vLLM agree on the fault too.

Note: in vLLM 0.32 ``rejection_sample`` takes target LOGITS (it applies a float32 softmax itself
and applies no temperature); we pass ``log p`` (``-inf`` for zeros).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_specplugin import stats
from vllm_specplugin.verification import algorithm as alg

pytestmark = pytest.mark.statistical

ALPHA = 0.01
TV = 0.05
POWER = 0.99
GAMMA = 2
V = 6

P = [  # target at positions 1, 2 and the bonus position 3
    np.array([0.30, 0.25, 0.20, 0.15, 0.10, 0.00]),  # token 5 impossible
    np.array([0.05, 0.15, 0.20, 0.30, 0.25, 0.05]),
    np.array([0.10, 0.10, 0.30, 0.20, 0.20, 0.10]),
]
Q = [  # draft sampling distributions (token 5 drafted though p1(5) = 0: must always be rejected)
    np.array([0.10, 0.30, 0.10, 0.20, 0.05, 0.25]),
    np.array([0.30, 0.10, 0.20, 0.20, 0.10, 0.10]),
]


def required_n(probs) -> int:
    df = int(np.count_nonzero(probs)) - 1
    return stats.sample_size_for_tv(TV, df, alpha=ALPHA, power=POWER)


@pytest.fixture(scope="module")
def rs(cpu_rejection_sampler):
    """vLLM's rejection_sampler module with CPU fallbacks registered and expand repaired (conftest)."""
    return cpu_rejection_sampler


def metadata(rows: int, temperature=1.0, top_k=None, top_p=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((rows,), float(temperature)),
        all_greedy=False,
        all_random=True,
        top_p=None if top_p is None else torch.full((rows,), float(top_p)),
        top_k=None if top_k is None else torch.full((rows,), int(top_k), dtype=torch.int32),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def draw(probs, rows, gen) -> torch.Tensor:
    return torch.multinomial(torch.tensor(probs, dtype=torch.float64), rows, replacement=True,
                             generator=gen)


def run(rs, rows, *, seed, q_draw=Q, draft_probs=None, drafts=None, target_logits=None,
        md=None, bonus=P[2]):
    """One rejection_sample call on ``rows`` identical requests; returns int array (rows, G+1).

    ``drafts``: fixed draft tokens per position (deterministic rule); else sampled from q_draw.
    ``draft_probs``: per-position draft probabilities given to the verifier (None: one-hot).
    ``target_logits``: per-position logits rows (default log P), or a full (rows*G, V) tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    if drafts is None:
        draft_ids = torch.stack([draw(q_draw[i], rows, gen) for i in range(GAMMA)], dim=1)
    else:
        draft_ids = torch.tensor(drafts).repeat(rows, 1)
    draft_ids = draft_ids.reshape(-1).to(torch.int32).contiguous()
    if target_logits is None:
        with np.errstate(divide="ignore"):
            target_logits = [np.log(P[i]) for i in range(GAMMA)]
    if isinstance(target_logits, torch.Tensor):  # already one row per draft token
        logits = target_logits.to(torch.float32)
    else:
        logits = torch.tensor(np.stack(target_logits), dtype=torch.float32).repeat(rows, 1)
    dp = None
    if draft_probs is not None:
        dp = torch.tensor(np.stack(draft_probs), dtype=torch.float32).repeat(rows, 1).contiguous()
    bonus_ids = draw(bonus, rows, gen).reshape(rows, 1).contiguous()
    cu = (torch.arange(1, rows + 1, dtype=torch.int32) * GAMMA).contiguous()
    md = md or metadata(rows)
    torch.manual_seed(seed + 1)  # uniforms and recovery noise use the global generator
    out = rs.rejection_sample(draft_ids, [GAMMA] * rows, GAMMA, cu, dp, logits.contiguous(),
                              bonus_ids, md)
    out = out.numpy()
    # Emitted positions form a prefix of each row; -1 pads the rest.
    emitted = out >= 0
    assert (emitted[:, 0]).all()
    assert not (~emitted[:, :-1] & emitted[:, 1:]).any()
    return out


def position_tests(out, targets, label):
    """GOF of each emitted position against its exact target; returns [(pos, result, power)]."""
    results = []
    for pos, probs in enumerate(targets):
        tokens = out[:, pos][out[:, pos] >= 0]
        counts = np.bincount(tokens, minlength=V)
        res = stats.gof_test(counts, probs, method="pearson")
        power = stats.power_for_tv(res.n, TV, max(res.df, 1), alpha=ALPHA)
        print(f"{label} pos{pos + 1}: n={res.n} df={res.df} p={res.pvalue:.4g} "
              f"impossible={res.impossible_count} tv_hat={res.tv:.4f} power@0.05={power:.4f}")
        results.append((pos, res, power))
    return results


def rows_for(acceptance_to_last: float, n: int) -> int:
    """Rows so that the expected count at the last (bonus) position is 1.3 n."""
    return int(math.ceil(1.3 * n / acceptance_to_last))


def assert_honest(results, need_n):
    for pos, res, _power in results:
        assert res.impossible_count == 0, pos
        assert res.n >= need_n[pos], (pos, res.n, need_n[pos])
        assert res.pvalue >= ALPHA, (pos, res.pvalue)


# ---------------------------------------------------------------------------------------------
# Honest configurations
# ---------------------------------------------------------------------------------------------


def test_probabilistic_verification_is_exact(rs):
    beta = [float(np.minimum(P[i], Q[i]).sum()) for i in range(GAMMA)]  # acceptance rates
    need = [required_n(p) for p in P]
    rows = rows_for(beta[0] * beta[1], max(need))
    out = run(rs, rows, seed=11, draft_probs=Q)
    assert_honest(position_tests(out, P, "probabilistic"), need)
    # Acceptance rate of position 1 is the exact beta_1 (binomial 4-sigma band).
    acc = (out[:, 1] >= 0).mean()
    assert abs(acc - beta[0]) < 4 * math.sqrt(beta[0] * (1 - beta[0]) / rows)


def test_onehot_verification_sampled_drafts_is_exact(rs):
    beta = [float((P[i] * Q[i]).sum()) for i in range(GAMMA)]  # P(accept) = E_q p(x)
    need = [required_n(p) for p in P]
    rows = rows_for(beta[0] * beta[1], max(need))
    out = run(rs, rows, seed=12, draft_probs=None)
    assert_honest(position_tests(out, P, "onehot-sampled"), need)


def test_onehot_verification_deterministic_drafts_is_exact(rs):
    """Drafts fixed at (0, 3) in every row, as a deterministic proposer would give them."""
    drafts = [0, 3]
    beta = [P[0][0], P[1][3]]
    need = [required_n(p) for p in P]
    rows = rows_for(beta[0] * beta[1], max(need))
    out = run(rs, rows, seed=13, drafts=drafts)
    assert_honest(position_tests(out, P, "onehot-deterministic"), need)


def test_pipeline_with_temperature_top_k_top_p_is_exact(rs):
    """Raw logits + (T=0.7, top_k=5, top_p=0.9) through apply_sampling_constraints (which reads
    per-token T/k/p through the repaired expand kernel) then rejection_sample: emitted tokens
    follow ``process_logits`` of the raw logits, the enumerative model's target."""
    raw = [np.array([1.0, 0.6, 0.3, 0.0, -0.4, -2.5]), np.array([-1.0, 0.2, 0.5, 1.1, 0.9, -3.0])]
    t, k, p = 0.7, 5, 0.9
    targets = [alg.process_logits(r, t, k, p) for r in raw]
    assert all(np.count_nonzero(x) < V for x in targets)  # top-k/top-p really remove tokens
    q_draw = [alg.softmax(r) for r in raw]
    beta = [float(np.minimum(targets[i], q_draw[i]).sum()) for i in range(GAMMA)]
    need = [required_n(x) for x in targets]
    rows = rows_for(beta[0], max(need))
    md = metadata(rows, temperature=t, top_k=k, top_p=p)
    logits = torch.tensor(np.stack(raw), dtype=torch.float32).repeat(rows, 1)
    cu = (torch.arange(1, rows + 1, dtype=torch.int32) * GAMMA)
    processed = rs.apply_sampling_constraints(logits, cu, md)
    out = run(rs, rows, seed=14, q_draw=q_draw, draft_probs=q_draw,
              target_logits=processed.clone(), md=md)
    # apply_sampling_constraints processed every row identically (checked against the model).
    probs = torch.softmax(processed, dim=-1).numpy()
    np.testing.assert_allclose(probs[0::2], np.broadcast_to(targets[0], (rows, V)), atol=1e-5)
    np.testing.assert_allclose(probs[1::2], np.broadcast_to(targets[1], (rows, V)), atol=1e-5)
    results = position_tests(out[:, :GAMMA], targets, "pipeline T/k/p")
    assert_honest(results, need)

    # Fault: verify against the unprocessed logits (temperature/top-k/top-p ignored).
    bad = run(rs, rows, seed=14, q_draw=q_draw, draft_probs=q_draw, target_logits=raw, md=md)
    res = stats.gof_test(np.bincount(bad[:, 0], minlength=V), targets[0], method="pearson")
    print(f"ignore-temperature fault pos1: n={res.n} p={res.pvalue:.3g} "
          f"impossible={res.impossible_count} tv_hat={res.tv:.4f}")
    assert res.pvalue < ALPHA


# ---------------------------------------------------------------------------------------------
# Honest-vs-fault pair: draft_probs at the wrong temperature
# ---------------------------------------------------------------------------------------------


def test_wrong_temperature_draft_probs_is_rejected(rs):
    """Drafts sampled from softmax(l / 0.5) but draft_probs = softmax(l / 1.0): the verifier's q
    is wrong. The honest twin (same seed, right draft_probs) passes; the fault is rejected; and
    the faulty output still fits the enumerative model's prediction for the fault."""
    draft_logits = [np.array([1.5, 0.0, -0.5, 1.0, -1.0, 0.5]),
                    np.array([0.0, 1.0, -1.0, 0.5, 0.0, -0.5])]
    q_draw = [alg.process_logits(x, 0.5) for x in draft_logits]
    q_wrong = [alg.process_logits(x, 1.0) for x in draft_logits]
    predicted = alg.first_token_distribution(
        alg.chain_output_distribution(lambda s: P[len(s)], lambda s: q_draw[len(s)], GAMMA,
                                      fault="wrong_q", fault_arg=lambda s: q_wrong[len(s)]), V)
    predicted_tv = 0.5 * float(np.abs(predicted - P[0]).sum())
    assert predicted_tv > TV  # the test is powered (>= 0.99) to see this deviation
    rows = required_n(P[0])

    honest = run(rs, rows, seed=21, q_draw=q_draw, draft_probs=q_draw)
    h = stats.gof_test(np.bincount(honest[:, 0], minlength=V), P[0], method="pearson")
    faulty = run(rs, rows, seed=21, q_draw=q_draw, draft_probs=q_wrong)
    f = stats.gof_test(np.bincount(faulty[:, 0], minlength=V), P[0], method="pearson")
    fm = stats.gof_test(np.bincount(faulty[:, 0], minlength=V), predicted, method="pearson")
    print(f"wrong-q pair: n={rows} honest p={h.pvalue:.4g}; fault p={f.pvalue:.3g} "
          f"(tv_hat={f.tv:.4f}, predicted tv={predicted_tv:.4f}); fault vs model p={fm.pvalue:.4g}")
    assert h.pvalue >= ALPHA
    assert f.pvalue < ALPHA
    assert fm.pvalue >= ALPHA
