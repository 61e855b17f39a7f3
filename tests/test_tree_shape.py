"""Tree shapes chosen per request (``proposers/tree.py``: build_dynamic_tree, tree_acceptance,
DepthAcceptance, TreeProposer(shape="dynamic")).

* Shape: a confident draft gets exactly the chain of N, a flat one a wide, shallow tree; the node
  budget and the tree invariants hold; the greedy growth is the best N-node tree under its model
  (checked against every N-node tree on a tiny vocabulary) and never below the chain (pathwise
  for top-k, in expectation over the draws for sampled children, by exact enumeration).
* Model: the expected accepted length equals exact enumeration of the real verifier's walk
  (``emission_distribution``) over the model's random targets, and a Monte Carlo of the sampled
  walk (``verify_tree_nodes``).
* Exactness: trees whose child counts the chooser decides as it draws, walked with recursive
  rejection sampling (and the one-hot rule), emit the target's law to 1e-12, by enumeration of
  every draw (``enumerate_draws``) in float64; T = 0 top-k trees too. Known wrong variants are
  caught: candidates drawn before being chosen and dropped when not chosen (fault ``predraw``),
  and a drawn child dropped by its own target probability; while a stopping rule that looks at
  the earlier draws' target probabilities is exact, as the argument says.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_tree_reference import target_law  # same directory (pytest rootdir import)
from test_tree_reference import total_variation as tv
from vllm_specplugin.proposers.base import GREEDY, DraftRequest
from vllm_specplugin.proposers.metrics import DraftMetrics
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.proposers.tree import (
    DepthAcceptance,
    TokenTree,
    TreeProposer,
    acceptance_parameters,
    build_dynamic_tree,
    build_sampled_tree,
    build_tree,
    chain_expected_accepted_length,
    chain_tree,
    enumerate_draws,
    first_child_trials,
    predicted_first_acceptance,
    tree_acceptance,
    tree_expected_accepted_length,
)
from vllm_specplugin.proposers.tree_verify import (
    draft_probs_from_tree,
    emission_distribution,
    tree_children,
    verify_tree_nodes,
)

torch.set_num_threads(1)

EXACT = 1e-12
SETTINGS = settings(derandomize=True, deadline=None, max_examples=12, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Drafts and targets
# ---------------------------------------------------------------------------------------------


def _seed(*parts) -> int:
    return hash(parts) % 2**62


class Pair:
    """Target p and draft q after any prefix (tuple of tokens), float64, fixed by a seed.
    ``draft_zeros``: the draft has no mass on some tokens (top-k / top-p processed q)."""

    def __init__(self, vocab: int, seed: int, peak: float = 1.5, mix: float = 0.5,
                 draft_zeros: bool = False, target_zeros: bool = False):
        self.vocab, self.seed, self.peak, self.mix = vocab, seed, peak, mix
        self.draft_zeros, self.target_zeros = draft_zeros, target_zeros
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, prefix) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = tuple(int(t) for t in prefix)
        if prefix not in self._rows:
            gen = torch.Generator().manual_seed(_seed(self.seed, *prefix))
            logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak
            if self.target_zeros:
                drop = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < 0.3
                drop[int(logits.argmax())] = False
                logits[drop] = float("-inf")
            p = logits.softmax(-1)
            other = (torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak).softmax(-1)
            q = self.mix * p + (1 - self.mix) * other
            if self.draft_zeros:
                q[int(torch.randint(self.vocab, (), generator=gen))] = 0
            self._rows[prefix] = (p, q / q.sum())
        return self._rows[prefix]

    def p(self, prefix):
        return self.rows(prefix)[0]

    def q(self, prefix):
        return self.rows(prefix)[1]


def confident_q(vocab: int, top: float, seed: int):
    """q after a path: ``top`` on a path-dependent token, the rest spread at random (each < top)."""

    def q(path) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed(seed, *path))
        best = int(torch.randint(vocab, (), generator=gen))
        row = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.1
        row[best] = 0
        row = row / row.sum() * (1 - top)
        row[best] = top
        return row

    return q


def flat_q(vocab: int, seed: int, spread: float = 0.05):
    def q(path) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed(seed, *path))
        return (torch.randn(vocab, generator=gen, dtype=torch.float64) * spread).softmax(-1)

    return q


class Draft:
    """``expand`` over a q(path) function; records its calls."""

    def __init__(self, q):
        self.q = q
        self.calls: list[list[list[int]]] = []

    def root(self) -> torch.Tensor:
        return self.q(()).float()

    def expand(self, paths: list[list[int]]) -> torch.Tensor:
        assert paths and all(paths)
        self.calls.append([list(p) for p in paths])
        return torch.stack([self.q(tuple(p)) for p in paths]).float()


def width_and_depth(tree: TokenTree) -> tuple[int, int]:
    return len(tree.children(0)), max(tree.depths)


def is_chain(tree: TokenTree) -> bool:
    return tree.parents == [-1] + list(range(tree.num_nodes - 1))


def node_prefix(tree: TokenTree, node: int) -> tuple[int, ...]:
    return tuple(tree.path(node))


def check_invariants(tree: TokenTree, q, budget: int, depth_limit: int, max_children: int | None = None) -> None:
    n = tree.num_nodes
    assert (tree.tokens[0], tree.parents[0], tree.depths[0]) == (-1, -1, 0)
    assert n - 1 <= budget and max(tree.depths) <= depth_limit
    kids = tree_children(tree.parents)
    for node in range(1, n):
        parent = tree.parents[node]
        assert 0 <= parent < node and tree.depths[node] == tree.depths[parent] + 1
        torch.testing.assert_close(tree.node_probs[node], q(node_prefix(tree, parent)).float())
        assert tree.token_prob(node) > 0
    for node in range(n):
        tokens = [tree.tokens[k] for k in kids[node]]
        assert len(set(tokens)) == len(tokens)
        assert max_children is None or len(tokens) <= max_children


# ---------------------------------------------------------------------------------------------
# Shape
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top", [0.9, 0.95, 0.999])
@pytest.mark.parametrize("budget", [1, 2, 5, 8, 16])
def test_confident_draft_gets_exactly_the_chain_of_n(top, budget):
    draft = Draft(confident_q(32, top, seed=int(top * 1000) + budget))
    tree = build_dynamic_tree(draft.root(), draft.expand, budget, budget)
    check_invariants(tree, draft.q, budget, budget)
    assert is_chain(tree) and tree.num_nodes - 1 == budget
    # The chain is the greedy one (argmax at every step), and it is what the tree model expects most.
    path = []
    for _ in range(budget):
        path.append(int(draft.q(tuple(path)).argmax()))
    assert tree.path(budget) == path
    assert len(draft.calls) == budget - 1 and all(len(c) == 1 for c in draft.calls)  # a chain's cost
    # Sampled children, every draw the top token (the draws a confident draft makes most often).
    tree = build_dynamic_tree(draft.root(), draft.expand, budget, budget, children="sampled",
                              draw=lambda q, count: [int(q.argmax())])
    assert is_chain(tree) and tree.path(budget) == path and tree.rule == "without_replacement"


def test_confident_draft_with_high_measured_acceptance_gets_the_chain_for_every_draw():
    """Sampled children: even an unlikely first draw keeps the chain when the target is measured to
    agree with the draft (alpha 0.99): every one of the 4^5 draw sequences gives the chain of 5."""
    draft = Draft(confident_q(4, 0.9, seed=3))
    outcomes = list(enumerate_draws(lambda draw: build_dynamic_tree(
        draft.root(), draft.expand, 5, 5, children="sampled", alpha=[0.99], draw=draw)))
    assert len(outcomes) == 4 ** 5 and abs(sum(w for w, _ in outcomes) - 1) < EXACT
    assert all(is_chain(tree) and tree.num_nodes == 6 for _, tree in outcomes)
    # Measured acceptance below the draft's own prediction (0.5 < Σq² = 0.81): the target often
    # takes a token the draft does not offer, and otherwise one drawn like the draft's; an unlikely
    # first draw is then likely rejected, so a second child at the root is worth more than going
    # deeper below it. Without a measurement, drawn children make the chain (the target is taken
    # to be the draft, which accepts any first draw).
    unlikely = [int(t) for t in (draft.q(()) < 0.5).nonzero().flatten()]
    tree = build_dynamic_tree(draft.root(), draft.expand, 5, 5, children="sampled", alpha=[0.5],
                              draw=_scripted([unlikely[0]]))
    assert len(tree.children(0)) == 2
    tree = build_dynamic_tree(draft.root(), draft.expand, 5, 5, children="sampled", draw=_scripted([unlikely[0]]))
    assert is_chain(tree) and tree.num_nodes == 6


def _scripted(first: list[int]):
    """A draw that returns ``first`` tokens first, then the most likely remaining token."""
    queue = list(first)

    def draw(q, count):
        if queue:
            token = queue.pop(0)
            assert q[token] > 0
            return [token]
        return [int(q.argmax())]

    return draw


@pytest.mark.parametrize("children", ["topk", "sampled"])
@pytest.mark.parametrize("budget", [4, 8, 16])
def test_flat_draft_gets_a_wide_shallow_tree(children, budget):
    """Top-k: the draft as the proxy (EAGLE-2). Drawn children: calibrated by a measurement
    (alpha 0.3 over drafts whose mean prediction was 0.6), under which a flat node is poor."""
    draft = Draft(flat_q(64, seed=budget))
    generator = torch.Generator().manual_seed(budget)
    calibration = {"alpha": [0.3], "confidence": [0.6]} if children == "sampled" else {}
    tree = build_dynamic_tree(draft.root(), draft.expand, budget, budget, children=children, generator=generator,
                              **calibration)
    check_invariants(tree, draft.q, budget, budget)
    width, depth = width_and_depth(tree)
    assert tree.num_nodes - 1 == budget
    assert width > 1 and depth < budget
    assert width == budget and depth == 1  # nearly uniform over 64 tokens: every node at the root
    if children == "topk":
        assert len(draft.calls) == 1  # the root's children were expanded in one call (prefetch)


def test_mixed_confidence_mixes_depth_and_width():
    """Two likely first tokens, confident after token 0: the chain below 0 until its value
    (0.45 * 0.97^k) falls under the second token's 0.4, then that sibling, then the chain again."""
    confident, flat = confident_q(16, 0.97, seed=1), flat_q(16, seed=2)

    def q(path):
        if not path:  # the root: two likely tokens
            row = torch.full((16,), 0.15 / 14, dtype=torch.float64)
            row[0], row[1] = 0.45, 0.4
            return row
        return confident(path) if path[0] == 0 else flat(path)

    draft = Draft(q)
    tree = build_dynamic_tree(draft.root(), draft.expand, 10, 10)
    width, depth = width_and_depth(tree)
    assert width == 2 and depth == 9


@st.composite
def shape_cases(draw):
    vocab = draw(st.sampled_from([3, 5, 16]))
    q = flat_q(vocab, seed=draw(st.integers(0, 999)), spread=draw(st.sampled_from([0.3, 1.5, 4.0])))
    budget = draw(st.integers(0, 14))
    depth_limit = draw(st.integers(0, 16))
    max_children = draw(st.sampled_from([None, 1, 2, 4]))
    alpha = draw(st.sampled_from([None, [0.9], [0.3, 0.6], [0.05]]))
    confidence = draw(st.sampled_from([None, "mean"]))
    children = draw(st.sampled_from(["topk", "sampled"]))
    return q, budget, depth_limit, max_children, alpha, confidence, children, draw(st.integers(0, 99))


@SETTINGS
@given(shape_cases())
def test_budget_depth_width_invariants_and_prefix_property(case):
    q, budget, depth_limit, max_children, alpha, confidence, children, seed = case
    confidence = [0.4] if confidence == "mean" and alpha else None

    def build(n):
        draft = Draft(q)
        tree = build_dynamic_tree(draft.root(), draft.expand, n, depth_limit, children=children, alpha=alpha,
                                  confidence=confidence, max_children=max_children,
                                  generator=torch.Generator().manual_seed(seed))
        return tree, draft

    tree, draft = build(budget)
    check_invariants(tree, q, budget, depth_limit, max_children)
    assert tree.rule == ("without_replacement" if children == "sampled" else "one_hot")
    # Every draft token has q > 0 and the model's value of every node is positive: the budget is
    # spent unless depth and width caps run out (full support here, so only those).
    vocab = q(()).shape[0]
    width = vocab if max_children is None else min(vocab, max_children)
    capacity = sum(width ** d for d in range(1, depth_limit + 1))
    assert tree.num_nodes - 1 == min(budget, capacity)
    # At most one expand call per node but the last, each over at most the budget.
    assert len(draft.calls) <= max(0, budget - 1) and all(len(c) <= budget for c in draft.calls)
    # A prefix of the nodes is the tree grown with that smaller budget (same draws).
    for n in range(budget):
        smaller, _ = build(n)
        assert smaller.tokens == tree.tokens[: n + 1] and smaller.parents == tree.parents[: n + 1]


def test_bad_arguments_are_refused():
    draft = Draft(flat_q(8, seed=0))
    for kwargs in ({"children": "iid"}, {"max_children": 0}, {"alpha": [1.5]}, {"confidence": [-0.1]},
                   {"fault": "predraw"}, {"fault": "nope", "children": "sampled"}):
        with pytest.raises(ValueError):
            build_dynamic_tree(draft.root(), draft.expand, 4, 4, **kwargs)
    with pytest.raises(ValueError):
        build_dynamic_tree(draft.root(), draft.expand, -1, 4)
    assert build_dynamic_tree(draft.root(), draft.expand, 0, 4).num_nodes == 1
    assert build_dynamic_tree(draft.root(), draft.expand, 4, 0).num_nodes == 1


# ---------------------------------------------------------------------------------------------
# Never below the chain; the best tree of N nodes (top-k)
# ---------------------------------------------------------------------------------------------


class TopkTree:
    """The infinite top-k tree of a q(path) function: a node's children are its tokens with q > 0
    by decreasing q (ties: lower token first)."""

    def __init__(self, q, vocab: int):
        self.q, self.vocab, self._order = q, vocab, {}

    def order(self, path) -> list[int]:
        if path not in self._order:
            row = self.q(path)
            self._order[path] = sorted((t for t in range(self.vocab) if row[t] > 0), key=lambda t: (-float(row[t]), t))
        return self._order[path]

    def subtrees(self, size: int, depth_limit: int) -> set[frozenset]:
        """Every set of ``size`` nodes (paths) closed under parent and previous sibling."""
        level = {frozenset()}
        for _ in range(size):
            grown = set()
            for chosen in level:
                for parent in [()] + list(chosen):
                    if len(parent) >= depth_limit:
                        continue
                    taken = sum(1 for c in chosen if c[:-1] == parent)
                    kids = self.order(parent)
                    if taken < len(kids):
                        grown.add(chosen | {parent + (kids[taken],)})
            level = grown
        return level

    def tree(self, paths) -> TokenTree:
        """A TokenTree of these paths: parents first, siblings in top-k order (argmax first)."""
        def key(p):
            return len(p), tuple(self.order(p[:t]).index(p[t]) for t in range(len(p)))

        index = {(): 0}
        tokens, parents, depths, rows = [-1], [-1], [0], [torch.zeros(self.vocab)]
        for p in sorted(paths, key=key):
            index[p] = len(tokens)
            tokens.append(p[-1])
            parents.append(index[p[:-1]])
            depths.append(len(p))
            rows.append(self.q(p[:-1]).float())
        return TokenTree(tokens, parents, depths, torch.stack(rows), rule="one_hot")


@pytest.mark.parametrize("alpha", [None, [0.85], [0.2, 0.5]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_greedy_is_the_best_tree_of_n_nodes(seed, alpha):
    """Top-k: the greedy tree's model expected length is the maximum over every N-node tree of
    top-k children (brute force on V = 3), so at least the greedy chain's and build_tree's."""
    vocab, size = 3, 5
    q = flat_q(vocab, seed=seed, spread=1.2)
    draft = Draft(q)
    tree = build_dynamic_tree(draft.root(), draft.expand, size, size, alpha=alpha)
    value = tree_expected_accepted_length(tree, alpha)
    topk = TopkTree(q, vocab)
    candidates = topk.subtrees(size, size)
    assert len(candidates) > 20
    best = max(tree_expected_accepted_length(topk.tree(paths), alpha) for paths in candidates)
    assert value == pytest.approx(best, abs=1e-12)
    chain = build_dynamic_tree(draft.root(), draft.expand, size, size, alpha=alpha, max_children=1)
    assert is_chain(chain)
    assert value >= tree_expected_accepted_length(chain, alpha) - 1e-15
    fixed = build_tree(draft.root(), draft.expand, size, 3, 2)
    assert value >= tree_expected_accepted_length(fixed, alpha) - 1e-15


@pytest.mark.parametrize("seed,spread,alpha,confidence", [
    (0, 0.3, [0.2], [0.6]), (1, 1.5, [0.5], None), (2, 1.5, [0.7], None), (3, 4.0, [0.3], None),
    (4, 0.8, [0.95, 0.5], None), (5, 1.0, [0.4], [0.7]), (6, 1.0, None, None)])
def test_sampled_greedy_never_below_the_chain_in_expectation(seed, spread, alpha, confidence):
    """Sampled children: over every draw (exact enumeration), the model's expected accepted length
    of the dynamic tree is at least that of the chain drawn the same way (max_children=1)."""
    vocab, size = 4, 4
    draft = Draft(flat_q(vocab, seed=seed, spread=spread))

    def mean(max_children):
        total = 0.0
        for weight, tree in enumerate_draws(lambda draw: build_dynamic_tree(
                draft.root(), draft.expand, size, size, children="sampled", alpha=alpha, confidence=confidence,
                max_children=max_children, draw=draw)):
            total += weight * tree_expected_accepted_length(tree, alpha, confidence)
        return total

    tree_value, chain_value = mean(None), mean(1)
    assert tree_value >= chain_value - 1e-12
    if spread <= 0.3:  # flat: the tree is much better
        assert tree_value > 1.5 * chain_value
    if alpha is None:  # no measurement: drawn children make the chain (the target is the draft)
        assert tree_value == pytest.approx(chain_value, abs=1e-12) == size


# ---------------------------------------------------------------------------------------------
# The model: expected accepted length against the real walk
# ---------------------------------------------------------------------------------------------


def brute_force_expected_length(tree: TokenTree, alpha=None, confidence=None) -> float:
    """E[accepted tokens] of one verify step of ``tree``, by enumeration of the model's random
    targets (per internal node: agree / a token the draft never offers / one token y ~ q) and of
    every accept / reject branch of the real walk (emission_distribution, the tree's own rule)."""
    n, vocab = tree.num_nodes, tree.node_probs.shape[1]
    miss_token = vocab  # one extra token no draft row offers
    kids = tree_children(tree.parents)
    draft = torch.zeros(n, vocab + 1, dtype=torch.float64)
    options = []
    for j in range(n):
        if not kids[j]:
            options.append([(1.0, miss_token)])  # a leaf's target row only sets the final token
            continue
        q = tree.node_probs[kids[j][0]].double()
        q = q / q.sum()
        draft[j, :vocab] = q
        first = tree.tokens[kids[j][0]]
        predicted = float((q * q).sum()) if tree.rule == "without_replacement" else float(q[first])
        depth = tree.depths[j] + 1
        a = None if alpha is None else alpha[min(depth, len(alpha)) - 1]
        c = None if confidence is None else confidence[min(depth, len(confidence)) - 1]
        agree, miss = acceptance_parameters(a, predicted if c is None else c)
        if a is None and tree.rule == "without_replacement":
            agree = 1.0  # no measurement: the target is the draft, any first draw is accepted
        row = [(agree, "agree"), ((1 - agree) * miss, miss_token)]
        row += [((1 - agree) * (1 - miss) * float(q[y]), y) for y in range(vocab) if q[y] > 0]
        options.append([(w, what) for w, what in row if w > 0])
    total = 0.0
    for combo in itertools.product(*options):
        weight = math.prod(w for w, _ in combo)
        target = torch.zeros(n, vocab + 1, dtype=torch.float64)
        for j, (_, what) in enumerate(combo):
            if what == "agree":  # the target is the draft (RRS) / takes the first child (one-hot)
                if tree.rule == "without_replacement":
                    target[j] = draft[j]
                else:
                    target[j, tree.tokens[kids[j][0]]] = 1
            else:
                target[j, what] = 1
        law = emission_distribution(target, draft, tree.parents, tree.tokens, tree.rule)
        total += weight * sum(prob * (len(emitted) - 1) for emitted, prob in law.items())
    return total


def small_trees(vocab=4, seed=0):
    """Trees of every builder on a small vocabulary (at most 4 internal nodes)."""
    draft = Draft(flat_q(vocab, seed=seed, spread=1.3))
    gen = torch.Generator().manual_seed(seed)
    yield build_dynamic_tree(draft.root(), draft.expand, 5, 5)
    yield build_dynamic_tree(draft.root(), draft.expand, 5, 5, children="sampled", generator=gen)
    yield build_dynamic_tree(draft.root(), draft.expand, 4, 4, children="sampled", generator=gen, alpha=[0.9])
    yield build_tree(draft.root(), draft.expand, 4, 2, 2)
    yield build_sampled_tree(draft.root(), draft.expand, 4, 2, 2, gen)


@pytest.mark.parametrize("alpha,confidence", [(None, None), ([0.95], None), ([0.1, 0.4], None),
                                              ([0.8], [0.5]), ([0.2], [0.6]), ([0.6, 0.99], [0.3, None])])
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_length_equals_enumeration_of_the_walk(seed, alpha, confidence):
    for tree in small_trees(seed=seed):
        expected = tree_expected_accepted_length(tree, alpha, confidence)
        assert expected == pytest.approx(brute_force_expected_length(tree, alpha, confidence), abs=EXACT)
        reach = tree_acceptance(tree, alpha, confidence)
        assert reach[0] == 1.0 and all(reach[tree.parents[i]] >= reach[i] >= 0 for i in range(1, tree.num_nodes))


def test_expected_length_equals_a_monte_carlo_of_the_sampled_walk():
    """A larger tree (V = 16, 10 nodes): the model's random targets sampled, the tree walked with
    verify_tree_nodes (recursive rejection sampling, its own uniforms); 5000 steps, within 5
    standard errors."""
    vocab, alpha, confidence = 16, [0.8, 0.6], None
    draft = Draft(flat_q(vocab, seed=5, spread=1.0))
    tree = build_dynamic_tree(draft.root(), draft.expand, 10, 10, children="sampled", alpha=alpha,
                              generator=torch.Generator().manual_seed(5))
    assert tree.num_nodes == 11 and not is_chain(tree) and max(tree.depths) > 1
    expected = tree_expected_accepted_length(tree, alpha, confidence)
    kids = tree_children(tree.parents)
    draft_rows = torch.zeros(tree.num_nodes, vocab + 1, dtype=torch.float64)
    rows = draft_probs_from_tree(tree)
    draft_rows[:, :vocab] = rows / rows.sum(-1, keepdim=True).clamp(min=1e-300)
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(1)
    params = []
    for j in range(tree.num_nodes):
        if kids[j]:
            q = draft_rows[j, :vocab]
            a = alpha[min(tree.depths[j] + 1, len(alpha)) - 1]
            params.append(acceptance_parameters(a, float((q * q).sum())))
        else:
            params.append(None)
    lengths = []
    for _ in range(5000):
        target = torch.zeros(tree.num_nodes, vocab + 1, dtype=torch.float64)
        for j in range(tree.num_nodes):
            if params[j] is None:
                target[j, vocab] = 1
                continue
            agree, miss = params[j]
            u = rng.random()
            if u < agree:
                target[j] = draft_rows[j]
            elif u < agree + (1 - agree) * miss:
                target[j, vocab] = 1
            else:
                target[j, rng.choice(vocab, p=draft_rows[j, :vocab].numpy())] = 1
        accepted, _ = verify_tree_nodes(target, draft_rows, tree.parents, tree.tokens, tree.rule, generator)
        lengths.append(len(accepted))
    lengths = np.array(lengths)
    error = lengths.std() / math.sqrt(len(lengths))
    assert abs(lengths.mean() - expected) < 5 * error, (lengths.mean(), expected, error)


def test_calibration_reproduces_the_measured_acceptance():
    """Per-node fit: every node's first child is expected accepted with exactly alpha[d]; with a
    depth's mean prediction given, the mean over nodes is alpha[d]."""
    rng = np.random.default_rng(0)
    qs = [torch.from_numpy(rng.dirichlet(np.ones(6) * c)) for c in (0.2, 0.5, 1, 3, 10)]
    for alpha in (0.0, 0.05, 0.3, 0.7, 0.99, 1.0):
        for rule in ("without_replacement", "one_hot"):
            predictions = [predicted_first_acceptance(q, rule) for q in qs]
            for s in predictions:
                agree, miss = acceptance_parameters(alpha, s)
                assert 0 <= agree <= 1 and 0 <= miss <= 1 and agree * miss == 0
                assert agree + (1 - agree) * (1 - miss) * s == pytest.approx(alpha, abs=1e-12)
            mean = float(np.mean(predictions))
            agree, miss = acceptance_parameters(alpha, mean)
            first = [agree + (1 - agree) * (1 - miss) * s for s in predictions]
            assert float(np.mean(first)) == pytest.approx(alpha, abs=1e-12)
    assert acceptance_parameters(None, 0.4) == (0.0, 0.0)
    assert chain_expected_accepted_length([0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert chain_expected_accepted_length([1.0, 0.5, 0.0], 4) == pytest.approx(1 + 0.5)
    # A chain tree's model length with alpha given per node equals the chain formula.
    draft = Draft(flat_q(8, seed=1, spread=2.0))
    chain = build_dynamic_tree(draft.root(), draft.expand, 4, 4, alpha=[0.9, 0.7, 0.6], max_children=1)
    assert tree_expected_accepted_length(chain, [0.9, 0.7, 0.6]) == pytest.approx(
        chain_expected_accepted_length([0.9, 0.7, 0.6], 4), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Exactness by enumeration
# ---------------------------------------------------------------------------------------------


def emitted_law(pair: Pair, build, rule: str, length: int = 2, greedy: bool = False, fault: str | None = None):
    """Exact law of the first ``length`` emitted tokens: at each prefix the trees ``build(root_q,
    expand, draw, prefix)`` makes (every draw enumerated), each walked with ``rule``
    (emission_distribution), continued by fresh trees after what a step emitted."""
    memo = {}

    def law(prefix, length):
        if length == 0:
            return {(): 1.0}
        if (prefix, length) in memo:
            return memo[(prefix, length)]
        out = memo[(prefix, length)] = {}

        def expand(paths):
            return torch.stack([pair.q(prefix + tuple(p)) for p in paths]).float()

        for weight, tree in enumerate_draws(lambda draw: build(pair.q(prefix).float(), expand, draw, prefix)):
            target = torch.stack([pair.p(prefix + node_prefix(tree, n)) for n in range(tree.num_nodes)])
            step = emission_distribution(target, draft_probs_from_tree(tree), tree.parents, tree.tokens, rule,
                                         greedy=greedy, fault=fault)
            for emitted, prob in step.items():
                if len(emitted) >= length:
                    out[emitted[:length]] = out.get(emitted[:length], 0.0) + weight * prob
                else:
                    for more, r in law(prefix + emitted, length - len(emitted)).items():
                        out[emitted + more] = out.get(emitted + more, 0.0) + weight * prob * r
        return out

    return law((), length)


def dynamic(budget, children="sampled", alpha=None, confidence=None, max_children=None, fault=None, wrap=None):
    def build(root_q, expand, draw, prefix):
        if wrap is not None:
            draw = wrap(draw, prefix)
        return build_dynamic_tree(root_q, expand, budget, budget, children=children, alpha=alpha,
                                  confidence=confidence, max_children=max_children, draw=draw, fault=fault)

    return build


SAMPLED_CASES = [  # (vocab, budget, alpha, confidence, pair options): shapes depend on the draws
    (4, 3, [0.5], None, {}),
    (4, 4, [0.6], None, {"draft_zeros": True}),
    (4, 5, [0.4], [0.7], {"peak": 2.0}),
    (4, 5, [0.2, 0.6], None, {"peak": 2.0}),
    (5, 3, [0.5], None, {"peak": 2.0}),
    (5, 4, [0.3], [0.5], {"mix": 0.0, "draft_zeros": True}),
    (6, 3, [0.4], [0.8], {"peak": 2.0}),
]


@pytest.mark.parametrize("vocab,budget,alpha,confidence,options", SAMPLED_CASES)
def test_sampled_dynamic_trees_are_exact(vocab, budget, alpha, confidence, options):
    """Children drawn without replacement, their number decided by the chooser as it draws (from
    the earlier draws' values and the nodes' q): recursive rejection sampling emits the target's
    law (first two tokens) to 1e-12, and so does the one-hot rule; known wrong rules do not."""
    pair = Pair(vocab, seed=vocab * 10 + budget, **options)
    truth = target_law(pair)
    build = dynamic(budget, alpha=alpha, confidence=confidence)
    shapes = {tuple(tree.parents) for _, tree in enumerate_draws(lambda draw: build(
        pair.q(()).float(), lambda paths: torch.stack([pair.q(tuple(p)) for p in paths]).float(), draw, ()))}
    assert len(shapes) > 1  # the shape does depend on the draws here
    assert tv(emitted_law(pair, build, "without_replacement"), truth) < EXACT
    assert tv(emitted_law(pair, build, "one_hot"), truth) < EXACT
    assert tv(emitted_law(pair, build, "without_replacement", fault="q_not_updated"), truth) > 1e-3
    assert tv(emitted_law(pair, build, "iid"), truth) > 1e-3


def test_candidates_drawn_before_being_chosen_are_caught():
    """The natural best-first bug (fault ``predraw``: each node's next child drawn when it becomes
    a candidate, ranked by its drawn token, the unchosen dropped) is biased, and the enumeration
    sees it (one case: pre-drawing multiplies the draws to enumerate)."""
    pair = Pair(4, seed=43)
    build = dynamic(3, alpha=[0.5], fault="predraw")
    assert tv(emitted_law(pair, build, "without_replacement"), target_law(pair)) > 1e-2


@pytest.mark.parametrize("vocab,budget,alpha,confidence,options", [SAMPLED_CASES[i] for i in (0, 1, 4, 5)])
def test_a_drawn_child_dropped_for_its_target_probability_is_caught(vocab, budget, alpha, confidence, options):
    """Deciding a node's child count *after* the draw, from the drawn token's target probability
    (the child is drawn, then dropped and the node closed), is biased; the enumeration sees it."""
    pair = Pair(vocab, seed=vocab * 10 + budget, **options)
    truth = target_law(pair)

    def drop_unlikely(draw, prefix):
        root = pair.q(prefix).float().double()

        def wrapped(q, count):
            drawn = draw(q, count)
            at_root = torch.allclose(q[q > 0] / q.sum(), root[q > 0] / root[q > 0].sum(), atol=1e-6)
            if drawn and at_root and float(pair.p(prefix)[drawn[0]]) < 0.2:
                return []  # drawn, then dropped (and the root closed) for its target probability
            return drawn
        return wrapped

    build = dynamic(budget, alpha=alpha, confidence=confidence, wrap=drop_unlikely)
    assert tv(emitted_law(pair, build, "without_replacement"), truth) > 1e-2


def test_a_stopping_rule_on_earlier_draws_is_exact_even_on_target_probabilities():
    """The argument, on one node: children drawn one at a time without replacement, the decision to
    draw one more made from the earlier draws (here even from the target's probability of the last
    one: p is fixed, so that is a function of the draws) — the walk emits p exactly. Dropping a
    drawn child by its own probability is not exact."""
    rng = np.random.default_rng(4)
    for _ in range(5):
        vocab = 5
        p = torch.from_numpy(rng.dirichlet(np.ones(vocab)))
        q = torch.from_numpy(rng.dirichlet(np.ones(vocab)))

        def law(policy):
            out = {}

            def run(draw):
                drawn = []
                remaining = q.clone()
                while True:
                    decision = policy(drawn)
                    if decision == "stop" or not float(remaining.sum()) > 0:
                        return drawn
                    token = draw(remaining, 1)[0]
                    remaining[token] = 0
                    if decision == "keep_if_likely" and float(p[token]) < 0.15:
                        return drawn  # drawn, then dropped for its own target probability
                    drawn.append(token)

            for weight, drawn in enumerate_draws(run):
                tree_tokens, parents = [-1] + drawn, [-1] + [0] * len(drawn)
                target = p[None].repeat(len(parents), 1)
                draft = q[None].repeat(len(parents), 1)
                for emitted, prob in emission_distribution(target, draft, parents, tree_tokens,
                                                           "without_replacement").items():
                    out[emitted[0]] = out.get(emitted[0], 0.0) + weight * prob
            return out

        truth = {t: float(p[t]) for t in range(vocab) if p[t] > 0}

        def stop_after_likely(drawn):  # draw again while the last draw had a low target probability
            return "stop" if drawn and (float(p[drawn[-1]]) > 0.25 or len(drawn) >= 3) else "draw"

        assert tv(law(stop_after_likely), truth) < EXACT
        assert tv(law(lambda drawn: "stop" if len(drawn) >= 3 else "keep_if_likely"), truth) > 1e-3


@pytest.mark.parametrize("seed,budget,alpha", [(0, 4, None), (1, 5, [0.7]), (2, 5, [0.1, 0.9]), (3, 3, None)])
def test_topk_dynamic_trees_are_exact_at_t0_and_with_the_one_hot_rule(seed, budget, alpha):
    pair = Pair(5, seed=seed, peak=2.0, target_zeros=seed % 2 == 1)
    build = dynamic(budget, children="topk", alpha=alpha)
    assert tv(emitted_law(pair, build, "one_hot", greedy=True), target_law(pair, greedy=True)) < EXACT
    assert tv(emitted_law(pair, build, "one_hot"), target_law(pair)) < EXACT
    # The i.i.d. rule on deterministic children is the known wrong one.
    assert tv(emitted_law(pair, build, "one_hot", fault="iid_on_topk"), target_law(pair)) > 1e-3


@st.composite
def exact_cases(draw):
    vocab = draw(st.integers(4, 5))
    budget = draw(st.integers(3, 4))
    pair = Pair(vocab, seed=draw(st.integers(0, 2**16)), peak=draw(st.sampled_from([0.3, 1.5, 4.0])),
                mix=draw(st.sampled_from([0.0, 0.5, 0.9])), draft_zeros=draw(st.booleans()),
                target_zeros=draw(st.booleans()))
    alpha = draw(st.sampled_from([None, [0.5], [0.95, 0.2], [0.02]]))
    confidence = draw(st.sampled_from([None, [0.5]])) if alpha else None
    max_children = draw(st.sampled_from([None, 2]))
    return pair, budget, alpha, confidence, max_children


@settings(derandomize=True, deadline=None, max_examples=8, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(exact_cases())
def test_random_sampled_dynamic_trees_are_exact(case):
    pair, budget, alpha, confidence, max_children = case
    build = dynamic(budget, alpha=alpha, confidence=confidence, max_children=max_children)
    assert tv(emitted_law(pair, build, "without_replacement"), target_law(pair)) < EXACT


# ---------------------------------------------------------------------------------------------
# DepthAcceptance and TreeProposer(shape="dynamic")
# ---------------------------------------------------------------------------------------------


def test_depth_acceptance_counts_first_children():
    q_root = torch.tensor([0.6, 0.3, 0.1, 0.0])
    q_a = torch.tensor([0.1, 0.1, 0.1, 0.7])
    q_b = torch.tensor([0.0, 0.0, 0.5, 0.5])
    # root -> a (0), b (1); a -> c (3); b -> d (2)
    tree = TokenTree([-1, 0, 1, 3, 2], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2],
                     torch.stack([torch.zeros(4), q_root, q_root, q_a, q_b]), rule="one_hot")
    measured = DepthAcceptance()
    measured.observe(tree, [1, 3])  # root's first child, then a's first child accepted
    measured.observe(tree, [2, 4])  # root's first child rejected, b's accepted
    measured.observe(tree, [])  # nothing accepted
    assert measured.reached == [3, 2] and measured.accepted == [1, 2]
    assert measured.predicted == pytest.approx([3 * 0.6, 0.7 + 0.5])
    # Chain verification of the path root -> b -> d: root's verified child is b, not its first.
    chain = DepthAcceptance()
    chain.observe(tree, [2], submitted=[2, 4])
    assert chain.reached == [0, 1] and chain.accepted == [0, 0]
    chain.observe(tree, [1, 3], submitted=[1, 3])
    assert chain.reached == [1, 2] and chain.accepted == [1, 1]
    alpha, confidence = chain.estimate(weight=0.0)
    assert alpha == [1.0, 0.5] and confidence == pytest.approx([0.6, 0.6])
    alpha, _ = chain.estimate(weight=1.0)  # shrunk toward the pooled 2 / 3
    assert alpha == pytest.approx([(1 + 2 / 3) / 2, (1 + 2 / 3) / 3])
    alpha, confidence = chain.estimate(prior=[0.5, 0.5, 0.4], weight=1.0)
    assert alpha == pytest.approx([0.75, 1.5 / 3, 0.4]) and confidence[2] is None
    assert DepthAcceptance().estimate() == (None, None)
    assert DepthAcceptance().estimate([0.3]) == ([0.3], None)


@pytest.mark.parametrize("rule", ["one_hot", "without_replacement"])
def test_first_child_trials_are_the_per_node_predictions_in_one_pass(rule):
    """first_child_trials predicts every tried first child in one batched pass (a chain's rows as a
    view, a tree's gathered): the same values as predicted_first_acceptance node by node, rows that
    do not sum to 1 (float32 rounding) and a zero row included."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.rand(6, 50, generator=generator) ** 4 * 1.3  # unnormalised
    rows[4] = 0.0
    tokens = [int(t) for t in torch.randint(0, 50, (6,), generator=generator)]
    chain = chain_tree(tokens, rows, rule)
    trials = first_child_trials(chain, [1, 2, 3, 4, 5], submitted=[1, 2, 3, 4, 5, 6])
    expected = [predicted_first_acceptance(rows[k], rule, tokens[k]) for k in range(6)]
    assert [depth for depth, _, _ in trials] == [1, 2, 3, 4, 5, 6]
    assert [taken for _, taken, _ in trials] == [True] * 5 + [False]
    assert [p for _, _, p in trials] == pytest.approx(expected, rel=1e-12, abs=1e-15) and expected[4] == 0.0
    # a tree: root -> 1, 2; 1 -> 3; 2 -> 4, 5 (first children 1, 3 on the path root -> 1 -> 3; 1, 4 on root -> 2)
    tree = TokenTree([-1] + tokens[:5], [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2],
                     torch.cat([torch.zeros(1, 50), rows[:5]]), rule=rule)
    trials = first_child_trials(tree, [2, 5])
    assert [(d, taken) for d, taken, _ in trials] == [(1, False), (2, False)]
    assert [p for _, _, p in trials] == pytest.approx(
        [predicted_first_acceptance(rows[0], rule, tokens[0]), predicted_first_acceptance(rows[3], rule, tokens[3])],
        rel=1e-12)


class FakeEnsemble:
    """The public ensemble API TreeProposer uses, over a q(path) function of the context's end."""

    def __init__(self, q, vocab):
        self.q, self.vocab_size = q, vocab
        self.metrics = DraftMetrics(["fake"])
        self.freed = []

    def room(self, request_id, context_length, gamma):
        return gamma

    def prepare(self, requests):
        pass

    def time_step(self, now, requests):
        pass

    def sync_cost_counters(self):
        pass

    def free(self, request_id):
        self.freed.append(request_id)

    def tracked_request_ids(self):
        return set()

    def root_distributions(self, request_ids, contexts):
        return torch.stack([self.q(()).float() for _ in request_ids])

    def branch_distributions_of(self, items):
        return [torch.stack([self.q(tuple(p)) for p in paths]).float() for _, _, paths in items]

    def draw_chains(self, active, drafts, row_params=None):
        """EnsembleProposer.draw_chains over q(path): each token drawn from the processed row."""
        from vllm_specplugin.proposers.base import Draft
        from vllm_specplugin.proposers.sampling import processed_probs, sample

        for k, (index, request, gamma) in enumerate(active):
            path, rows = [], []
            for _ in range(gamma):
                row = processed_probs(self.q(tuple(path)).float().log(), row_params[k] if row_params else request.params)
                path.append(int(row.argmax()) if request.params.greedy else int(sample(row, request.generator)))
                rows.append(row)
            drafts[index] = Draft(path, torch.stack(rows))


def test_tree_proposer_default_shape_is_unchanged():
    ensemble = FakeEnsemble(flat_q(32, seed=3, spread=1.0), 32)
    proposer = TreeProposer(ensemble, node_budget=8, branching=2, verify="tree")
    assert proposer.shape == "fixed"
    draft = proposer.propose([DraftRequest("r", [1, 2, 3], 8, GREEDY, tree_ok=True)])[0]
    tree = build_tree(ensemble.q(()).float(), lambda paths: torch.stack([ensemble.q(tuple(p)) for p in paths]).float(),
                      8, 4, 2)
    assert draft.parents == tree.parents and draft.token_ids == tree.tokens[1:]
    with pytest.raises(ValueError, match="shape"):
        TreeProposer(ensemble, shape="wide")
    with pytest.raises(ValueError, match="alpha"):
        TreeProposer(ensemble, shape="dynamic", alpha=[2.0])


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["t0", "t1"])
def test_tree_proposer_dynamic_shape(params):
    confident = FakeEnsemble(confident_q(32, 0.97, seed=1), 32)
    proposer = TreeProposer(confident, node_budget=12, verify="tree", shape="dynamic")
    draft = proposer.propose([DraftRequest("c", [5, 6], 12, params, torch.Generator().manual_seed(0), True)])[0]
    tree = proposer.last_trees["c"]
    assert draft.parents == tree.parents and draft.token_ids == tree.tokens[1:]
    one_hot = torch.nn.functional.one_hot(torch.tensor(draft.token_ids), 32).float()
    if params.greedy:  # top-k children: exactly the chain of the whole budget, one-hot q for vLLM
        assert is_chain(tree) and tree.num_nodes == 13 and tree.rule == "one_hot"
        assert torch.equal(draft.probs, one_hot)
    else:  # drawn children: the chain unless a draw was unlikely
        assert tree.num_nodes == 13 and max(tree.depths) >= 6 and tree.rule == "without_replacement"
        # vLLM verifies a chain itself: a drawn chain hands it the rows its tokens were drawn
        # from (standard speculative sampling), any other tree one-hot rows.
        assert torch.equal(draft.probs, tree.node_probs[1:] if is_chain(tree) else one_hot)
    sampled_chains = 0
    less_confident = TreeProposer(FakeEnsemble(confident_q(32, 0.9, seed=1), 32), node_budget=12, verify="tree",
                                  shape="dynamic", alpha=[0.7])
    for seed in range(16):
        request = DraftRequest(f"c{seed}", [5, 6], 12, SamplingParams(temperature=1.0),
                               torch.Generator().manual_seed(seed), True)
        draft = less_confident.propose([request])[0]
        tree = less_confident.last_trees[request.request_id]
        if is_chain(tree):
            sampled_chains += 1
            assert torch.equal(draft.probs, tree.node_probs[1:]) and (draft.probs[
                torch.arange(12), torch.tensor(draft.token_ids)] > 0).all()
        else:
            assert torch.equal(draft.probs, torch.nn.functional.one_hot(torch.tensor(draft.token_ids), 32).float())
    assert 0 < sampled_chains < 16
    flat = FakeEnsemble(flat_q(64, seed=2), 64)
    # branch_cost 0: the builder's shape for a flat draft (priced, test_the_static_model_prices_...).
    proposer = TreeProposer(flat, node_budget=12, verify="tree", shape="dynamic", alpha=[0.3], confidence=[0.6],
                            branch_cost=0.0)
    proposer.propose([DraftRequest("f", [5, 6], 12, params, torch.Generator().manual_seed(0), True)])
    width, depth = width_and_depth(proposer.last_trees["f"])
    assert width == 12 and depth == 1
    # The request's budget (gamma) caps the tree; chain mode submits one path of the dynamic tree.
    proposer.propose([DraftRequest("g", [5, 6], 5, params, torch.Generator().manual_seed(0), True)])
    assert proposer.last_trees["g"].num_nodes == 6
    chain = TreeProposer(confident, node_budget=12, verify="chain", shape="dynamic")
    draft = chain.propose([DraftRequest("h", [5, 6], 4, params, torch.Generator().manual_seed(0))])[0]
    assert draft.parents is None and len(draft.token_ids) == 4
    assert chain.stats.model_expected_length > 0


def test_tree_proposer_dynamic_seeded_draws_are_reproducible():
    ensemble = FakeEnsemble(flat_q(16, seed=4, spread=1.5), 16)

    def run():
        proposer = TreeProposer(ensemble, node_budget=10, verify="tree", shape="dynamic")
        request = DraftRequest("s", [1, 2], 10, SamplingParams(temperature=1.0), torch.Generator().manual_seed(7), True)
        return proposer.propose([request])[0]

    first, second = run(), run()
    assert first.token_ids == second.token_ids and first.parents == second.parents


def test_tree_proposer_calibrates_each_request_from_its_outcomes():
    """Outcomes where every first child is accepted raise the request's alpha, hence deepen its
    trees; set_alpha overrides; free forgets."""
    ensemble = FakeEnsemble(flat_q(8, seed=6, spread=1.0), 8)
    proposer = TreeProposer(ensemble, node_budget=8, verify="tree", shape="dynamic", calibration_weight=1.0)
    context = [1, 2, 3]
    first = proposer.propose([DraftRequest("x", context, 8, GREEDY, tree_ok=True)])[0]
    assert proposer.calibration("x") == (None, None)
    before = max(proposer.last_trees["x"].depths)
    for _ in range(6):  # the target accepts the whole first-child chain each time
        tree = proposer.last_trees["x"]
        node, emitted = 0, []
        while tree.children(node):
            node = tree.children(node)[0]
            emitted.append(tree.tokens[node])
        context = context + emitted + [0]
        proposer.propose([DraftRequest("x", context, 8, GREEDY, tree_ok=True)])
    alpha, confidence = proposer.calibration("x")
    assert alpha[0] > 0.8 and confidence[0] is not None
    assert max(proposer.last_trees["x"].depths) > before
    assert first.token_ids  # drafted
    proposer.set_alpha("x", [0.01])
    assert proposer.calibration("x") == ([0.01], None)
    proposer.set_alpha("x", None)
    assert proposer.calibration("x")[0] == alpha
    assert "x" in proposer.tracked_request_ids()
    proposer.free("x")
    assert "x" not in proposer.tracked_request_ids() and proposer.calibration("x", seeded=True) == (None, None)
    # An unseeded request starts from the population's acceptance, measured over x's outcomes.
    assert proposer.calibration("new")[0][0] > 0.8
    population = TreeProposer(ensemble, shape="dynamic", alpha=[0.9])
    assert population.calibration("y") == ([0.9], None)
    population = TreeProposer(ensemble, shape="dynamic", alpha=[0.9, 0.8], confidence=[0.5, None])
    assert population.calibration("y") == ([0.9, 0.8], [0.5, None])


def test_tree_proposer_dynamic_shape_on_a_demo_draft():
    """On a real draft model: expand calls over paths of different lengths, trees within budget."""
    import os

    from vllm_specplugin.proposers.draft_runtime import DraftRuntime
    from vllm_specplugin.proposers.ensemble import EnsembleProposer
    from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

    runtime = DraftRuntime(os.path.join(REPO_ROOT, "models", "demo", "draft-tiny"), target_vocab_size=4096)
    proposer = TreeProposer(EnsembleProposer([runtime]), node_budget=12, verify="tree", shape="dynamic")
    context = np.random.default_rng(0).integers(3, 4096, size=30).tolist()
    for params in (GREEDY, SamplingParams(temperature=1.0, top_k=50)):
        generator = torch.Generator().manual_seed(0)
        draft = proposer.propose([DraftRequest("d", context, 12, params, generator, True)])[0]
        tree = proposer.last_trees["d"]
        assert tree.num_nodes == 13 and draft.parents == tree.parents and draft.token_ids == tree.tokens[1:]
        assert tree.rule == ("one_hot" if params.greedy else "without_replacement")
        kids = tree_children(tree.parents)
        for node in range(1, tree.num_nodes):
            assert tree.token_prob(node) > 0
        assert all(len({tree.tokens[k] for k in ks}) == len(ks) for ks in kids)
        context = context + draft.token_ids[:1] + [7]  # one accepted, then the target's own token
    assert proposer.calibration("d")[0] is not None
    proposer.free("d")
    assert proposer.tracked_request_ids() == set()


def test_expected_chain_steps_are_drawn_by_the_chain_loop():
    """TreeProposer._expect_chain says "the chain" where, under the calibrated model's expected
    values, nothing off the chain is worth its last node: for confident rows whose mean Σq² is the
    calibration's confidence, the builder itself grows the chain for most seeds (it hedges with a
    sibling only after an unlikely draw). Uncertain calibrations, per-node fits (confidence None)
    and top-k children go to the builder. An expected-chain step is drafted by the ensemble's
    chain loop and recorded as a chain tree for the request's measured acceptance."""
    from vllm_specplugin.proposers.tree import _TreeGrowth

    def growth(alpha, confidence, depth=8, sampled=True):
        request = DraftRequest("r", [1, 2], depth, SamplingParams(temperature=1.0), None, True)
        return _TreeGrowth(request, [1, 2], request.params, depth, depth, True, True, sampled, alpha, confidence)

    q = confident_q(32, 0.9, seed=5)
    mean_sq = float((q(()) ** 2).sum())
    alpha = [0.97, 0.95, 0.93, 0.92]
    deciding = TreeProposer(FakeEnsemble(q, 32), node_budget=8, verify="tree", shape="dynamic")
    assert deciding._expect_chain(growth(None, None))  # the draft as proxy: only the chain has value
    assert deciding._expect_chain(growth(alpha, [mean_sq] * 4))
    assert not deciding._expect_chain(growth([0.5], [0.3]))  # an uncertain draft: the builder decides
    assert not deciding._expect_chain(growth(alpha, None))  # fitted per node: cannot bound before the rows
    assert not deciding._expect_chain(growth(alpha, [mean_sq] * 4, sampled=False))  # top-k at T > 0: the builder
    # The uncertain draft's branched step must pay its extra cost: at branch_cost 0.125 a node (twice
    # the chain step for 8 nodes) it is the chain.
    assert TreeProposer(FakeEnsemble(q, 32), node_budget=8, verify="tree", shape="dynamic",
                        branch_cost=0.125)._expect_chain(growth([0.5], [0.3]))
    chains = sum(is_chain(build_dynamic_tree(
        q(()).float(), lambda paths: torch.stack([q(tuple(p)) for p in paths]).float(), 8, 8, children="sampled",
        alpha=alpha, confidence=[mean_sq] * 4, generator=torch.Generator().manual_seed(seed))) for seed in range(40))
    assert chains >= 30, chains
    proposer = TreeProposer(FakeEnsemble(q, 32), node_budget=8, verify="tree", shape="dynamic",
                            alpha=alpha, confidence=[mean_sq] * 4)
    request = DraftRequest("r", [1, 2], 8, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), True)
    draft = proposer.propose([request])[0]
    tree = proposer.last_trees["r"]
    assert proposer.stats.chain_steps == 1 and proposer.stats.trees == 0
    assert is_chain(tree) and draft.parents == tree.parents and draft.token_ids == tree.tokens[1:]
    assert torch.equal(draft.probs, tree.node_probs[1:]) and tree.rule == "without_replacement"
    # The next step scores it: the request's measured acceptance by depth grows from the chain.
    proposer.propose([DraftRequest("r", [1, 2] + draft.token_ids[:3] + [0], 8, SamplingParams(temperature=1.0),
                                   torch.Generator().manual_seed(1), True)])
    assert proposer._measured["r"].reached[:4] == [1, 1, 1, 1] and proposer._measured["r"].accepted[:4] == [1, 1, 1, 0]


def test_expected_chain_at_t0_is_the_argmax_chain_with_t1_rows_for_the_model():
    """At T = 0 (top-k children, one-hot rule) a calibrated confident request's step is the argmax
    chain, drafted by the chain loop: one-hot q for vLLM, the T = 1 rows kept for the acceptance
    model; before any measurement the builder decides (EAGLE-2's values need the rows)."""
    q = confident_q(32, 0.9, seed=5)
    top = float(q(()).max())
    proposer = TreeProposer(FakeEnsemble(q, 32), node_budget=8, verify="tree", shape="dynamic")
    first = proposer.propose([DraftRequest("g", [1, 2], 8, GREEDY, tree_ok=True)])[0]
    assert proposer.stats.chain_steps == 0 and proposer.stats.trees == 1  # no measurement yet: the builder
    greedy_chain = TreeProposer(FakeEnsemble(q, 32), node_budget=8, verify="tree", shape="dynamic",
                                alpha=[0.97, 0.95], confidence=[top, top])
    draft = greedy_chain.propose([DraftRequest("g", [1, 2], 8, GREEDY, tree_ok=True)])[0]
    tree = greedy_chain.last_trees["g"]
    assert greedy_chain.stats.chain_steps == 1 and is_chain(tree) and tree.rule == "one_hot"
    path = []
    for _ in range(8):  # the argmax chain of q
        path.append(int(q(tuple(path)).argmax()))
    assert draft.token_ids == path
    assert torch.equal(draft.probs, torch.nn.functional.one_hot(torch.tensor(path), 32).float())
    assert abs(float(tree.node_probs[1].max()) - top) < 1e-6  # T = 1 rows, not one-hot
    assert first.token_ids[0] == path[0]


def test_population_prior_for_unseeded_requests_only():
    """Without a configured alpha, an unseeded request's calibration starts from the population's
    measured acceptance by depth (all unseeded requests' outcomes); a seeded request's depends on
    its own history only, so other traffic cannot change its trees."""
    ensemble = FakeEnsemble(flat_q(8, seed=6, spread=1.0), 8)
    proposer = TreeProposer(ensemble, node_budget=8, verify="tree", shape="dynamic")
    context = [1, 2, 3]
    proposer.propose([DraftRequest("x", context, 8, GREEDY, tree_ok=True)])
    for _ in range(4):  # the target rejects every first child: the population learns a low alpha
        context = context + [0]
        proposer.propose([DraftRequest("x", context, 8, GREEDY, tree_ok=True)])
    alpha, _ = proposer.calibration("fresh")
    assert alpha is not None and alpha[0] < 0.5
    assert proposer.calibration("fresh", seeded=True) == (None, None)
    seeded = DraftRequest("s", [1, 2, 3], 8, GREEDY, tree_ok=True, seeded=True)
    alone = TreeProposer(FakeEnsemble(flat_q(8, seed=6, spread=1.0), 8), node_budget=8, verify="tree", shape="dynamic")
    assert proposer.propose([seeded])[0].parents == alone.propose([seeded])[0].parents
    population = proposer._population
    trials = population.reached[0]
    assert trials == 4  # one first-child trial per scored step of x
    population.decay(5)
    assert population.reached[0] == 4
    population.decay(4)  # halved once the window is full
    assert population.reached[0] == 2


def test_the_static_model_prices_a_branched_step_against_the_chain():
    """expected_chain_and_tree: the chain's expected accepted length is Σ_k Π_{d <= k} alpha_d; the
    tree's is the best ``budget`` static node values (first child alpha_d, k-th child (1 - agree)
    (1 - miss) q_k), never below the chain's; by hand on a small case. expect_chain: the chain unless
    the tree's tokens per step beat the chain's by more than branch_cost."""
    from vllm_specplugin.proposers.tree import DEFAULT_BRANCH_COST, expect_chain, expected_chain_and_tree

    # alpha 0.5 at confidence 0.25: agree 1/3, so a sibling's value is its parent's x (2/3)(1/4) = 1/6,
    # three siblings per node (q uniform over 4 tokens). Budget 3, depth 2: 0.5 (first child),
    # 0.25 (its first child), 1/6 (a sibling of the first child); the chain of 2: 0.75.
    e_chain, e_tree = expected_chain_and_tree([0.5], [0.25], depth=2, budget=3, drawn=True)
    assert e_chain == pytest.approx(0.75) and e_tree == pytest.approx(0.5 + 0.25 + 1 / 6)
    # Budget 4: the second root sibling (1/6) beats the first child's sibling (0.5 x 1/6).
    assert expected_chain_and_tree([0.5], [0.25], 2, 4, True)[1] == pytest.approx(0.75 + 2 / 6)
    # Top-k children at confidence 0.9: the second most likely has q <= 0.1, none after it.
    e_chain, e_tree = expected_chain_and_tree([0.5], [0.9], 1, 3, drawn=False)
    agree, miss = 0.0, 1 - 0.5 / 0.9
    assert e_chain == pytest.approx(0.5) and e_tree == pytest.approx(0.5 + (1 - agree) * (1 - miss) * 0.1)
    alpha = [0.9, 0.8, 0.7, 0.6]
    e_chain, e_tree = expected_chain_and_tree(alpha, [0.3] * 4, 6, 6, True)
    assert e_chain == pytest.approx(sum(math.prod(([0.9, 0.8, 0.7] + [0.6] * 3)[:k]) for k in range(1, 7)))
    assert e_tree >= e_chain
    # A draft whose measured acceptance is all agreement (alpha 1): nothing beats the chain.
    assert expected_chain_and_tree([1.0], [0.3], 5, 5, True) == (5.0, 5.0)
    # The decision, at the calibrations measured on the memory-bound target at T = 1 (7 Dec,
    # throughput/tree_prediction.py): its own draft is accepted 0.94 a position at Σ q² 0.16 (the
    # chain), the tiny draft 0.61 at 0.11: its tree of 8 promises 1.02x the chain's tokens, of 16
    # 1.14x (the exact laws: 1.002x, 1.107x), less than a branched step's extra cost (0.2, 0.4).
    assert expect_chain([0.94], [0.16], 8, 8, True, DEFAULT_BRANCH_COST)
    assert expect_chain([0.61], [0.11], 8, 8, True, DEFAULT_BRANCH_COST)
    assert expect_chain([0.61], [0.11], 16, 16, True, DEFAULT_BRANCH_COST)
    assert not expect_chain([0.61], [0.11], 8, 8, True, branch_cost=0.0)
    assert not expect_chain([0.61], [0.11], 16, 16, True, branch_cost=0.005)  # 1.08 < 1.14
    assert expect_chain([0.61], [0.11], 16, 16, True, branch_cost=0.01)  # 1.16 > 1.14
    assert not expect_chain([0.66], [None], 8, 8, True)  # a depth fitted per node: the builder decides
    assert not expect_chain([0.66], None, 8, 8, True)
