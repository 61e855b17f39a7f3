"""Batched ragged drafting and the ensemble: equal to one-at-a-time, q is what was drawn, metrics add up."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.base import GREEDY, DraftRequest
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DEMO = os.path.join(REPO_ROOT, "models", "demo")
VOCAB = 4096


def runtime(name: str, **kwargs) -> DraftRuntime:
    return DraftRuntime(os.path.join(DEMO, name), target_vocab_size=VOCAB, **kwargs)


def context(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


@torch.no_grad()
def full_forward_logits(rt: DraftRuntime, tokens: list[int]) -> torch.Tensor:
    """Next-token logits from a cache-free forward of the whole context."""
    return rt.model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_ragged_batch_equals_one_request_at_a_time():
    rt = runtime("draft-small")
    # Give two requests caches of different lengths, leave one fresh with a long prompt.
    warm_a, warm_b = context(30, 1), context(7, 2)
    rt.draft("a", warm_a, 3, GREEDY)
    rt.draft("b", warm_b, 2, GREEDY)
    contexts = [warm_a + [5, 9], warm_b[:5] + [11], context(45, 3), [42]]
    batch = rt.open_batch(["a", "b", "c", "d"], contexts)
    for row, ctx in enumerate(contexts):
        torch.testing.assert_close(batch.logits[row], full_forward_logits(rt, ctx), atol=2e-4, rtol=1e-4)
    extra = [[17, 23], [3, 4], [100, 200], [8, 8]]
    for step in range(2):
        logits = batch.extend([tokens[step] for tokens in extra])
        for row, ctx in enumerate(contexts):
            expected = full_forward_logits(rt, ctx + extra[row][: step + 1])
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=1e-4)
    batch.close()
    # The caches were split back: the next step forwards only what is new.
    before = rt.tokens_forwarded
    again = rt.open_batch(["a", "c"], [contexts[0] + extra[0] + [1], contexts[2] + extra[2] + [1]])
    assert rt.tokens_forwarded - before == 2
    torch.testing.assert_close(
        again.logits[1], full_forward_logits(rt, contexts[2] + extra[2] + [1]), atol=2e-4, rtol=1e-4
    )
    again.close()


def test_batched_step_cost_is_new_tokens_plus_drafts():
    rt = runtime("draft-tiny")
    proposer = EnsembleProposer([rt])
    requests = [DraftRequest(f"r{i}", context(50 + 13 * i, seed=i), 4) for i in range(5)]
    first = proposer.propose(requests)
    # Each target step accepted one draft and added a token. The accepted draft is already in the
    # draft's cache, so one new token per request, then three more draft steps.
    requests = [
        DraftRequest(r.request_id, list(r.context) + d.token_ids[:1] + [7], 4) for r, d in zip(requests, first)
    ]
    before = rt.tokens_forwarded
    proposer.propose(requests)
    assert rt.tokens_forwarded - before == 5 * 1 + 5 * 3


def test_single_draft_ensemble_is_the_draft_model():
    proposer = EnsembleProposer([runtime("draft-distill")])
    ctx = context(33, seed=4)
    greedy = proposer.propose([DraftRequest("x", ctx, 5)])[0]
    alone = runtime("draft-distill").draft("x", ctx, 5, GREEDY)
    assert greedy.token_ids == alone.token_ids


def test_mixture_q_is_processed_weighted_average():
    names = ["draft-distill", "draft-small", "draft-tiny"]
    runtimes = [runtime(n) for n in names]
    weights = [0.5, 0.3, 0.2]
    proposer = EnsembleProposer(runtimes, weights)
    ctx = context(25, seed=5)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    draft = proposer.propose([DraftRequest("m", ctx, 3, params, torch.Generator().manual_seed(0))])[0]
    assert len(draft.token_ids) == 3
    for position in range(3):
        prefix = ctx + draft.token_ids[:position]
        mixture = sum(w * full_forward_logits(rt, prefix).softmax(-1) for w, rt in zip(weights, runtimes))
        expected = processed_probs(mixture.log(), params)
        torch.testing.assert_close(draft.probs[position], expected, atol=1e-5, rtol=1e-4)
        assert draft.probs[position, draft.token_ids[position]] > 0
        assert int((draft.probs[position] > 0).sum()) <= 50


def test_greedy_ensemble_takes_the_mixture_argmax():
    runtimes = [runtime("draft-small"), runtime("draft-tiny")]
    proposer = EnsembleProposer(runtimes)
    ctx = context(20, seed=6)
    draft = proposer.propose([DraftRequest("g", ctx, 1)])[0]
    mixture = sum(0.5 * full_forward_logits(rt, ctx).softmax(-1) for rt in runtimes)
    assert draft.token_ids == [int(mixture.argmax())]
    assert float(draft.probs[0].max()) == 1.0


def test_outcomes_are_read_from_the_next_context():
    proposer = EnsembleProposer([runtime("draft-small"), runtime("draft-tiny")])
    ctx = context(20, seed=7)
    draft = proposer.propose([DraftRequest("o", ctx, 4)])[0]
    # Target accepts two drafts, then emits its own token (not the third draft).
    correction = (draft.token_ids[2] + 1) % VOCAB
    proposer.propose([DraftRequest("o", ctx + draft.token_ids[:2] + [correction], 4)])
    m = proposer.metrics
    assert (m.drafted_tokens, m.accepted_tokens, m.verify_steps) == (4, 2, 1)
    assert m.drafted_per_position == [1, 1, 1, 1] and m.accepted_per_position == [1, 1, 0, 0]
    assert m.mean_accepted_per_step == 3.0
    assert all(n == 3 for n in m.verified_positions.values())


def test_adaptive_weights_follow_the_draft_that_agrees():
    good, bad = runtime("draft-distill"), runtime("draft-tiny")
    oracle = runtime("draft-distill")  # the "target" here: exactly the distill draft
    proposer = EnsembleProposer([good, bad], adapt_weights=True)
    for i in range(12):
        ctx = context(15, seed=100 + i)
        draft = proposer.propose([DraftRequest(f"w{i}", ctx, 3)])[0]
        truth = oracle.draft(f"w{i}", ctx, 3, GREEDY).token_ids
        proposer.propose([DraftRequest(f"w{i}", ctx + truth + [5], 3)])
        proposer.free(f"w{i}")
    weights = proposer.metrics.weights
    assert weights["draft-distill"] > 0.6 > weights["draft-tiny"]
    assert proposer.tracked_request_ids() == set()


def test_a_seeded_request_drafts_with_the_weights_before_any_evidence():
    """Adapted weights come from every request's outcomes; a seeded request's text may depend
    only on its own history, so it drafts with the prior weights, in a batch with others too."""
    good, bad = runtime("draft-distill"), runtime("draft-tiny")
    oracle = runtime("draft-distill")
    proposer = EnsembleProposer([good, bad], adapt_weights=True)
    for i in range(12):  # other traffic moves the adapted weights
        ctx = context(15, seed=100 + i)
        proposer.propose([DraftRequest(f"w{i}", ctx, 3)])
        truth = oracle.draft(f"w{i}", ctx, 3, GREEDY).token_ids
        proposer.propose([DraftRequest(f"w{i}", ctx + truth + [5], 3)])
        proposer.free(f"w{i}")
    assert proposer.weights[0] > 0.6
    sampled = SamplingParams(temperature=1.0)
    seeded = DraftRequest("s", context(12, seed=7), 3, sampled, torch.Generator().manual_seed(3), seeded=True)
    unseeded = DraftRequest("u", context(12, seed=7), 3, sampled, torch.Generator().manual_seed(3))
    moved = proposer.propose([unseeded, seeded])
    fresh = EnsembleProposer([runtime("draft-distill"), runtime("draft-tiny")], adapt_weights=True)
    (alone,) = fresh.propose([dataclasses.replace(seeded, generator=torch.Generator().manual_seed(3))])
    assert moved[1].token_ids == alone.token_ids
    torch.testing.assert_close(moved[1].probs, alone.probs)
    assert not torch.allclose(moved[0].probs, alone.probs)  # the unseeded row used the adapted weights


def test_each_request_weights_the_draft_that_fits_its_own_text():
    """Two requests served together whose "targets" are different drafts (one emits draft-distill's
    greedy text, the other draft-tiny's): each request's weights follow its own target's draft,
    where one global set of weights would give both the same mixture. A seeded request's weights
    come from its own verdicts only: the same whatever the other traffic, and not the prior."""
    oracles = {"distill": runtime("draft-distill"), "tiny": runtime("draft-tiny")}
    sampled = SamplingParams(temperature=1.0)

    def serve(proposer, names, seeded=(), steps=6):
        contexts = {name: context(15, seed=60 + i) for i, name in enumerate(names)}
        for _ in range(steps):
            requests = [DraftRequest(name, contexts[name], 3, sampled, torch.Generator().manual_seed(len(contexts[name])),
                                     seeded=name in seeded) for name in names]
            proposer.propose(requests)
            for name in names:
                truth = oracles[name.split("-")[0]].draft(f"o-{name}", contexts[name], 3, GREEDY).token_ids
                contexts[name] = contexts[name] + truth + [5]
        proposer.propose([DraftRequest(name, contexts[name], 3, sampled, torch.Generator().manual_seed(0),
                                       seeded=name in seeded) for name in names])
        return proposer.row_weights(list(names))

    def ensemble():
        return EnsembleProposer([runtime("draft-distill"), runtime("draft-tiny")], adapt_weights=True)

    proposer = ensemble()
    weights = serve(proposer, ["distill", "tiny"])
    assert weights[0, 0] > 0.6 and weights[1, 1] > 0.6, weights  # each its own target's draft
    population = proposer.weights
    assert proposer.tracked_request_ids() >= {"distill", "tiny"}
    proposer.free("distill")
    assert "distill" not in proposer.tracked_request_ids()
    # A seeded request: its own verdicts only, whatever is served beside it.
    busy = ensemble()
    serve(busy, ["distill-a", "distill-b"])  # other traffic moves the population's weights
    beside = serve(busy, ["tiny-s", "distill-c"], seeded={"tiny-s"})[0]
    alone = serve(ensemble(), ["tiny-s"], seeded={"tiny-s"})[0]
    torch.testing.assert_close(beside, alone)
    assert beside[1] > 0.6 and busy.weights[0] > 0.6, (beside, busy.weights)
    assert not torch.allclose(population, proposer.fixed_weights)


def test_ensemble_rejects_bad_inputs():
    with pytest.raises(ValueError, match="1 to 3"):
        EnsembleProposer([])
    with pytest.raises(ValueError, match="weights"):
        EnsembleProposer([runtime("draft-tiny")], [0.0])


def test_row_sampling_draws_from_each_row():
    """Inverse-CDF sampling draws each row from its own probabilities (chi-square, fixed seed)."""
    from scipy.stats import chisquare

    from vllm_specplugin.proposers.sampling import sample_rows

    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    draws = torch.stack([sample_rows(probs, [None, None]) for _ in range(4000)])
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=4).double()
        support = probs[row] > 0
        assert counts[~support].sum() == 0
        expected = probs[row][support].double() * 4000
        assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 0.001
    seeded = [sample_rows(probs, [torch.Generator().manual_seed(5), None])[0] for _ in range(3)]
    assert len(set(int(s) for s in seeded)) == 1  # a row with its own generator is reproducible


def test_branch_distributions_equal_full_forwards():
    runtimes = [runtime("draft-small"), runtime("draft-tiny")]
    proposer = EnsembleProposer(runtimes, [0.7, 0.3])
    ctx = context(30, seed=8)
    root = proposer.root_distribution("t", ctx)
    expected_root = sum(w * full_forward_logits(rt, ctx).softmax(-1) for w, rt in zip([0.7, 0.3], runtimes))
    torch.testing.assert_close(root, expected_root, atol=1e-5, rtol=1e-4)
    paths = [[5], [9, 11], [5, 6, 7]]
    mixture = proposer.branch_distributions("t", ctx, paths)
    for row, path in enumerate(paths):
        expected = sum(w * full_forward_logits(rt, ctx + path).softmax(-1) for w, rt in zip([0.7, 0.3], runtimes))
        torch.testing.assert_close(mixture[row], expected, atol=1e-5, rtol=1e-4)
    # The request's caches still hold exactly the context: the next step forwards only new tokens.
    before = runtimes[0].tokens_forwarded
    proposer.root_distribution("t", ctx + [3])
    assert runtimes[0].tokens_forwarded - before == 1


def test_rows_stop_at_their_own_gamma():
    """A row leaves the batched forward once it has its γ tokens: it is never extended past its
    γ, nor past the draft's maximum length (a row the length clips)."""
    rt = runtime("draft-tiny")
    proposer = EnsembleProposer([rt])
    near_end = context(rt.max_length - 2, seed=30)  # room for 2 draft tokens
    requests = [
        DraftRequest("one", context(20, seed=31), 1),
        DraftRequest("five", context(25, seed=32), 5),
        DraftRequest("end", near_end, 5),
    ]
    before = rt.tokens_forwarded
    drafts = proposer.propose(requests)
    assert [len(d.token_ids) for d in drafts] == [1, 5, 2]
    # Each row forwards its context, then one token per drafted token but its last.
    assert rt.tokens_forwarded - before == (20 + 0) + (25 + 4) + (rt.max_length - 2 + 1)
    for request, draft in zip(requests, drafts):
        cached = len(rt._caches[request.request_id].cached_tokens)
        assert cached == len(request.context) + len(draft.token_ids) - 1 <= rt.max_length


def _log_likelihoods(runtimes, ctx: list[int], emitted: list[int]) -> torch.Tensor:
    """Σ_j log softmax(draft d's logits after ctx + emitted[:j])[emitted[j]], per draft [D]."""
    return torch.tensor([
        sum(float(full_forward_logits(rt, ctx + emitted[:j]).log_softmax(-1)[token]) for j, token in enumerate(emitted))
        for rt in runtimes
    ])


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_adaptive_weights_score_exactly_from_compact_state(lean):
    """The weight update sees each draft's exact log-probability of the emitted tokens, the
    target's own token at the rejected position included, from what it kept per request (no
    [γ, D, V] distributions), and that state counts in each draft's memory budget."""
    runtimes = [runtime("draft-distill"), runtime("draft-tiny", lean_forward=lean)]
    proposer = EnsembleProposer(runtimes, adapt_weights=True, forgetting=0.0, min_weight=0.0)
    ctx = context(15, seed=40)
    params = SamplingParams(temperature=1.0)
    draft = proposer.propose([DraftRequest("s", ctx, 4, params, torch.Generator().manual_seed(0))])[0]
    hidden = runtimes[0].model.config.hidden_size
    assert runtimes[0].resident_bytes == 4 * (8 + hidden * 4)  # float32 hidden states
    assert runtimes[1].resident_bytes == 4 * (8 + (hidden * 4 if lean else VOCAB * 4))
    assert runtimes[0].total_bytes == runtimes[0].cache_bytes + runtimes[0].resident_bytes
    # Two accepted, then the target's own token: positions 0 and 1 score drafted tokens, 2 another.
    emitted = draft.token_ids[:2] + [(draft.token_ids[2] + 1) % VOCAB]
    proposer.propose([DraftRequest("s", ctx + emitted, 4, params, torch.Generator().manual_seed(1))])
    expected = _log_likelihoods(runtimes, ctx, emitted)
    weights = proposer.weights
    # With a uniform prior, no forgetting and no floor, log(w0 / w1) is the log-likelihood gap.
    assert abs(float((weights[0] / weights[1]).log()) - float(expected[0] - expected[1])) < 2e-3
    proposer.free("s")
    assert runtimes[0].resident_bytes == runtimes[1].resident_bytes == 0


def test_forgetting_and_min_weight_are_parameters():
    """Weights after two verdicts of 4 verified tokens each, against log-likelihoods from full
    forwards: forgetting f scales the older evidence by (1 - f) per newly verified token, and
    min_weight floors the weights before they are renormalised."""
    runtimes = [runtime("draft-distill"), runtime("draft-tiny")]
    prior = torch.tensor([0.8, 0.2])  # the mixture follows draft-distill: a clear evidence gap
    ctx = context(15, seed=41)

    def expected(log_evidence: torch.Tensor, min_weight: float) -> torch.Tensor:
        posterior = prior * torch.softmax(log_evidence, 0)
        floored = (posterior / posterior.sum()).clamp_min(min_weight)
        return floored / floored.sum()

    for forgetting, min_weight in [(0.0, 0.0), (0.5, 0.0), (0.0, 0.4)]:
        proposer = EnsembleProposer(runtimes, prior.tolist(), adapt_weights=True, forgetting=forgetting,
                                    min_weight=min_weight)
        first = proposer.propose([DraftRequest("f", ctx, 4)])[0].token_ids
        emitted_1 = first[:3] + [(first[3] + 1) % VOCAB]  # three accepted, then the target's own token
        second = proposer.propose([DraftRequest("f", ctx + emitted_1, 4)])[0].token_ids
        after_one = proposer.weights.clone()
        emitted_2 = second[:3] + [(second[3] + 1) % VOCAB]
        proposer.propose([DraftRequest("f", ctx + emitted_1 + emitted_2, 4)])
        evidence_1 = _log_likelihoods(runtimes, ctx, emitted_1)
        evidence_2 = _log_likelihoods(runtimes, ctx + emitted_1, emitted_2)
        torch.testing.assert_close(after_one, expected(evidence_1, min_weight), atol=2e-3, rtol=0)
        torch.testing.assert_close(
            proposer.weights, expected((1 - forgetting) ** 4 * evidence_1 + evidence_2, min_weight), atol=2e-3, rtol=0
        )
        proposer.free("f")
    with pytest.raises(ValueError, match="forgetting"):
        EnsembleProposer(runtimes, forgetting=1.0)


def _text_of(rt: DraftRuntime, seed: int, length: int = 40) -> list[int]:
    """A context whose last ``length`` tokens are ``rt``'s own greedy text (after 5 random ones)."""
    start = context(5, seed=seed)
    return start + rt.draft(f"text-{seed}", start, length, GREEDY).token_ids


def test_mean_log_likelihood_is_the_texts_mean_log_probability():
    rt = runtime("draft-tiny")
    tokens = context(20, seed=70)
    with torch.no_grad():
        logits = rt.model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None]).mean()
    assert rt.mean_log_likelihood(tokens) == pytest.approx(float(expected), abs=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        rt.mean_log_likelihood([5])


def test_routing_drafts_each_request_with_the_draft_that_fits_its_prompt():
    """Routing: a request whose prompt is draft-distill's own text is drafted by draft-distill
    alone, one of draft-tiny's text by draft-tiny alone, in one propose; each gets exactly the
    tokens and q its draft gives it on its own (a one-draft proposer, same generator), and the
    other draft never forwards it."""
    distill, tiny = runtime("draft-distill"), runtime("draft-tiny")
    texts = {"d": _text_of(distill, 71), "t": _text_of(tiny, 72)}
    routed_runtimes = [runtime("draft-distill"), runtime("draft-tiny")]
    proposer = EnsembleProposer(routed_runtimes, route=True)
    sampled = SamplingParams(temperature=1.0, top_k=50)

    def requests(names):
        return [DraftRequest(name, texts[name], 4, sampled, torch.Generator().manual_seed(9)) for name in names]

    drafts = proposer.propose(requests(["d", "t"]))
    assert [proposer.route_of("d"), proposer.route_of("t")] == [0, 1]
    assert proposer.metrics.routed == {"draft-distill": 1, "draft-tiny": 1}
    assert routed_runtimes[0].request_ids == ["d"] and routed_runtimes[1].request_ids == ["t"]
    for name, draft, alone_rt in [("d", drafts[0], runtime("draft-distill")), ("t", drafts[1], runtime("draft-tiny"))]:
        (alone,) = EnsembleProposer([alone_rt]).propose(requests([name]))
        assert draft.token_ids == alone.token_ids
        torch.testing.assert_close(draft.probs, alone.probs)
    # The route is kept for the request's life (the next step drafts on the same draft), then freed.
    accepted = drafts[1].token_ids[:2] + [7]
    proposer.propose([DraftRequest("t", texts["t"] + accepted, 4, sampled, torch.Generator().manual_seed(1))])
    assert proposer.route_of("t") == 1 and proposer.metrics.routed["draft-tiny"] == 1
    proposer.free("t")
    assert proposer.route_of("t") is None and "t" not in proposer.tracked_request_ids()


def test_routing_trees_read_the_routed_draft_only():
    """The tree drafting calls (root and branch distributions) of a routed request are its draft's
    own softmax, not the mixture, and the other draft holds nothing of it."""
    runtimes = [runtime("draft-distill"), runtime("draft-tiny")]
    proposer = EnsembleProposer(runtimes, route=True)
    ctx = _text_of(runtimes[1], 73)
    root = proposer.root_distributions(["r"], [ctx])
    assert proposer.route_of("r") == 1 and runtimes[0].request_ids == []
    torch.testing.assert_close(root[0], full_forward_logits(runtimes[1], ctx).softmax(-1), atol=1e-5, rtol=1e-4)
    paths = [[5], [9, 11]]
    (branches,) = proposer.branch_distributions_of([("r", ctx, paths)])
    for row, path in enumerate(paths):
        expected = full_forward_logits(runtimes[1], ctx + path).softmax(-1)
        torch.testing.assert_close(branches[row], expected, atol=1e-5, rtol=1e-4)
    assert runtimes[0].request_ids == []


def test_routing_refuses_mixing_options():
    with pytest.raises(ValueError, match="give one of the two"):
        EnsembleProposer([runtime("draft-tiny"), runtime("draft-small")], [1.0, 2.0], route=True)
    with pytest.raises(ValueError, match="give one of the two"):
        EnsembleProposer([runtime("draft-tiny"), runtime("draft-small")], adapt_weights=True, route=True)
    with pytest.raises(ValueError, match="route_window"):
        EnsembleProposer([runtime("draft-tiny"), runtime("draft-small")], route=True, route_window=0)
