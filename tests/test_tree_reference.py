"""The reference tree verifier (``proposers/tree_verify.py``): exact by enumeration, and the same
logits and KV cache as plain forwards on a tiny transformers Llama.

Exactness is proved without sampling: every draw of a tree's children (top-k, i.i.d., without
replacement) and every accept / reject branch of the walk is enumerated in float64, and the law
of the first two emitted tokens must equal the target's (first ~ P[prefix], second ~ P[prefix +
first]). A step that emits one token is followed by a fresh step, enumerated the same way.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.proposers.tree import TokenTree, build_tree
from vllm_specplugin.proposers.tree_verify import (
    FAULTS,
    AcceptanceRule,
    ReferenceTreeVerifier,
    draft_probs_from_tree,
    drawn_children_law,
    emission_distribution,
    tree_attention_mask,
    tree_children,
    tree_positions,
    verify_tree,
    verify_tree_nodes,
)

torch.set_num_threads(1)

EXACT = 1e-12
SETTINGS = settings(derandomize=True, deadline=None, max_examples=30, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Draft skeletons (parents, BFS): one child, siblings, a chain, siblings with grandchildren.
SKELETONS = [
    [-1, 0],
    [-1, 0, 0],
    [-1, 0, 0, 0],
    [-1, 0, 1],
    [-1, 0, 0, 1],
    [-1, 0, 0, 1, 2],
    [-1, 0, 0, 1, 1, 2],
]


# ---------------------------------------------------------------------------------------------
# Exact enumeration
# ---------------------------------------------------------------------------------------------


class MarkovPair:
    """Target P and draft q that depend on the whole prefix, fixed by a seed (float64 rows)."""

    def __init__(self, vocab: int, seed: int, peak: float, target_zeros: bool, mix: float):
        self.vocab, self.seed, self.peak, self.target_zeros, self.mix = vocab, seed, peak, target_zeros, mix
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self._rows:
            gen = torch.Generator().manual_seed(hash((self.seed,) + prefix) % 2**62)
            logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak
            if self.target_zeros:  # top-k / top-p processed targets have zeros
                drop = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < 0.4
                drop[int(logits.argmax())] = False
                logits[drop] = float("-inf")
            p = logits.softmax(-1)
            other = (torch.randn(self.vocab, generator=gen, dtype=torch.float64) * self.peak).softmax(-1)
            q = self.mix * p + (1 - self.mix) * other  # full support while mix < 1
            self._rows[prefix] = (p, q / q.sum())
        return self._rows[prefix]

    def p(self, prefix):
        return self.rows(prefix)[0]

    def q(self, prefix):
        return self.rows(prefix)[1]


def child_draws(scheme: str, q: torch.Tensor, m: int) -> list[tuple[tuple[int, ...], float]]:
    """Every way to choose m children from q, with its probability."""
    vocab, q = q.shape[0], q.tolist()
    if scheme == "topk":  # deterministic: the m most likely, ties by index
        return [(tuple(sorted(range(vocab), key=lambda t: (-q[t], t))[:m]), 1.0)]
    draws = []
    if scheme == "iid":
        for xs in itertools.product(range(vocab), repeat=m):
            weight = 1.0
            for x in xs:
                weight *= q[x]
            draws.append((xs, weight))
    elif scheme == "wor":
        for xs in itertools.permutations(range(vocab), m):
            weight, left = 1.0, 1.0
            for x in xs:
                weight *= q[x] / left
                left -= q[x]
            draws.append((xs, weight))
    else:
        raise AssertionError(scheme)
    return [(xs, w) for xs, w in draws if w > 0]


def node_prefix(parents, tokens, node) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(path[::-1])


def drawn_trees(skeleton, pair: MarkovPair, prefix, scheme):
    """Every tree of this skeleton the draft can produce after ``prefix``: (tokens, probability)."""
    children = tree_children(skeleton)

    def rec(j, tokens, weight):
        if j == len(skeleton):
            yield tokens, weight
            return
        if not children[j]:
            yield from rec(j + 1, tokens, weight)
            return
        q = pair.q(prefix + node_prefix(skeleton, tokens, j))
        for xs, w in child_draws(scheme, q, len(children[j])):
            drawn = list(tokens)
            for kid, x in zip(children[j], xs):
                drawn[kid] = x
            yield from rec(j + 1, drawn, weight * w)

    yield from rec(0, [-1] * len(skeleton), 1.0)


def emitted_law(skeleton, pair, scheme, rule, length=2, greedy=False, fault=None):
    """Exact law of the first ``length`` tokens emitted by repeated verify steps from ()."""
    memo = {}

    def law(prefix, length):
        if (prefix, length) in memo:
            return memo[(prefix, length)]
        out: dict[tuple[int, ...], float] = {}
        for tokens, weight in drawn_trees(skeleton, pair, prefix, scheme):
            rows = [pair.rows(prefix + node_prefix(skeleton, tokens, i)) for i in range(len(skeleton))]
            target = torch.stack([r[0] for r in rows])
            draft = torch.stack([r[1] for r in rows])
            step = emission_distribution(target, draft, skeleton, tokens, rule, greedy=greedy, fault=fault)
            for emitted, prob in step.items():
                if len(emitted) >= length:
                    continuations = {emitted[:length]: 1.0}
                else:  # the next verify step continues after what this one emitted
                    rest = law(prefix + emitted, length - len(emitted))
                    continuations = {emitted + more: r for more, r in rest.items()}
                for seq, r in continuations.items():
                    out[seq] = out.get(seq, 0.0) + weight * prob * r
        memo[(prefix, length)] = out
        return out

    return law((), length)


def target_law(pair: MarkovPair, length=2, greedy=False):
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, prob in out.items():
            p = pair.p(seq)
            if greedy:
                p = torch.nn.functional.one_hot(p.argmax(), pair.vocab).double()
            for token, r in enumerate(p.tolist()):
                if r > 0:
                    nxt[seq + (token,)] = prob * r
        out = nxt
    return out


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@st.composite
def cases(draw):
    skeleton = draw(st.sampled_from(SKELETONS))
    vocab = draw(st.integers(3, 4 if len(skeleton) <= 5 else 3))  # keeps i.i.d. enumeration small
    pair = MarkovPair(
        vocab,
        seed=draw(st.integers(0, 2**16)),
        peak=draw(st.sampled_from([0.3, 1.0, 3.0])),
        target_zeros=draw(st.booleans()),
        mix=draw(st.sampled_from([0.0, 0.5, 0.9])),
    )
    return skeleton, pair


# (rule, how the children were drawn): the exact pairings. The one-hot rule is exact for children
# chosen by any rule that ignores the target, sampled ones included.
EXACT_PAIRINGS = [
    ("one_hot", "topk"),
    ("iid", "iid"),
    ("without_replacement", "wor"),
    ("one_hot", "iid"),
    ("one_hot", "wor"),
]


@pytest.mark.parametrize("rule,scheme", EXACT_PAIRINGS)
@SETTINGS
@given(case=cases())
def test_exact_pairings_emit_the_target_law(rule, scheme, case):
    skeleton, pair = case
    assert total_variation(emitted_law(skeleton, pair, scheme, rule), target_law(pair)) < EXACT


@pytest.mark.parametrize("scheme", ["topk", "iid"])
@SETTINGS
@given(case=cases())
def test_greedy_emits_the_argmax_chain(scheme, case):
    skeleton, pair = case
    law = emitted_law(skeleton, pair, scheme, "iid", greedy=True)  # greedy overrides the rule
    assert total_variation(law, target_law(pair, greedy=True)) < EXACT


# (rule, children, fault): known wrong variants that the enumeration must see.
WRONG = [
    ("iid", "topk", None),  # the i.i.d. rule on a top-k tree
    ("one_hot", "topk", "iid_on_topk"),  # the same, injected
    ("without_replacement", "wor", "q_not_updated"),  # without replacement, q not renormalised
    ("one_hot", "topk", "residual_not_updated"),
    ("iid", "iid", "residual_not_updated"),
    ("without_replacement", "wor", "residual_not_updated"),
]


def test_every_fault_has_a_case():
    assert {fault for _, _, fault in WRONG} - {None} == set(FAULTS)


@pytest.mark.parametrize("rule,scheme,fault", WRONG)
def test_wrong_pairings_and_faults_are_inexact(rule, scheme, fault):
    honest_rule = {"topk": "one_hot", "iid": "iid", "wor": "without_replacement"}[scheme]
    worst = 0.0
    for seed in range(4):
        pair = MarkovPair(4, seed=seed, peak=1.0, target_zeros=False, mix=0.5)
        truth = target_law(pair)
        # The same cases pass without the fault: the difference is the fault's alone.
        assert total_variation(emitted_law([-1, 0, 0, 1], pair, scheme, honest_rule), truth) < EXACT
        worst = max(worst, total_variation(emitted_law([-1, 0, 0, 1], pair, scheme, rule, fault=fault), truth))
    assert worst > 1e-3


# ---------------------------------------------------------------------------------------------
# The sampled walk
# ---------------------------------------------------------------------------------------------


def fixed_case(vocab=4, seed=3):
    pair = MarkovPair(vocab, seed=seed, peak=1.0, target_zeros=False, mix=0.5)
    skeleton = [-1, 0, 0, 1]
    (tokens, _), *_ = drawn_trees(skeleton, pair, (), "wor")
    rows = [pair.rows(node_prefix(skeleton, tokens, i)) for i in range(len(skeleton))]
    return skeleton, tokens, torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@pytest.mark.parametrize("rule", ["one_hot", "iid", "without_replacement"])
def test_sampled_walk_follows_the_enumerated_law(rule):
    """A consistency check of the sampled walk against the enumeration (which is proved above)."""
    parents, tokens, target, draft = fixed_case()
    law = emission_distribution(target, draft, parents, tokens, rule)
    gen = torch.Generator().manual_seed(0)
    draws = 2000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(draws):
        nodes, emitted = verify_tree_nodes(target, draft, parents, tokens, rule, gen)
        assert emitted[:-1] == [tokens[n] for n in nodes]
        assert all(parents[b] == a for a, b in zip([0] + nodes, nodes))
        counts[tuple(emitted)] = counts.get(tuple(emitted), 0) + 1
    assert set(counts) <= set(law)
    for seq, prob in law.items():  # 5 sigma per outcome
        assert abs(counts.get(seq, 0) / draws - prob) < 5 * (prob * (1 - prob) / draws) ** 0.5 + 1e-9
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first, again = (verify_tree(target, draft, parents, tokens, rule, g) for g in (gen_a, gen_b))
    assert first == again  # the generator alone decides


def _drawn_law_by_enumeration(p, q, count, fault):
    """drawn_children_law's (accepted, residual) from emission_distribution on every ordered draw
    of ``count`` children without replacement, weighted by its probability."""
    vocab = len(p)
    accepted, residual = np.zeros((count, vocab)), np.zeros(vocab)
    for draw in itertools.permutations(range(vocab), count):
        weight, left = 1.0, 1.0
        for x in draw:
            weight, left = weight * q[x] / left, left - q[x]
        if weight == 0:
            continue
        rows = torch.tensor(np.stack([p] * (count + 1)))
        drafts = torch.tensor(np.stack([q] * (count + 1)))
        law = emission_distribution(rows, drafts, [-1] + [0] * count, [-1, *draw], "without_replacement", fault=fault)
        for seq, prob in law.items():
            if len(seq) == 2:  # a child accepted, then its (leaf) draw
                accepted[draw.index(seq[0]), seq[0]] += weight * prob
            else:
                residual[seq[0]] += weight * prob
    return accepted, residual


@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("fault", [None, "q_not_updated"])
def test_drawn_children_law_marginalises_the_walk_over_the_draws(count, fault):
    """The vectorised law of a node with drawn children (the statistical tier's fault power) equals
    the enumerated walk averaged over every draw; honest, it is the target; with the fault, not."""
    rng = np.random.default_rng(count)
    worst = 0.0
    for trial in range(12):
        p, q = rng.dirichlet(np.full(5, 0.5)), rng.dirichlet(np.full(5, 0.5))
        if trial % 3 == 0:
            q[trial % 5] = 0.0  # a token the draft never draws
            q /= q.sum()
        accepted, residual = drawn_children_law(p, q, count, fault)
        expected_accepted, expected_residual = _drawn_law_by_enumeration(p, q, count, fault)
        np.testing.assert_allclose(accepted, expected_accepted, atol=1e-12)
        np.testing.assert_allclose(residual, expected_residual, atol=1e-12)
        law = accepted.sum(0) + residual
        assert abs(law.sum() - 1) < 1e-12
        worst = max(worst, 0.5 * np.abs(law - p).sum())
        if fault is None:
            np.testing.assert_allclose(law, p, atol=1e-12)
    if fault is not None and count > 1:
        assert worst > 1e-3  # the fault shows (one child alone has no sibling to mis-handle)
    # Tokens outside both supports stay zero at a larger vocabulary.
    p, q = np.zeros(40), np.zeros(40)
    p[[1, 3, 5]], q[[3, 5, 7]] = [0.2, 0.5, 0.3], [0.6, 0.3, 0.1]
    accepted, residual = drawn_children_law(p, q, count, fault)
    assert set(np.flatnonzero(accepted.sum(0) + residual)) <= {1, 3, 5}


def test_drawn_children_law_refuses_other_faults():
    with pytest.raises(ValueError, match="without-replacement"):
        drawn_children_law(np.ones(3) / 3, np.ones(3) / 3, 2, "iid_on_topk")


def test_greedy_walk_takes_the_argmax_child_even_when_not_first():
    target = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    # root children: token 1 (node 1), token 2 (node 2 = the argmax)
    nodes, emitted = verify_tree_nodes(target, None, [-1, 0, 0], [-1, 1, 2], "one_hot", greedy=True)
    assert nodes == [2] and emitted == [2, 2]


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _uniform(n, v):
    return torch.full((n, v), 1.0 / v, dtype=torch.float64)


@pytest.mark.parametrize("parents,message", [
    ([-1, 2, 0], "parents first"),
    ([-1, 0, 2], "parents first"),
    ([0, 0, 1], "parents\\[0\\] must be -1"),
])
def test_parents_must_come_first(parents, message):
    with pytest.raises(ValueError, match=message):
        verify_tree(_uniform(3, 4), _uniform(3, 4), parents, [-1, 1, 2], "iid")
    with pytest.raises(ValueError, match=message):
        tree_attention_mask(parents)


def test_shape_mismatches_are_refused():
    with pytest.raises(ValueError, match="3 rows but parents has 2"):
        verify_tree(_uniform(3, 4), _uniform(3, 4), [-1, 0], [-1, 1], "iid")
    with pytest.raises(ValueError, match="tokens 2"):
        verify_tree(_uniform(3, 4), _uniform(3, 4), [-1, 0, 0], [-1, 1], "iid")
    with pytest.raises(ValueError, match="draft_probs has shape"):
        verify_tree(_uniform(3, 4), _uniform(3, 5), [-1, 0, 0], [-1, 1, 2], "iid")
    with pytest.raises(ValueError, match=r"\[num_nodes, V\]"):
        verify_tree(torch.full((4,), 0.25), None, [-1], [-1], "one_hot")
    with pytest.raises(ValueError, match="outside"):
        verify_tree(_uniform(2, 4), None, [-1, 0], [-1, 4], "one_hot")
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(_uniform(2, 4), None, [-1, 0], [-1, 1], "without_replacement")


def test_rows_must_be_distributions():
    off = _uniform(3, 4)
    off[1, 0] += 2e-3
    with pytest.raises(ValueError, match=r"target_probs\[1\] sums to"):
        verify_tree(off, None, [-1, 0, 0], [-1, 1, 2], "one_hot")
    with pytest.raises(ValueError, match=r"draft_probs\[1\] sums to"):
        verify_tree(_uniform(3, 4), off, [-1, 0, 1], [-1, 1, 2], "iid")
    # A leaf's draft row is never read, so it is not checked; within tolerance passes.
    verify_tree(_uniform(3, 4), off, [-1, 0, 0], [-1, 1, 2], "iid")
    near = _uniform(3, 4)
    near[0, 0] += 5e-4  # float32 rows over a large vocabulary sum to 1 only approximately
    verify_tree(near, None, [-1, 0, 0], [-1, 1, 2], "one_hot")
    negative = _uniform(3, 4)
    negative[1, :2] = torch.tensor([-0.25, 0.75], dtype=torch.float64)
    with pytest.raises(ValueError, match="non-negative"):
        verify_tree(negative, None, [-1, 0, 0], [-1, 1, 2], "one_hot")
    zero_q = _uniform(2, 4)
    zero_q[0] = torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_tree(_uniform(2, 4), zero_q, [-1, 0], [-1, 0], "iid")


def test_unknown_rule_and_fault():
    with pytest.raises(ValueError, match="not a valid AcceptanceRule"):
        verify_tree(_uniform(2, 4), None, [-1, 0], [-1, 1], "typical")
    with pytest.raises(ValueError, match="unknown fault"):
        verify_tree(_uniform(2, 4), None, [-1, 0], [-1, 1], AcceptanceRule.ONE_HOT, fault="accept_all")


def test_mask_and_positions():
    parents = [-1, 0, 0, 1, 2, 3]
    mask = tree_attention_mask(parents)
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert mask[4].nonzero().flatten().tolist() == [0, 2, 4]
    assert tree_positions(parents, 10).tolist() == [10, 11, 11, 12, 12, 13]
    assert tree_positions(parents, 10).dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# The transformers reference: logits and KV cache
# ---------------------------------------------------------------------------------------------

VOCAB = 64
PROMPT = [5, 17, 3, 42, 8, 29, 11]
# 11 nodes, parents first but not BFS (node 9 is a late child of the root): branching and depth 4.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 0, 8]
TOKENS = [-1, 12, 40, 7, 12, 33, 1, 60, 25, 3, 9]
LOGIT_ATOL = 1e-5


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
        attn_implementation=request.param,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def plain_logits(model, sequence) -> torch.Tensor:
    """Logits after the last token of ``sequence``, from a cache-free causal forward."""
    return model(input_ids=torch.tensor([list(sequence)])).logits[0, -1].float()


def path_tokens(parents, tokens, node):
    return list(node_prefix(parents, tokens, node))


def assert_node_logits_match(model, logits, context, parents, tokens):
    assert logits.shape == (len(parents), VOCAB)
    for node in range(len(parents)):
        expected = plain_logits(model, list(context) + path_tokens(parents, tokens, node))
        torch.testing.assert_close(logits[node], expected, atol=LOGIT_ATOL, rtol=0, msg=f"node {node}")


@torch.no_grad()
def assert_cache_matches_fresh_forward(model, verifier):
    fresh = model(input_ids=torch.tensor([verifier.cached_tokens]), use_cache=True).past_key_values
    assert verifier.cache.get_seq_length() == len(verifier.cached_tokens)
    for ours, theirs in zip(verifier.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=LOGIT_ATOL, rtol=0)


def test_tree_logits_equal_per_path_forwards(model):
    verifier = ReferenceTreeVerifier(model)
    logits = verifier.tree_logits(PROMPT, PARENTS, TOKENS)
    assert_node_logits_match(model, logits, PROMPT, PARENTS, TOKENS)


def test_compaction_of_a_non_first_child_path(model):
    verifier = ReferenceTreeVerifier(model)
    verifier.tree_logits(PROMPT, PARENTS, TOKENS)
    accepted = [2, 5, 8]  # node 2 is the root's second child
    verifier.compact(accepted)
    assert verifier.cached_tokens == PROMPT + [40, 33, 25]
    assert_cache_matches_fresh_forward(model, verifier)
    # The next step: accepted path + one more token as the new root, and a new tree.
    context = verifier.cached_tokens + [50]
    parents, tokens = [-1, 0, 0, 2, 1], [-1, 4, 19, 19, 63]
    logits = verifier.tree_logits(context, parents, tokens)
    assert_node_logits_match(model, logits, context, parents, tokens)
    verifier.compact([])  # nothing accepted: only the context stays
    assert_cache_matches_fresh_forward(model, verifier)
    with pytest.raises(ValueError, match="extend the cached tokens"):
        verifier.tree_logits(context[:-1] + [0], parents, tokens)
    verifier.tree_logits(context + [1], parents, tokens)
    with pytest.raises(ValueError, match="not a path from the root"):
        verifier.compact([2, 3, 1])


def noisy_draft(model, noise: float):
    """A draft: the target's logits plus fixed noise per context (so it is wrong now and then)."""

    @torch.no_grad()
    def distributions(contexts: list[list[int]]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor(contexts)).logits[:, -1].float()
        for row, context in enumerate(contexts):
            gen = torch.Generator().manual_seed(hash(tuple(context)) % 2**62)
            logits[row] += noise * torch.randn(VOCAB, generator=gen)
        return processed_probs(logits, SamplingParams())

    def tree_for(context: list[int]) -> TokenTree:
        root_q = distributions([context])[0]
        return build_tree(root_q, lambda paths: distributions([context + p for p in paths]), 8, 3, 2)

    return tree_for


def test_chained_greedy_steps_reproduce_greedy_decoding(model):
    tree_for = noisy_draft(model, noise=0.6)
    verifier = ReferenceTreeVerifier(model, SamplingParams(temperature=0.0))
    context, non_first, accepted_total = list(PROMPT), 0, 0
    while len(context) < len(PROMPT) + 16:
        tree = tree_for(context)
        accepted, emitted = verifier.step(context, tree)
        non_first += any(a != tree.children(tree.parents[a])[0] for a in accepted)
        accepted_total += len(accepted)
        context += emitted
        assert_cache_matches_fresh_forward(model, verifier)
    expected = list(PROMPT)
    while len(expected) < len(context):
        expected.append(int(plain_logits(model, expected).argmax()))
    assert context == expected
    assert accepted_total > 0 and non_first > 0  # the test reached compaction of a non-first child


@pytest.mark.parametrize("rule", ["one_hot", "iid"])
def test_chained_sampled_steps_keep_the_cache_exact(model, rule):
    tree_for = noisy_draft(model, noise=0.3)
    # On this top-k tree only one_hot is exact; "iid" runs step()'s draft-row path, and only the
    # cache is checked here.
    verifier = ReferenceTreeVerifier(model, SamplingParams(temperature=0.7), rule=rule)
    gen = torch.Generator().manual_seed(1)
    context = list(PROMPT)
    for _ in range(4):
        tree = tree_for(context)
        assert draft_probs_from_tree(tree).shape == (tree.num_nodes, VOCAB)
        accepted, emitted = verifier.step(context, tree, gen)
        assert emitted[:-1] == [tree.tokens[a] for a in accepted]
        context += emitted
        assert verifier.cached_tokens == context[:-1]
        assert_cache_matches_fresh_forward(model, verifier)
