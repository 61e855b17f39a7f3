"""Adaptive γ: the threshold rule, the cost-model rule, the batch back-off, and the probe at γ = 0."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vllm_specplugin.proposers.base import DraftRequest
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.gamma import AdaptiveGamma, GammaPolicy
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-tiny")


@pytest.fixture(scope="module")
def runtime():
    return DraftRuntime(DRAFT, target_vocab_size=4096)


def step(proposer, contexts: dict[str, list[int]], gamma_max: int, accept: bool) -> dict[str, int]:
    """One engine step: draft, then the 'target' accepts every draft (or none) and adds a token."""
    requests = [DraftRequest(rid, ctx, gamma_max) for rid, ctx in contexts.items()]
    drafts = proposer.propose(requests)
    lengths = {}
    for request, draft in zip(requests, drafts):
        lengths[request.request_id] = len(draft.token_ids)
        kept = draft.token_ids if accept else []
        wrong = (draft.token_ids[0] + 1) % 4096 if draft.token_ids and not accept else 7
        contexts[request.request_id] = list(request.context) + kept + [wrong]
    return lengths


def test_threshold_rule_raises_and_lowers_gamma(runtime):
    proposer = AdaptiveGamma(EnsembleProposer([runtime]), GammaPolicy(gamma_min=1))
    contexts = {"r": np.random.default_rng(0).integers(3, 4096, 20).tolist()}
    seen = [step(proposer, contexts, 6, accept=False)["r"]]
    for _ in range(8):
        seen.append(step(proposer, contexts, 6, accept=False)["r"])
    assert seen[-1] == 1 and seen == sorted(seen, reverse=True)  # rejections: down to gamma_min
    for _ in range(12):
        seen.append(step(proposer, contexts, 6, accept=True)["r"])
    assert seen[-1] == 6  # acceptance: up to gamma_max (the request's budget)
    proposer.free("r")
    assert proposer.tracked_request_ids() == set()


def test_cost_model_rule_matches_the_speedup_formula(runtime):
    from vllm_specplugin.stats.speedup import expected_speedup

    proposer = AdaptiveGamma(EnsembleProposer([runtime]), GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=0.2))
    contexts = {"c": np.random.default_rng(1).integers(3, 4096, 20).tolist()}
    for _ in range(10):
        step(proposer, contexts, 8, accept=True)
    state = proposer._states["c"]
    speedups = [float(expected_speedup(min(state.alpha, 0.999), g, 0.2)) for g in range(1, 9)]
    assert proposer.gamma_of("c") == 1 + int(np.argmax(speedups))
    # Always rejected: speculation does not pay, gamma 0, with a probe every probe_every steps.
    every = proposer.policy.probe_every
    assert every == 8  # the default
    lengths = [step(proposer, contexts, 8, accept=False)["c"] for _ in range(4 * every)]
    assert lengths[-every:].count(0) == every - 1 and lengths[-every:].count(1) == 1


def test_requests_at_gamma_zero_probe_in_the_same_step(runtime):
    """Requests that arrive at different steps and sit at γ = 0 (drafting does not pay at c = 50)
    probe together, every probe_every-th step: a probe step verifies one token per such request,
    so the measured cost per token is not one step's fixed cost of having drafts at all."""
    proposer = AdaptiveGamma(EnsembleProposer([runtime]), GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=50))
    rng = np.random.default_rng(4)
    contexts: dict[str, list[int]] = {}
    drafting_per_step = []
    for i in range(4 * proposer.policy.probe_every):
        if i < 5:  # one new request per step
            contexts[f"r{i}"] = rng.integers(3, 4096, 10).tolist()
        lengths = step(proposer, contexts, 4, accept=False)
        drafting_per_step.append(sum(n > 0 for n in lengths.values()))
    late = drafting_per_step[5:]
    assert set(late) == {0, 5} and late.count(5) == 4  # all five together, at calls 8, 16, 24 and 32


def test_a_new_request_starts_from_the_acceptance_seen_so_far(runtime):
    """c = 0.8 is above the break-even of the fixed start α = 0.7 (γ = 1 pays only when α > c):
    a new request starting from it would not draft until its probes had raised its average. After
    the proposer has seen high acceptance, a new request starts from that and drafts at once."""
    policy = GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=0.8)
    rng = np.random.default_rng(3)
    fresh = AdaptiveGamma(EnsembleProposer([runtime]), policy)
    assert step(fresh, {"x": rng.integers(3, 4096, 12).tolist()}, 6, accept=True)["x"] == 0
    proposer = AdaptiveGamma(EnsembleProposer([runtime]), policy)
    seen = {"a": rng.integers(3, 4096, 12).tolist()}
    step(proposer, seen, 6, accept=True)
    proposer._states["a"].alpha = 0.95  # as if "a" had been accepted for a while: it drafts
    for _ in range(40):
        step(proposer, seen, 6, accept=True)
    assert proposer.population_alpha > 0.9
    newcomer = {"b": rng.integers(3, 4096, 12).tolist()}
    assert step(proposer, newcomer, 6, accept=True)["b"] >= 1
    assert proposer._states["b"].alpha > 0.9


def test_large_batches_back_off_to_no_drafting(runtime):
    inner = EnsembleProposer([runtime])
    proposer = AdaptiveGamma(inner, GammaPolicy(max_batch=4))
    rng = np.random.default_rng(2)
    small = {f"s{i}": rng.integers(3, 4096, 10).tolist() for i in range(4)}
    large = {f"l{i}": rng.integers(3, 4096, 10).tolist() for i in range(5)}
    assert all(n > 0 for n in step(proposer, small, 3, accept=True).values())
    assert all(n == 0 for n in step(proposer, large, 3, accept=True).values())
    assert inner.metrics.backoff_steps == 1
    assert inner.metrics.gamma_chosen[0] == 5


def test_policy_rejects_impossible_settings():
    with pytest.raises(ValueError, match="mode"):
        GammaPolicy(mode="magic")
    with pytest.raises(ValueError, match="lower_below <= raise_above"):
        GammaPolicy(raise_above=0.5, lower_below=0.6)
    with pytest.raises(ValueError, match="gamma_min"):
        GammaPolicy(gamma_min=-1)
    with pytest.raises(ValueError, match="probe_every"):
        GammaPolicy(probe_every=0)
    with pytest.raises(ValueError, match="initial_alpha"):
        GammaPolicy(initial_alpha=1.5)


def test_initial_alpha_is_the_new_request_estimate(runtime):
    """A new request starts from initial_alpha: the rule acts on it at the first step."""
    drafted = {}
    for initial in (0.7, 0.1):  # default: γ stays at the budget; below lower_below: γ − 1 at once
        proposer = AdaptiveGamma(EnsembleProposer([runtime]), GammaPolicy(initial_alpha=initial))
        drafted[initial] = step(proposer, {"a": [11, 12, 13, 14]}, 4, accept=True)["a"]
        assert proposer._states["a"].alpha == initial  # no outcome seen yet
    assert drafted == {0.7: 4, 0.1: 3}


def test_step_cost_model_recovers_verification_and_draft_costs():
    """Target time a + b·D and draft time d per token: c = (b + d) / (a / batch)."""
    from vllm_specplugin.proposers.gamma import StepCostModel

    model = StepCostModel()
    rng = np.random.default_rng(3)
    a, b, d, batch = 0.008, 0.0004, 0.0002, 4
    assert model.cost_ratio(batch) is None  # not enough steps yet
    for _ in range(200):
        drafted = int(rng.integers(0, 17))
        model.observe_target(drafted, a + b * drafted)
        model.observe_draft(drafted, d * drafted)
    assert model.slope == pytest.approx(b, rel=1e-6)
    assert model.cost_ratio(batch) == pytest.approx((b + d) / (a / batch), rel=1e-6)
    # Expensive verification makes speculation stop paying: the cost model picks gamma 0.
    from vllm_specplugin.stats.speedup import optimal_gamma

    assert optimal_gamma(0.25, model.cost_ratio(batch), 5) == 0 < optimal_gamma(0.6, model.cost_ratio(batch), 5)


def test_threshold_mode_at_gamma_zero_probes_and_comes_back(runtime):
    """gamma_min 0 means "stop drafting when it does not pay, come back when it does": at γ = 0 a
    request still drafts γ = 1 every probe_every steps, so α recovers and γ rises again."""
    policy = GammaPolicy(gamma_min=0, probe_every=4)
    proposer = AdaptiveGamma(EnsembleProposer([runtime]), policy)
    contexts = {"z": np.random.default_rng(4).integers(3, 4096, 20).tolist()}
    rejected = [step(proposer, contexts, 6, accept=False)["z"] for _ in range(40)]
    assert proposer.gamma_of("z") == 0
    # At γ = 0, exactly one probe of one token every probe_every steps.
    assert rejected[-8:].count(1) == 2 and rejected[-8:].count(0) == 6, rejected
    recovered = [step(proposer, contexts, 6, accept=True)["z"] for _ in range(60)]
    assert proposer.gamma_of("z") == 6, recovered  # back up to the request's budget
    assert recovered[-1] == 6


class _Clock:
    """A synthetic clock (seconds, float) that tests advance by hand."""

    now = 0.0

    def __call__(self):
        return self.now


class _ClockedProposer:
    """A drafter on a synthetic clock: drafting costs ``d`` per token, and a request's first
    draft also prefills its prompt (``prefill`` seconds), as the plugin's drafts do."""

    vocab_size = 4096

    def __init__(self, clock, d: float, prefill: float):
        self.clock, self.d, self.prefill, self.seen = clock, d, prefill, set()

    def propose(self, requests):
        import torch

        from vllm_specplugin.proposers.base import Draft

        drafts = []
        for request in requests:
            if request.request_id not in self.seen:
                self.seen.add(request.request_id)
                self.clock.now += self.prefill
            self.clock.now += self.d * request.gamma
            tokens = [5] * request.gamma
            drafts.append(Draft(tokens, torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), 4096).float()))
        return drafts

    def free(self, request_id):
        self.seen.discard(request_id)

    def tracked_request_ids(self):
        return set(self.seen)


class _BatchedDraft(_ClockedProposer):
    """The draft forwards a batch together: a step's drafting costs ``d`` per position of its
    longest draft, whatever the number of rows."""

    def propose(self, requests):
        self.clock.now += self.d * max(r.gamma for r in requests)  # one forward per position
        saved, self.d = self.d, 0.0
        try:
            return super().propose(requests)
        finally:
            self.d = saved


def test_cost_model_leaves_out_steps_that_admit_a_request():
    """Served at concurrency 4 with short outputs, a request arrives every few steps and its
    prompt is prefilled by the target (the step before) and by the drafts (this call). Those
    steps are not decoding steps: the measured c must be the decoding steps' (b + d) / (a / B)."""

    clock = _Clock()
    a, b, d, batch, prefill = 0.008, 0.0004, 0.0002, 4, 0.02
    proposer = AdaptiveGamma(_ClockedProposer(clock, d, prefill),
                             GammaPolicy(mode="cost_model", gamma_min=0, probe_every=2), clock=clock)
    rng = np.random.default_rng(5)
    live = {f"r{i}": [3] * 30 for i in range(batch)}
    next_id = batch
    for step_index in range(400):
        requests = [DraftRequest(rid, ctx, int(rng.integers(1, 7))) for rid, ctx in live.items()]
        drafts = proposer.propose(requests)
        drafted = sum(len(x.token_ids) for x in drafts)
        clock.now += a + b * drafted  # the target step verifying them
        for rid in live:
            live[rid] = live[rid] + [int(rng.integers(3, 4096))]
        if step_index % 4 == 3:  # a request finishes, a new one arrives: its prefill joins the step
            finished = next(iter(live))
            del live[finished]
            proposer.free(finished)
            live[f"r{next_id}"] = [3] * 30
            next_id += 1
            clock.now += prefill
    assert proposer.step_costs.slope == pytest.approx(b, rel=0.05)
    assert proposer.cost_ratio == pytest.approx((b + d) / (a / batch), rel=0.1)


def test_step_cost_model_is_not_held_by_its_first_observations():
    """The first step a server drafts is slow (cold caches, a first forward): with a fixed small
    weight from the start it stayed most of the measured d for dozens of steps. The first
    1/forgetting observations are averaged plainly, so nine steady ones outweigh it."""
    from vllm_specplugin.proposers.gamma import StepCostModel

    model = StepCostModel(forgetting=0.05)
    d = 0.0005
    model.observe_draft(16, 16 * 10 * d)  # one cold step at ten times the steady cost
    model.observe_target(16, 0.05)
    for _ in range(9):
        model.observe_draft(16, 16 * d)
        model.observe_target(0, 0.03)
    assert model.draft_per_token == pytest.approx(1.9 * d)  # the plain mean of the ten
    assert model._moments[1] == pytest.approx((0.05 + 9 * 0.03) / 10)


def test_cost_model_leaves_out_draft_catch_up_after_undrafted_steps():
    """A request that did not draft for some steps (γ = 0, then a probe) first forwards the
    tokens of those steps through its draft model. That catch-up is not the price of a draft
    token: served at batch 16 it doubled the measured d and kept every request at γ = 0."""

    class CatchingUp(_ClockedProposer):
        def __init__(self, clock, d, catch_up):
            super().__init__(clock, d, prefill=0.0)
            self.catch_up, self.calls, self.last_drafted = catch_up, 0, {}

        def propose(self, requests):
            self.calls += 1
            for request in requests:
                if request.gamma:
                    skipped = self.calls - self.last_drafted.get(request.request_id, self.calls - 1) - 1
                    self.clock.now += self.catch_up * skipped
                    self.last_drafted[request.request_id] = self.calls
            return super().propose(requests)

    clock = _Clock()
    a, b, d, batch = 0.03, 0.0005, 0.0005, 16
    proposer = AdaptiveGamma(CatchingUp(clock, d, catch_up=0.002),
                             GammaPolicy(mode="cost_model", gamma_min=0), clock=clock)
    live = {f"r{i}": [3] * 30 for i in range(batch)}
    chosen = []
    for i in range(80):  # drafts accepted for 10 steps, then rejected: γ 0 with a probe every 8 steps
        drafts = proposer.propose([DraftRequest(rid, ctx, 6) for rid, ctx in live.items()])
        drafted = sum(len(x.token_ids) for x in drafts)
        chosen.append(drafted)
        clock.now += a + b * drafted
        for rid, draft in zip(list(live), drafts):
            live[rid] = live[rid] + (list(draft.token_ids) if i < 10 else []) + [7]
    assert chosen[-16:].count(0) == 14  # at γ = 0 with its probes: catch-ups happened
    assert proposer.step_costs.draft_per_token == pytest.approx(d, rel=1e-6)


def test_cost_model_gives_a_batch_one_common_draft_length(runtime):
    """The draft forwards the whole batch once per position, so a step costs about what its
    longest draft costs: every request whose drafts pay drafts the γ that is best for the batch
    (Σ E(α_i, γ) / (1 + cγ)); one whose drafts do not pay at all stays at γ = 0 and probes with
    one token in every step (the batch's forwards run anyway), not every probe_every-th."""
    from vllm_specplugin.stats.speedup import expected_tokens_per_step, optimal_gamma

    c = 0.5
    proposer = AdaptiveGamma(EnsembleProposer([runtime]),
                             GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=c, probe_every=1000))
    rng = np.random.default_rng(6)
    contexts = {rid: rng.integers(3, 4096, 12).tolist() for rid in ("good", "fair", "poor")}
    step(proposer, contexts, 6, accept=True)
    alphas = {"good": 0.965, "fair": 0.79, "poor": 0.37}
    for rid, alpha in alphas.items():
        proposer._states[rid].alpha, proposer._states[rid].pending = alpha, None
    own = {rid: optimal_gamma(alpha, c, 6) for rid, alpha in alphas.items()}
    assert own == {"good": 6, "fair": 2, "poor": 0}  # what each would choose alone
    gammas = np.arange(1, 7)
    batch_best = 1 + int(np.argmax((expected_tokens_per_step(0.965, gammas) + expected_tokens_per_step(0.79, gammas))
                                   / (1 + c * gammas)))
    assert batch_best == 3
    assert step(proposer, contexts, 6, accept=True) == {"good": 3, "fair": 3, "poor": 1}
    assert proposer.gamma_of("poor") == 0  # a probe: its γ stays 0 until its α says otherwise
    # Alone, a request still drafts its own best γ.
    alone = {"good": contexts["good"]}
    proposer._states["good"].alpha, proposer._states["good"].pending = 0.965, None
    assert step(proposer, alone, 6, accept=True) == {"good": 6}


def test_step_costs_are_measured_per_batch_size_class():
    """The draft forwards a batch together: a forward costs about the same for 1 row or 16, so a
    draft token costs 16 times less at batch 16. Costs measured at batch 1 must not price batch 16
    (they did: c read 0.85 at batch 16 on the memory-bound pair, about twice its own cost)."""

    clock = _Clock()
    forward, b = 0.004, 0.0005
    proposer = AdaptiveGamma(_BatchedDraft(clock, forward, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0), clock=clock)
    plain = {}
    for batch in (1, 16):
        live = {f"b{batch}-{i}": [3] * 30 for i in range(batch)}
        plain[batch] = 0.01 + 0.001 * batch
        for i in range(30):
            budget = 2 + 2 * (i % 2)  # the drafted length varies, so the verification slope shows
            drafts = proposer.propose([DraftRequest(rid, ctx, budget) for rid, ctx in live.items()])
            drafts_made = [x.token_ids for x in drafts]
            clock.now += plain[batch] + b * sum(len(t) for t in drafts_made)
            for rid, tokens in zip(live, drafts_made):
                live[rid] = live[rid] + list(tokens) + [9]  # every draft accepted
    costs = proposer.step_costs_by_batch
    assert set(costs) == {1, 16}
    assert costs[1].draft_per_token == pytest.approx(forward, rel=1e-6)
    assert costs[16].draft_per_token == pytest.approx(forward / 16, rel=1e-6)
    assert costs[16].slope == pytest.approx(b, rel=1e-3)
    assert proposer.cost_ratio == pytest.approx((b + forward / 16) / (plain[16] / 16), rel=1e-3)
    assert AdaptiveGamma.batch_class(1) == 1 and AdaptiveGamma.batch_class(3) == 2 and AdaptiveGamma.batch_class(16) == 16


# Conditional acceptance by draft position served on the memory-bound pair at γ = 6 (batch 1, T = 0).
SERVED_CONDITIONAL = [0.99, 0.99, 0.959, 0.947, 0.966, 0.988]


def _accepted_run(rng, conditional, gamma: int) -> int:
    """How many of a γ-token draft's positions are accepted: position k with probability
    ``conditional[k-1]`` given the positions before it were."""
    accepted = 0
    while accepted < gamma and rng.random() < conditional[accepted]:
        accepted += 1
    return accepted


def _run_correlated_acceptance(proposer, clock, conditional, steps: int, seed: int,
                               first_step: list[float] | None = None) -> list[int]:
    """Batch 1: each step a draft's position k is accepted with probability ``conditional[k-1]``
    given the positions before it were (``first_step`` in place of it in the first step); returns
    the γ chosen in every step."""
    rng = np.random.default_rng(seed)
    context, chosen = [3] * 30, []
    for index in range(steps):
        (draft,) = proposer.propose([DraftRequest("r", context, len(conditional))])
        gamma = len(draft.token_ids)
        rates = first_step if index == 0 and first_step is not None else conditional
        accepted = _accepted_run(rng, rates, gamma)
        context = context + list(draft.token_ids[:accepted]) + [7]
        clock.now += 0.01
        chosen.append(gamma)
    return chosen


def test_cost_model_prices_long_drafts_by_acceptance_per_position():
    """Acceptance comes in runs: served on the memory-bound pair at γ = 6 (batch 1, T = 0) its
    positions were accepted with probability 0.99, 0.98, 0.94, 0.89, 0.86, 0.85 (6.51 tokens per
    step), conditionally 0.99, 0.99, 0.959, 0.947, 0.966, 0.988, while a request's per-token α
    averaged 0.918, whose i.i.d. model predicts 5.49 tokens and prices the sixth position at 0.6.
    At c = 0.3, γ = 6 is best (E / (1 + cγ) 2.32 against 2.18 at γ = 4), where the i.i.d. model
    sees nearly a tie (1.96 against 1.93) and drops γ after every rejection; the cost model must
    learn the positions' acceptance from what it verifies and keep γ = 6."""
    from vllm_specplugin.stats.speedup import expected_tokens_by_position

    conditional = SERVED_CONDITIONAL
    tokens = expected_tokens_by_position(conditional)
    speedups = tokens[1:] / (1 + 0.3 * np.arange(1, 7))
    assert int(np.argmax(speedups)) + 1 == 6 and tokens[6] == pytest.approx(6.5, abs=0.02)

    clock = _Clock()
    proposer = AdaptiveGamma(_ClockedProposer(clock, 0.0, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=0.3), clock=clock)
    chosen = _run_correlated_acceptance(proposer, clock, conditional, steps=300, seed=11)
    learned = proposer.position_acceptance.conditional(6, fallback=0.0)
    np.testing.assert_allclose(learned, conditional, atol=0.06)
    # After the first 50 steps γ = 6 in at least 95% of steps and never below 4 (seed 11: 97.2%,
    # min 4, with the prior of 4a071c4; 98.4% before it; the i.i.d. model at the request's α: 88%, min 1).
    assert np.mean(np.array(chosen[50:]) == 6) >= 0.95 and min(chosen[50:]) >= 4


def test_cost_model_recovers_from_a_rejected_first_test_of_a_position():
    """Served, the warm-up's first draft (γ = 4 at the initial α, before c was measured) had its
    third position rejected; that one outcome set the position's estimate to 0, the controller
    drafted γ = 2 from then on, and a position not drafted is never tested again: 1.41x plain for
    the whole run where γ = 6 ran at 2.24x. The estimate starts from a prior and the controller
    explores one position beyond its γ, so γ must climb back to 6."""
    conditional = SERVED_CONDITIONAL

    clock = _Clock()
    # c measured after 8 steps: 3 ms of drafting per token over a 10 ms step, c = 0.3.
    proposer = AdaptiveGamma(_ClockedProposer(clock, 0.003, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0), clock=clock)
    chosen = _run_correlated_acceptance(proposer, clock, conditional, steps=400, seed=11,
                                        first_step=[1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert chosen[0] == 4  # the served warm-up's first γ
    assert proposer.cost_ratio == pytest.approx(0.3, rel=0.05)
    # seed 11: γ = 6 in 98.5% of steps 200-400; without the prior and the exploration, 0%
    # (γ = 2 from the second step on).
    assert np.mean(np.array(chosen[200:]) == 6) >= 0.9, np.bincount(chosen)


def test_cost_model_explores_one_position_beyond_its_gamma():
    """A position is tested only where it is drafted: one whose estimate fell to where drafting
    it does not pay must still be drafted every probe_every steps, or it never recovers."""
    conditional = SERVED_CONDITIONAL

    clock = _Clock()
    proposer = AdaptiveGamma(_ClockedProposer(clock, 0.0, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=0.3, initial_alpha=0.95),
                             clock=clock)
    acceptance = proposer.position_acceptance
    acceptance.rates, acceptance.counts = [0.99, 0.99, 0.0], [20, 20, 4]  # three early rejections
    chosen = _run_correlated_acceptance(proposer, clock, conditional, steps=400, seed=11)
    assert chosen[0] == 2
    assert 3 in chosen[: proposer.policy.probe_every]  # explored within probe_every steps
    # seed 11: γ = 6 in 99% of steps 200-400; without exploration γ = 2 in every step.
    assert np.mean(np.array(chosen[200:]) == 6) >= 0.9, np.bincount(chosen)


def test_position_acceptance_starts_from_the_prior():
    """A position's first outcome does not alone set its estimate (one rejection set it to 0)."""
    from vllm_specplugin.proposers.gamma import PositionAcceptance

    acceptance = PositionAcceptance()  # the controller's defaults: weight 0.01, 2 pseudo-outcomes
    acceptance.observe(drafted=4, accepted=2, prior=0.75)
    np.testing.assert_allclose(acceptance.rates, [(1.5 + 1) / 3, (1.5 + 1) / 3, 1.5 / 3])
    for _ in range(500):
        acceptance.observe(drafted=3, accepted=3, prior=0.75)
    assert min(acceptance.rates) > 0.99  # the prior fades: after 1/weight outcomes, weight 0.01
    np.testing.assert_allclose(acceptance.conditional(5, fallback=0.5), acceptance.rates + [acceptance.rates[-1]] * 2)


def test_cost_model_stops_exploring_a_settled_position():
    """Exploration costs a draft position in one step of probe_every; once the position beyond γ
    has been tested 1/weight times its estimate is settled and the extra position is no longer
    drafted. Here γ = 1 is best (positions accepted with 0.7, then 0.3; c = 0.3: E / (1 + cγ)
    1.31 at γ = 1, 1.19 at γ = 2)."""
    clock = _Clock()
    proposer = AdaptiveGamma(_ClockedProposer(clock, 0.0, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0, cost_ratio=0.3, initial_alpha=0.7),
                             clock=clock)
    chosen = np.array(_run_correlated_acceptance(proposer, clock, [0.7, 0.3, 0.3, 0.3], steps=2000, seed=3))
    every, step = proposer.policy.probe_every, np.arange(len(chosen))
    exploring = step % every == every - 1  # the probe_every-th calls
    early, late = exploring & (step < 400), exploring & (step >= 1500)
    assert np.mean(chosen[early] >= 2) >= 0.8  # explored: γ = 1 drafted as 2
    assert proposer.position_acceptance.settled(2)
    # and stopped (seed 3: 94% of those steps explored early, γ = 1 in 86% late; 0% without the check)
    assert np.mean(chosen[late] == 1) >= 0.5


def test_cost_model_measures_the_verification_cost_at_a_constant_gamma():
    """With γ constant every step verifies the same number of draft tokens, so the step's cost
    per verified token b cannot be told from its base cost: served at batch 32-48 on the
    memory-bound pair the slope stayed 0, c was the draft's cost alone (0.07) and γ stayed at 5-6
    where every fixed γ ran at 0.87-0.99x plain. Here verification is what stops paying (a 16 ms
    plain step for 16 requests, b = 1.2 ms per verified draft token, drafting nearly free: c =
    1.25, where no γ pays: E / (1 + cγ) 0.88 at γ = 1, 0.85 at 2); the controller must measure b
    and stop drafting."""

    clock = _Clock()
    forward, plain, b = 0.0008, 0.016, 0.0012
    proposer = AdaptiveGamma(_BatchedDraft(clock, forward, prefill=0.0),
                             GammaPolicy(mode="cost_model", gamma_min=0, initial_alpha=0.95), clock=clock)
    rng = np.random.default_rng(5)
    live = {f"r{i}": [3] * 30 for i in range(16)}
    chosen = []
    for _ in range(400):
        drafts = proposer.propose([DraftRequest(rid, ctx, 6) for rid, ctx in live.items()])
        clock.now += plain + b * sum(len(d.token_ids) for d in drafts)
        for rid, draft in zip(list(live), drafts):
            accepted = _accepted_run(rng, SERVED_CONDITIONAL, len(draft.token_ids))
            live[rid] = live[rid] + list(draft.token_ids[:accepted]) + [7]
            chosen.append(len(draft.token_ids))
    costs = proposer.step_costs_by_batch[16]
    assert costs.slope_measured and costs.slope == pytest.approx(b, rel=0.05)
    assert proposer.cost_ratio == pytest.approx((b + forward / 16) / (plain / 16), rel=0.05)
    late = np.array(chosen[200 * 16:])
    # seed 5: γ <= 1 in 100% of request-steps 200-400 (0 in 87.5%, the probes' 1 in the rest);
    # without the slope probe the slope is never measured and γ = 6 in all of them.
    assert np.mean(late <= 1) >= 0.9, np.bincount(late)


def test_a_seeded_request_starts_from_the_fixed_initial_alpha(runtime):
    """The population's α comes from other requests; a seeded request starts from initial_alpha."""
    proposer = AdaptiveGamma(EnsembleProposer([runtime]), GammaPolicy(initial_alpha=0.7))
    contexts = {"other": np.random.default_rng(5).integers(3, 4096, 20).tolist()}
    for _ in range(6):
        step(proposer, contexts, 4, accept=False)
    assert proposer.population_alpha < 0.6
    proposer.propose([DraftRequest("seeded", [5, 6, 7], 4, seeded=True), DraftRequest("unseeded", [5, 6, 7], 4)])
    assert proposer._states["seeded"].alpha == 0.7
    assert proposer._states["unseeded"].alpha == proposer.population_alpha
