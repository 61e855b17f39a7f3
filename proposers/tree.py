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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.metrics import accepted_count
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, processed_probs_rows, sample
from vllm_specplugin.proposers.tree_verify import tree_children, tree_depths

ROOT = 0
TREE_CHILDREN = ("sampled", "topk")


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
        frontier_q = expand([_path(tokens, parents, n) for n in frontier]).float()
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
        frontier_q = expand([_path(tokens, parents, n) for n in frontier]).float()
    return TokenTree(tokens, parents, depths, torch.stack(rows), rule="without_replacement")


@dataclass
class TreeStats:
    """Per-proposer totals for comparing the chosen path with the greedy chain."""

    trees: int = 0
    nodes: int = 0  # draft nodes (root not counted) over all trees
    chosen_expected_length: float = 0.0  # Σ expected accepted length of the submitted path
    greedy_expected_length: float = 0.0  # Σ the same for the greedy chain of the same tree
    drafted_tokens: int = 0
    expand_calls: int = 0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pending:
    context_length: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # a submitted tree (root included): tokens are its nodes 1..N-1


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


class TreeProposer(Proposer):
    """Grows a token tree per request on an :class:`EnsembleProposer`'s drafts (1–3 models) and
    proposes the path with the highest expected accepted length, as a chain."""

    def __init__(self, ensemble: EnsembleProposer, node_budget: int = 16, branching: int = 3,
                 verify: str = "chain", max_depth: int | None = None, children: str = "sampled"):
        if node_budget < 1 or branching < 1:
            raise ValueError(f"need node_budget >= 1 and branching >= 1, got {node_budget} and {branching}")
        if verify not in ("chain", "tree"):
            raise ValueError(f"verify must be 'chain' or 'tree', got {verify!r}")
        if children not in TREE_CHILDREN:
            raise ValueError(f"children must be one of {TREE_CHILDREN}, got {children!r}")
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
        self.ensemble.free(request_id)

    def tracked_request_ids(self) -> set[str]:
        return set(self._pending) | set(self.last_trees) | self.ensemble.tracked_request_ids()

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        # The ensemble's own step timing (its propose() is not called when wrapped).
        self.ensemble.time_step(started, requests)
        drafts = []
        for request in requests:
            self._observe(request)
            drafts.append(self._draft_one(request))
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.ensemble.sync_cost_counters()
        return drafts

    def _draft_one(self, request: DraftRequest) -> Draft:
        rid, context, params = request.request_id, list(request.context), request.params
        if params.greedy:
            # Greedy verification accepts x iff x is the target's argmax; the draft's unprocessed
            # probability of x estimates that chance (its one-hot argmax would say nothing).
            params = SamplingParams(temperature=1.0)
        depth = min(rt.room(rid, len(context), request.gamma) for rt in self.ensemble.runtimes)
        if depth == 0 and request.gamma > 0:
            self.metrics.fallback_requests += 1
        if depth == 0 or not context:
            return self.empty_draft()
        root_q = processed_probs(self.ensemble.root_distribution(rid, context).log(), params)

        def expand(paths: list[list[int]]) -> torch.Tensor:
            self.stats.expand_calls += 1
            mixture = self.ensemble.branch_distributions(rid, context, paths)
            return processed_probs_rows(mixture.log(), [params] * len(paths))

        submit_tree = self.verify == "tree" and request.tree_ok
        # A submitted tree is the draft: its nodes must fit in the request's draft budget (gamma).
        budget = min(self.node_budget, request.gamma) if submit_tree else self.node_budget
        if submit_tree:
            depth = min(depth, budget, self.max_depth or -(-budget // self.branching))
        elif self.max_depth is not None:
            depth = min(depth, self.max_depth)
        if submit_tree and not request.params.greedy and self.children == "sampled":
            tree = build_sampled_tree(root_q, expand, budget, depth, self.branching, request.generator)
        else:
            tree = build_tree(root_q, expand, budget, depth, self.branching)
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
            self._pending[rid] = _Pending(len(context), nodes, list(tree.parents))
            probs = torch.nn.functional.one_hot(torch.tensor(nodes), self.vocab_size).float()
            return Draft(nodes, probs.to(root_q.device), parents=list(tree.parents))
        self._pending[rid] = _Pending(len(context), tokens)
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
            self.metrics.record_outcome(depth, len(tree_accepted_path(pending.tokens, pending.parents, emitted)))
            return
        self.metrics.record_outcome(len(pending.tokens), accepted_count(pending.tokens, emitted))
