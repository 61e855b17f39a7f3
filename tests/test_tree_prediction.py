"""throughput/tree_prediction.py: predicted tokens per target pass equal exact enumeration of the
verifier's walk (``emission_distribution``, the enumeration the tree-verification tests use), on
tiny vocabularies in float64, for each rule; the chain formula equals enumeration of the drafted
chains; the jump-chain (per-pass) correction equals enumeration of the pass sequences."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.tree import build_dynamic_tree, build_sampled_tree, build_tree, enumerate_draws
from vllm_specplugin.proposers.tree_verify import draft_probs_from_tree, drawn_children_law, emission_distribution
from vllm_specplugin.throughput import tree_prediction as tp

VOCAB = 6


class Pair:
    """Target p and draft q after any prefix (tuple of tokens), float64, fixed by a seed."""

    def __init__(self, seed: int, vocab: int = VOCAB, peak: float = 1.5, mix: float = 0.6):
        self.seed, self.vocab, self.peak, self.mix = seed, vocab, peak, mix
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, prefix):
        prefix = tuple(int(t) for t in prefix)
        if prefix not in self._rows:
            gen = torch.Generator().manual_seed(hash((self.seed,) + prefix) % 2**62)
            p = (torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak).softmax(-1)
            other = (torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak).softmax(-1)
            self._rows[prefix] = (p, self.mix * p + (1 - self.mix) * other)
        return self._rows[prefix]

    def target(self, paths):
        return torch.stack([self.rows(p)[0] for p in paths])

    def draft(self, paths):
        return torch.stack([self.rows(p)[1] for p in paths])


def mean_length(law: dict) -> float:
    return sum(len(seq) * prob for seq, prob in law.items())


def length_law(law: dict, size: int) -> np.ndarray:
    out = np.zeros(size)
    for seq, prob in law.items():
        out[len(seq)] += prob
    return out


def node_path(parents, tokens, node):
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(path[::-1])


# A hand-made tree: the root has 3 children, node 1 two, node 2 one, node 4 one (depth 3).
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
TOKENS = [-1, 0, 3, 5, 1, 2, 4, 0]


@pytest.mark.parametrize("rule,greedy", [("one_hot", False), ("without_replacement", False), ("iid", False),
                                         ("one_hot", True)], ids=["one_hot", "without_replacement", "iid", "greedy"])
@pytest.mark.parametrize("seed,peak,mix", [(0, 1.5, 0.6), (1, 1.5, 0.6), (3, 3.0, 0.0)],
                         ids=["close0", "close1", "overconfident"])
def test_fixed_tree_law_equals_enumeration(rule, greedy, seed, peak, mix):
    """tree_pass_law's law of tokens per pass = the length law of the enumerated walk (a draft
    close to the target, and one unrelated to it, where a wrong residual or q shows most)."""
    pair = Pair(seed, peak=peak, mix=mix)
    paths = [node_path(PARENTS, TOKENS, n) for n in range(len(PARENTS))]
    target, draft = pair.target(paths), pair.draft(paths)
    law = tp.tree_pass_law(target, draft, PARENTS, TOKENS, rule, greedy=greedy)
    exact = emission_distribution(target, draft, PARENTS, TOKENS, rule, greedy=greedy)
    assert np.abs(law - length_law(exact, len(law))).max() < 1e-12
    assert abs(tp.expected_tokens(law) - mean_length(exact)) < 1e-12
    assert law.sum() == pytest.approx(1.0, abs=1e-12)


def enumerate_sampled_trees(pair, budget, depth, branching):
    """Every tree build_sampled_tree can draw, with its probability (each draw sequence replayed
    once; written here independently of the module's own enumeration)."""
    scripts, out = [[]], []
    while scripts:
        script = scripts.pop()
        taken, weight = [], [1.0]

        def draw(q, count, script=script, taken=taken, weight=weight):
            left, drawn = q.double().clone(), []
            while len(drawn) < count and float(left.sum()) > 0:
                if len(taken) < len(script):
                    x = script[len(taken)]
                else:
                    support = [int(t) for t in (left > 0).nonzero().flatten()]
                    x = support[0]
                    scripts.extend(taken + [y] for y in support[1:])
                weight[0] *= float(left[x] / left.sum())
                taken.append(x)
                left[x] = 0
                drawn.append(x)
            return drawn

        tree = build_sampled_tree(pair.draft([()])[0].float(), lambda paths: pair.draft(paths).float(), budget, depth,
                                  branching, draw=draw)
        out.append((tree, weight[0]))
    return out


def exact_sampled_mean(pair, budget, depth, branching) -> float:
    total = 0.0
    for tree, weight in enumerate_sampled_trees(pair, budget, depth, branching):
        target = pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)])
        law = emission_distribution(target, draft_probs_from_tree(tree), tree.parents, tree.tokens, tree.rule)
        total += weight * mean_length(law)
    return total


@pytest.mark.parametrize("budget,depth,branching", [(3, 2, 2), (4, 2, 2), (4, 3, 2)])
def test_sampled_tree_average_equals_enumeration(budget, depth, branching):
    """Over the draft's draws of the tree: the module's exact average = enumeration of every draw,
    each walked by emission_distribution (recursive rejection sampling)."""
    pair = Pair(budget * 10 + depth, vocab=5)
    law = tp.sampled_tree_law_exact(pair.draft([()])[0].float(), lambda paths: pair.draft(paths).float(), pair.target,
                                    budget, depth, branching)
    assert abs(law.sum() - 1) < 1e-12
    assert abs(tp.expected_tokens(law) - exact_sampled_mean(pair, budget, depth, branching)) < 1e-12


def test_one_node_average_equals_drawn_children_law():
    """Depth 1, three children drawn without replacement: 1 + P(some child accepted), by
    drawn_children_law (the exact law of one node's walk over its draws)."""
    pair = Pair(7)
    p, q = pair.rows(())
    law = tp.sampled_tree_law_exact(q.float(), pair.draft, pair.target, 3, 1, 3)
    accepted, _ = drawn_children_law(p.numpy(), q.float().double().numpy() / float(q.float().double().sum()), 3)
    assert abs(tp.expected_tokens(law) - (1 + accepted.sum())) < 1e-12  # q as float32, as in the tree


@pytest.mark.parametrize("seed", [0, 1])
def test_predict_position_at_T1_matches_enumeration(seed):
    """predict_position (what the CLI runs per position) at T = 1: each drawn tree's figure is
    its exact walk (emission_distribution, recursive rejection sampling) and the Monte Carlo mean
    is within 4 standard errors of the exact average over every draw; the best path exactly the
    one-hot walk of the top-k tree's best path; the sampled chains likewise (one child per node)."""
    pair = Pair(100 + seed, vocab=5)
    setting = tp.Setting(1.0, budgets=(3, 4), depth=2, branching=2, draws=600)
    result = tp.predict_position(setting, lambda paths: pair.draft(paths).float(), pair.target,
                                 torch.Generator().manual_seed(seed), keep_trees=True)
    for key, trees in result.trees.items():
        assert len(trees) == setting.draws
        for tree, value in list(zip(trees, result.draw_means[key]))[:50]:
            assert tree.rule == "without_replacement"
            if key == "chain":
                assert tree.parents == list(range(-1, setting.depth))
            target = pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)])
            law = emission_distribution(target, draft_probs_from_tree(tree), tree.parents, tree.tokens,
                                        "without_replacement")
            assert abs(value - mean_length(law)) < 1e-12
    for budget in setting.budgets:
        draws = np.array(result.draw_means[f"tree {budget}"])
        se = draws.std(ddof=1) / np.sqrt(len(draws))
        exact = exact_sampled_mean(pair, budget, setting.depth, setting.branching)
        assert abs(tp.expected_tokens(result.laws[f"tree {budget}"]) - exact) < 4 * se + 1e-12, (budget, exact, se)
        tree = build_tree(pair.draft([()])[0].float(), lambda paths: pair.draft(paths).float(), budget, setting.depth,
                          setting.branching)
        path = tree.path(tree.best_node(max_depth=setting.depth))
        parents, tokens = list(range(-1, len(path))), [-1] + path
        law = emission_distribution(pair.target([tuple(path[:k]) for k in range(len(path) + 1)]), None, parents,
                                    tokens, "one_hot")
        assert abs(tp.expected_tokens(result.laws[f"best_path {budget}"]) - mean_length(law)) < 1e-12
    draws = np.array(result.draw_means["chain"])
    se = draws.std(ddof=1) / np.sqrt(len(draws))
    exact = exact_sampled_mean(pair, setting.depth, setting.depth, 1)
    assert abs(tp.expected_tokens(result.laws["chain"]) - exact) < 4 * se + 1e-12


@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_trees_and_the_chains_calibration_match_enumeration(seed):
    """With Setting.dynamic (--alpha / --confidence): "dynamic N" is TreeProposer's calibrated dynamic
    tree of N nodes (drawn children) and "chain N" the chain of N drafts, each Monte Carlo mean within
    4 standard errors of the exact average over every draw (enumerate_draws, each tree walked by
    emission_distribution); at T = 0 both exact. The chains' calibration: at depth 1 every draw reaches
    the node, whose prediction is the root's Σ q² exactly and whose acceptance averages to
    Σ min(p, q) (within 4 standard errors)."""
    pair = Pair(300 + seed, vocab=5)
    calibration = ([0.6, 0.5], [0.4, 0.4])
    setting = tp.Setting(1.0, budgets=(3,), depth=2, branching=2, draws=600, dynamic=calibration)
    result = tp.predict_position(setting, lambda paths: pair.draft(paths).float(), pair.target,
                                 torch.Generator().manual_seed(seed))
    root_q = pair.draft([()])[0].float()
    expand = lambda paths: pair.draft(paths).float()  # noqa: E731
    for key, build in (("dynamic 3", lambda draw: build_dynamic_tree(root_q, expand, 3, 3, children="sampled",
                                                                      alpha=calibration[0], confidence=calibration[1],
                                                                      draw=draw)),
                       ("chain 3", lambda draw: build_sampled_tree(root_q, expand, 3, 3, 1, draw=draw))):
        exact = 0.0
        for weight, tree in enumerate_draws(build):
            target = pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)])
            exact += weight * mean_length(emission_distribution(target, draft_probs_from_tree(tree), tree.parents,
                                                                tree.tokens, tree.rule))
        draws = np.array(result.draw_means[key])
        se = draws.std(ddof=1) / np.sqrt(len(draws))
        assert abs(tp.expected_tokens(result.laws[key]) - exact) < 4 * se + 1e-12, (key, exact, se)
    p, q = pair.target([()])[0].double(), pair.draft([()])[0].float().double()
    q = q / q.sum()
    reach, accepted, predicted = result.calibration[0]
    assert reach == pytest.approx(1.0) and predicted == pytest.approx(float((q * q).sum()))
    per_draw = [tp.chain_calibration(tree, pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)]))[0, 1]
                for tree in [build_sampled_tree(root_q, expand, 2, 2, 1, torch.Generator().manual_seed(k))
                             for k in range(400)]]
    assert abs(accepted - float(torch.minimum(p / p.sum(), q).sum())) < 4 * np.std(per_draw) / np.sqrt(setting.draws)
    greedy = tp.predict_position(tp.Setting(0.0, budgets=(3,), depth=2, branching=2, dynamic=calibration),
                                 lambda paths: pair.draft(paths).float(), pair.target, torch.Generator())
    tree = build_dynamic_tree(root_q, expand, 3, 3, children="topk", alpha=calibration[0], confidence=calibration[1])
    target = pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)])
    law = emission_distribution(target, None, tree.parents, tree.tokens, "one_hot", greedy=True)
    assert abs(tp.expected_tokens(greedy.laws["dynamic 3"]) - mean_length(law)) < 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_predict_position_at_T0_matches_enumeration(seed):
    """At T = 0 every figure is exact: the top-k tree (on the draft's T = 1 rows) walked greedily,
    its best path walked greedily, the draft's greedy chain walked greedily."""
    pair = Pair(200 + seed, vocab=5, mix=0.8)
    setting = tp.Setting(0.0, budgets=(3, 5), depth=3, branching=2)
    result = tp.predict_position(setting, lambda paths: pair.draft(paths).float(), pair.target, torch.Generator())
    for budget in setting.budgets:
        tree = build_tree(pair.draft([()])[0].float(), lambda paths: pair.draft(paths).float(), budget, setting.depth,
                          setting.branching)
        target = pair.target([tuple(tree.path(n)) for n in range(tree.num_nodes)])
        law = emission_distribution(target, None, tree.parents, tree.tokens, "one_hot", greedy=True)
        assert abs(tp.expected_tokens(result.laws[f"tree {budget}"]) - mean_length(law)) < 1e-12
    chain = []
    for _ in range(setting.depth):
        chain.append(int(pair.draft([tuple(chain)])[0].argmax()))
    law = emission_distribution(pair.target([tuple(chain[:k]) for k in range(len(chain) + 1)]), None,
                                list(range(-1, len(chain))), [-1] + chain, "one_hot", greedy=True)
    assert abs(tp.expected_tokens(result.laws["chain"]) - mean_length(law)) < 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_formula_equals_enumeration(seed):
    """E = 1 + Σ_k Π_{i≤k} α_i with α_i = Σ min(p_i, q_i), when p_i and q_i depend only on the
    depth: every drafted chain enumerated, each walked by rejection sampling (emission_distribution);
    and with 0/1 indicators for a greedy chain."""
    rng = np.random.default_rng(seed)
    depth, vocab = 3, 5
    p = torch.from_numpy(rng.dirichlet(np.ones(vocab), size=depth + 1))
    q = torch.from_numpy(rng.dirichlet(np.ones(vocab), size=depth + 1))
    parents = list(range(-1, depth))
    total = 0.0
    for chain in itertools.product(range(vocab), repeat=depth):
        weight = float(np.prod([q[i, x] for i, x in enumerate(chain)]))
        law = emission_distribution(p, q, parents, [-1, *chain], "without_replacement")
        total += weight * mean_length(law)
    formula = tp.chain_pass_law([tp.alpha(p[i], q[i]) for i in range(depth)])
    assert abs(tp.expected_tokens(formula) - total) < 1e-12
    greedy_chain = [int(q[i].argmax()) for i in range(depth)]
    law = emission_distribution(p, None, parents, [-1, *greedy_chain], "one_hot", greedy=True)
    indicators = [float(int(p[i].argmax()) == greedy_chain[i]) for i in range(depth)]
    assert abs(tp.expected_tokens(tp.chain_pass_law(indicators)) - mean_length(law)) < 1e-12


def test_per_pass_equals_enumeration_of_pass_sequences():
    """The jump chain's expected tokens and passes = the sum over every sequence of passes."""
    rng = np.random.default_rng(0)
    start, end, size = 1, 9, 5
    laws = [None] + [np.concatenate([[0.0], rng.dirichlet(np.ones(size - 1))]) for _ in range(end + size)]

    def enumerate_from(t, prob, tokens, passes, out):
        if t >= end:
            out.append((prob, tokens, passes))
            return
        for k in range(1, size):
            enumerate_from(t + k, prob * laws[t][k], tokens + k, passes + 1, out)

    sequences = []
    enumerate_from(start, 1.0, 0, 0, sequences)
    tokens, passes = tp.per_pass(laws, start, end)
    assert abs(tokens - sum(p * t for p, t, _ in sequences)) < 1e-12
    assert abs(passes - sum(p * n for p, _, n in sequences)) < 1e-12
    # every pass emits 3: ceil(8 / 3) = 3 passes, 9 tokens
    assert tp.per_pass([None] + [np.eye(size)[3]] * (end + size), start, end) == (9.0, 3.0)


def test_measured_pooling_and_table(tmp_path):
    entries = [dict(config="tree 8", batch=1, temperature=1.0, drafts=10, accepted_tokens=30, mean_accepted_length=4.0),
               dict(config="plain", batch=1, temperature=1.0, drafts=0, accepted_tokens=0, mean_accepted_length=1.0)]
    more = [dict(config="tree 8", batch=1, temperature=1.0, drafts=30, accepted_tokens=30, mean_accepted_length=2.0)]
    (tmp_path / "a.json").write_text(json.dumps(entries))
    (tmp_path / "b.json").write_text(json.dumps(more))
    measured = tp.load_measured([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert measured[("tree 8", 1, 1.0)]["per_pass"] == pytest.approx(1 + 60 / 40)  # pooled: 1 + Σ accepted / Σ drafts
    assert ("plain", 1, 1.0) not in measured
    summary = {"tree 8": {"per_position": 2.4, "per_pass": 2.75, "per_pass_sd": 1.0, "mc_se": 0.01, "positions": 5}}
    text, rows = tp.table({1.0: summary}, measured)
    assert "+10.0%" in text and rows[0]["measured"][1]["relative_difference"] == pytest.approx(0.1)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "vllm_specplugin.throughput.tree_prediction", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--measured MEASURED" in out.stdout and "--json JSON" in out.stdout
    assert "import vllm" not in open(tp.__file__).read().replace("import vllm_specplugin", "")
