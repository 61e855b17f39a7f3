"""Several drafters merged into one token tree (``proposers/merged_tree.py``): exact by enumeration.

Exactness is proved without sampling, in float64. A case is a target P and 2-3 drafters (model
drafts drawing children i.i.d. or without replacement from their own q, one-hot drafters: top-k of
their own q, or fixed tokens per context), all depending on the whole prefix. For a context, every
joint draw of the drafters' subtrees is enumerated with its probability, merged
(:func:`merge_proposals`, with or without a node budget), and walked exactly
(:func:`merged_emission_distribution`). One step is exact iff its emitted tokens, completed by
target draws to a fixed length m (>= the longest possible emission), have the target's law of m
tokens: the steps after it then continue exactly by induction on the number of tokens, which is
what repeated steps do.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from vllm_specplugin.proposers.merged_tree import (
    MERGED_FAULTS,
    DrafterProposal,
    MergedTree,
    ProposalGroup,
    merge_proposals,
    merged_emission_distribution,
    verify_merged_tree,
)
from vllm_specplugin.proposers.tree_verify import (
    FAULTS,
    AcceptanceRule,
    emission_distribution,
    tree_children,
    tree_depths,
)

torch.set_num_threads(1)

EXACT = 1e-12
SETTINGS = settings(derandomize=True, deadline=None, max_examples=40, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

MODEL_KINDS = ("wor", "iid")
ONE_HOT_KINDS = ("topk", "fixed")
RULES = {"wor": "without_replacement", "iid": "iid", "topk": "one_hot", "fixed": "one_hot"}

# A drafter's own skeleton (parents, BFS): what it tries to propose; without-replacement draws
# stop early when q's support runs out.
SHALLOW = ([-1, 0], [-1, 0, 0])
DEEP = ([-1, 0, 1], [-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 1, 2], [-1, 0, 0, 1, 1, 3])
JOINT_DRAWS = 1200  # the most joint draws a hypothesis case enumerates (at V = 4 before growing V)
SAMPLED_SEED = 0  # the sampled case's target rows


# ---------------------------------------------------------------------------------------------
# The world: target and drafters after any prefix
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drafter:
    kind: str  # wor / iid (model), topk / fixed (one-hot)
    skeleton: tuple[int, ...]
    mix: float = 0.5  # q = mix * P + (1 - mix) * other
    q_zeros: bool = False  # q has zeros (tokens it never draws)
    q_seed: int | None = None  # drafters with the same q_seed (and mix) have the same q


class World:
    """Target rows P(prefix) and each drafter's q_k(prefix), float64, fixed by a seed."""

    def __init__(self, vocab: int, seed: int, drafters: list[Drafter], peak: float = 1.0, target_zeros: bool = False):
        self.vocab, self.seed, self.drafters, self.peak, self.target_zeros = vocab, seed, drafters, peak, target_zeros
        self._p: dict = {}
        self._q: dict = {}
        self._law: dict = {}

    def _gen(self, *key) -> torch.Generator:  # stable across processes (str hashes are salted)
        digest = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % 2**62)

    def p(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._p:
            gen = self._gen("p", *prefix)
            logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak
            if self.target_zeros:  # top-k / top-p targets
                drop = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < 0.4
                drop[int(logits.argmax())] = False
                logits[drop] = float("-inf")
            self._p[prefix] = logits.softmax(-1)
        return self._p[prefix]

    def q(self, k: int, prefix: tuple[int, ...]) -> torch.Tensor:
        if (k, prefix) not in self._q:
            spec = self.drafters[k]
            gen = self._gen("q", k if spec.q_seed is None else ("shared", spec.q_seed), *prefix)
            other = (torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak).softmax(-1)
            q = spec.mix * self.p(prefix) + (1 - spec.mix) * other
            if spec.q_zeros:
                drop = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < 0.5
                drop[int(q.argmax())] = False
                q = torch.where(drop, torch.zeros_like(q), q)
            self._q[(k, prefix)] = q / q.sum()
        return self._q[(k, prefix)]

    def fixed_tokens(self, k: int, prefix: tuple[int, ...], m: int) -> list[int]:
        """A deterministic drafter's m distinct tokens after prefix (an n-gram table, say)."""
        return torch.randperm(self.vocab, generator=self._gen("fixed", k, *prefix))[:m].tolist()

    def target_law(self, prefix: tuple[int, ...], length: int, greedy: bool = False) -> dict:
        """{tokens: probability} of the target's next ``length`` tokens after prefix."""
        key = (prefix, length, greedy)
        if key not in self._law:
            out = {(): 1.0}
            if length:
                p = self.p(prefix)
                if greedy:
                    p = torch.nn.functional.one_hot(p.argmax(), self.vocab).double()
                out = {}
                for token, prob in enumerate(p.tolist()):
                    if prob > 0:
                        for rest, r in self.target_law(prefix + (token,), length - 1, greedy).items():
                            out[(token,) + rest] = prob * r
            self._law[key] = out
        return self._law[key]


def child_draws(kind: str, q: torch.Tensor, m: int):
    """Every way the drafter picks up to m children from q: [(tokens in draw order, probability)]."""
    qs = q.tolist()
    support = [t for t, v in enumerate(qs) if v > 0]
    if kind == "topk":
        return [(tuple(sorted(support, key=lambda t: (-qs[t], t))[:m]), 1.0)]
    if kind == "iid":
        return [(xs, float(np.prod([qs[x] for x in xs]))) for xs in itertools.product(support, repeat=m)]
    draws = []
    for xs in itertools.permutations(support, min(m, len(support))):
        weight, left = 1.0, 1.0
        for x in xs:
            weight, left = weight * qs[x] / left, left - qs[x]
        draws.append((xs, weight))
    return draws


def drafter_draws(world: World, k: int, prefix: tuple[int, ...]) -> list[tuple[DrafterProposal, float]]:
    """Every subtree drafter k can propose after prefix, with its probability."""
    spec = world.drafters[k]
    kids_of = tree_children(spec.skeleton)
    one_hot = spec.kind in ONE_HOT_KINDS
    out = []

    def rec(queue, parents, tokens, rows, weight):
        if not queue:
            zeros = torch.zeros(world.vocab, dtype=torch.float64)
            draft = None if one_hot else torch.stack([zeros if r is None else r for r in rows])
            out.append((DrafterProposal(parents, tokens, RULES[spec.kind], draft, name=spec.kind), weight))
            return
        (skel, own, path), rest = queue[0], queue[1:]
        kids = kids_of[skel]
        if not kids:
            rec(rest, parents, tokens, rows, weight)
            return
        q = world.q(k, prefix + path)
        if spec.kind == "fixed":
            draws = [(tuple(world.fixed_tokens(k, prefix + path, len(kids))), 1.0)]
        else:
            draws = child_draws(spec.kind, q, len(kids))
        for xs, w in draws:
            new_parents, new_tokens, new_rows = list(parents), list(tokens), list(rows)
            new_rows[own] = q
            added = []
            for kid, x in zip(kids, xs):
                new_parents.append(own)
                new_tokens.append(x)
                new_rows.append(None)
                added.append((kid, len(new_tokens) - 1, path + (x,)))
            rec(rest + added, new_parents, new_tokens, new_rows, weight * w)

    rec([(0, 0, ())], [-1], [-1], [None], 1.0)
    return out


def max_emitted(world: World) -> int:
    return 1 + max(max(tree_depths(d.skeleton)) for d in world.drafters)


def merged_trees(world: World, prefix=(), budget=None):
    """Every merged tree after prefix with its probability (the drafters draw independently)."""
    per_drafter = [drafter_draws(world, k, prefix) for k in range(len(world.drafters))]
    for combo in itertools.product(*per_drafter):
        weight = float(np.prod([w for _, w in combo]))
        if weight > 0:
            yield merge_proposals([d for d, _ in combo], budget, world.vocab), weight


def target_rows(world: World, tree: MergedTree, prefix=()) -> torch.Tensor:
    return torch.stack([world.p(prefix + tuple(tree.path(n))) for n in range(tree.num_nodes)])


def step_law(world: World, prefix=(), budget=None, fault=None, greedy=False, transform=None) -> dict:
    """Exact law of one step's emitted tokens after prefix, over every joint draw."""
    law: dict = {}
    for tree, weight in merged_trees(world, prefix, budget):
        if transform is not None:
            tree = transform(tree)
        step = merged_emission_distribution(tree, target_rows(world, tree, prefix), greedy=greedy, fault=fault)
        for emitted, prob in step.items():
            law[emitted] = law.get(emitted, 0.0) + weight * prob
    return law


def completed(world: World, law: dict, length: int, prefix=(), greedy=False) -> dict:
    """The step's law followed by target draws up to ``length`` tokens."""
    out: dict = {}
    for emitted, prob in law.items():
        assert len(emitted) <= length
        for rest, r in world.target_law(prefix + emitted, length - len(emitted), greedy).items():
            out[emitted + rest] = out.get(emitted + rest, 0.0) + prob * r
    return out


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def step_tv(world: World, prefix=(), budget=None, fault=None, greedy=False, transform=None, law=None) -> float:
    """TV between one step completed by target draws and the target, over max_emitted tokens."""
    m = max_emitted(world)
    if law is None:
        law = step_law(world, prefix, budget, fault, greedy, transform)
    assert abs(sum(law.values()) - 1) < 1e-12
    return total_variation(completed(world, law, m, prefix, greedy), world.target_law(prefix, m, greedy))


def shared_slot_mass(world: World, prefix=(), budget=None) -> float:
    """Probability that some node gets slots from two different drafters (the duplicate case)."""
    return sum(w for tree, w in merged_trees(world, prefix, budget)
               if any(len({g.drafter for g in tree.groups[tree.parents[n]] if n in g.children}) > 1
                      for n in range(1, tree.num_nodes)))


# ---------------------------------------------------------------------------------------------
# Exactness by enumeration
# ---------------------------------------------------------------------------------------------


def draw_count(kind: str, skeleton, vocab: int) -> int:
    if kind in ONE_HOT_KINDS:
        return 1
    count = 1
    for kids in tree_children(skeleton):
        k = len(kids)
        if k:
            count *= vocab ** k if kind == "iid" else int(np.prod(range(vocab - k + 1, vocab + 1)))
    return count


def joint_draws(drafters, vocab: int) -> int:
    return int(np.prod([draw_count(d.kind, d.skeleton, vocab) for d in drafters]))


@st.composite
def cases(draw):
    """2-3 drafters (at least one model draft, one subtree of depth 2-3), V in 4..8 as far as the
    enumeration allows, with or without a node budget."""
    n = draw(st.integers(2, 3))
    kinds = [draw(st.sampled_from(MODEL_KINDS))] + [draw(st.sampled_from(MODEL_KINDS + ONE_HOT_KINDS))
                                                    for _ in range(n - 1)]
    kinds = draw(st.permutations(kinds))  # the model draft is not always first
    deep = draw(st.integers(0, n - 1))
    skeletons: dict[int, tuple] = {}
    cost = 1
    for i in [deep] + [i for i in range(n) if i != deep]:  # the deep one first: room is left for the rest
        left = 4 ** sum(kinds[j] in MODEL_KINDS for j in range(n) if j != i and j not in skeletons)  # [-1, 0] each
        pool = DEEP if i == deep else SHALLOW + DEEP
        options = [s for s in pool if cost * draw_count(kinds[i], s, 4) * left <= JOINT_DRAWS]
        skeletons[i] = tuple(draw(st.sampled_from(options)))
        cost *= draw_count(kinds[i], skeletons[i], 4)
    drafters = [Drafter(kinds[i], skeletons[i], mix=draw(st.sampled_from([0.0, 0.5, 0.9])), q_zeros=draw(st.booleans()))
                for i in range(n)]
    vocab = draw(st.sampled_from([v for v in range(4, 9) if joint_draws(drafters, v) <= JOINT_DRAWS]))
    world = World(vocab, seed=draw(st.integers(0, 2**16)), drafters=drafters,
                  peak=draw(st.sampled_from([0.3, 1.0, 3.0])), target_zeros=draw(st.booleans()))
    budget = draw(st.sampled_from([None, None, 2, 3, 5]))
    return world, budget


@SETTINGS
@given(case=cases())
def test_merged_tree_emits_the_target_law(case):
    world, budget = case
    assert step_tv(world, budget=budget) < EXACT


@settings(SETTINGS, max_examples=15)
@given(case=cases())
def test_greedy_merged_tree_emits_the_argmax_chain(case):
    world, budget = case
    assert step_tv(world, budget=budget, greedy=True) < EXACT


def hand_worlds():
    """Hand-picked: every drafter mix, same-token proposals forced, q with zeros, depth 3."""
    return {
        # Three drafters after one another at every node, q with zeros, top-k one-hot sharing the
        # model's argmax (mix 0.9 makes them propose the same tokens).
        "wor+iid+topk": World(5, 1, [Drafter("wor", (-1, 0, 0, 1), 0.9, True), Drafter("iid", (-1, 0, 1), 0.5),
                                     Drafter("topk", (-1, 0, 0, 1, 2), 0.9)]),
        # Two model drafts with the same q, so they often propose the same tokens.
        "wor+wor same q": World(4, 2, [Drafter("wor", (-1, 0, 0, 1), 0.3, q_seed=0),
                                       Drafter("wor", (-1, 0, 1), 0.3, q_seed=0)]),
        # One-hot first, then the model draft, at V = 8, target zeros.
        "fixed+wor V8": World(8, 4, [Drafter("fixed", (-1, 0, 0, 1, 1, 3), 0.5), Drafter("wor", (-1, 0, 0), 0.5, True)],
                              target_zeros=True),
        # i.i.d. draws repeat tokens (one node, two slots of one group) under a one-hot chain.
        "iid repeats+topk": World(4, 4, [Drafter("iid", (-1, 0, 0, 1), 0.9, True), Drafter("topk", (-1, 0, 1, 2), 0.9)],
                                  peak=3.0),
    }


@pytest.mark.parametrize("name", list(hand_worlds()))
@pytest.mark.parametrize("budget", [None, 3])
def test_hand_picked_merged_trees_are_exact_with_shared_tokens(name, budget):
    world = hand_worlds()[name]
    assert shared_slot_mass(world, budget=budget) > 0.01  # the same token proposed by two drafters
    assert step_tv(world, budget=budget) < EXACT
    assert step_tv(world, prefix=(1,), budget=budget) < EXACT  # another context


def test_a_duplicate_slot_is_never_accepted_but_moves_the_residual():
    """Two drafters propose token 0 at the root; the nodes are shared. Once a's 0 is rejected the
    residual has no mass at 0, so b's 0 is rejected too, but its rejection subtracts b's q."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    qa = torch.tensor([0.8, 0.1, 0.1], dtype=torch.float64)  # p[0] / qa[0] = 0.625
    qb = torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64)
    a = DrafterProposal.chain([0], qa[None], "iid", name="a")
    b = DrafterProposal.chain([0], qb[None], "without_replacement", name="b")
    tree = merge_proposals([a, b])
    assert tree.parents == [-1, 0] and tree.tokens == [-1, 0]
    assert [g.drafter for g in tree.groups[0]] == [0, 1] and tree.proposed_by[1] == (0, 1)
    assert tree.sources[1] == ((0, 1), (1, 1))
    target = torch.stack([p, p])
    law = merged_emission_distribution(tree, target)
    assert abs(sum(v for s, v in law.items() if len(s) == 2) - 0.625) < EXACT
    # After a: norm(max(p - qa, 0)) = [0, 2/3, 1/3]; after b: norm(max(that - qb, 0)) = [0, 1, 0].
    assert abs(law[(1,)] - 0.375) < EXACT and (2,) not in law
    alone = merged_emission_distribution(merge_proposals([a]), target)
    assert abs(alone[(1,)] - 0.25) < EXACT and abs(alone[(2,)] - 0.125) < EXACT
    # b first: min(1, .5 / .2) = 1, so a's slot is never tried.
    law = merged_emission_distribution(merge_proposals([b, a]), target)
    assert abs(sum(v for s, v in law.items() if len(s) == 2) - 1.0) < EXACT
    gen = torch.Generator().manual_seed(0)
    assert all(verify_merged_tree(merge_proposals([b, a]), target, gen).drafters == [0] for _ in range(50))


@pytest.mark.parametrize("rule", ["one_hot", "iid", "without_replacement"])
def test_one_drafter_is_the_single_tree_rule(rule):
    """A merged tree of one drafter has the law of proposers/tree_verify.py's walk on that tree
    (proved exact by its own tests); i.i.d. draws of one token share a node here."""
    rng = np.random.default_rng(0)
    repeats = 0
    for trial in range(20):
        vocab = 4
        parents = [-1, 0, 0, 1, 1, 2]
        kids = tree_children(parents)
        q = torch.tensor(rng.dirichlet(np.full(vocab, 0.6), size=len(parents)))
        if trial % 2:
            q[:, 0] = 0
            q /= q.sum(1, keepdim=True)
        tokens = [-1]
        for node in range(1, len(parents)):
            row = q[parents[node]].numpy()
            siblings = [tokens[s] for s in kids[parents[node]] if s < node]
            # Siblings differ, except i.i.d. leaves (nodes 3, 4): the single tree gives a repeated
            # token with children its own subtree, which the merged tree shares (another law).
            if rule != "iid" or node == 2:
                row = np.where(np.isin(np.arange(vocab), siblings), 0.0, row)
            tokens.append(int(rng.choice(vocab, p=row / row.sum())))
        repeats += tokens[3] == tokens[4]
        draft = None if rule == "one_hot" else q
        tree = merge_proposals([DrafterProposal(parents, tokens, rule, draft)], vocab_size=vocab)
        # Target rows by token path (the same for nodes with the same path).
        by_path = {}

        def row_for(path):
            if path not in by_path:
                by_path[path] = torch.tensor(rng.dirichlet(np.full(vocab, 0.6)))
            return by_path[path]

        single_rows = torch.stack([row_for(tuple(_path(parents, tokens, n))) for n in range(len(parents))])
        merged_rows = torch.stack([row_for(tuple(tree.path(n))) for n in range(tree.num_nodes)])
        expected = emission_distribution(single_rows, draft, parents, tokens, rule)
        got = merged_emission_distribution(tree, merged_rows)
        assert total_variation(expected, got) < EXACT
        assert tree.num_nodes == len(parents) - (tokens[3] == tokens[4])
    assert rule != "iid" or repeats > 0


def _path(parents, tokens, node):
    out = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


# ---------------------------------------------------------------------------------------------
# Designs that are not exact (why the builder keeps duplicate slots and cuts before looking)
# ---------------------------------------------------------------------------------------------


def prune(tree: MergedTree, keep) -> MergedTree:
    """The merged tree with only the slots ``keep(tree, node, group, position, kept_nodes)``
    accepts (breadth-first, as the builder considers them); unreachable nodes are dropped."""
    new_index, parents, tokens, depths = {0: 0}, [-1], [-1], [0]
    groups, proposed, sources = [[]], [set()], [()]
    for node in range(tree.num_nodes):
        if node not in new_index:
            continue
        for group in tree.groups[node]:
            slots = []
            for position, child in enumerate(group.children):
                if not keep(tree, node, group, position, len(parents) - 1, child in new_index):
                    continue
                if child not in new_index:
                    new_index[child] = len(parents)
                    parents.append(new_index[node])
                    tokens.append(tree.tokens[child])
                    depths.append(depths[new_index[node]] + 1)
                    groups.append([])
                    proposed.append(set())
                    sources.append(())
                slots.append(new_index[child])
                proposed[new_index[child]].add(group.drafter)
            if slots:
                groups[new_index[node]].append(ProposalGroup(group.drafter, group.source, group.rule, group.q,
                                                             tuple(slots)))
    return MergedTree(parents, tokens, depths, [tuple(g) for g in groups], [tuple(sorted(s)) for s in proposed],
                      sources, tree.vocab_size)


def drop_duplicate_model_slots(tree: MergedTree) -> MergedTree:
    """'Merge duplicates into one slot': a slot whose node an earlier group at the node already
    proposed is dropped (the model group's later draws keep their q)."""
    def keep(tree, node, group, position, used, exists):
        child = group.children[position]
        earlier = [g for g in tree.groups[node][: tree.groups[node].index(group)]]
        return not any(child in g.children for g in earlier)
    return prune(tree, keep)


def budget_by_own_token(budget: int):
    """A node budget where a slot whose path already exists is always kept (it costs nothing),
    and a new one only while there is room: the slot's existence depends on its own token."""
    def transform(tree: MergedTree) -> MergedTree:
        return prune(tree, lambda tree, node, group, position, used, exists: exists or used < budget)
    return transform


def test_dropping_a_duplicate_model_slot_is_inexact():
    world = World(4, 0, [Drafter("wor", (-1, 0, 0), 0.0), Drafter("wor", (-1, 0, 0), 0.0)], peak=2.0)
    assert step_tv(world) < EXACT
    tv = step_tv(world, transform=drop_duplicate_model_slots)
    assert tv > 1e-2, tv


def test_a_budget_cut_that_looks_at_the_token_is_inexact():
    world = World(4, 5, [Drafter("wor", (-1, 0, 0, 0), 0.0), Drafter("wor", (-1, 0, 0, 0), 0.0)])
    assert step_tv(world, budget=1) < EXACT  # the builder's cut
    tv = step_tv(world, transform=budget_by_own_token(1))
    assert tv > 1e-2, tv


# ---------------------------------------------------------------------------------------------
# The two faults of the merged rule
# ---------------------------------------------------------------------------------------------

# Representative cases (V = 5, two drafters at the root and at depth 1, depth 2): the TV of one
# step completed to 3 tokens, and of the first token, are what the report quotes.
WOR, IID, TOPK = Drafter("wor", (-1, 0, 0, 1), 0.5), Drafter("iid", (-1, 0, 1), 0.5), Drafter("topk", (-1, 0, 1), 0.5)
FAULT_CASES = {
    "merged_residual_not_updated": {"model, model": World(5, 11, [WOR, IID]),
                                    "one-hot, model": World(5, 11, [TOPK, WOR])},
    "merged_wrong_q": {"one-hot, model": World(5, 11, [TOPK, WOR]), "model, one-hot": World(5, 11, [WOR, TOPK])},
}
# Cases where the fault cannot matter: one drafter (one group per node), or no node with both a
# one-hot and a model group.
HARMLESS = {
    "merged_residual_not_updated": [
        World(6, 12, [Drafter("wor", (-1, 0, 0, 1), 0.5)]),
        World(6, 12, [Drafter("topk", (-1, 0, 0, 1, 2), 0.5)]),
        World(5, 12, [Drafter("iid", (-1, 0, 0, 1), 0.5, True)]),
    ],
    "merged_wrong_q": [
        World(5, 13, [Drafter("wor", (-1, 0, 0, 1), 0.5), Drafter("iid", (-1, 0, 1), 0.5, True)]),
        World(6, 13, [Drafter("topk", (-1, 0, 0, 1), 0.5), Drafter("fixed", (-1, 0, 1, 2), 0.5)]),
    ],
}


def test_every_merged_fault_has_a_case():
    assert set(FAULT_CASES) == set(HARMLESS) == set(MERGED_FAULTS)
    assert not set(MERGED_FAULTS) & set(FAULTS)  # the single-drafter faults are unchanged


def first_token_tv(world: World, law: dict) -> float:
    first = {}
    for seq, prob in law.items():
        first[seq[:1]] = first.get(seq[:1], 0.0) + prob
    return total_variation(first, world.target_law((), 1))


@pytest.mark.parametrize("fault,order", [(f, o) for f in MERGED_FAULTS for o in FAULT_CASES[f]])
def test_merged_faults_move_the_law_where_they_should(fault, order):
    world = FAULT_CASES[fault][order]
    assert step_tv(world) < EXACT
    law = step_law(world, fault=fault)
    tv, first = step_tv(world, law=law), first_token_tv(world, law)
    print(f"{fault} ({order}): TV of one step + target to 3 tokens {tv:.4f}, of the first token {first:.4f}")
    assert tv > 0.02 and first > 0.01, (tv, first)


@pytest.mark.parametrize("fault", MERGED_FAULTS)
def test_merged_faults_are_harmless_where_they_cannot_matter(fault):
    for world in HARMLESS[fault]:
        assert step_tv(world, fault=fault) < EXACT


# ---------------------------------------------------------------------------------------------
# The sampled walk against the exact law
# ---------------------------------------------------------------------------------------------


def three_drafters():
    """A model draft (without replacement, depth 2), an i.i.d. chain and an n-gram subtree over
    V = 5 that share tokens at the root and below."""
    p = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    qa = torch.stack([p(.4, .3, .2, .1, 0), p(.1, .1, .1, .1, .6), p(.2, .2, .2, .2, .2), p(0, 0, 0, 0, 0),
                      p(0, 0, 0, 0, 0)])
    a = DrafterProposal([-1, 0, 0, 1, 1], [-1, 0, 1, 4, 2], "without_replacement", qa, name="model wor")
    b = DrafterProposal.chain([0, 4], torch.stack([p(.5, .2, .1, .1, .1), p(.1, .2, .3, .2, .2)]), "iid", name="iid")
    c = DrafterProposal([-1, 0, 0, 2], [-1, 1, 3, 3], "one_hot", name="ngram")
    return a, b, c


def sampled_case():
    """The three drafters merged n-gram first (then the model draft, then the chain), and fixed
    target rows under which every slot at the root can be rejected."""
    a, b, c = three_drafters()
    tree = merge_proposals([c, a, b])
    target = torch.tensor(np.random.default_rng(SAMPLED_SEED).dirichlet(np.full(5, 0.8), size=tree.num_nodes))
    return tree, target


def chi_square_pvalue(law: dict, counts: dict, draws: int) -> float:
    """Chi-square test of sampled ``counts`` against ``law``: one bin per outcome expected at
    least 5 times, the rest pooled (into the smallest bin when the pool expects < 5). An outcome
    the law gives probability 0 is an outright failure (p-value 0)."""
    if not set(counts) <= set(law):
        return 0.0
    ordered = sorted(law, key=lambda s: -law[s])
    big = [s for s in ordered if draws * law[s] >= 5]
    rest = [s for s in ordered if draws * law[s] < 5]
    observed = [counts.get(s, 0) for s in big]
    expected = [draws * law[s] for s in big]
    rest_expected = draws - sum(expected)
    rest_observed = draws - sum(observed)
    if rest and rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:  # too little to stand alone: folded into the smallest bin
        observed[-1] += rest_observed
        expected[-1] += rest_expected
    return float(stats.chisquare(observed, expected).pvalue)


def sample_counts(tree, target, draws, seed, fault=None, greedy=False):
    gen = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(draws):
        nodes, emitted, drafters = verify_merged_tree(tree, target, gen, fault=fault, greedy=greedy)
        assert emitted[:-1] == [tree.tokens[n] for n in nodes]
        assert all(tree.parents[b] == a for a, b in zip([0] + nodes, nodes))
        assert all(d in tree.proposed_by[n] for n, d in zip(nodes, drafters))
        counts[tuple(emitted)] = counts.get(tuple(emitted), 0) + 1
    return counts


def test_sampled_walk_follows_the_exact_law():
    tree, target = sampled_case()
    assert max(len(g) for g in tree.groups) == 3
    assert any(len(tree.proposed_by[n]) > 1 for n in range(tree.num_nodes))
    law = merged_emission_distribution(tree, target)
    draws = 4000
    counts = sample_counts(tree, target, draws, seed=0)
    assert set(counts) <= set(law)
    assert chi_square_pvalue(law, counts, draws) > 1e-3
    # The generator alone decides.
    again = [verify_merged_tree(tree, target, torch.Generator().manual_seed(9)) for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.parametrize("fault", MERGED_FAULTS)
def test_the_sampling_check_sees_the_faults(fault):
    """The chi-square check has power: a faulty walk's samples fail it against the honest law."""
    tree, target = sampled_case()
    law = merged_emission_distribution(tree, target)
    assert total_variation(law, merged_emission_distribution(tree, target, fault=fault)) > 0.02
    draws = 3000
    assert chi_square_pvalue(law, sample_counts(tree, target, draws, seed=1, fault=fault), draws) < 1e-3


# ---------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------


def test_builder_merges_breadth_first_and_records_drafters():
    tree = merge_proposals(list(three_drafters()))
    # a: root -> 0 (node), 1; 0 -> 4, 2.  b: root -> 0 -> 4.  c: root -> 1, 3; 3 -> 3.
    assert tree.parents == [-1, 0, 0, 0, 1, 1, 3]
    assert tree.tokens == [-1, 0, 1, 3, 4, 2, 3]
    assert tree.depths == [0, 1, 1, 1, 2, 2, 2]
    assert [(g.drafter, g.rule.value, g.children) for g in tree.groups[0]] == [
        (0, "without_replacement", (1, 2)), (1, "iid", (1,)), (2, "one_hot", (2, 3))]
    assert [(g.drafter, g.children) for g in tree.groups[1]] == [(0, (4, 5)), (1, (4,))]
    assert [(g.drafter, g.children) for g in tree.groups[3]] == [(2, (6,))]
    assert tree.proposed_by == [(), (0, 1), (0, 2), (2,), (0, 1), (0,), (2,)]
    assert tree.sources[4] == ((0, 3), (1, 2)) and tree.num_slots == 9
    assert tree.groups[0][0].q.dtype == torch.float64 and tree.groups[0][2].q is None
    assert tree.path(4) == [0, 4] and tree.vocab_size == 5


def test_budget_keeps_a_prefix_of_each_group_and_free_duplicates():
    tree = merge_proposals(list(three_drafters()))
    a, b, c = (DrafterProposal([-1, 0, 0, 1, 1], [-1, 0, 1, 4, 2], "one_hot"), DrafterProposal.chain([0, 4]),
               DrafterProposal([-1, 0, 0, 2], [-1, 1, 3, 3], "one_hot"))
    for budget in range(0, 8):
        cut = merge_proposals([a, b, c], budget)
        assert cut.num_nodes - 1 <= budget
        assert cut.num_nodes - 1 == min(budget, 6)
        for node in range(cut.num_nodes):
            assert cut.path(node) in [tree.path(n) for n in range(tree.num_nodes)]
    two = merge_proposals([a, b, c], 2)
    # Budget 2: a's 0 and 1 take it; b's 0 was looked at when the budget was full: cut although free.
    assert two.tokens == [-1, 0, 1] and [g.drafter for g in two.groups[0]] == [0]
    three = merge_proposals([a, b, c], 3)
    # Budget 3: b's 0 and c's 1 are free; c's 3 was looked at with room left: it takes the last node.
    assert three.tokens == [-1, 0, 1, 3] and [(g.drafter, g.children) for g in three.groups[0]] == [
        (0, (1, 2)), (1, (1,)), (2, (2, 3))]
    assert all(not groups for groups in three.groups[1:])
    assert merge_proposals([a, b, c], 0).num_nodes == 1


def test_a_budget_keeps_the_first_nodes_of_the_unbudgeted_tree():
    """merge_proposals(..., node_budget=b) has the first b + 1 nodes of the unbudgeted tree (same
    indices), but not its slots: a tree cut to a node prefix afterwards (by the engine, say) must
    be merged again with that budget, not sliced (slicing would keep duplicate slots that were
    looked at after the cut, a cut that depends on their tokens)."""
    drafters = list(three_drafters())
    for order in itertools.permutations(drafters):
        full = merge_proposals(list(order))
        for budget in range(full.num_nodes):
            cut = merge_proposals(list(order), budget)
            assert cut.parents == full.parents[: budget + 1] and cut.tokens == full.tokens[: budget + 1]
            assert cut.num_slots <= sum(len([c for c in g.children if c <= budget])
                                        for groups in full.groups[: budget + 1] for g in groups)


def test_prefix_is_the_tree_merged_with_that_budget():
    """MergedTree.prefix(n) (what the engine uses when vLLM schedules only n - 1 of the drafted
    nodes) is exactly merge_proposals(..., node_budget=n - 1): the same nodes, groups, slots and
    sources, for every cut of every drafter order over many joint draws of three drafters."""
    worlds = [list(three_drafters())]
    world = World(4, 11, [Drafter("iid", (-1, 0, 0, 1)), Drafter("fixed", (-1, 0, 1)), Drafter("wor", (-1, 0, 0, 1, 2))])
    worlds += [[d for d, _ in combo] for combo in itertools.islice(
        itertools.product(*[drafter_draws(world, k, ()) for k in range(3)]), 0, 400, 7)]
    checked = 0
    for proposals in worlds:
        for order in itertools.permutations(proposals):
            full = merge_proposals(list(order))
            assert full.prefix(full.num_nodes) is full
            for n in range(1, full.num_nodes):
                expected, got = merge_proposals(list(order), n - 1), full.prefix(n)
                assert (got.parents, got.tokens, got.depths, got.proposed_by, got.sources) == (
                    expected.parents, expected.tokens, expected.depths, expected.proposed_by, expected.sources)
                assert [[(g.drafter, g.source, g.rule, g.children) for g in gs] for gs in got.groups] == [
                    [(g.drafter, g.source, g.rule, g.children) for g in gs] for gs in expected.groups]
                checked += got.num_slots < full.num_slots
    assert checked > 50  # cuts that drop slots were met
    with pytest.raises(ValueError, match="prefix"):
        full.prefix(0)


def test_chain_and_token_tree_inputs():
    from vllm_specplugin.proposers.tree import build_sampled_tree, build_tree

    q = torch.tensor([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    chain = DrafterProposal.chain([1, 3], q)
    assert chain.parents == [-1, 0, 1] and chain.tokens == [-1, 1, 3] and chain.rule is AcceptanceRule.IID
    assert chain.draft_probs.shape == (3, 4) and chain.draft_probs.dtype == torch.float64
    assert DrafterProposal.chain([2]).rule is AcceptanceRule.ONE_HOT
    uniform, peaked = torch.full((16,), 1 / 16), torch.arange(16.0).softmax(-1)
    expand = lambda paths: torch.stack([torch.roll(peaked, len(p)) for p in paths])  # noqa: E731
    sampled = build_sampled_tree(uniform, expand, 5, 3, 2, torch.Generator().manual_seed(0))
    topk = build_tree(peaked, expand, 4, 2, 2)
    merged = merge_proposals([DrafterProposal.from_token_tree(sampled), DrafterProposal.from_token_tree(topk)])
    assert [g.rule for g in merged.groups[0]] == [AcceptanceRule.WITHOUT_REPLACEMENT, AcceptanceRule.ONE_HOT]
    target = torch.full((merged.num_nodes, 16), 1 / 16, dtype=torch.float64)
    assert abs(sum(merged_emission_distribution(merged, target).values()) - 1) < EXACT
    walk = verify_merged_tree(merged, target.float(), torch.Generator().manual_seed(0))
    assert len(walk.emitted) == len(walk.accepted) + 1 == len(walk.drafters) + 1


def test_bad_input_is_refused():
    q = torch.tensor([[0.5, 0.5, 0.0], [0, 0, 0], [0, 0, 0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="draft probability 0"):
        merge_proposals([DrafterProposal([-1, 0], [-1, 2], "iid", q[:2])])
    with pytest.raises(ValueError, match="repeat a token"):
        merge_proposals([DrafterProposal([-1, 0, 0], [-1, 1, 1], "without_replacement", q)])
    merge_proposals([DrafterProposal([-1, 0, 0], [-1, 1, 1], "iid", q)])  # i.i.d. may repeat
    with pytest.raises(ValueError, match="needs draft_probs"):
        merge_proposals([DrafterProposal([-1, 0], [-1, 1], "iid")])
    with pytest.raises(ValueError, match="parents first"):
        merge_proposals([DrafterProposal([-1, 1, 0], [-1, 1, 2], "one_hot")])
    with pytest.raises(ValueError, match="different vocabulary"):
        merge_proposals([DrafterProposal.chain([0], torch.ones(1, 3) / 3),
                         DrafterProposal.chain([0], torch.ones(1, 4) / 4)])
    with pytest.raises(ValueError, match="outside"):
        merge_proposals([DrafterProposal.chain([0], torch.ones(1, 3) / 3), DrafterProposal.chain([3])])
    off = q.clone()
    off[0, 0] += 0.01
    with pytest.raises(ValueError, match="sums to"):
        merge_proposals([DrafterProposal([-1, 0], [-1, 1], "iid", off[:2])])
    tree = merge_proposals([DrafterProposal.chain([1, 2])])
    with pytest.raises(ValueError, match=r"target_probs must be \[3, V\]"):
        verify_merged_tree(tree, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="outside"):
        verify_merged_tree(tree, torch.full((3, 2), 1 / 2))
    with pytest.raises(ValueError, match="unknown fault"):
        merged_emission_distribution(tree, torch.full((3, 3), 1 / 3), fault="residual_not_updated")
    with pytest.raises(ValueError, match="node_budget"):
        merge_proposals([], -1)


def test_greedy_takes_the_argmax_slot_of_any_drafter():
    q = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    tree = merge_proposals([DrafterProposal.chain([0], q, "iid"), DrafterProposal.chain([2])])
    target = torch.tensor([[0.2, 0.3, 0.5], [1 / 3] * 3, [0.1, 0.1, 0.8]], dtype=torch.float64)
    walk = verify_merged_tree(tree, target, greedy=True)
    assert walk.accepted == [2] and walk.emitted == [2, 2] and walk.drafters == [1]
