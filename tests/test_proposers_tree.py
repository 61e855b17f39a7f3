"""Tree drafting: the tree's shape and probabilities, path choice, and the chain proposer on top."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.base import GREEDY, DraftRequest
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.proposers.tree import TokenTree, TreeProposer, build_tree, enumerate_draws
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DEMO = os.path.join(REPO_ROOT, "models", "demo")
VOCAB = 4096
TOP_K_50 = SamplingParams(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def drafts() -> dict[str, DraftRuntime]:
    names = ("draft-small", "draft-tiny", "draft-distill")
    return {n: DraftRuntime(os.path.join(DEMO, n), target_vocab_size=VOCAB) for n in names}


def context(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


def ancestors(tree: TokenTree, node: int) -> set[int]:
    found = {node}
    while tree.parents[node] >= 0:
        node = tree.parents[node]
        found.add(node)
    return found


def check_invariants(tree: TokenTree, node_budget: int, depth_limit: int, branching: int) -> None:
    n = tree.num_nodes
    assert (tree.tokens[0], tree.parents[0], tree.depths[0]) == (-1, -1, 0)
    assert tree.node_probs.shape == (n, tree.node_probs.shape[1]) and not tree.node_probs[0].any()
    assert n - 1 <= node_budget and max(tree.depths) <= depth_limit
    for node in range(1, n):
        parent = tree.parents[node]
        assert 0 <= parent < node  # parents precede children
        assert tree.depths[node] == tree.depths[parent] + 1
        row = tree.node_probs[node]
        assert abs(float(row.sum()) - 1) < 1e-4 and float(row.min()) >= 0
        assert tree.token_prob(node) > 0  # each token had mass under the distribution it came from
    for node in range(n):
        kids = tree.children(node)
        assert len(kids) <= branching and len({tree.tokens[k] for k in kids}) == len(kids)
        # Siblings share their parent's distribution.
        for kid in kids[1:]:
            assert torch.equal(tree.node_probs[kid], tree.node_probs[kids[0]])
    mask = tree.attention_mask()
    expected = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        expected[node, list(ancestors(tree, node))] = True
    assert torch.equal(mask, expected)


# -- the tree itself, on hand-made distributions ---------------------------------------------


def hand_tree() -> TokenTree:
    r"""root -> a (token 0, q .5), b (token 1, q .3); a -> c (token 2, q .1); b -> d (token 3, q 1)."""
    q_root = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q_a = torch.tensor([0.4, 0.4, 0.1, 0.1])
    q_b = torch.tensor([0.0, 0.0, 0.0, 1.0])
    probs = torch.stack([torch.zeros(4), q_root, q_root, q_a, q_b])
    return TokenTree(tokens=[-1, 0, 1, 2, 3], parents=[-1, 0, 0, 1, 2], depths=[0, 1, 1, 2, 2], node_probs=probs)


def test_expected_accepted_length_on_a_hand_built_tree():
    tree = hand_tree()
    check_invariants(tree, node_budget=4, depth_limit=2, branching=2)
    assert tree.path(3) == [0, 2] and tree.path(4) == [1, 3] and tree.path(0) == []
    assert tree.path_probability(3) == pytest.approx(0.5 * 0.1)
    assert tree.path_probability(4) == pytest.approx(0.3 * 1.0)
    # Token j is accepted iff every token up to j is: E[accepted] = Σ_j Π_{i<=j} q(x_i).
    expected = {0: 0.0, 1: 0.5, 2: 0.3, 3: 0.5 + 0.5 * 0.1, 4: 0.3 + 0.3 * 1.0}
    for node, value in expected.items():
        assert tree.expected_accepted_length(node) == pytest.approx(value)
    assert tree.best_node() == 4  # the less likely first token leads to the better path
    assert tree.best_node(max_depth=1) == 1
    assert tree.best_node(max_depth=0) == 0
    assert tree.greedy_chain_node() == 3  # argmax first token (a), then its only child
    assert tree.attention_mask().tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, True, False, True],
    ]


class FakeDraft:
    """Deterministic peaked distributions per path over a small vocabulary; counts expand calls."""

    def __init__(self, vocab: int = 32, scale: float = 3.0):
        self.vocab, self.scale = vocab, scale
        self.calls: list[list[list[int]]] = []

    def q(self, path: list[int]) -> torch.Tensor:
        seed = hash(tuple(path)) % 2**31
        logits = torch.randn(self.vocab, generator=torch.Generator().manual_seed(seed)) * self.scale
        return logits.softmax(-1)

    def expand(self, paths: list[list[int]]) -> torch.Tensor:
        self.calls.append([list(p) for p in paths])
        assert all(paths)
        return torch.stack([self.q(p) for p in paths])


@pytest.mark.parametrize("node_budget,depth_limit,branching", [(16, 5, 3), (7, 4, 2), (30, 3, 4), (5, 5, 3), (3, 6, 1)])
def test_build_tree_invariants_and_greedy_chain(node_budget, depth_limit, branching):
    draft = FakeDraft()
    tree = build_tree(draft.q([]), draft.expand, node_budget, depth_limit, branching)
    check_invariants(tree, node_budget, depth_limit, branching)
    # One expand call per depth, over at most `branching` frontier nodes.
    assert len(draft.calls) <= depth_limit - 1 and all(len(c) <= branching for c in draft.calls)
    assert [len(c[0]) for c in draft.calls] == list(range(1, len(draft.calls) + 1))
    # Each node's row is the distribution after its parent's path.
    for node in range(1, tree.num_nodes):
        torch.testing.assert_close(tree.node_probs[node], draft.q(tree.path(tree.parents[node])))
    # The greedy chain is in the tree, to the full depth the budget allows.
    greedy, path = tree.greedy_chain_node(), []
    for _ in range(min(depth_limit, node_budget)):
        path.append(int(draft.q(path).argmax()))
    assert tree.path(greedy) == path
    best = tree.best_node(depth_limit)
    assert tree.expected_accepted_length(best) >= tree.expected_accepted_length(greedy)
    assert tree.num_nodes - 1 == node_budget or tree.depths[-1] == depth_limit


def test_budget_cut_keeps_the_most_probable_children():
    draft = FakeDraft(scale=1.5)
    full = build_tree(draft.q([]), draft.expand, node_budget=100, depth_limit=2, branching=3)
    cut = build_tree(draft.q([]), draft.expand, node_budget=3 + 4, depth_limit=2, branching=3)
    assert full.num_nodes - 1 == 3 + 9 and cut.num_nodes - 1 == 7
    layer = [n for n in range(full.num_nodes) if full.depths[n] == 2]
    paths = {tuple(full.path(n)): full.path_probability(n) for n in layer}
    greedy = tuple(full.path(full.greedy_chain_node()))
    kept = {tuple(cut.path(n)) for n in range(cut.num_nodes) if cut.depths[n] == 2}
    others = sorted((p for p in paths if p != greedy), key=lambda p: -paths[p])
    assert kept == {greedy, *others[:3]}


def test_one_hot_distributions_make_a_chain():
    draft = FakeDraft()

    def one_hot(q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]).float()

    tree = build_tree(one_hot(draft.q([])), lambda paths: one_hot(draft.expand(paths)), 16, 5, 3)
    assert tree.num_nodes == 6 and tree.parents == [-1, 0, 1, 2, 3, 4]
    assert tree.best_node() == tree.greedy_chain_node() == 5
    assert tree.expected_accepted_length(5) == 5.0


# -- on the demo drafts ----------------------------------------------------------------------


def greedy_tokens(runtimes, ctx, gamma, request_id="greedy") -> list[int]:
    return EnsembleProposer(runtimes).propose([DraftRequest(request_id, ctx, gamma)])[0].token_ids


@pytest.mark.parametrize("params", [GREEDY, TOP_K_50], ids=["temperature-0", "temperature-1-top-k-50"])
def test_tree_on_demo_drafts(drafts, params):
    runtimes = [drafts["draft-small"], drafts["draft-tiny"]]
    ensemble = EnsembleProposer(runtimes)
    proposer = TreeProposer(ensemble, node_budget=16, branching=3)
    ctx, gamma = context(40, seed=11), 5
    draft = proposer.propose([DraftRequest("t", ctx, gamma, params)])[0]
    tree = proposer.last_trees["t"]
    check_invariants(tree, 16, gamma, 3)
    best, greedy = tree.best_node(gamma), tree.greedy_chain_node()
    assert draft.token_ids == tree.path(best)
    assert tree.expected_accepted_length(best) >= tree.expected_accepted_length(greedy)
    # The greedy chain is the plain ensemble's greedy draft (argmax of the mixture at every step).
    assert tree.path(greedy) == greedy_tokens(runtimes, ctx, gamma)
    # Rows are the processed mixture after the parent's path; greedy requests grow their tree on
    # the unprocessed mixture (its probabilities estimate the chance of matching the argmax).
    tree_params = SamplingParams(temperature=1.0) if params.greedy else params
    root = processed_probs(ensemble.root_distribution("t", ctx).log(), tree_params)
    torch.testing.assert_close(tree.node_probs[1], root)
    deep = max(range(tree.num_nodes), key=lambda n: tree.depths[n])
    parent_path = tree.path(tree.parents[deep])
    expected = processed_probs(ensemble.branch_distributions("t", ctx, [parent_path])[0].log(), tree_params)
    torch.testing.assert_close(tree.node_probs[deep], expected, atol=1e-5, rtol=1e-4)
    assert tree.num_nodes == 17  # the budget is spent on branches
    if not params.greedy:
        assert all(int((tree.node_probs[n] > 0).sum()) <= 50 for n in range(1, tree.num_nodes))


def test_tree_proposer_drafts(drafts):
    proposer = TreeProposer(EnsembleProposer([drafts["draft-distill"]]), node_budget=10, branching=2)
    requests = [
        DraftRequest("a", context(30, seed=1), 4, TOP_K_50, torch.Generator().manual_seed(0)),
        DraftRequest("b", context(12, seed=2), 0, TOP_K_50),
        DraftRequest("c", [], 3, TOP_K_50),
        DraftRequest("d", context(20, seed=3), 2, SamplingParams(temperature=0.7, top_p=0.9)),
        DraftRequest("e", context(1022, seed=4), 5, TOP_K_50),  # the draft's max length is 1024
        DraftRequest("f", context(1024, seed=5), 5, TOP_K_50),
    ]
    first = proposer.propose(requests)
    for request, draft in zip(requests, first):
        room = max(0, min(request.gamma, 1024 - len(request.context))) if request.context else 0
        assert 1 <= len(draft.token_ids) <= room or (room == 0 and not draft.token_ids)
        assert draft.probs.shape == (len(draft.token_ids), VOCAB)
        # One-hot rows at the drafted tokens: the path is chosen deterministically.
        one_hot = torch.nn.functional.one_hot(torch.tensor(draft.token_ids, dtype=torch.long), VOCAB).float()
        assert torch.equal(draft.probs, one_hot)
    assert proposer.metrics.fallback_requests == 1  # request f
    assert proposer.stats.trees == 3
    assert proposer.stats.chosen_expected_length >= proposer.stats.greedy_expected_length > 0
    # Same input, same draft: again on warm caches, and on a fresh proposer.
    assert [d.token_ids for d in proposer.propose(requests)] == [d.token_ids for d in first]
    fresh = TreeProposer(EnsembleProposer([drafts["draft-distill"]]), node_budget=10, branching=2)
    assert [d.token_ids for d in fresh.propose(requests)] == [d.token_ids for d in first]
    for request in requests:
        proposer.free(request.request_id)
        fresh.free(request.request_id)
    assert proposer.tracked_request_ids() == set() and fresh.tracked_request_ids() == set()


def test_outcomes_are_read_from_the_next_context(drafts):
    ensemble = EnsembleProposer([drafts["draft-small"], drafts["draft-tiny"], drafts["draft-distill"]])
    proposer = TreeProposer(ensemble)
    assert proposer.metrics is ensemble.metrics
    ctx = context(25, seed=9)
    draft = proposer.propose([DraftRequest("o", ctx, 4, GREEDY)])[0]
    assert len(draft.token_ids) == 4
    # The target accepts two drafts, then emits its own token instead of the third.
    correction = (draft.token_ids[2] + 1) % VOCAB
    proposer.propose([DraftRequest("o", ctx + draft.token_ids[:2] + [correction], 4, GREEDY)])
    m = proposer.metrics
    assert (m.drafted_tokens, m.accepted_tokens, m.verify_steps) == (4, 2, 1)
    assert m.accepted_per_position == [1, 1, 0, 0] and m.propose_calls == 2
    proposer.free("o")
    assert "o" not in proposer.tracked_request_ids()


def test_tree_proposer_rejects_bad_settings(drafts):
    with pytest.raises(ValueError, match="node_budget"):
        TreeProposer(EnsembleProposer([drafts["draft-tiny"]]), node_budget=0)


class _PublicOnly:
    """Forwards public attributes only: touching a private one (``_pending``, a runtime's caches)
    raises. Lists of objects (the ensemble's ``runtimes``) are wrapped item by item."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"private attribute {name!r} used through the public API")
        value = getattr(object.__getattribute__(self, "_target"), name)
        if isinstance(value, list) and value and hasattr(value[0], "open_batch"):
            return [_PublicOnly(v) for v in value]
        return value


def test_tree_proposer_uses_only_public_ensemble_api_and_draws_nothing(drafts):
    """TreeProposer drives the ensemble through its public API only, and its path is a function of
    the draft distributions: no random draw (which is why one-hot q is exact for verification)."""
    requests = [
        DraftRequest("p", context(30, seed=11), 4, TOP_K_50, torch.Generator().manual_seed(0)),
        DraftRequest("q", context(18, seed=12), 3, SamplingParams(temperature=0.8, top_p=0.9)),
    ]
    plain = TreeProposer(EnsembleProposer([drafts["draft-tiny"]]), node_budget=8, branching=2)
    expected = [d.token_ids for d in plain.propose(requests)]
    wrapped = TreeProposer(_PublicOnly(EnsembleProposer([drafts["draft-tiny"]])), node_budget=8, branching=2)
    global_rng = torch.get_rng_state()
    request_rng = requests[0].generator.get_state()
    got = [d.token_ids for d in wrapped.propose(requests)]
    assert got == expected and all(got)
    assert torch.equal(torch.get_rng_state(), global_rng)
    assert torch.equal(requests[0].generator.get_state(), request_rng)
    for request in requests:
        wrapped.free(request.request_id)
        plain.free(request.request_id)
    assert not {"p", "q"} & (wrapped.tracked_request_ids() | plain.tracked_request_ids())


# --- trees whose children are drawn without replacement (T > 0, tree verification) -----------


def _markov(vocab: int, seed: int, zeros: bool):
    """A Markov target p and draft q (next-token law given the last token), float64."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(vocab) * 0.7, size=vocab + 1)
    q = 0.5 * p + 0.5 * rng.dirichlet(np.ones(vocab) * 0.7, size=vocab + 1)
    if zeros:
        q[:, 0] = 0  # token 0 is never drafted; the target still emits it
        q /= q.sum(1, keepdims=True)
    return torch.from_numpy(p), torch.from_numpy(q)


def _sampled_tree_law(p, q, budget, branching, rule, fault=None, length=2):
    """Exact law of the first ``length`` emitted tokens: trees from build_sampled_tree (every draw
    enumerated), each walked with ``rule`` (emission_distribution), continued by fresh trees."""
    from vllm_specplugin.proposers.tree import build_sampled_tree
    from vllm_specplugin.proposers.tree_verify import draft_probs_from_tree, emission_distribution

    vocab = p.shape[1]

    def row(matrix, context):
        return matrix[context[-1] if context else vocab]

    memo = {}

    def law(context, length):
        if length == 0:
            return {(): 1.0}
        if (context, length) in memo:
            return memo[(context, length)]
        out = memo[(context, length)] = {}

        def run(draw):
            return build_sampled_tree(
                row(q, context).float(), lambda paths: torch.stack([row(q, context + tuple(x)) for x in paths]).float(),
                budget, -(-budget // branching), branching, draw=draw)

        for weight, tree in enumerate_draws(run):
            target = torch.stack([row(p, context + tuple(tree.path(n))) for n in range(tree.num_nodes)])
            step = emission_distribution(target, draft_probs_from_tree(tree), tree.parents, tree.tokens, rule,
                                         fault=fault)
            for emitted, prob in step.items():
                if len(emitted) >= length:
                    out[emitted[:length]] = out.get(emitted[:length], 0.0) + weight * prob
                else:
                    for more, r in law(context + emitted, length - len(emitted)).items():
                        out[emitted + more] = out.get(emitted + more, 0.0) + weight * prob * r
        return out

    return law((), length)


def _markov_target_law(p, length=2):
    vocab = p.shape[1]
    out = {(): 1.0}
    for _ in range(length):
        out = {seq + (t,): prob * float(p[seq[-1] if seq else vocab][t]) for seq, prob in out.items()
               for t in range(vocab) if p[seq[-1] if seq else vocab][t] > 0}
    return out


def _tv(a, b):
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("seed,zeros", [(0, False), (1, True)])
@pytest.mark.parametrize("budget,branching", [(3, 2), (4, 2), (4, 3)])
def test_sampled_trees_with_recursive_rejection_sampling_are_exact(seed, zeros, budget, branching):
    """Children drawn without replacement by build_sampled_tree and walked with the
    without-replacement rule (recursive rejection sampling) emit the target's law exactly, by
    enumeration of every draw (float64); the one-hot rule on the same trees is exact too; the
    known wrong variants (q not renormalised, the residual not updated, the i.i.d. rule) are not."""
    p, q = _markov(4, seed, zeros)
    truth = _markov_target_law(p)
    assert _tv(_sampled_tree_law(p, q, budget, branching, "without_replacement"), truth) < 1e-12
    assert _tv(_sampled_tree_law(p, q, budget, branching, "one_hot"), truth) < 1e-12
    for rule, fault in (("without_replacement", "q_not_updated"), ("without_replacement", "residual_not_updated"),
                        ("iid", None)):
        assert _tv(_sampled_tree_law(p, q, budget, branching, rule, fault), truth) > 1e-3, (rule, fault)


def test_sampled_tree_shape_and_draws():
    from vllm_specplugin.proposers.tree import build_sampled_tree, sample_without_replacement

    generator = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    for _ in range(20):
        drawn = sample_without_replacement(q, 5, generator)
        assert len(drawn) == 3 and sorted(drawn) == [0, 1, 2]  # distinct, never a q = 0 token
    counts = np.zeros(4)
    for _ in range(4000):
        counts[sample_without_replacement(q, 1, generator)[0]] += 1
    assert np.abs(counts / 4000 - q.numpy()).max() < 0.03
    tree = build_sampled_tree(torch.full((32,), 1 / 32), lambda paths: torch.full((len(paths), 32), 1 / 32), 6, 3, 2,
                              generator)
    assert tree.rule == "without_replacement" and tree.num_nodes == 7
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]  # main chain 0-1-3-6; the budget reserves its depth 3
    for node in range(tree.num_nodes):
        kids = tree.children(node)
        assert len({tree.tokens[k] for k in kids}) == len(kids)  # without replacement


@pytest.mark.parametrize("shape,verify", [("fixed", "chain"), ("fixed", "tree"), ("dynamic", "tree")])
def test_trees_grown_together_equal_trees_grown_alone(drafts, shape, verify):
    """propose() grows every request's tree in one batched draft forward per depth (per wave):
    each request gets the tree (tokens, shape, rows) and the draws it gets drafted alone, sampled
    children from its own seeded generator included. Two drafts, mixed greedy / T > 0 requests,
    different context lengths, one request without room."""
    def requests():
        return [
            DraftRequest("a", context(30, seed=21), 6, TOP_K_50, torch.Generator().manual_seed(1), tree_ok=True),
            DraftRequest("b", context(7, seed=22), 6, GREEDY, tree_ok=True),
            DraftRequest("c", context(1024, seed=23), 6, TOP_K_50, tree_ok=True),  # no room: empty
            DraftRequest("d", context(55, seed=24), 4, SamplingParams(temperature=1.3, top_p=0.9),
                         torch.Generator().manual_seed(2), tree_ok=True),
            DraftRequest("e", context(12, seed=25), 6, SamplingParams(temperature=0.7), torch.Generator().manual_seed(3),
                         tree_ok=True),
        ]

    def proposer():
        return TreeProposer(EnsembleProposer([drafts["draft-tiny"], drafts["draft-small"]]), node_budget=6,
                            branching=2, verify=verify, shape=shape)

    together = proposer()
    batch = together.propose(requests())
    alone = []
    for request in requests():
        single = proposer()
        alone.append(single.propose([request])[0])
        if request.request_id in single.last_trees:
            tree, grown = single.last_trees[request.request_id], together.last_trees[request.request_id]
            assert (grown.tokens, grown.parents) == (tree.tokens, tree.parents), request.request_id
            torch.testing.assert_close(grown.node_probs, tree.node_probs, atol=1e-5, rtol=1e-4)
    for request, got, expected in zip(requests(), batch, alone):
        assert got.token_ids == expected.token_ids and got.parents == expected.parents, request.request_id
        torch.testing.assert_close(got.probs, expected.probs, atol=1e-5, rtol=1e-4)
    assert [bool(d.token_ids) for d in batch] == [True, True, False, True, True]
    # A dynamic tree of drawn children without a calibration is the chain: drafted as one (a, d, e).
    chains = 3 if shape == "dynamic" else 0
    assert together.stats.chain_steps == chains and together.stats.trees == 4 - chains
    assert together.metrics.propose_calls == 1


def test_expected_chains_share_each_wave_forward_with_the_trees(drafts):
    """A step where some requests' dynamic trees are expected to be chains and others are grown
    by the builder drafts them together: each wave of the trees also extends the chains by one
    token, so the step costs the longer of the two in draft forwards, not their sum. Alone, a
    chain step is the ensemble's chain loop (one forward per token); the chain drawn in the waves
    is the same chain (same seeded draws). Contexts short enough to need no solo prefill forward."""
    runtime = drafts["draft-tiny"]
    forwards = []
    run = runtime._run

    def counted(*args, **kwargs):
        forwards[-1] += 1
        return run(*args, **kwargs)

    def step(requests):
        proposer = TreeProposer(EnsembleProposer([runtime]), node_budget=6, verify="tree", shape="dynamic")
        forwards.append(0)
        drafts_out = proposer.propose(requests)
        for request in requests:
            runtime.free(request.request_id)
        return proposer, drafts_out

    def chain():  # drawn children without a calibration: the chain of 6
        return DraftRequest("chain", context(12, seed=31), 6, SamplingParams(temperature=1.0),
                            torch.Generator().manual_seed(4), tree_ok=True)

    def tree():  # top-k children without a measurement: the builder's waves
        return DraftRequest("tree", context(9, seed=32), 6, GREEDY, tree_ok=True)

    runtime._run = counted
    try:
        alone_chain, (chain_draft,) = step([chain()])
        alone_tree, (tree_draft,) = step([tree()])
        together, (mixed_chain, mixed_tree) = step([chain(), tree()])
    finally:
        runtime._run = run
    chain_forwards, tree_forwards, mixed_forwards = forwards
    assert alone_chain.stats.chain_steps == 1 and alone_tree.stats.trees == 1
    assert together.stats.chain_steps == 1 and together.stats.trees == 1
    assert chain_forwards == 6 and tree_forwards >= 2, forwards
    assert mixed_forwards == max(chain_forwards, tree_forwards), forwards
    assert mixed_chain.token_ids == chain_draft.token_ids and mixed_chain.parents == chain_draft.parents
    torch.testing.assert_close(mixed_chain.probs, chain_draft.probs, atol=1e-5, rtol=1e-4)
    assert mixed_tree.token_ids == tree_draft.token_ids and mixed_tree.parents == tree_draft.parents
    assert together.last_trees["chain"].rule == "without_replacement"
