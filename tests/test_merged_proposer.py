"""Zero-cost drafters merged with the model's tree (proposers/merged_proposer.py, proposers/ngram.py).

The merged rule's exactness is proved in tests/test_tree_merged.py; here: what the proposer hands
the engine (the merged tree, its budget split, the model's draft when nothing matched), that the
one-hot groups come first, and the n-gram matcher's choices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_tree_shape import FakeEnsemble, flat_q
from vllm_specplugin.proposers.base import GREEDY, DraftRequest
from vllm_specplugin.proposers.choice import ChoicePolicy
from vllm_specplugin.proposers.merged_proposer import MergedTreeProposer
from vllm_specplugin.proposers.merged_tree import MergedTree, merged_emission_distribution
from vllm_specplugin.proposers.ngram import NgramDrafter, NgramSettings, match_ngram
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.proposers.suffix import SuffixDrafter, SuffixSettings
from vllm_specplugin.proposers.tree import TokenTree, TreeProposer

V = 32
REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # suffix "5 6" seen before: continues 7 8 9 5 6 ...


def test_ngram_takes_the_longest_then_most_recent_match():
    text = np.array([1, 2, 3, 9, 1, 2, 4, 8, 2, 3, 7, 1, 2], dtype=np.int64)
    # "1 2" occurs at 0 and 4 (and ends the text): the most recent earlier one (4) continues 4 8.
    assert match_ngram(text, 2, NgramSettings(min_n=2, max_n=2)) == [4, 8]
    # A longer suffix wins over a more recent shorter one: "7 1 2" never occurred, "1 2" did.
    assert match_ngram(text, 3) == [4, 8, 2]
    assert match_ngram(np.array([1, 2, 3], dtype=np.int64), 3) == []
    assert match_ngram(text, 0) == []
    drafts = NgramDrafter(V).propose([DraftRequest("r", REPEATING, 4)])
    assert drafts[0].token_ids == [7, 8, 9, 5]
    assert torch.equal(drafts[0].probs.argmax(-1), torch.tensor([7, 8, 9, 5])) and drafts[0].probs.sum() == 4
    with pytest.raises(ValueError, match="min_n"):
        NgramSettings(min_n=3, max_n=2)


# Free model drafts: the goodput rule then always lets the model draft (merged trees every step).
MODEL_ALWAYS = ChoicePolicy(draft_cost=0.0, verify_cost=0.0)


def merged_proposer(params_children="sampled", share=0.5, names=("suffix", "ngram"), policy=MODEL_ALWAYS):
    ensemble = FakeEnsemble(flat_q(V, seed=3, spread=1.0), V)
    tree = TreeProposer(ensemble, node_budget=8, verify="tree", shape="dynamic", children=params_children)
    make = {"suffix": lambda: SuffixDrafter(V, SuffixSettings(corpus_requests=0)), "ngram": lambda: NgramDrafter(V)}
    return MergedTreeProposer(tree, [(name, make[name]()) for name in names], share, policy)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["t0", "t1"])
def test_zero_cost_chains_and_the_model_tree_share_one_tree(params):
    proposer = merged_proposer()
    generator = torch.Generator().manual_seed(0)
    request = DraftRequest("r", REPEATING, 8, params, generator=generator, tree_ok=True)
    draft = proposer.propose([request])[0]
    tree = proposer.last_trees["r"]
    assert isinstance(tree, MergedTree)
    assert draft.parents == tree.parents and draft.token_ids == tree.tokens[1:]
    assert tree.num_nodes - 1 <= 8  # the request's budget
    # Both zero-cost drafters matched (at most ceil(0.5 x 8) = 4 tokens each) and agree: shared
    # nodes, tried before the model's proposals (drafter order: suffix, ngram, model).
    chains = [d.propose([DraftRequest("r", REPEATING, 4)])[0].token_ids for _, d in proposer.zero_cost]
    assert chains[1] == [7, 8, 9, 5] and chains[0] == chains[1][: len(chains[0])] and chains[0]
    for k, chain in enumerate(chains):
        nodes = [j for j in range(1, tree.num_nodes) if k in tree.proposed_by[j]]
        # The suffix's whole chain; the n-gram's duplicate slots up to the one after which the
        # budget was full (later slots are cut, duplicates too).
        assert sorted(tree.path(j) for j in nodes) == [chain[:d] for d in range(1, len(nodes) + 1)]
        assert len(nodes) == len(chain) or (k == 1 and tree.num_nodes - 1 == 8)
    assert [g.drafter for g in tree.groups[0]] == [0, 1, 2]
    assert proposer.last_drafters["r"] == ["suffix", "ngram", "model"]
    # The model drafted with what the zero-cost chain left: 8 - 4 nodes.
    model_tree = proposer.model.last_trees["r"]
    assert isinstance(model_tree, TokenTree) and model_tree.num_nodes - 1 <= 4
    assert all(torch.equal(row, torch.nn.functional.one_hot(torch.tensor(t), V).float())
               for row, t in zip(draft.probs, draft.token_ids))
    # The merged tree as the engine walks it: a law over emitted tokens that sums to 1.
    target = torch.full((tree.num_nodes, V), 1.0 / V, dtype=torch.float64)
    assert sum(merged_emission_distribution(tree, target, greedy=params.greedy).values()) == pytest.approx(1.0)
    assert proposer.accepted_drafter_kinds("r", [0, 2, 1]) == (2, 1)


def test_without_a_match_the_model_draft_is_unchanged():
    proposer = merged_proposer()
    context = [1, 2, 3, 4]  # nothing repeats
    merged = proposer.propose([DraftRequest("r", context, 8, GREEDY, tree_ok=True)])[0]
    alone = TreeProposer(FakeEnsemble(flat_q(V, seed=3, spread=1.0), V), node_budget=8, verify="tree",
                         shape="dynamic").propose([DraftRequest("r", context, 8, GREEDY, tree_ok=True)])[0]
    assert merged.token_ids == alone.token_ids and merged.parents == alone.parents
    assert proposer.last_trees["r"] is proposer.model.last_trees["r"]
    assert proposer.last_drafters["r"] == ["model"]


def test_chain_only_requests_and_chain_verification_are_not_merged():
    proposer = merged_proposer()
    draft = proposer.propose([DraftRequest("r", REPEATING, 8, GREEDY, tree_ok=False)])[0]
    assert not isinstance(proposer.last_trees.get("r"), MergedTree)
    assert draft.parents is None or all(p == i - 1 for i, p in enumerate(draft.parents) if i)


def test_the_share_caps_the_zero_cost_chains_and_free_forgets():
    proposer = merged_proposer(share=0.25)
    proposer.propose([DraftRequest("r", REPEATING, 8, GREEDY, tree_ok=True)])
    tree = proposer.last_trees["r"]
    zero_cost_nodes = [j for j in range(1, tree.num_nodes) if set(tree.proposed_by[j]) & {0, 1}]
    assert len(zero_cost_nodes) == 2  # ceil(0.25 x 8)
    proposer.free("r")
    assert "r" not in proposer.tracked_request_ids()
    with pytest.raises(ValueError, match="zero_cost_share"):
        merged_proposer(share=0.0)


def test_a_chain_the_target_keeps_accepting_drafts_alone_and_the_model_comes_back_when_it_fails():
    """The goodput rule (default costs): a request's zero-cost chain alone, at its full length,
    while its measured acceptance says it beats the merged tree; the model drafts again once the
    emitted tokens stop following the chain, and every probe_every-th skipped step meanwhile."""
    proposer = merged_proposer(policy=ChoicePolicy())
    context = list(REPEATING)
    first = proposer.propose([DraftRequest("r", context, 8, GREEDY, tree_ok=True)])[0]
    assert proposer.skipped_model["r"] and first.token_ids == [7, 8, 9, 5, 6, 7, 8, 9][: len(first.token_ids)]
    assert len(first.token_ids) > 4  # not capped at ceil(0.5 x 8): the chain drafts alone
    assert proposer.last_drafters["r"] == ["suffix", "ngram"]
    skips = []
    for step in range(8):  # the target emits a token no chain proposed, then "5 6" again (chains keep matching)
        context += [20 + step, 5, 6]
        proposer.propose([DraftRequest("r", context, 8, GREEDY, tree_ok=True)])
        skips.append(proposer.skipped_model["r"])
    assert not all(skips) and skips[-1] is False, skips
    assert proposer._states["r"].zero_cost.alpha < 0.5 and proposer.metrics.choice_model_steps > 0
    # Probes: with the chain always accepted, every probe_every-th skipped step drafts the model.
    probing = merged_proposer(policy=ChoicePolicy(probe_every=2))
    pattern = []
    for _ in range(4):
        probing.propose([DraftRequest("p", REPEATING, 8, GREEDY, tree_ok=True)])
        pattern.append(probing.skipped_model["p"])
    assert pattern == [True, False, True, False]
