"""Tree drafting, EAGLE-2 style, submitted to the target as one chain or as the whole tree.

:func:`build_tree` grows a token tree from the draft's (processed) distributions: per depth it
expands the frontier nodes with the highest cumulative path probability and gives each its most
likely children, within a node budget. vLLM 0.32 verifies only chains, so by default
(``verify="chain"``) :class:`TreeProposer` submits one root-to-node path: the one with the
highest expected accepted length had the target behaved like the draft. With ``verify="tree"``
it submits every node, parents first, for requests marked ``tree_ok``; other requests still get
the best path. A submitted tree at T > 0 has its children *drawn* without replacement from the
draft (:func:`build_sampled_tree`), verified by recursive rejection sampling, so a rejected
child's siblings still add acceptance; at T = 0 (or with ``children="topk"``) the children are
the draft's top-k, verified with the one-hot rule. The tree's ``rule`` says which
(``vllm_specplugin/tree_verification.py`` walks it with that rule). :class:`TokenTree` keeps
what a tree verifier needs (every node's draft distribution q and the tree attention mask).

With ``shape="dynamic"`` the shape is chosen per request (:func:`build_dynamic_tree`): grown best
first by each node's probability of acceptance under a calibrated draft-as-proxy model
(:func:`tree_acceptance`, :func:`tree_expected_accepted_length`), so a confident draft gets the
chain and an uncertain one a wide, shallow tree, with the same ``TokenTree`` and rules.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.metrics import accepted_count
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, processed_probs_rows, sample, sample_rows
from vllm_specplugin.proposers.tree_verify import tree_children, tree_depths

ROOT = 0
TREE_CHILDREN = ("sampled", "topk")
POPULATION_WINDOW = 2000  # first-child trials the population's acceptance by depth keeps (then halved)


@dataclass
class TokenTree:
    """Draft tokens as a tree; node 0 is the root ("after the context", token -1, parent -1).

    Nodes are stored parents first (breadth-first), so ``parents[i] < i`` for every i > 0.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    # [num_nodes, V]: for node i > 0 the draft distribution q at its parent, from which its token
    # was chosen (row 0: zeros). A lossless tree verifier needs exactly these.
    node_probs: torch.Tensor
    # The acceptance rule that is exact for how the children were chosen
    # (proposers/tree_verify.py's AcceptanceRule values): "one_hot" for top-k children (build_tree),
    # "without_replacement" for children drawn without replacement (build_sampled_tree).
    rule: str = "one_hot"

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def ancestry(self, node: int) -> list[int]:
        """Nodes root -> ``node``, both included."""
        chain = [node]
        while self.parents[chain[-1]] >= 0:
            chain.append(self.parents[chain[-1]])
        return chain[::-1]

    def path(self, node: int) -> list[int]:
        """The draft tokens root -> ``node`` (the root itself has none)."""
        return [self.tokens[i] for i in self.ancestry(node)[1:]]

    def token_prob(self, node: int) -> float:
        """q(token) for the node's own token, under its parent's distribution."""
        return float(self.node_probs[node, self.tokens[node]]) if node != ROOT else 1.0

    def path_probability(self, node: int) -> float:
        """Product of q(x_j) along the path: the chance the draft itself would have produced it."""
        probability = 1.0
        for i in self.ancestry(node)[1:]:
            probability *= self.token_prob(i)
        return probability

    def expected_accepted_length(self, node: int) -> float:
        """Σ over the path's nodes of the path probability up to that node: the expected number
        of accepted tokens if the target behaved like the draft (token j is accepted iff all
        tokens up to j are)."""
        total, probability = 0.0, 1.0
        for i in self.ancestry(node)[1:]:
            probability *= self.token_prob(i)
            total += probability
        return total

    def best_node(self, max_depth: int | None = None) -> int:
        """The node whose path has the highest expected accepted length (ties: the earlier node,
        which favours shallower and greedy-first nodes); the root when nothing else qualifies."""
        best, best_value = ROOT, 0.0
        for node in range(1, self.num_nodes):
            if max_depth is not None and self.depths[node] > max_depth:
                continue
            value = self.expected_accepted_length(node)
            if value > best_value:
                best, best_value = node, value
        return best

    def greedy_chain_node(self) -> int:
        """Follow the child with the largest q (the argmax token) at each depth while there is one;
        the end of the greedy chain, for comparisons."""
        node = ROOT
        while True:
            kids = self.children(node)
            if not kids:
                return node
            # max() keeps the first of equals: build_tree adds the argmax child first.
            node = max(kids, key=self.token_prob)

    def attention_mask(self) -> torch.Tensor:
        """Tree attention [N, N] bool: node i attends to itself and its ancestors."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for node in range(self.num_nodes):
            mask[node, self.ancestry(node)] = True
        return mask


def drive(steps: Generator[list[list[int]], torch.Tensor, TokenTree],
          expand: Callable[[list[list[int]]], torch.Tensor]) -> TokenTree:
    """Run a tree builder's steps (:func:`tree_steps`, :func:`sampled_tree_steps`,
    :func:`dynamic_tree_steps`) to its tree, answering each yielded list of paths with
    ``expand(paths)``."""
    try:
        paths = next(steps)
        while True:
            paths = steps.send(expand(paths))
    except StopIteration as done:
        return done.value


def build_tree(
    root_q: torch.Tensor,
    expand: Callable[[list[list[int]]], torch.Tensor],
    node_budget: int,
    depth_limit: int,
    branching: int,
) -> TokenTree:
    """Grow a token tree EAGLE-2 style.

    ``root_q`` [V] is the processed draft distribution after the context; ``expand(paths)``
    returns [len(paths), V], the processed distributions after each path (one call per depth,
    batched over the expanded frontier). Per depth, the ``branching`` frontier nodes with the
    highest cumulative path probability each get their ``branching`` most likely children (only
    tokens with q > 0); growth stops at ``depth_limit`` or when ``node_budget`` draft nodes (the
    root not counted) exist, the budget keeping the children of highest cumulative probability.

    The greedy chain (argmax at every depth) is always in the tree, to depth
    min(``depth_limit``, ``node_budget``): the argmax-path node is always expanded, its argmax
    child is always kept, and each layer leaves one node of the budget per deeper level for it.
    So the best path is never worse, by expected accepted length, than greedy drafting.
    """
    return drive(tree_steps(root_q, node_budget, depth_limit, branching), expand)


def tree_steps(
    root_q: torch.Tensor,
    node_budget: int,
    depth_limit: int,
    branching: int,
) -> Generator[list[list[int]], torch.Tensor, TokenTree]:
    """:func:`build_tree` as a generator, for growing many trees in one batch: it yields the
    paths to expand ([len(paths)] token lists) and is sent their processed distributions
    [len(paths), V]; it returns the tree (:func:`drive` runs it with an ``expand``)."""
    if node_budget < 0 or depth_limit < 0 or branching < 1:
        raise ValueError(
            f"need node_budget >= 0, depth_limit >= 0, branching >= 1; got {node_budget}, {depth_limit}, {branching}"
        )
    vocab = root_q.shape[-1]
    tokens, parents, depths = [-1], [-1], [0]
    rows = [torch.zeros(vocab, dtype=torch.float32, device=root_q.device)]
    cumulative = [1.0]  # path probability per node, kept here to rank without recomputing
    greedy = ROOT  # the node at the end of the greedy chain so far
    frontier, frontier_q = [ROOT], root_q[None].float()
    for depth in range(1, depth_limit + 1):
        room = node_budget - (len(tokens) - 1)
        if room <= 0:
            break
        # Candidate children: (cumulative probability, parent, token, parent's row in frontier_q).
        candidates: list[tuple[float, int, int, int]] = []
        greedy_candidate = None
        for row, parent in enumerate(frontier):
            q = frontier_q[row]
            # The argmax first (top-k may break a tie elsewhere), then the next most likely.
            argmax = int(q.argmax())
            top = [argmax] + [t for t in q.topk(min(branching, vocab)).indices.tolist() if t != argmax]
            for token in top[:branching]:
                value = float(q[token])
                if value <= 0:  # outside top-k / top-p: the draft would never choose it
                    continue
                candidate = (cumulative[parent] * value, parent, token, row)
                if parent == greedy and token == argmax:
                    greedy_candidate = candidate
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep frontier and top-k order
        if greedy_candidate is None:
            layer = candidates[:room]
        else:
            # The greedy child goes first (lowest index in its layer) and the other children
            # leave one node per deeper level, so the greedy chain always reaches the depth limit
            # when the budget allows (otherwise wide early layers would spend it all).
            reserve = depth_limit - depth
            layer = [greedy_candidate] + candidates[: max(0, room - 1 - reserve)]
        if not layer:
            break
        first_new = len(tokens)
        for probability, parent, token, row in layer:
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            rows.append(frontier_q[row].float())
            cumulative.append(probability)
        if greedy_candidate is not None:
            greedy = first_new  # the greedy child was added first
        if depth == depth_limit or len(tokens) - 1 >= node_budget:
            break
        # Next frontier: the greedy node plus the most probable others, up to `branching`.
        new_nodes = list(range(first_new, len(tokens)))
        others = sorted((n for n in new_nodes if n != greedy), key=lambda n: -cumulative[n])
        frontier = ([greedy] if greedy in new_nodes else []) + others
        frontier = frontier[:branching]
        frontier_q = (yield [_path(tokens, parents, n) for n in frontier]).float()
    return TokenTree(tokens, parents, depths, torch.stack(rows))


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    path = []
    while node > ROOT:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def sample_without_replacement(q: torch.Tensor, count: int, generator: torch.Generator | None = None) -> list[int]:
    """Up to ``count`` distinct tokens drawn one after another from ``q`` [V] without replacement
    (each draw from q restricted to the tokens not drawn yet, renormalised; exact float64 inverse
    CDF, :func:`~vllm_specplugin.proposers.sampling.sample`); fewer when q's support runs out."""
    remaining = q.detach().double().clone()
    drawn: list[int] = []
    for _ in range(count):
        if not float(remaining.sum()) > 0:
            break
        token = int(sample(remaining[None], generator)[0])
        drawn.append(token)
        remaining[token] = 0
    return drawn


def enumerate_draws(run: Callable):
    """Every outcome of ``run(draw)`` over all sequences of draws, with its probability: yields
    (probability, result). ``draw(q, count)`` draws up to ``count`` tokens from ``q`` without
    replacement, as :func:`sample_without_replacement` does, but each sequence of choices is
    replayed once (depth-first over the choices). Exact enumeration for tiny vocabularies: the
    reference the tests and ``throughput/tree_prediction.py`` check sampled trees against."""
    pending: list[list[int]] = [[]]
    while pending:
        script = pending.pop()
        state = {"prob": 1.0, "taken": []}

        def draw(q, count, script=script, state=state):
            remaining, out = q.double().clone(), []
            for _ in range(count):
                total = float(remaining.sum())
                if total <= 0:
                    break
                position = len(state["taken"])
                if position < len(script):
                    token = script[position]
                else:
                    support = (remaining > 0).nonzero().flatten().tolist()
                    token = support[0]
                    pending.extend(state["taken"] + [alt] for alt in support[1:])
                state["prob"] *= float(remaining[token]) / total
                state["taken"].append(token)
                remaining[token] = 0
                out.append(token)
            return out

        result = run(draw)
        yield state["prob"], result


def build_sampled_tree(
    root_q: torch.Tensor,
    expand: Callable[[list[list[int]]], torch.Tensor],
    node_budget: int,
    depth_limit: int,
    branching: int,
    generator: torch.Generator | None = None,
    draw: Callable[[torch.Tensor, int], list[int]] | None = None,
) -> TokenTree:
    """A token tree whose children are drawn without replacement from the draft (T > 0), for
    verification by recursive rejection sampling (``AcceptanceRule.WITHOUT_REPLACEMENT``).

    Same growth as :func:`build_tree` (per depth, up to ``branching`` children for each of up to
    ``branching`` frontier nodes, one node per deeper level reserved for the main chain, within
    ``node_budget``), except that a node's children are *drawn* from its q, one after another
    without replacement, in that order (their node order), and that how many children a node gets
    is fixed before any child of that depth is drawn (the main node first, then the frontier in
    order). So no drawn child is ever dropped for its own token, which recursive rejection
    sampling needs; which drawn nodes are expanded next may depend on their tokens (the main
    node's first child, then the highest path probabilities), which it does not mind: at a node,
    the walk sees children drawn from its q with a count fixed by what was drawn before them.
    ``draw(q, count)`` replaces the draws (tests enumerate them); default
    :func:`sample_without_replacement` with ``generator``. The tree's ``rule`` is
    ``"without_replacement"``.
    """
    return drive(sampled_tree_steps(root_q, node_budget, depth_limit, branching, generator, draw), expand)


def sampled_tree_steps(
    root_q: torch.Tensor,
    node_budget: int,
    depth_limit: int,
    branching: int,
    generator: torch.Generator | None = None,
    draw: Callable[[torch.Tensor, int], list[int]] | None = None,
) -> Generator[list[list[int]], torch.Tensor, TokenTree]:
    """:func:`build_sampled_tree` as a generator, for growing many trees in one batch: it yields the
    paths to expand ([len(paths)] token lists) and is sent their processed distributions
    [len(paths), V]; it returns the tree (:func:`drive` runs it with an ``expand``)."""
    if node_budget < 0 or depth_limit < 0 or branching < 1:
        raise ValueError(
            f"need node_budget >= 0, depth_limit >= 0, branching >= 1; got {node_budget}, {depth_limit}, {branching}"
        )
    if draw is None:
        def draw(q, count):
            return sample_without_replacement(q, count, generator)
    vocab = root_q.shape[-1]
    tokens, parents, depths = [-1], [-1], [0]
    rows = [torch.zeros(vocab, dtype=torch.float32, device=root_q.device)]
    cumulative = [1.0]
    main = ROOT  # the main chain's end: it is always expanded, and its first child continues it
    frontier, frontier_q = [ROOT], root_q[None].float()
    for depth in range(1, depth_limit + 1):
        room = node_budget - (len(tokens) - 1)
        if room <= 0:
            break
        # Counts first, from what is known before this depth's draws.
        left = max(1, room - (depth_limit - depth))
        counts = []
        for _ in frontier:
            counts.append(min(branching, left))
            left -= counts[-1]
        first_new, next_main = len(tokens), None
        for row, (node, count) in enumerate(zip(frontier, counts)):
            q = frontier_q[row]
            for rank, token in enumerate(draw(q, count) if count else []):
                tokens.append(int(token))
                parents.append(node)
                depths.append(depth)
                rows.append(q.float())
                cumulative.append(cumulative[node] * float(q[token]))
                if node == main and rank == 0:
                    next_main = len(tokens) - 1
        if len(tokens) == first_new:
            break
        main = next_main
        if depth == depth_limit or len(tokens) - 1 >= node_budget:
            break
        new_nodes = range(first_new, len(tokens))
        others = sorted((n for n in new_nodes if n != main), key=lambda n: -cumulative[n])
        frontier = ([main] if main is not None else []) + others
        frontier = frontier[:branching]
        frontier_q = (yield [_path(tokens, parents, n) for n in frontier]).float()
    return TokenTree(tokens, parents, depths, torch.stack(rows), rule="without_replacement")


# ---------------------------------------------------------------------------------------------
# Tree shape chosen per request: best-first growth on a calibrated acceptance model
# ---------------------------------------------------------------------------------------------

TREE_SHAPES = ("fixed", "dynamic")
# Known wrong variants of build_dynamic_tree, for tests that must see them caught:
#   predraw: (children="sampled") each node's next child is drawn when it becomes a candidate,
#     ranked by its drawn token's value, and the candidates never chosen are dropped at the end,
#     so whether a drawn child stays in the tree depends on its own token (the natural best-first
#     bug: recursive rejection sampling then sees children that are not draws from q).
SHAPE_FAULTS = ("predraw",)


def acceptance_parameters(alpha: float | None, predicted: float) -> tuple[float, float]:
    """The calibration (``agree``, ``miss``) of the acceptance model at one depth.

    ``predicted`` is the uncalibrated (draft-as-proxy) chance that a node's first child is
    accepted, ``alpha`` the measured one (None: no measurement: (0, 0); :func:`tree_acceptance`
    then takes the target to be the draft).
    Measured above the proxy: the target agrees with the draft more often than the draft's own
    probabilities say, ``agree`` = (alpha - predicted) / (1 - predicted); below it: part of the
    time the target picks a token the draft does not offer, ``miss`` = 1 - alpha / predicted. In
    both cases the first child's expected acceptance becomes ``alpha`` exactly (see
    :func:`tree_acceptance` for the model)."""
    if alpha is None:
        return 0.0, 0.0
    alpha, predicted = float(alpha), float(predicted)
    if not 0.0 <= alpha <= 1.0 or not 0.0 <= predicted <= 1.0 + 1e-9:
        raise ValueError(f"need 0 <= alpha <= 1 and 0 <= predicted <= 1, got {alpha} and {predicted}")
    if alpha >= predicted:
        return ((alpha - predicted) / (1.0 - predicted) if predicted < 1.0 else 0.0), 0.0
    return 0.0, 1.0 - alpha / predicted


def _at_depth(values: Sequence[float | None] | None, depth: int) -> float | None:
    """values[depth - 1]; past the end, the last value; None when there are none."""
    if values is None or len(values) == 0:
        return None
    return values[min(depth, len(values)) - 1]


def _check_depth_values(name: str, values: Sequence[float | None] | None) -> None:
    if values is None:
        return
    for value in values:
        if value is not None and not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} values must lie in [0, 1], got {list(values)}")


def _node_parameters(predicted: float, depth: int, alpha, confidence, rule: str) -> tuple[float, float]:
    """(agree, miss) for a node whose children are at ``depth``: fitted on the depth's mean
    ``confidence`` when given, else on the node's own ``predicted`` (then the node's first child is
    expected accepted with exactly alpha[depth]). Without a measurement the target is the draft:
    (1, 0) for recursive rejection sampling (which then accepts any first child), (0, 0) for the
    one-hot rule (which then accepts x with q(x))."""
    measured = _at_depth(alpha, depth)
    if measured is None:
        return (1.0, 0.0) if rule == "without_replacement" else (0.0, 0.0)
    mean = _at_depth(confidence, depth)
    return acceptance_parameters(measured, predicted if mean is None else mean)


def _prob64(row: torch.Tensor) -> torch.Tensor:
    row = row.detach().double()
    total = float(row.sum())
    return row / total if total > 0 else row


def predicted_first_acceptances(rows: torch.Tensor, rule: str, first_tokens: Sequence[int]) -> list[float]:
    """:func:`predicted_first_acceptance` of each row of ``rows`` [n, V] (each normalised in
    float64) with its first child's token, in one pass."""
    q = rows.detach().double()
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-300)  # a zero row predicts 0, as predicted_first_acceptance
    if rule == "one_hot":
        index = torch.tensor(list(first_tokens), dtype=torch.long, device=q.device)[:, None]
        return q.gather(1, index)[:, 0].tolist()
    if rule == "without_replacement":
        return (q * q).sum(-1).tolist()
    raise ValueError(f"no acceptance model for the {rule!r} rule")


def predicted_first_acceptance(q: torch.Tensor, rule: str, first_token: int | None = None) -> float:
    """The draft-as-proxy chance that a node's first child is accepted: q(first child's token) for
    the one-hot rule (top-k: the argmax, so max q), and for children drawn from q (the
    without-replacement rule) its expectation over the draw, Σ q²."""
    q = _prob64(q)
    if rule == "one_hot":
        return float(q.max()) if first_token is None else float(q[first_token])
    if rule == "without_replacement":
        return float((q * q).sum())
    raise ValueError(f"no acceptance model for the {rule!r} rule")


def tree_acceptance(tree: TokenTree, alpha: Sequence[float] | None = None,
                    confidence: Sequence[float | None] | None = None) -> list[float]:
    """P(node accepted) for every node under the calibrated draft-as-proxy model (root: 1).

    The model, per node j whose children are c_1, c_2, ... (in verification order) with tokens
    x_i, all at depth d: the target's distribution at j is random, independently per node:
    with probability ``agree`` it agrees with the draft (RRS, children drawn from q: the target
    is q, so the first child is accepted whatever its token; one-hot rule: the target's token is
    the first child's), with probability (1 - agree) · ``miss`` it is a token the draft never
    offers, and otherwise it is a single token y drawn from q (the draft's probabilities are
    the chance of each token: EAGLE-2's confidence proxy). Under the tree's own rule
    (``tree.rule``: "one_hot" or "without_replacement") child i is then accepted, given j was,
    with probability

        r_1 = agree + (1 - agree)(1 - miss) q(x_1),    r_i = (1 - agree)(1 - miss) q(x_i) (i > 1)

    (the walk accepts c_i iff y = x_i, or i = 1 when the target agrees), and a node is accepted
    with the product of r along its path. With no ``alpha`` the draft is the proxy: the target
    is q itself, so the one-hot rule accepts x with q(x) (agree = miss = 0: EAGLE-2's value) and
    recursive rejection sampling accepts every first child (agree = 1: only the chain has value;
    measured at N = 16, T = 1 on synthetic pairs, the uncalibrated q(x) proxy under-rates the
    rejection sampler's acceptance so much that its trees lost to the chain by 30-45%, so drawn
    children get a tree only from a measurement). ``alpha[d - 1]``: the measured acceptance of a
    first child at depth d (a chain's
    acceptance at position d; past the end of the vector the last value); (agree, miss) come
    from :func:`acceptance_parameters` with ``predicted`` = ``confidence[d - 1]`` (the mean
    draft-as-proxy prediction over the steps alpha was measured on) or, where it is None, the
    node's own :func:`predicted_first_acceptance`.
    """
    _check_depth_values("alpha", alpha)
    _check_depth_values("confidence", confidence)
    kids = tree_children(tree.parents)
    reach = [0.0] * tree.num_nodes
    reach[ROOT] = 1.0
    for node in range(tree.num_nodes):  # parents first: reach[node] is final here
        if not kids[node]:
            continue
        q = _prob64(tree.node_probs[kids[node][0]])
        first = tree.tokens[kids[node][0]]
        predicted = predicted_first_acceptance(q, tree.rule, first)
        agree, miss = _node_parameters(predicted, tree.depths[node] + 1, alpha, confidence, tree.rule)
        for rank, child in enumerate(kids[node]):
            r = (agree if rank == 0 else 0.0) + (1.0 - agree) * (1.0 - miss) * float(q[tree.tokens[child]])
            reach[child] = reach[node] * r
    return reach


def tree_expected_accepted_length(tree: TokenTree, alpha: Sequence[float] | None = None,
                                  confidence: Sequence[float | None] | None = None) -> float:
    """Expected accepted tokens of one verify step of ``tree`` (not counting the target's own
    token), under the model of :func:`tree_acceptance`: Σ over draft nodes of P(accepted)."""
    return float(sum(tree_acceptance(tree, alpha, confidence)[1:]))


def chain_expected_accepted_length(alpha: Sequence[float], length: int) -> float:
    """Expected accepted tokens of a chain of ``length`` drafts whose position d is accepted with
    alpha[d - 1] (past the end: the last value) given the ones before: Σ_k Π_{d <= k} alpha[d-1].
    The chain candidate for a controller comparing it with a tree's
    :func:`tree_expected_accepted_length`."""
    _check_depth_values("alpha", alpha)
    total, reach = 0.0, 1.0
    for depth in range(1, length + 1):
        reach *= float(_at_depth(alpha, depth))
        total += reach
    return total


@dataclass
class _Node:
    """An expanded node's candidate children (build_dynamic_tree)."""

    q32: torch.Tensor  # the row stored for its children (the draft's q as expanded)
    q64: torch.Tensor  # normalised float64 q
    agree: float
    miss: float
    count: int = 0  # children added so far
    order: list[int] | None = None  # top-k: tokens by decreasing q (q > 0)
    remaining: torch.Tensor | None = None  # sampled: q64 without the tokens drawn so far
    exhausted: bool = False
    predrawn: tuple[int, float] | None = None  # fault "predraw": (token, acceptance)


def build_dynamic_tree(
    root_q: torch.Tensor,
    expand: Callable[[list[list[int]]], torch.Tensor],
    node_budget: int,
    depth_limit: int,
    **options,
) -> TokenTree:
    """A token tree whose shape is chosen from the draft's distributions (and the measured
    acceptance by depth): grown best first, one node at a time, by the probability that the node
    is accepted under the model of :func:`tree_acceptance`, with no fixed depth or width, until
    ``node_budget`` draft nodes exist (or no candidate can be accepted).

    A candidate is the next child of a node already in the tree; its value is the node's
    P(accepted) times the model's chance r that the child is accepted given its parent was:
    EAGLE-2's value (the path product of q) when the draft is the proxy, calibrated by
    ``alpha`` / ``confidence`` (:func:`acceptance_parameters`). A confident draft therefore gets
    a chain (top-k, q(top) >= 0.9 at every step: exactly the chain for N <= 21, since its N-th
    node is worth >= 0.9^N > 0.1 >= any sibling), a flat one a wide, shallow tree. Drawn children
    without ``alpha`` get the chain (see :func:`tree_acceptance`); with it, the calibrated tree.
    ``max_children``: at most that many children per node (1: the chain).

    ``children="topk"``: the children of a node are its most likely tokens in order (argmax
    first), for the one-hot rule (T = 0, or top-k trees at T > 0): any choice that does not look
    at the target is exact. The values are then fixed numbers, each at most its parent's and its
    previous sibling's, so the greedy picks are the ``node_budget`` highest-valued nodes of the
    infinite top-k tree: its expected accepted length (model) is the largest of every tree of
    that many nodes, the greedy chain (``max_children=1``) and :func:`build_tree`'s trees among
    them.

    ``children="sampled"``: children drawn from q without replacement (``draw(q, count)`` or
    :func:`sample_without_replacement` with ``generator``), for recursive rejection sampling.
    The candidate value of a node's next child is its expectation *before the draw*
    (r over x ~ q without the node's earlier children), the decision to add it is made on that,
    and once drawn a child is never dropped nor moved: each node's children are one draw
    sequence from its q, cut by a stopping rule that depends only on what was drawn before (here
    and elsewhere in the tree) and never on the target. Recursive rejection sampling is exact
    under any such rule (:func:`~vllm_specplugin.proposers.tree_verify.drawn_children_law`'s
    argument, per step): after i children are drawn and rejected the residual is
    norm((p - q_i)+), whatever the i-th token was, and both "stop" (draw from it) and "draw one
    more" (accept min(1, p'/q'), else the next residual) emit that residual's law, so by
    induction the node emits p. A drawn child's realised value (its token's q) is used from then
    on, for its own children and for later choices. In expectation over the draws the model's
    expected accepted length is at least the chain's (the chain's next node is always a
    candidate, with value its expectation, and chain values only fall with depth).

    Nodes are stored parents first in the order chosen (not breadth-first), siblings in draw
    order; so a prefix of the nodes is the tree this builder grows with that smaller budget (the
    best cut when vLLM's scheduler cuts the drafts). ``expand`` is called once per wave, for the
    added nodes whose first child could beat every known candidate (an upper bound on its value,
    exact when only ``alpha`` is given); at most budget - 1 calls (a chain: one per node, like
    chain drafting); nodes at ``depth_limit`` and the last node added are never expanded. For
    top-k the wave also expands the candidates not yet added whose value is at least ``prefetch``
    times the wave's best bound (a flat draft's siblings then take one call); the tree does not
    depend on ``prefetch``. Sampled children cannot be prefetched (a draw is a commitment).
    ``fault``: one of :data:`SHAPE_FAULTS` (tests only). ``options`` are these keyword arguments
    (``children``, ``alpha``, ``confidence``, ``max_children``, ``generator``, ``draw``,
    ``prefetch``, ``fault``), with their defaults as :func:`dynamic_tree_steps` declares them.
    """
    return drive(dynamic_tree_steps(root_q, node_budget, depth_limit, **options), expand)


def dynamic_tree_steps(
    root_q: torch.Tensor,
    node_budget: int,
    depth_limit: int,
    *,
    children: str = "topk",
    alpha: Sequence[float] | None = None,
    confidence: Sequence[float | None] | None = None,
    max_children: int | None = None,
    generator: torch.Generator | None = None,
    draw: Callable[[torch.Tensor, int], list[int]] | None = None,
    prefetch: float = 0.25,
    fault: str | None = None,
) -> Generator[list[list[int]], torch.Tensor, TokenTree]:
    """:func:`build_dynamic_tree` as a generator (its options, with their defaults, are these keyword
    arguments), for growing many trees in one batch: it yields the
    paths to expand ([len(paths)] token lists) and is sent their processed distributions
    [len(paths), V]; it returns the tree (:func:`drive` runs it with an ``expand``)."""
    if node_budget < 0 or depth_limit < 0:
        raise ValueError(f"need node_budget >= 0 and depth_limit >= 0; got {node_budget}, {depth_limit}")
    if children not in TREE_CHILDREN:
        raise ValueError(f"children must be one of {TREE_CHILDREN}, got {children!r}")
    if max_children is not None and max_children < 1:
        raise ValueError(f"max_children must be >= 1, got {max_children}")
    if fault is not None and (fault not in SHAPE_FAULTS or children != "sampled"):
        raise ValueError(f"unknown fault {fault!r} for children={children!r}; known: {SHAPE_FAULTS} (sampled)")
    _check_depth_values("alpha", alpha)
    _check_depth_values("confidence", confidence)
    sampled = children == "sampled"
    rule = "without_replacement" if sampled else "one_hot"
    if sampled and draw is None:
        def draw(q, count):
            return sample_without_replacement(q, count, generator)
    vocab = root_q.shape[-1]
    tokens, parents, depths, reach = [-1], [-1], [0], [1.0]
    rows = [torch.zeros(vocab, dtype=torch.float32, device=root_q.device)]
    nodes: dict[int, _Node] = {}
    heap: list[tuple[float, int]] = []  # (-value, node): each expanded node's next candidate
    unexpanded: list[int] = []  # added nodes above the depth limit whose q is not known yet
    prefetched: dict[tuple[int, ...], torch.Tensor] = {}
    width_cap = node_budget if max_children is None else min(node_budget, max_children)

    def acceptance(state: _Node, rank: int, q_token: float) -> float:
        return (state.agree if rank == 0 else 0.0) + (1.0 - state.agree) * (1.0 - state.miss) * q_token

    def candidate(node: int) -> None:
        """Push the node's next child candidate, valued before any draw (but fault "predraw")."""
        state = nodes[node]
        if state.count >= width_cap or state.exhausted:
            return
        if not sampled:
            if state.count >= len(state.order):
                return
            value = reach[node] * acceptance(state, state.count, float(state.q64[state.order[state.count]]))
        elif fault == "predraw":
            drawn = draw(state.remaining, 1)
            if not drawn:
                state.exhausted = True
                return
            token = int(drawn[0])
            state.remaining[token] = 0
            r = acceptance(state, state.count, float(state.q64[token]))
            state.predrawn = (token, r)
            value = reach[node] * r
        else:
            mass = float(state.remaining.sum())
            if not mass > 0:
                return
            expected_q = float((state.remaining * state.q64).sum()) / mass
            value = reach[node] * acceptance(state, state.count, expected_q)
        if value > 0:
            heapq.heappush(heap, (-value, node))

    def open_node(node: int, q: torch.Tensor) -> None:
        q32 = q.detach().float()
        q64 = _prob64(q32)
        if sampled:
            order, remaining = None, q64.clone()
            predicted = predicted_first_acceptance(q64, rule)
        else:
            k = min(vocab, width_cap)
            values, indices = torch.topk(q64, k)
            ranked = sorted(zip(values.tolist(), indices.tolist()), key=lambda vt: (-vt[0], vt[1]))
            order = [t for v, t in ranked if v > 0]
            remaining = None
            predicted = float(q64[order[0]]) if order else 0.0
        agree, miss = _node_parameters(predicted, depths[node] + 1, alpha, confidence, rule)
        nodes[node] = _Node(q32, q64, agree, miss, order=order, remaining=remaining)
        candidate(node)

    def bound(node: int) -> float:
        """An upper bound on the value of the node's first child (exact when alpha alone is given)."""
        depth = depths[node] + 1
        measured = _at_depth(alpha, depth)
        if measured is None:
            return reach[node]
        mean = _at_depth(confidence, depth)
        if mean is None:
            return reach[node] * float(measured)
        agree, miss = acceptance_parameters(measured, mean)
        return reach[node] * (agree + (1.0 - agree) * (1.0 - miss))

    def prefetch_paths(threshold: float, room: int) -> list[tuple[int, ...]]:
        """Top-k: paths of not yet added candidates worth expanding in this wave."""
        found = []
        for node, state in nodes.items():
            if depths[node] + 1 >= depth_limit:
                continue
            for rank in range(state.count, min(len(state.order), width_cap)):
                value = reach[node] * acceptance(state, rank, float(state.q64[state.order[rank]]))
                if value < threshold:
                    break  # values fall with rank
                path = tuple(_path(tokens, parents, node)) + (state.order[rank],)
                if path not in prefetched:
                    found.append((-value, path))
        return [path for _, path in sorted(found)[:room]]

    if node_budget > 0 and depth_limit > 0:
        open_node(ROOT, root_q)
    while len(tokens) - 1 < node_budget:
        best = -heap[0][0] if heap else 0.0
        wave = [node for node in unexpanded if bound(node) > best]
        if wave:
            paths = [tuple(_path(tokens, parents, node)) for node in wave]
            extra = []
            if not sampled and prefetch > 0:
                room = node_budget - (len(tokens) - 1) - 1
                extra = prefetch_paths(prefetch * max(bound(node) for node in wave), room)
            q_rows = yield [list(p) for p in paths + extra]
            for path, row in zip(extra, q_rows[len(wave):]):
                prefetched[path] = row
            for node, row in zip(wave, q_rows):
                unexpanded.remove(node)
                open_node(node, row)
            continue
        if not heap:
            break
        _, node = heapq.heappop(heap)
        state = nodes[node]
        if not sampled:
            token = state.order[state.count]
            r = acceptance(state, state.count, float(state.q64[token]))
        elif fault == "predraw":
            (token, r), state.predrawn = state.predrawn, None
        else:
            drawn = draw(state.remaining, 1)
            if not drawn:  # the support ran out
                state.exhausted = True
                continue
            token = int(drawn[0])
            state.remaining[token] = 0
            r = acceptance(state, state.count, float(state.q64[token]))
        child = len(tokens)
        tokens.append(int(token))
        parents.append(node)
        depths.append(depths[node] + 1)
        rows.append(state.q32)
        reach.append(reach[node] * r)
        state.count += 1
        candidate(node)
        if depths[child] < depth_limit:
            path = tuple(_path(tokens, parents, child))
            if path in prefetched:
                open_node(child, prefetched.pop(path))
            else:
                unexpanded.append(child)
    return TokenTree(tokens, parents, depths, torch.stack(rows), rule=rule)


# The extra cost of a step that verifies a branched tree over one that verifies the chain of as many
# nodes, per tree node, as a fraction of the chain step (TreeProposer's branch_cost default): the
# tree rows' attention is recomputed per node, so the extra grows with the tree. Measured on the
# memory-bound target at batch 1, T = 1, the tiny draft: a tree of 8 cost 1.20x its chain's step
# (20.84 against 17.42 ms in-process, 7 Dec), a tree of 16 about 1.35x (interleaved --preset tree,
# 7 Dec: 216 of 728 steps branched, 42 against 38 ms a step on average): 0.025 a node (0.2 at 8,
# 0.4 at 16). At batch 16 a tree of 8 cost 1.37x the chain's step (issue 31).
DEFAULT_BRANCH_COST = 0.025


def _sibling_shares(confidence: float, drawn: bool, count: int) -> list[float]:
    """The q of a node's 2nd, 3rd, ... child under the static model of :func:`expected_chain_and_tree`,
    from the node's mean confidence c alone. Drawn children (c = Σ q²): q taken as uniform over 1 / c
    tokens, so each further draw has q = c, while any is left. Top-k children (c = max q): the
    k-th most likely token's q at most the one before's and the mass left, min(c, 1 - c - ...)."""
    shares, left = [], 1.0 - confidence
    previous = confidence
    for _ in range(count):
        share = min(previous, left)
        if share <= 1e-12:
            break
        shares.append(share)
        left -= share
        previous = share if not drawn else previous
    return shares


def expected_chain_and_tree(alpha: Sequence[float], confidence: Sequence[float], depth: int, budget: int,
                            drawn: bool) -> tuple[float, float]:
    """(E_chain, E_tree): expected accepted tokens per verify step (the target's own token not
    counted) of the chain of ``depth`` drafts and of the best tree of ``budget`` nodes at most
    ``depth`` deep, under :func:`tree_acceptance`'s calibrated model on *static* nodes: every node
    at depth d - 1 has the depth's mean ``confidence[d - 1]``, so its first child is accepted with
    ``alpha[d - 1]`` exactly and its k-th child (k >= 2) with (1 - agree)(1 - miss) q_k, q_k from
    :func:`_sibling_shares`. Known before any draft row is seen (a decision made on it keeps any
    tree exact); best first over the static values, so E_tree >= E_chain, equal when no sibling is
    worth a chain node. An estimate (real rows vary around the mean) for pricing a branched step
    against a chain, not the builder's model."""
    levels = []
    for d in range(1, depth + 1):
        measured, mean = float(_at_depth(alpha, d)), float(_at_depth(confidence, d))
        agree, miss = acceptance_parameters(measured, min(1.0, mean))
        spread = (1.0 - agree) * (1.0 - miss)
        levels.append((measured, [spread * share for share in _sibling_shares(min(1.0, mean), drawn, budget)]))
    e_chain = chain_expected_accepted_length(alpha, depth)
    # Best first: (-value, tie, node depth of the parent, child rank, parent's reach).
    heap = [(-levels[0][0], 0, 0, 0, 1.0)]
    e_tree, added, tie = 0.0, 0, 1
    while heap and added < budget:
        negative, _, parent_depth, rank, parent_reach = heapq.heappop(heap)
        value = -negative
        if value <= 0:
            break
        e_tree += value
        added += 1
        siblings = levels[parent_depth][1]
        if rank < len(siblings):  # the parent's next child
            heapq.heappush(heap, (-parent_reach * siblings[rank], tie, parent_depth, rank + 1, parent_reach))
            tie += 1
        if parent_depth + 1 < depth:  # this node's first child
            heapq.heappush(heap, (-value * levels[parent_depth + 1][0], tie, parent_depth + 1, 0, value))
            tie += 1
    return e_chain, max(e_tree, e_chain)


def expect_chain(alpha: Sequence[float], confidence: Sequence[float | None] | None, depth: int, budget: int,
                 drawn: bool, branch_cost: float = DEFAULT_BRANCH_COST) -> bool:
    """Whether a dynamic tree step should verify the chain of ``depth`` drafts rather than a branched
    tree of ``budget`` nodes: true unless the tree's expected tokens per step (accepted + the
    target's own, :func:`expected_chain_and_tree`) beat the chain's by more than the branched step's
    extra cost, ``branch_cost`` per node: (1 + E_tree) > (1 + branch_cost x budget)(1 + E_chain).
    False (the builder decides) when a depth's confidence is not given. A chain is a tree: choosing
    it where branching does not pay its step is how a dynamic tree never loses to the chain of as
    many drafts."""
    if confidence is None or any(_at_depth(confidence, d) is None for d in range(1, depth + 1)):
        return False
    e_chain, e_tree = expected_chain_and_tree(alpha, confidence, depth, budget, drawn)
    return 1.0 + e_tree <= (1.0 + branch_cost * budget) * (1.0 + e_chain) + 1e-12


def first_child_trials(tree: TokenTree, accepted_nodes: Sequence[int],
                       submitted: Sequence[int] | None = None) -> list[tuple[int, bool, float]]:
    """The first children the verifier tried in one verify step of ``tree``, as (depth, accepted,
    draft-as-proxy prediction) for :class:`DepthAcceptance`: one per node of the accepted path
    ``accepted_nodes`` (root -> leaf, root excluded) that has children. ``submitted``: the nodes
    verified when only a path of the tree was (a chain, root excluded); then only the path's nodes
    that are their parent's first child count. The predictions are computed in one batched
    float64 pass over their rows (one call per node cost about 25 µs each, twice per step and
    request: a request's and the population's estimate)."""
    kids = tree_children(tree.parents)
    path = [ROOT] + list(accepted_nodes)
    submitted = None if submitted is None else list(submitted)
    tried: list[tuple[int, int, bool]] = []  # (node, its first child, accepted)
    for index, node in enumerate(path):
        if not kids[node]:
            continue
        first = kids[node][0]
        if submitted is not None and (index >= len(submitted) or submitted[index] != first):
            continue  # the chain verified another child here (or nothing)
        tried.append((node, first, index + 1 < len(path) and path[index + 1] == first))
    if not tried:
        return []
    firsts = [first for _, first, _ in tried]
    contiguous = firsts[-1] - firsts[0] == len(firsts) - 1  # a chain's: a view, not a gather
    rows = tree.node_probs[firsts[0]:firsts[-1] + 1] if contiguous else tree.node_probs[firsts]
    predicted = predicted_first_acceptances(rows, tree.rule, [tree.tokens[f] for f in firsts])
    return [(tree.depths[node] + 1, taken, p) for (node, _, taken), p in zip(tried, predicted)]


@dataclass
class DepthAcceptance:
    """One request's measured first-child acceptance by depth, from its verified drafts, for
    :func:`build_dynamic_tree`'s ``alpha`` / ``confidence``.

    Per depth d (index d - 1): ``reached``, the verified nodes at depth d - 1 whose first child
    the verifier tried (the root, every accepted node with children); ``accepted``, how many of
    those first children it accepted (a Bernoulli draw of the model's r_1 each: the emitted
    token at a node equals its first child's token iff that child was accepted, since a
    rejected token has no mass left in the residual); ``predicted``, the sum of those nodes'
    draft-as-proxy predictions (:func:`predicted_first_acceptance`).
    """

    reached: list[float] = field(default_factory=list)  # counts (halved by decay)
    accepted: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)

    def record(self, depth: int, accepted: bool, predicted: float) -> None:
        while len(self.reached) < depth:
            self.reached.append(0)
            self.accepted.append(0)
            self.predicted.append(0.0)
        self.reached[depth - 1] += 1
        self.accepted[depth - 1] += int(accepted)
        self.predicted[depth - 1] += float(predicted)

    def observe(self, tree: TokenTree, accepted_nodes: Sequence[int], submitted: Sequence[int] | None = None) -> None:
        """Record one verify step of ``tree``: ``accepted_nodes`` root -> leaf (root excluded).
        ``submitted``: the nodes verified when only a path of the tree was (a chain, root
        excluded); then only the path's nodes that are their parent's first child count."""
        self.record_trials(first_child_trials(tree, accepted_nodes, submitted))

    def record_trials(self, trials: Sequence[tuple[int, bool, float]]) -> None:
        """Record :func:`first_child_trials` (computed once for the request and the population)."""
        for depth, accepted, predicted in trials:
            self.record(depth, accepted, predicted)

    def decay(self, window: int) -> None:
        """Halve every count once the first depth holds ``window`` trials (a population estimate
        that follows changing traffic)."""
        if self.reached and self.reached[0] >= window:
            self.reached = [r / 2 for r in self.reached]
            self.accepted = [a / 2 for a in self.accepted]
            self.predicted = [p / 2 for p in self.predicted]

    def estimate(self, prior: Sequence[float] | None = None, weight: float = 4.0,
                 prior_confidence: Sequence[float | None] | None = None,
                 ) -> tuple[list[float] | None, list[float | None] | None]:
        """(alpha, confidence) for build_dynamic_tree. Per observed depth: the measured acceptance
        shrunk by ``weight`` pseudo-observations toward ``prior[d - 1]`` (the population's) or,
        without a prior, toward this request's acceptance pooled over all depths (deep depths
        see few nodes); and the mean draft-as-proxy prediction over the same nodes (so the model
        keeps each node's own confidence). Deeper than observed: the prior with
        ``prior_confidence`` (None: fitted per node) where given, else the deepest observed
        values. Before any observation: the prior, or (None, None)."""
        observed = len(self.reached)
        if observed == 0 or sum(self.reached) == 0:
            if not prior:
                return None, None
            return list(prior), (None if prior_confidence is None else list(prior_confidence))
        pooled = sum(self.accepted) / sum(self.reached)
        alpha: list[float] = []
        confidence: list[float | None] = []
        for depth in range(1, max(observed, len(prior) if prior else 0) + 1):
            if depth <= observed and self.reached[depth - 1] > 0:
                n = self.reached[depth - 1]
                base = _at_depth(prior, depth)
                base = pooled if base is None else float(base)
                alpha.append((self.accepted[depth - 1] + weight * base) / (n + weight))
                confidence.append(min(1.0, self.predicted[depth - 1] / n))
            elif prior:
                alpha.append(float(_at_depth(prior, depth)))
                confidence.append(_at_depth(prior_confidence, depth))
            else:
                alpha.append(alpha[-1])
                confidence.append(confidence[-1])
        return alpha, confidence


@dataclass
class TreeStats:
    """Per-proposer totals for comparing the chosen path with the greedy chain."""

    trees: int = 0
    nodes: int = 0  # draft nodes (root not counted) over all trees
    chosen_expected_length: float = 0.0  # Σ expected accepted length of the submitted path
    greedy_expected_length: float = 0.0  # Σ the same for the greedy chain of the same tree
    drafted_tokens: int = 0
    expand_calls: int = 0
    # shape="dynamic": Σ the model's expected accepted length of what was submitted
    # (tree_expected_accepted_length for a tree, the path's for a chain), and of the trees built.
    model_expected_length: float = 0.0
    # shape="dynamic", submitted trees at T > 0: steps whose tree would be the chain, drafted by the
    # ensemble's chain loop instead of the tree builder (see TreeProposer._expect_chain).
    chain_steps: int = 0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pending:
    context_length: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # a submitted tree (root included): tokens are its nodes 1..N-1
    # shape="dynamic": the drafted tree and, for a chain, the submitted path's nodes (root excluded)
    tree: TokenTree | None = None
    path_nodes: list[int] | None = None


def tree_accepted_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The tree nodes a verifier accepted, root -> leaf: follow ``emitted`` (accepted tokens and
    then one token of the target's own) down the tree while a child carries the next token.
    ``tokens`` [N - 1]: the nodes' tokens (node i has ``tokens[i - 1]``); ``parents`` [N] with
    parents[0] = -1. Children carry distinct tokens in a tree from :func:`build_tree`; the
    first match is taken otherwise. The last emitted token is the target's own, never a node."""
    children = tree_children(parents)
    path, node = [], ROOT
    for token in list(emitted)[:-1]:
        nxt = next((c for c in children[node] if tokens[c - 1] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def chain_tree(tokens: Sequence[int], rows: torch.Tensor, rule: str) -> TokenTree:
    """A chain as a :class:`TokenTree`: ``tokens`` [n] each chosen from its row of ``rows`` [n, V]
    (the q after the tokens before it), under ``rule``."""
    tokens = [int(t) for t in tokens]
    parents = list(range(-1, len(tokens)))
    node_probs = torch.cat([torch.zeros(1, rows.shape[-1], device=rows.device), rows.float()])
    return TokenTree([-1] + tokens, parents, list(range(len(parents))), node_probs, rule=rule)


def chain_steps(root_q: torch.Tensor, depth: int, greedy: bool,
                generator: torch.Generator | None = None) -> Generator[list[list[int]], torch.Tensor, TokenTree]:
    """A chain of ``depth`` tokens as a tree builder (see :func:`drive`): each token the argmax
    (``greedy``) or one draw from q (:func:`~vllm_specplugin.proposers.sampling.sample_rows`, as
    the ensemble's chain loop draws), asking for one path per wave; returns :func:`chain_tree`
    with rule ``"one_hot"`` (greedy) or ``"without_replacement"`` (one drawn child per node).
    Lets a step's expected chains share each wave's draft forward with other requests' trees."""
    if depth < 1:
        raise ValueError(f"a chain needs depth >= 1, got {depth}")
    tokens, rows, q = [], [], root_q
    while True:
        rows.append(q)
        tokens.append(int(q.argmax()) if greedy else int(sample_rows(q[None].float(), [generator])[0]))
        if len(tokens) == depth:
            return chain_tree(tokens, torch.stack(rows), "one_hot" if greedy else "without_replacement")
        q = (yield [list(tokens)])[0]


@dataclass(eq=False)
class _TreeGrowth:
    """One request's tree while :meth:`TreeProposer.propose` grows the batch's trees together."""

    request: DraftRequest
    context: list[int]
    params: SamplingParams  # the processing of the draft's q (greedy: T = 1, see _plan)
    depth: int
    budget: int
    submit_tree: bool
    dynamic: bool
    sampled: bool
    alpha: list[float] | None = None  # the dynamic shape's calibration (TreeProposer.calibration)
    confidence: list[float | None] | None = None
    root_q: torch.Tensor | None = None  # [V] processed
    paths: list[list[int]] | None = None  # what the builder asks for next; None once grown
    tree: TokenTree | None = None
    chain: bool = False  # an expected chain (TreeProposer._expect_chain) grown in the waves: chain_steps
    _steps: Generator | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def start(self, root_q: torch.Tensor, proposer: TreeProposer) -> None:
        self.root_q = root_q
        self._steps = proposer._steps(self, root_q)
        self._advance(None)

    def answer(self, q_rows: torch.Tensor) -> None:
        """``q_rows`` [len(paths), V]: the processed distributions after each asked path."""
        self._advance(q_rows)

    def _advance(self, q_rows: torch.Tensor | None) -> None:
        try:
            self.paths = next(self._steps) if q_rows is None else self._steps.send(q_rows)
        except StopIteration as done:
            self.tree, self.paths = done.value, None


class TreeProposer(Proposer):
    """Grows a token tree per request on an :class:`EnsembleProposer`'s drafts (1–3 models) and
    proposes the path with the highest expected accepted length, as a chain, or (``verify="tree"``,
    requests marked ``tree_ok``) the whole tree.

    ``shape`` chooses how the tree is grown:

    * ``"fixed"`` (default, as before): :func:`build_tree` / :func:`build_sampled_tree`, per depth
      up to ``branching`` children for up to ``branching`` nodes; a submitted tree is at most
      ``max_depth`` or ceil(budget / branching) deep.
    * ``"dynamic"``: :func:`build_dynamic_tree`, grown best first by each node's probability of
      being accepted (EAGLE-2's path product of q, calibrated by the measured acceptance by
      depth), with no fixed depth or width: a confident draft gets a chain of the whole budget,
      an uncertain one a wide, shallow tree; under its model never worse than the chain of the
      same budget. ``branching`` is not used; ``max_depth`` still caps the depth. Children are
      drawn without replacement at T > 0 (``children="sampled"``, verified by recursive
      rejection sampling) or are the top-k (one-hot rule) as with the fixed shape. The
      calibration of a request is, in order: what :meth:`set_alpha` gave for it; else its own
      measured first-child acceptance by depth (:class:`DepthAcceptance`, from the outcomes of its
      earlier drafts), shrunk toward ``alpha`` by ``calibration_weight`` pseudo-observations (without
      ``alpha``, an unseeded request's toward the population's, measured over all unseeded requests);
      else ``alpha``, the population's acceptance by depth (a chain's, per position), with
      ``confidence``, the population's mean draft-as-proxy prediction over the same drafts
      (:func:`predicted_first_acceptance`; None: fitted per node, which makes every node's first
      child worth alpha, losing what its own confidence says); else none: the draft is the proxy,
      which for drawn children (T > 0, ``children="sampled"``) means the chain, until the
      request's own outcomes calibrate it (see :func:`tree_acceptance`). A request's calibration
      depends only on its own history, so a seeded request stays reproducible. A submitted
      tree's step is drafted as the chain unless the calibration expects the best tree to emit
      more than (1 + ``branch_cost`` x nodes) times the chain's tokens per step
      (:func:`expect_chain`): a branched step costs more than a chain step of as many nodes. A chain drawn
      this way is handed to vLLM with the rows its tokens were drawn from (standard speculative
      sampling), any other tree with one-hot rows.
    """

    def __init__(self, ensemble: EnsembleProposer, node_budget: int = 16, branching: int = 3,
                 verify: str = "chain", max_depth: int | None = None, children: str = "sampled",
                 shape: str = "fixed", alpha: Sequence[float] | None = None,
                 confidence: Sequence[float | None] | None = None, calibration_weight: float = 4.0,
                 branch_cost: float = DEFAULT_BRANCH_COST):
        if node_budget < 1 or branching < 1:
            raise ValueError(f"need node_budget >= 1 and branching >= 1, got {node_budget} and {branching}")
        if verify not in ("chain", "tree"):
            raise ValueError(f"verify must be 'chain' or 'tree', got {verify!r}")
        if children not in TREE_CHILDREN:
            raise ValueError(f"children must be one of {TREE_CHILDREN}, got {children!r}")
        if shape not in TREE_SHAPES:
            raise ValueError(f"shape must be one of {TREE_SHAPES}, got {shape!r}")
        _check_depth_values("alpha", alpha)
        _check_depth_values("confidence", confidence)
        if calibration_weight < 0:
            raise ValueError(f"calibration_weight must be >= 0, got {calibration_weight}")
        if not branch_cost >= 0:
            raise ValueError(f"branch_cost must be >= 0, got {branch_cost}")
        self.shape = shape
        self.branch_cost = float(branch_cost)
        self.alpha = None if alpha is None else [float(a) for a in alpha]
        self.confidence = None if confidence is None else list(confidence)
        self.calibration_weight = calibration_weight
        self._request_alpha: dict[str, tuple[list[float], list[float | None] | None]] = {}
        self._measured: dict[str, DepthAcceptance] = {}
        # Every unseeded request's outcomes together: the prior a request's own estimate starts
        # from (halved when it holds POPULATION_WINDOW first-child trials, so it follows the traffic).
        self._population = DepthAcceptance()
        self.ensemble = ensemble
        self.node_budget = node_budget
        self.branching = branching
        self.verify = verify
        # How a submitted tree's children are chosen at T > 0: "sampled" (drawn without
        # replacement, verified by recursive rejection sampling) or "topk" (the draft's most
        # likely, verified with the one-hot rule). T = 0 and chain mode always use top-k.
        self.children = children
        # Depth limit: chain mode drafts up to gamma deep (a path); a submitted tree shares its
        # node budget between width and depth, so by default it is ceil(budget / branching) deep
        # (a tree as deep as its budget would be only the greedy chain, see build_tree).
        if max_depth is not None and max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.vocab_size = ensemble.vocab_size
        self.stats = TreeStats()
        self.last_trees: dict[str, TokenTree] = {}  # the latest tree per request (inspection, tests)
        self._pending: dict[str, _Pending] = {}

    @property
    def metrics(self):
        return self.ensemble.metrics

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.last_trees.pop(request_id, None)
        self._request_alpha.pop(request_id, None)
        self._measured.pop(request_id, None)
        self.ensemble.free(request_id)

    def tracked_request_ids(self) -> set[str]:
        return (set(self._pending) | set(self.last_trees) | set(self._request_alpha) | set(self._measured)
                | self.ensemble.tracked_request_ids())

    def set_alpha(self, request_id: str, alpha: Sequence[float] | None,
                  confidence: Sequence[float | None] | None = None) -> None:
        """Fix the calibration of one request's dynamic trees (a controller's measured acceptance of
        a first child / chain position by depth, and optionally the mean draft-as-proxy prediction
        over the same steps; see :func:`tree_acceptance`); None returns it to the proposer's own
        estimate. Kept until :meth:`free`."""
        if alpha is None:
            self._request_alpha.pop(request_id, None)
            return
        _check_depth_values("alpha", alpha)
        _check_depth_values("confidence", confidence)
        self._request_alpha[request_id] = ([float(a) for a in alpha], None if confidence is None else list(confidence))

    def calibration(self, request_id: str, seeded: bool = False) -> tuple[list[float] | None, list[float | None] | None]:
        """(alpha, confidence) the next dynamic tree of this request is grown with: its own measured
        acceptance by depth, shrunk toward the configured ``alpha``, else (unseeded requests) toward
        the population's, measured over every unseeded request's verified drafts; a seeded
        request's calibration depends on its own history only (reproducibility)."""
        if request_id in self._request_alpha:
            return self._request_alpha[request_id]
        prior, prior_confidence = self.alpha, self.confidence
        if prior is None and not seeded:
            prior, prior_confidence = self._population.estimate()
        return self._measured.get(request_id, DepthAcceptance()).estimate(prior, self.calibration_weight,
                                                                          prior_confidence)

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One tree per request, grown for all requests together: each depth (each wave of a
        dynamic tree) of every request's tree is one draft forward per draft model, not one per
        request (the trees and their draws are each request's own, as if grown alone)."""
        started = time.perf_counter()
        # The ensemble's own step timing (its propose() is not called when wrapped).
        self.ensemble.time_step(started, requests)
        self.ensemble.prepare(requests)
        for request in requests:
            self._observe(request)
        plans = [self._plan(request) for request in requests]
        growing = [plan for plan in plans if isinstance(plan, _TreeGrowth)]
        chains = [plan for plan in growing if self._expect_chain(plan)]
        if chains and len(chains) == len(growing):
            # Only chains: the ensemble's chain loop (its drafts stay in the draft caches, so the
            # next step's catch-up forwards only the target's own token).
            for plan, draft in zip(chains, self._draw_chains(chains)):
                plans[plans.index(plan)] = draft
            growing = []
        for plan in chains:
            # Beside other requests' trees: one path per wave, so the step's draft forwards are its
            # deepest tree's or chain's, not the chains' and the trees' one after the other.
            plan.chain = True
        if growing:
            roots = self.ensemble.root_distributions([g.request_id for g in growing], [g.context for g in growing])
            for growth, root in zip(growing, roots):
                growth.start(processed_probs(root.log(), growth.params), self)
            self._grow(growing)
        drafts = [plan if isinstance(plan, Draft) else self._finish(plan) for plan in plans]
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.ensemble.sync_cost_counters()
        return drafts

    def _expect_chain(self, growth: _TreeGrowth) -> bool:
        """Whether ``growth`` (a submitted dynamic tree: drawn children at T > 0, top-k at T = 0) is
        drafted as the chain of ``growth.depth`` nodes, decided before any draft row is seen, from
        the request's calibration alone (:func:`expect_chain`, priced with ``branch_cost``).
        Without a calibration drawn children get the chain anyway (the draft as proxy accepts
        every first child), top-k children the builder; top-k children at T > 0 and a depth whose
        confidence is not given (fitted per node) are left to the builder. Such a step is drafted by
        the ensemble's chain loop (or, beside other requests' trees, one token per wave:
        :func:`chain_steps`), the same draws the chain proposer makes, at its cost: on the
        memory-bound pair the builder spent 45-67% more draft time than the chain loop for the same
        chains (batch 1 / 16, T = 1, tests/benchmarks/test_bench_tree_shape.py, 5 Dec). Any shape
        chosen without the target is exact, so this is a cost decision only; it depends on the
        request's own history and the configuration alone (a seeded request stays reproducible)."""
        greedy = growth.request.params.greedy
        if not (growth.dynamic and growth.submit_tree and (growth.sampled or greedy)) or growth.depth < 1:
            return False
        if growth.alpha is None:
            return growth.sampled  # top-k without a measurement: EAGLE-2's values, the rows decide
        return expect_chain(growth.alpha, growth.confidence, growth.depth, growth.budget,
                            drawn=growth.sampled, branch_cost=self.branch_cost)

    def _draw_chains(self, growths: list[_TreeGrowth]) -> list[Draft]:
        """Chains of ``growth.depth`` drawn tokens (the ensemble's loop; rows are the q each token
        was drawn from), recorded as the dynamic builder's drawn chains are: a chain tree for the
        request's measured acceptance by depth, the rows handed to vLLM's chain sampler."""
        drafts: list[Draft | None] = [None] * len(growths)
        # growth.params: the request's own, but T = 1 for a greedy request (its tokens stay the
        # argmax; the T = 1 rows are what its acceptance model reads, as for the builder's trees).
        self.ensemble.draw_chains([(k, g.request, g.depth) for k, g in enumerate(growths)], drafts,
                                  row_params=[g.params for g in growths])
        return [self.empty_draft() if not draft.token_ids else
                self._chain_draft(growth, chain_tree(draft.token_ids, draft.probs,
                                                     "without_replacement" if growth.sampled else "one_hot"))
                for growth, draft in zip(growths, drafts)]

    def _chain_draft(self, growth: _TreeGrowth, tree: TokenTree) -> Draft:
        """The draft of an expected chain (:meth:`_draw_chains` or :func:`chain_steps`), recorded as
        the dynamic builder's drawn chains are: a chain tree for the request's measured acceptance
        by depth, the rows handed to vLLM's chain sampler."""
        nodes, parents = tree.tokens[1:], list(tree.parents)
        self._pending[growth.request_id] = _Pending(len(growth.context), nodes, parents, tree)
        self.last_trees[growth.request_id] = tree
        self.stats.chain_steps += 1
        self.metrics.tree_chain_steps += 1
        self.stats.drafted_tokens += len(nodes)
        # Drawn tokens: the rows they were drawn from (vLLM's min(1, p/q)); argmax tokens: one-hot.
        rows = tree.node_probs[1:]
        probs = rows if growth.sampled else torch.nn.functional.one_hot(
            torch.tensor(nodes), self.vocab_size).float().to(rows.device)
        return Draft(nodes, probs, parents=parents)

    def _grow(self, growing: list[_TreeGrowth]) -> None:
        """Run every request's tree builder to its tree, answering all the paths they ask for at
        once with one batched forward per draft model."""
        asking = [g for g in growing if g.paths is not None]
        while asking:
            mixtures = self.ensemble.branch_distributions_of([(g.request_id, g.context, g.paths) for g in asking])
            self.stats.expand_calls += len(asking)
            # Every request's rows processed in one call (rows grouped by their parameters), not
            # one call per request: at batch 16 the per-request calls were much of a wave's cost.
            params = [growth.params for growth in asking for _ in growth.paths]
            rows = processed_probs_rows(torch.cat(list(mixtures)).log(), params)
            for growth, answer in zip(asking, rows.split([len(growth.paths) for growth in asking])):
                growth.answer(answer)
            asking = [g for g in asking if g.paths is not None]

    def _plan(self, request: DraftRequest) -> Draft | _TreeGrowth:
        """What a request's tree will be (budget, depth, kind of children), or its empty draft."""
        rid, context, params = request.request_id, list(request.context), request.params
        if params.greedy:
            # Greedy verification accepts x iff x is the target's argmax; the draft's unprocessed
            # probability of x estimates that chance (its one-hot argmax would say nothing).
            params = SamplingParams(temperature=1.0)
        depth = self.ensemble.room(rid, len(context), request.gamma)
        if depth == 0 and request.gamma > 0:
            self.metrics.fallback_requests += 1
        if depth == 0 or not context:
            return self.empty_draft()
        submit_tree = self.verify == "tree" and request.tree_ok
        # A submitted tree is the draft: its nodes must fit in the request's draft budget (gamma).
        budget = min(self.node_budget, request.gamma) if submit_tree else self.node_budget
        dynamic = self.shape == "dynamic"
        if submit_tree:
            depth = min(depth, budget, self.max_depth or (budget if dynamic else -(-budget // self.branching)))
        elif self.max_depth is not None:
            depth = min(depth, self.max_depth)
        sampled = submit_tree and not request.params.greedy and self.children == "sampled"
        alpha, confidence = self.calibration(rid, request.seeded) if dynamic else (None, None)
        return _TreeGrowth(request, context, params, depth, budget, submit_tree, dynamic, sampled, alpha, confidence)

    def _steps(self, growth: _TreeGrowth, root_q: torch.Tensor):
        """The tree builder of ``growth`` as a generator (see :func:`drive`)."""
        generator = growth.request.generator if growth.sampled else None
        if growth.chain:
            # growth.sampled also decides the rows handed to vLLM (_chain_draft): one flag for both.
            return chain_steps(root_q, growth.depth, not growth.sampled, growth.request.generator)
        if growth.dynamic:
            return dynamic_tree_steps(root_q, growth.budget, growth.depth,
                                      children="sampled" if growth.sampled else "topk",
                                      alpha=growth.alpha, confidence=growth.confidence, generator=generator)
        if growth.sampled:
            return sampled_tree_steps(root_q, growth.budget, growth.depth, self.branching, generator)
        return tree_steps(root_q, growth.budget, growth.depth, self.branching)

    def _finish(self, growth: _TreeGrowth) -> Draft:
        """The draft of a grown tree (a submitted tree, or its best path as a chain), and the
        request's pending state for scoring it at the next step."""
        if growth.chain:
            return self._chain_draft(growth, growth.tree)
        tree, rid, context, root_q = growth.tree, growth.request_id, growth.context, growth.root_q
        submit_tree, dynamic, depth = growth.submit_tree, growth.dynamic, growth.depth
        reach = None
        if dynamic:
            reach = tree_acceptance(tree, growth.alpha, growth.confidence)
            self.stats.model_expected_length += sum(reach[1:]) if submit_tree else 0.0
        if reach is not None and not submit_tree:
            # The path with the most expected accepted tokens under the calibrated model.
            node = max(range(tree.num_nodes), key=lambda n: (sum(reach[i] for i in tree.ancestry(n)[1:]), -n))
            self.stats.model_expected_length += sum(reach[i] for i in tree.ancestry(node)[1:])
        else:
            node = tree.best_node(max_depth=depth)
        tokens = tree.path(node)
        self.last_trees[rid] = tree
        self.stats.trees += 1
        self.stats.nodes += tree.num_nodes - 1
        expected_best = tree.expected_accepted_length(node)
        expected_greedy = tree.expected_accepted_length(tree.greedy_chain_node())
        self.stats.chosen_expected_length += expected_best
        self.stats.greedy_expected_length += expected_greedy
        self.stats.drafted_tokens += len(tokens)
        self.metrics.trees += 1
        self.metrics.tree_expected_best += expected_best
        self.metrics.tree_expected_greedy += expected_greedy
        if not tokens:
            return self.empty_draft()
        if submit_tree:
            # Every node, parents first. The tree verifier walks it with tree.rule and the
            # tree's own rows (last_trees); the q handed to vLLM is one-hot at each node's token,
            # which is what vLLM's chain sampler needs should it verify these tokens as a chain
            # (exact for any drafts chosen without looking at the target, sampled ones included).
            nodes = tree.tokens[1:]
            self._pending[rid] = _Pending(len(context), nodes, list(tree.parents), tree if dynamic else None)
            probs = torch.nn.functional.one_hot(torch.tensor(nodes), self.vocab_size).float().to(root_q.device)
            if dynamic and tree.rule == "without_replacement" and all(
                    parent == node - 1 for node, parent in enumerate(tree.parents)):
                # A drawn chain (the dynamic shape of a confident draft): vLLM's chain sampler
                # verifies it (the tree verifier leaves chains to it), and each token was drawn
                # from its row, so hand the rows: its min(1, p/q) is then recursive rejection
                # sampling with one child per node (exact), which accepts more than one-hot q's
                # p(x). Any prefix vLLM may verify is such a chain too.
                probs = tree.node_probs[1:].to(probs)
            return Draft(nodes, probs, parents=list(tree.parents))
        self._pending[rid] = _Pending(len(context), tokens, None, tree if dynamic else None,
                                      tree.ancestry(node)[1:] if dynamic else None)
        # The path is a deterministic function of the draft's distributions (no sampling), so for
        # the chain verifier each token was "drawn" from the one-hot at itself: one-hot q is the
        # exact verification distribution (accept with p(x), else resample from p without x).
        probs = torch.nn.functional.one_hot(torch.tensor(tokens), self.vocab_size).float()
        return Draft(tokens, probs.to(root_q.device))

    def _observe(self, request: DraftRequest) -> None:
        """Score the request's previous draft against the tokens the target emitted since."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or len(request.context) <= pending.context_length:
            return
        emitted = list(request.context[pending.context_length:])
        if pending.parents is not None:
            # A tree: per depth, "drafted" is the tree's depth and "accepted" the path's length.
            depth = max(tree_depths(pending.parents))
            accepted = tree_accepted_path(pending.tokens, pending.parents, emitted)
            self.metrics.record_outcome(depth, len(accepted))
            if pending.tree is not None:
                self._record(request, first_child_trials(pending.tree, accepted))
            return
        count = accepted_count(pending.tokens, emitted)
        self.metrics.record_outcome(len(pending.tokens), count)
        if pending.tree is not None:
            self._record(request, first_child_trials(pending.tree, pending.path_nodes[:count], pending.path_nodes))

    def _record(self, request: DraftRequest, trials: list[tuple[int, bool, float]]) -> None:
        """One verify step's first-child trials into the request's estimate and, unseeded, the population's."""
        self._measured.setdefault(request.request_id, DepthAcceptance()).record_trials(trials)
        if not request.seeded:
            self._population.record_trials(trials)
            self._population.decay(POPULATION_WINDOW)
