"""The suffix drafter (proposers/suffix.py) and the drafter choice (proposers/choice.py)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.proposers.base import DraftRequest
from vllm_specplugin.proposers.choice import (MODEL, NONE, SUFFIX, ChoicePolicy, DrafterChoice, Prices,
                                              expected_accepted, model_goodput)
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.proposers.suffix import SuffixDrafter, SuffixSettings, match_suffix

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-tiny")
VOCAB = 4096


def match(tokens, **settings):
    text = np.asarray(tokens, dtype=np.int64)
    return match_suffix(text, text.size, SuffixSettings(**settings))


def test_continues_the_longest_earlier_occurrence():
    found = match([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert found.match_length == 3
    assert found.tokens == [4, 5, 9, 1, 2, 3]  # runs on into the key itself: a loop continues
    assert found.token_probs == [1.0] * 6


def test_follows_the_most_frequent_continuation():
    # "7 8" was followed by 1, 2, 1: the path takes 1 (2 of 3), then both of those continue 7 8.
    found = match([7, 8, 1, 7, 8, 2, 7, 8, 1, 7, 8], max_match=2)
    assert found.match_length == 2
    assert found.tokens[:3] == [1, 7, 8]
    assert found.token_probs[0] == pytest.approx(2 / 3)


def test_a_tie_goes_to_the_most_recent_occurrence():
    assert match([5, 6, 1, 5, 6, 2, 5, 6], max_match=2).tokens[0] == 2
    assert match([5, 6, 2, 5, 6, 1, 5, 6], max_match=2).tokens[0] == 1


def test_min_token_prob_cuts_the_path_and_min_match_refuses_short_matches():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]  # three continuations, each 1/3
    assert match(tokens, max_match=2, min_token_prob=0.5).tokens == []
    assert match(tokens, max_match=2, min_token_prob=0.3).tokens[:1] == [3]
    assert match([1, 2, 3, 4, 9, 4]).tokens == []  # a one-token match only
    assert match([1, 2, 3, 4, 9, 4], min_match=1).tokens[:2] == [9, 4]
    assert match([4]).tokens == [] and match([]).tokens == []


def test_no_continuation_crosses_a_document_separator():
    drafter = SuffixDrafter(VOCAB, SuffixSettings(corpus_requests=4))
    drafter.chain(DraftRequest("a", [10, 11, 12, 13], 4))
    drafter.free("a")  # "a" joins the corpus
    found = drafter.chain(DraftRequest("b", [40, 12, 13], 8))
    assert found.tokens == []  # 12 13 ended document "a": nothing followed it there
    found = drafter.chain(DraftRequest("c", [40, 11, 12], 8))
    assert found.tokens == [13]


def test_the_corpus_is_used_except_by_seeded_requests_at_positive_temperature():
    drafter = SuffixDrafter(VOCAB, SuffixSettings(corpus_requests=2))
    drafter.chain(DraftRequest("done", [1, 2, 3, 4, 5, 6], 4))
    drafter.free("done")
    sampled = SamplingParams(temperature=1.0)
    assert drafter.chain(DraftRequest("u", [9, 2, 3], 3, sampled)).tokens == [4, 5, 6]
    assert drafter.chain(DraftRequest("g", [9, 2, 3], 3, seeded=True)).tokens == [4, 5, 6]  # greedy: no randomness
    assert drafter.chain(DraftRequest("s", [9, 2, 3], 3, sampled, seeded=True)).tokens == []
    for rid in "xyz":  # the corpus keeps the last corpus_requests documents
        drafter.chain(DraftRequest(rid, [50, 51], 1))
        drafter.free(rid)
    assert drafter.chain(DraftRequest("u2", [9, 2, 3], 3, sampled)).tokens == []


def test_drafts_are_one_hot_and_cut_to_gamma_and_vocabulary():
    drafter = SuffixDrafter(16)
    (draft,) = drafter.propose([DraftRequest("r", [1, 2, 3, 4, 20, 5, 1, 2, 3], 3)])
    assert draft.token_ids == [4]  # 20 is outside the vocabulary: the chain ends before it
    assert draft.probs.shape == (1, 16) and draft.probs[0, 4] == 1 and draft.probs.sum() == 1
    (draft,) = drafter.propose([DraftRequest("r", [1, 2, 3, 4, 5, 6, 1, 2, 3], 2)])
    assert draft.token_ids == [4, 5] and torch.equal(draft.probs.argmax(-1), torch.tensor([4, 5]))


def test_settings_are_validated():
    for bad in ({"min_match": 0}, {"min_match": 5, "max_match": 4}, {"min_token_prob": 0}, {"corpus_requests": -1}):
        with pytest.raises(ValueError):
            SuffixSettings(**bad)
    with pytest.raises(ValueError):
        ChoicePolicy(draft_cost=-1)


# -- the drafter choice ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime():
    return DraftRuntime(DRAFT, target_vocab_size=VOCAB)


def loop_context(seed: int, period: int = 6, repeats: int = 3) -> list[int]:
    segment = np.random.default_rng(seed).integers(3, VOCAB, period).tolist()
    return segment * repeats


def test_expected_accepted():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.3, 0) == 0


def serve(choice: DrafterChoice, contexts: dict[str, list[int]], target, steps: int, gamma: int = 4,
          seeded: bool = False, params: SamplingParams = SamplingParams(temperature=0.0)) -> list[dict[str, str]]:
    """Steps of a synthetic engine: ``target(rid, context)`` is the token the target emits next
    (a deterministic target, T = 0); drafts are accepted while they agree with it."""
    seen = []
    for _ in range(steps):
        requests = [DraftRequest(rid, list(ctx), gamma, params, seeded=seeded) for rid, ctx in contexts.items()]
        drafts = choice.propose(requests)
        seen.append({rid: c.drafter for rid, c in choice.last_choices.items()})
        for request, draft in zip(requests, drafts):
            context = contexts[request.request_id]
            for token in draft.token_ids:
                if token != target(request.request_id, context):
                    break
                context.append(token)
            context.append(target(request.request_id, context))
    return seen


def periodic(period: int):
    """A target that repeats the context's last `period` tokens: the suffix drafter's best case."""
    return lambda rid, context: context[-period]


# The mechanics below at a fast-reacting average (the default, 0.1, is slower on purpose), at the
# configured prices (this loop's steps take microseconds: measured, they would price any draft out).
# The dynamics of the choice at the i.i.d. prior (model_run_prior = model_prior), under which a
# looping context's first step goes to the suffix (at the default run prior the model's first step
# prices above a suffix chain at suffix_prior 0.5).
FAST = ChoicePolicy(ema_weight=0.3, probe_every=8, measure_costs=False, model_run_prior=0.6)


def test_a_looping_target_is_drafted_by_the_suffix_at_no_draft_cost(runtime):
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), FAST)
    contexts = {"loop": loop_context(0)}
    seen = serve(choice, contexts, periodic(6), steps=6)
    assert all(step["loop"] == SUFFIX for step in seen), seen
    state = choice._states["loop"]
    assert state.suffix_alpha > 0.9
    assert choice.metrics.choice_suffix_steps == 6 and choice.metrics.choice_model_steps == 0
    assert choice.metrics.suffix_accepted_tokens == choice.metrics.suffix_drafted_tokens > 0
    assert runtime.num_cached_requests == 0  # the draft model never ran


def test_when_the_suffix_is_wrong_the_model_drafts_and_when_nothing_pays_nobody_does(runtime):
    # The target breaks every loop: it emits a token never seen, so suffix drafts fail.
    counter = iter(range(10_000, 20_000))
    novel = lambda rid, context: next(counter) % (VOCAB - 3) + 3  # noqa: E731
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), FAST)
    contexts = {"r": loop_context(1)}
    seen = [step["r"] for step in serve(choice, contexts, novel, steps=12)]
    assert seen[0] == SUFFIX  # the prior and a match: tried first
    assert MODEL in seen[1:4], seen  # one failure put the suffix's α (0.35) under the model's prior (0.6)
    assert choice._states["r"].suffix_alpha < 0.4
    # The model's drafts fail too (a synthetic target the draft cannot know): α_m falls and the
    # choice drafts nothing but a probe of one model token every probe_every idle steps.
    assert seen[-4:].count(NONE) >= 3, seen
    longer = [step["r"] for step in serve(choice, contexts, novel, steps=16)]
    assert longer.count(MODEL) in (1, 2) and longer.count(NONE) >= 14, longer


def test_a_seeded_requests_choices_do_not_depend_on_other_requests(runtime):
    def run(others: bool) -> list[str]:
        choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB, SuffixSettings(corpus_requests=8)))
        if others:  # other sampled traffic first: finished requests that began with the same text and
            # went on elsewhere in the corpus, and the population's α moved
            counter = iter(range(30_000, 40_000))
            for i in range(3):
                serve(choice, {f"other{i}": loop_context(3)[:10]}, lambda rid, ctx: next(counter) % (VOCAB - 3) + 3,
                      steps=6, params=SamplingParams(temperature=1.0))
                choice.free(f"other{i}")
            assert choice.population_alpha[SUFFIX, True] < choice.policy.suffix_prior
        contexts = {"seeded": loop_context(3)[:10]}
        params = SamplingParams(temperature=1.0)
        generator = torch.Generator().manual_seed(5)  # a seeded request's own, as vLLM hands it over
        seen = []
        for _ in range(6):
            request = DraftRequest("seeded", list(contexts["seeded"]), 4, params, generator, seeded=True)
            (draft,) = choice.propose([request])
            # The whole choice (its goodput too: what decides it), not only its outcome here.
            seen.append((choice.last_choices["seeded"], tuple(draft.token_ids)))
            contexts["seeded"].append(contexts["seeded"][-6])
        return seen

    assert run(others=False) == run(others=True)


def test_the_choice_maximises_the_goodput_formula(runtime):
    policy = ChoicePolicy(draft_cost=0.2, verify_cost=0.05)
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), policy)
    request = DraftRequest("r", [1, 2, 3], 6)
    state = choice._state(request)
    assert state.model_accepted == pytest.approx(0.6 * (1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4 + 0.8**5))  # the prior at k
    state.model_accepted, state.suffix_alpha = 4.0, 0.5
    picked = choice.choose(request, state, suffix_length=2)
    model = (1 + 4.0) / (1 + 0.25 * 6)  # the model drafts k = 6
    suffix = (1 + expected_accepted(0.5, 2)) / (1 + 0.05 * 2)
    assert picked.drafter == MODEL and picked.gamma == 6 and picked.goodput == pytest.approx(model) and model > suffix
    state.suffix_alpha = 0.95
    assert choice.choose(request, state, suffix_length=6).drafter == SUFFIX
    state.model_accepted, state.suffix_alpha = 0.3, 0.02  # below v: even a free draft does not pay its verification
    assert choice.choose(request, state, suffix_length=1).drafter == NONE


@pytest.mark.parametrize("seeded", [False, True])
def test_a_new_request_drafts_long_model_drafts_at_the_default_priors(runtime, seeded, caplog):
    """Drafts accept in runs: at the default costs an i.i.d. prior of 0.6 priced a model draft of
    8 at 0.98x drafting nothing (and 12 at 0.76x), so with num_speculative_tokens 8 or a tree of
    12 the model never drafted and never got measured (served 7 Dec: a tree of 12 in the choice
    drafted nothing in 3 rounds). The run prior drafts them; where even it is priced out (k 24
    here), a warning says so."""
    import logging

    policy = ChoicePolicy(measure_costs=False)
    iid = ChoicePolicy(model_run_prior=0.6)  # run = first: the i.i.d. prior E(0.6, k)
    assert iid.model_prior_accepted(8) == pytest.approx(expected_accepted(0.6, 8))
    for k in (4, 8, 12):
        choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), policy)
        request = DraftRequest("r", [1, 2, 3], k, SamplingParams(temperature=1.0), seeded=seeded)
        picked = choice.choose(request, choice._state(request), suffix_length=0)
        assert picked.drafter == MODEL and picked.gamma == k, (k, picked)
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), policy)
    request = DraftRequest("r", [1, 2, 3], 24, SamplingParams(temperature=1.0), seeded=seeded)
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin.choice"):
        picked = choice.choose(request, choice._state(request), suffix_length=0)
    assert picked.drafter == NONE
    assert "at γ 24 the model's prior" in caplog.text and "priced below min_gain" in caplog.text


def test_a_draft_must_promise_min_gain_over_drafting_nothing(runtime):
    """A thin predicted gain is not drafted: served at 4 requests, T = 1, model drafts predicted at
    1.06x ran at 0.91x the draft-free steps. At min_gain 1.0 the choice drafts whatever beats 1."""
    for min_gain, expected in ((1.0, MODEL), (1.1, NONE)):
        policy = ChoicePolicy(draft_cost=0.2, verify_cost=0.05, min_gain=min_gain, measure_costs=False)
        choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), policy)
        request = DraftRequest("r", [1, 2, 3], 4)
        state = choice._state(request)
        state.model_accepted = 1.1  # (1 + 1.1) / (1 + 0.25 * 4) = 1.05
        assert model_goodput(policy, 1.1, 4) == pytest.approx(1.05)
        assert choice.choose(request, state, suffix_length=0).drafter == expected
        state.suffix_alpha = 0.2  # a suffix chain of 1 at 0.2: 1.2 / 1.05 = 1.14 clears either bar
        assert choice.choose(request, state, suffix_length=1).drafter == SUFFIX
    for bad in (0.9, True, "1.2", 10):
        with pytest.raises(ValueError, match="min_gain"):
            ChoicePolicy(min_gain=bad)


def test_greedy_traffic_does_not_set_the_start_of_sampled_requests(runtime):
    """Population averages are kept apart for greedy and sampled requests: suffix drafts that
    greedy requests accept nearly always must not start a T = 1 request on suffix drafts."""
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), ChoicePolicy(measure_costs=False))
    for i in range(4):
        serve(choice, {f"g{i}": loop_context(10 + i)}, periodic(6), steps=6)
        choice.free(f"g{i}")
    assert choice.population_alpha[SUFFIX, False] > 0.6
    greedy = choice._state(DraftRequest("new-greedy", [1, 2, 3], 4))
    sampled = choice._state(DraftRequest("new-sampled", [1, 2, 3], 4, SamplingParams(temperature=1.0)))
    assert greedy.suffix_alpha == choice.population_alpha[SUFFIX, False]
    assert sampled.suffix_alpha == choice.policy.suffix_prior == choice.population_alpha[SUFFIX, True]


def test_acceptance_is_a_ratio_of_averages_and_recovers_the_per_token_rate():
    """Chains of 4 at an i.i.d. per-token α of 0.78: the ratio of averages finds 0.78; the average
    of each step's accepted / tested would say about 0.58 and pick too short a γ."""
    from vllm_specplugin.proposers.choice import Acceptance

    rng = np.random.default_rng(0)
    estimate, ratios = Acceptance(0.5), []
    for _ in range(4000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.78:
            accepted += 1
        tested = min(4, accepted + 1)
        estimate.observe(accepted, tested, 0.01)
        ratios.append(accepted / tested)
    assert estimate.alpha == pytest.approx(0.78, abs=0.03)
    assert np.mean(ratios) < 0.65


class StepClock:
    """Synthetic time for the choice's cost measurement: a target step of a batch of B verifying
    D draft tokens takes ``base[B] + slope[B] * D`` seconds; drafting takes none."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve_timed(choice: DrafterChoice, clock: StepClock, contexts: dict[str, list[int]], steps: int,
                base: float, slope: float, seeded: frozenset = frozenset()) -> list[dict[str, str]]:
    """``serve`` (a period-6 greedy target) with the target step's time on ``clock``."""
    seen = []
    for _ in range(steps):
        requests = [DraftRequest(rid, list(ctx), 4, SamplingParams(temperature=0.0), seeded=rid in seeded)
                    for rid, ctx in contexts.items()]
        drafts = choice.propose(requests)
        seen.append({rid: c.drafter for rid, c in choice.last_choices.items()})
        clock.now += base + slope * sum(len(d.token_ids) for d in drafts)
        for request, draft in zip(requests, drafts):
            context = contexts[request.request_id]
            for token in draft.token_ids:  # the period-6 target accepts every suffix draft (not the model's)
                if token != context[-6]:
                    break
                context.append(token)
            context.append(context[-6])
    return seen


def test_under_load_the_choice_drafts_nothing_where_a_verified_token_costs_a_whole_share(runtime):
    """Batch 16 on a compute-bound machine: each verified draft token costs what a request's share
    of a plain step costs (v = 1), so even drafts that are always accepted do not pay; alone, v is
    small and the suffix drafts. The choice measures v per batch-size class and stops drafting
    (no probes either) at 16, while a seeded request keeps its batch-1 prices."""
    clock = StepClock()
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), ChoicePolicy(), clock=clock)
    alone = serve_timed(choice, clock, {"alone": loop_context(20)}, steps=60, base=0.010, slope=0.0005)
    # Its chain of 4 every step does not vary the draft count: a few steps draft nothing (slope probes).
    assert [step["alone"] for step in alone].count(NONE) <= 8 and all(step["alone"] == SUFFIX for step in alone[-10:])
    c, v = choice.costs.ratios(1)
    assert v == pytest.approx(0.05, rel=0.05)
    choice.free("alone")

    contexts = {f"r{i}": loop_context(30 + i) for i in range(16)}
    loaded = serve_timed(choice, clock, contexts, steps=80, base=0.016, slope=0.001, seeded=frozenset({"r0"}))
    c, v = choice.costs.ratios(16)
    assert v == pytest.approx(1.0, rel=0.05)
    assert isinstance(choice.last_prices, Prices) and choice.last_prices.verify_cost == v
    assert all(step[rid] == NONE for step in loaded[-30:] for rid in contexts if rid != "r0"), loaded[-1]
    # The seeded request is chosen at the configured prices whatever the load: its suffix drafts go on.
    assert all(step["r0"] == SUFFIX for step in loaded[1:]), [step["r0"] for step in loaded]
    # While class 16 was unmeasured, the unseeded requests drafted (at the configured prices).
    assert sum(step["r1"] == SUFFIX for step in loaded[:10]) >= 5


def test_under_load_an_unmeasured_class_varies_its_draft_count_by_drafting_nothing(runtime):
    """Every request's suffix chain of 4 accepted every step: the draft count never varies, so the
    slope cannot be measured until steps without drafts are interleaved (every other, after 8 steps)."""
    clock = StepClock()
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), ChoicePolicy(), clock=clock)
    contexts = {f"r{i}": loop_context(50 + i) for i in range(8)}
    seen = serve_timed(choice, clock, contexts, steps=60, base=0.012, slope=0.0002)
    c, v = choice.costs.ratios(8)
    assert v == pytest.approx(0.0002 / (0.012 / 8), rel=0.05)
    undrafted = [i for i, step in enumerate(seen) if all(d == NONE for d in step.values())]
    assert undrafted and min(undrafted) >= 8 and len(undrafted) <= 8, undrafted
    assert all(d == SUFFIX for d in seen[-1].values())  # v 0.13 at batch 8: the suffix still pays


def test_batch_costs_leave_out_steps_that_admit_a_request():
    from vllm_specplugin.proposers.choice import BatchCosts

    clock = StepClock()
    costs = BatchCosts(clock)
    for step in range(40):
        costs.step_started({"a"}, admitting=step % 2 == 1)  # every other step "prefilled" a prompt
        drafted = (step % 3) * 4
        costs.step_ended({"a"}, 1, drafted)
        clock.now += 0.010 + 0.001 * drafted + (0.5 if step % 2 == 0 else 0.0)  # admitting steps after even calls
    c, v = costs.ratios(1)
    assert v == pytest.approx(0.1, rel=1e-6) and c is None


def test_an_unmeasured_class_is_priced_as_the_nearest_measured_class_below_it(runtime):
    """A burst: batch 16 measured (v 1), then 40 requests at once. Class 32 is unmeasured at first;
    its requests are priced as class 16's, not at the configured batch-1 prices, so they do not draft."""
    clock = StepClock()
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), ChoicePolicy(), clock=clock)
    serve_timed(choice, clock, {f"r{i}": loop_context(70 + i) for i in range(16)}, steps=40, base=0.016, slope=0.001)
    assert choice.costs.measured(16)
    burst = serve_timed(choice, clock, {f"b{i}": loop_context(100 + i) for i in range(40)}, steps=3, base=0.040,
                        slope=0.001)
    assert not choice.costs.measured(40)
    assert choice.last_prices.verify_cost == pytest.approx(1.0, rel=0.05)
    assert all(drafter == NONE for step in burst[1:] for drafter in step.values()), burst


def _measure_class(costs, clock, batch: int, base: float, slope: float, draft_s: float, steps: int = 24) -> None:
    """``steps`` target steps of ``batch`` requests on ``clock``: a + b·D with D varying, the model
    drafting ``draft_s`` per draft token."""
    for step in range(steps):
        drafted = (step % 3) * 2 * batch
        costs.step_started({"a"}, admitting=False)
        if drafted:
            costs.observe_draft(batch, drafted, draft_s * drafted)
        costs.step_ended({"a"}, batch, drafted)
        clock.now += base + slope * drafted


def test_an_unmeasured_class_between_measured_ones_is_priced_by_interpolation_in_log_batch():
    """Served at concurrency 48, a round's batch passes through classes 8-16 on its way up and down,
    too briefly to be measured: priced at the configured batch-1 prices there, the choice drafted
    15-30 requests at once where class 32 said drafting cannot pay. Below the smallest measured
    class the prices run from the configured batch-1 ones to it; between two measured classes from
    one to the other, in log2 of the batch size; above the largest they are the largest's."""
    from vllm_specplugin.proposers.choice import BatchCosts

    clock = StepClock()
    costs = BatchCosts(clock, batch1=(0.1, 0.05))
    _measure_class(costs, clock, 32, base=0.064, slope=0.0016, draft_s=0.0008)  # share 2 ms: c 0.4, v 0.8
    assert costs.measured(32) and not costs.measured(16)
    c32, v32 = costs.ratios(32)
    assert (c32, v32) == (pytest.approx(0.4), pytest.approx(0.8))
    assert costs.ratios(1) == (pytest.approx(0.1), pytest.approx(0.05))  # the configured batch-1 prices
    c16, v16 = costs.ratios(16)  # log2 16 = 4 of 5 from batch 1 to batch 32
    assert (c16, v16) == (pytest.approx(0.1 + 0.8 * 0.3), pytest.approx(0.05 + 0.8 * 0.75))
    assert costs.ratios(64) == (pytest.approx(0.4), pytest.approx(0.8))  # above every measured class
    _measure_class(costs, clock, 2, base=0.010, slope=0.0005, draft_s=0.001)  # share 5 ms: c 0.2, v 0.1
    c4, v4 = costs.ratios(4)  # 1 of 4 octaves from batch 2 to batch 32
    assert (c4, v4) == (pytest.approx(0.2 + 0.25 * 0.2), pytest.approx(0.1 + 0.25 * 0.7))
    assert BatchCosts(clock).ratios(16) is None  # nothing measured: the caller's configured prices


def test_a_class_where_the_model_never_drafted_takes_c_from_the_nearest_class_where_it_did():
    """Served under a burst, class 32's steps nearly all admitted a request and the model's draft
    time there was never observed: its c must not fall back to the configured batch-1 0.12."""
    from vllm_specplugin.proposers.choice import BatchCosts

    clock = StepClock()
    costs = BatchCosts(clock)
    for batch, d in ((1, 0.004), (32, None)):
        for step in range(24):
            drafted = (step % 3) * 2 * batch
            costs.step_started({"a"}, admitting=False)
            if d is not None and drafted:
                costs.observe_draft(batch, drafted, d * drafted)
            costs.step_ended({"a"}, batch, drafted)
            clock.now += 0.010 * batch ** 0.5 + 0.0005 * drafted
    c1, _ = costs.ratios(1)
    c32, v32 = costs.ratios(32)
    assert c1 == pytest.approx(0.004 / 0.010, rel=1e-3)
    assert c32 == c1 and v32 == pytest.approx(0.0005 / (0.010 * 32 ** 0.5 / 32), rel=1e-3)


def test_the_trace_has_a_line_per_step_with_what_was_measured_and_chosen(runtime, tmp_path):
    import json

    clock = StepClock()
    path = tmp_path / "choice.jsonl"
    # (the i.i.d. prior: the loops' first steps go to the suffix, whose drafts the target accepts)
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB),
                           ChoicePolicy(trace=str(path), model_run_prior=0.6), clock=clock)
    serve_timed(choice, clock, {"a": loop_context(5), "b": loop_context(6)}, steps=12, base=0.010, slope=0.001)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 12 and lines[0]["target_s"] is None and lines[0]["admitting"]
    previous = lines[0]
    for line in lines[1:]:
        # the period-6 target accepts every suffix draft: each request emits its draft and one token
        assert line["target_s"] == pytest.approx(0.010 + 0.001 * previous["verified"])
        assert line["emitted"] == previous["verified"] + 2
        assert line["suffix"] + line["model"] + line["none"] == line["batch"] == 2
        previous = line
    with pytest.raises(ValueError, match="trace"):
        ChoicePolicy(trace="")
    with pytest.raises(OSError):  # at start-up, not at every step
        DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB),
                      ChoicePolicy(trace=str(tmp_path / "no such folder" / "trace.jsonl")))


def test_probes_of_a_model_that_does_not_pay_back_off(runtime):
    """A request at "no draft" that the model drafted for probes the model after probe_every idle
    steps, then after twice as many each time it stays there (up to 64): served at 4 requests, a
    probe step cost 1.8 plain steps. One at "no draft" since it arrived does not probe."""
    choice = DrafterChoice(EnsembleProposer([runtime]), SuffixDrafter(VOCAB), ChoicePolicy(probe_every=4))
    request = DraftRequest("r", [1, 2, 3], 4)
    state = choice._state(request)
    state.model_accepted = 0.1
    # at "no draft" since it arrived: it follows the population's estimate and never probes
    assert not any(choice.choose(request, state, suffix_length=0).drafter == MODEL for _ in range(200))
    state.model_accepted = 4.0
    assert choice.choose(request, state, suffix_length=0).drafter == MODEL and state.model_chosen
    state.model_accepted = 0.1
    probes = [step for step in range(1, 200) if choice.choose(request, state, suffix_length=0).drafter == MODEL]
    assert probes == [4, 12, 28, 60, 124, 188], probes
    state.model_accepted = 4.0  # the model pays again: chosen, and the next wait starts at probe_every
    assert choice.choose(request, state, suffix_length=0).drafter == MODEL and state.probe_interval == 0


def test_with_tree_drafting_the_model_option_is_its_tree_measured_by_its_accepted_path(runtime):
    """The choice over a TreeProposer (tree_drafting with verify "tree"): the model's option is a
    whole tree (parents handed on), priced by its node count, and its acceptance per step is the
    tree's accepted path: here the target emits the path to the tree's last node at depth 3 and
    then a token of its own, so the request's accepted drafts per step move from the prior
    (E(0.6, 8) = 1.5) to 3. tree_verification finds the TreeProposer through ``inner``."""
    from types import SimpleNamespace

    from vllm_specplugin.proposers.tree import TreeProposer, tree_depths
    from vllm_specplugin.tree_verification import tree_proposer

    tree = TreeProposer(EnsembleProposer([runtime]), node_budget=8, verify="tree", shape="dynamic")
    # Prices at which a tree of 8 at the prior pays (2.5 / 1.48; FAST's would price it out).
    policy = dataclasses.replace(FAST, draft_cost=0.03, verify_cost=0.03)
    choice = DrafterChoice(tree, SuffixDrafter(VOCAB, SuffixSettings(corpus_requests=0)), policy)
    assert tree_proposer(SimpleNamespace(drafter=SimpleNamespace(proposer=choice))) is tree
    rng = np.random.default_rng(7)
    context = rng.permutation(np.arange(3, VOCAB))[:12].tolist()  # no repeats: nothing for the suffix
    fresh = iter(rng.permutation(np.arange(3, VOCAB))[12:].tolist())
    prior = choice.model_prior(8)
    branched = 0
    for _ in range(8):
        (draft,) = choice.propose([DraftRequest("r", list(context), 8, SamplingParams(temperature=0.0),
                                                tree_ok=True)])
        assert choice.last_choices["r"].drafter == MODEL and draft.parents is not None
        assert len(draft.parents) == len(draft.token_ids) + 1 and choice._states["r"].model_nodes == len(draft.token_ids)
        depths = tree_depths(draft.parents)
        branched += len(set(draft.parents[1:])) < len(draft.parents) - 1
        node = max(n for n in range(1, len(draft.parents)) if depths[n] == min(3, max(depths)))
        context += tree.last_trees["r"].path(node) + [next(fresh)]
    assert branched > 0  # some steps drafted a tree, not only chains
    assert abs(choice._states["r"].model_accepted - 3) < 0.3 < abs(prior - 3), (choice._states["r"].model_accepted, prior)
