"""Several drafters' proposals merged into one token tree per request, verified losslessly.

Each drafter proposes its own subtree after the root (the last context token), before the target
is seen: a model draft draws a node's children from its own processed q (i.i.d. or without
replacement); a deterministic drafter (n-gram, suffix, top-k) picks them by a rule that ignores
the verification's random numbers (one-hot). :func:`merge_proposals` merges these subtrees into
one tree, one node (one KV row, one target row) per distinct token path, and records at every
node the *proposal groups* the verifier must try, in a fixed order:

* a **group** is one drafter's children of one of its own nodes, in that drafter's draw order,
  with the drafter's rule and q row (None for one-hot). Groups at a node are ordered by drafter
  (the order of ``proposals``), then by the drafter's own node index; none of this looks at the
  target.
* a **slot** is one proposal of a group. A slot points to the merged node of its token path; two
  slots may point to the same node (two drafters proposing the same token, or an i.i.d. draft
  drawing it twice). **Both slots are kept**, in their groups' order: sharing the node shares its
  KV row and target row (the target after a token path is the same whoever proposed it) and the
  subtrees below it, but each slot is verified with its own group's rule and q.

Verification at node j (SpecInfer's multi-step speculative sampling, with the
without-replacement rule within a group) starts from the residual ``p = P[j]`` and tries every
slot in order. Slot x of a group with rule r and current draft row q: accept with
``acceptance_probability(r, p, q, x)`` (``min(1, p[x] / q[x])``; one-hot ``p[x]``) and move to
its node; else ``p, q = after_rejection(r, p, q, x)`` (``norm(max(p - q, 0))``; one-hot: p with
x zeroed; without replacement q also loses x). The residual **carries over** from one group to the
next; q restarts at the next group's own row. When every slot is rejected (or at a leaf) one
token is drawn from the residual. These are :mod:`proposers.tree_verify`'s rule helpers, shared
by the sampled walk (:func:`verify_merged_tree`) and the exact law (:func:`merged_emission_distribution`).

Why this is exact. Let F_i be everything the walk has seen before slot i (earlier slots' tokens,
their accept / reject outcomes) plus any side information that does not reveal slot i's token
(other drafters' draws, the draws elsewhere in the tree). The single-slot step is exact whenever,
given F_i, slot i's token is distributed as the q the rule uses (one-hot: it is determined by F_i)
and whether slot i exists is decided by F_i: then ``P(accept, x = y) = min(p, q)(y)`` and, on
rejection, the rest must produce ``(p - min(p, q)) / (1 - sum min(p, q)) = norm(max(p - q, 0))``
whatever x was, so the next slot may depend on x (without replacement) and the node emits p by
induction over the slots. Here: drafters draw independently of each other and of the walk's
uniforms, so a group's k-th draw, given F, is still its drafter's q renormalised without the group's
earlier draws (without replacement) or q itself (i.i.d.); a one-hot drafter's token is a function
of the context. A duplicate slot is no exception, and it must be tried even though it is never
accepted: once a slot with token x is rejected the residual has ``p[x] = 0`` (a model slot is
rejected only where ``q[x] > p[x]``, and then ``max(p - q, 0)`` is 0 at x; a one-hot rejection
zeroes x), so a later slot x is rejected with certainty, but a model slot's rejection still moves
the residual to ``norm(max(p - q, 0))`` with its own q: averaged over that drafter's draw, the
step is exact only if the draw that happened to duplicate a token does so too (dropping it is
inexact; a one-hot duplicate's rejection changes nothing). Sharing a node is exact because what
follows an accepted token depends only on the token path (so the node gets the subtrees of every
drafter that proposed it, tried drafter by drafter). Below an accepted node the groups there are
again drafted independently of the walk, so the argument repeats by depth.

Two things the design must not do, both of which make a slot's existence or law depend on its
own token (the merged tree's tests show the law then moves): drop a *duplicate* model slot (the
group's later draws are then verified with a q they were not drawn from), and cut the node budget
by a rule that looks at the slot's own token (e.g. "keep it only if it adds no node"). The
budget here is decided slot by slot in breadth-first order *before* the slot's token is looked
at: a slot is kept when fewer than ``node_budget`` nodes exist and the earlier slots of its group
were kept (a group keeps a prefix of its draws, as :func:`~proposers.tree.build_sampled_tree`
does); a kept slot whose token path exists costs no node.

Known wrong variants for fault injection (:data:`MERGED_FAULTS`):

* ``merged_residual_not_updated``: each proposal group at a node starts again from ``P[j]``
  instead of the residual the earlier groups left (within a group the residual is updated); the
  final draw is from the last group's residual. Cannot matter at nodes with one group.
* ``merged_wrong_q``: a one-hot group's tokens are verified with the i.i.d. rule and the q row of
  the first model group at the same node (``min(1, p[x] / q[x])``, 1 where q[x] = 0; residual
  ``norm(max(p - q, 0))``). Cannot matter at nodes without both kinds of group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from vllm_specplugin.proposers.sampling import sample
from vllm_specplugin.proposers.tree_verify import (
    AcceptanceRule,
    _check_parents,
    _check_rows,
    acceptance_probability,
    after_rejection,
    draft_probs_from_tree,
    tree_children,
)

if TYPE_CHECKING:
    from vllm_specplugin.proposers.tree import TokenTree

MERGED_FAULTS = ("merged_residual_not_updated", "merged_wrong_q")


# ---------------------------------------------------------------------------------------------
# Inputs: one drafter's proposals
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterProposal:
    """One drafter's proposals after the root, as its own tree; validated when constructed.

    ``parents`` [n] with ``parents[0] = -1`` (the root) and ``parents[i] < i``; ``tokens`` [n]
    (``tokens[0]`` ignored); siblings in increasing index = the order they were drawn (the order
    the verifier tries them). ``rule``: ``one_hot`` (children chosen without drawing from a q:
    n-gram, suffix, top-k), ``iid`` or ``without_replacement`` (children drawn from q). For the
    latter two ``draft_probs`` [n, V] (any float dtype; stored float64, rows of nodes with children
    normalised within :data:`~proposers.tree_verify.PROB_TOLERANCE`): row j = the processed q node
    j's children were drawn from (rows of leaves are ignored); every child's token must have
    q > 0, and without replacement siblings must differ. One-hot: ``draft_probs`` is ignored
    (stored None). ``name`` is for reports only. Raises ValueError on bad input.
    """

    parents: Sequence[int]
    tokens: Sequence[int]
    rule: AcceptanceRule | str = AcceptanceRule.ONE_HOT
    draft_probs: torch.Tensor | None = None
    name: str = ""
    children: list[list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        where = f"drafter proposal{' ' + repr(self.name) if self.name else ''}"
        rule = AcceptanceRule(self.rule)
        parents = _check_parents(self.parents)
        tokens = [int(t) for t in self.tokens]
        if len(tokens) != len(parents):
            raise ValueError(f"{where}: parents has {len(parents)} entries, tokens {len(tokens)}")
        children = tree_children(parents)
        rows = None
        if rule is not AcceptanceRule.ONE_HOT:
            if self.draft_probs is None:
                raise ValueError(f"{where}: the {rule.value} rule needs draft_probs")
            if self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(parents):
                raise ValueError(f"{where}: draft_probs must be [{len(parents)}, V], "
                                 f"got {tuple(self.draft_probs.shape)}")
            inner = [j for j in range(len(parents)) if children[j]]
            rows = _check_rows(f"{where}: draft_probs", self.draft_probs, inner)
            vocab = rows.shape[1]
            for j, kids in enumerate(children):
                for c in kids:
                    if not 0 <= tokens[c] < vocab:
                        raise ValueError(f"{where}: token {tokens[c]} of node {c} outside [0, {vocab})")
                    if rows[j, tokens[c]] <= 0:
                        raise ValueError(f"{where}: token {tokens[c]} of node {c} has draft probability 0: "
                                         "it cannot have been drawn")
                kid_tokens = [tokens[c] for c in kids]
                if rule is AcceptanceRule.WITHOUT_REPLACEMENT and len(set(kid_tokens)) != len(kid_tokens):
                    raise ValueError(f"{where}: children of node {j} repeat a token under the without_replacement rule")
        elif any(t < 0 for t in tokens[1:]):
            raise ValueError(f"{where}: negative tokens")
        for name, value in (("parents", parents), ("tokens", tokens), ("rule", rule), ("draft_probs", rows),
                            ("children", children)):
            object.__setattr__(self, name, value)

    @property
    def vocab_size(self) -> int | None:
        return None if self.draft_probs is None else int(self.draft_probs.shape[1])

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: torch.Tensor | None = None,
              rule: AcceptanceRule | str | None = None, name: str = "") -> DrafterProposal:
        """A chain of drafted ``tokens`` [k] (no root entry). ``draft_probs`` [k, V]: row i = the q
        token i was drawn from (as a chain proposer returns them); None for a one-hot chain. The
        rule defaults to ``iid`` with rows (one child per node: i.i.d. and without replacement
        coincide), else ``one_hot``."""
        k = len(tokens)
        if rule is None:
            rule = AcceptanceRule.ONE_HOT if draft_probs is None else AcceptanceRule.IID
        rows = None
        if draft_probs is not None:
            if draft_probs.dim() != 2 or draft_probs.shape[0] != k:
                raise ValueError(f"draft_probs must be [{k}, V], got shape {tuple(draft_probs.shape)}")
            rows = torch.cat([draft_probs.detach().double().cpu(),
                              torch.zeros(1, draft_probs.shape[1], dtype=torch.float64)])
        return cls(list(range(-1, k)), [-1, *[int(t) for t in tokens]], rule, rows, name)

    @classmethod
    def from_token_tree(cls, tree: TokenTree, name: str = "") -> DrafterProposal:
        """A :class:`~proposers.tree.TokenTree` (its ``rule``; rows from ``node_probs``)."""
        rule = AcceptanceRule(tree.rule)
        rows = None if rule is AcceptanceRule.ONE_HOT else draft_probs_from_tree(tree)
        return cls(list(tree.parents), list(tree.tokens), rule, rows, name)


# ---------------------------------------------------------------------------------------------
# The merged tree
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProposalGroup:
    """One drafter's proposals at one merged node: ``children`` = the merged node of each slot,
    in draw order (a node may appear twice: an i.i.d. draft drew its token twice). ``q`` [V]
    float64, normalised (None for one-hot). ``source`` = the drafter's own node they hang from."""

    drafter: int
    source: int
    rule: AcceptanceRule
    q: torch.Tensor | None
    children: tuple[int, ...]


@dataclass
class MergedTree:
    """A merged tree, nodes parents first (breadth-first): ``parents`` [N] (root -1), ``tokens``
    [N] (root -1), ``depths`` [N]. ``groups[j]``: the proposal groups at node j in verification
    order. ``proposed_by[j]``: the drafters (indices into the builder's ``proposals``) with a
    slot for node j, sorted; ``sources[j]``: the (drafter, drafter's own node) pairs merged into
    node j (root: every drafter's root). ``vocab_size``: from the draft rows, or None when every
    drafter is one-hot and none was given. Feed ``parents`` to
    :func:`~proposers.tree_verify.tree_attention_mask` / ``tree_positions`` for the target pass;
    the verifier needs ``target_probs`` [N, V] with row j = the processed target after node j."""

    parents: list[int]
    tokens: list[int]
    depths: list[int]
    groups: list[tuple[ProposalGroup, ...]]
    proposed_by: list[tuple[int, ...]]
    sources: list[tuple[tuple[int, int], ...]]
    vocab_size: int | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def one_hot(self) -> bool:
        """Every proposal is one-hot (deterministic drafters, top-k or greedy model drafts): the
        tree is then a function of the context, and on a chain the merged rule is the one-hot chain
        rule (a duplicate slot after a rejected token is rejected surely, changing nothing)."""
        return all(group.q is None for groups in self.groups for group in groups)

    @property
    def num_slots(self) -> int:
        return sum(len(g.children) for groups in self.groups for g in groups)

    def prefix(self, num_nodes: int) -> MergedTree:
        """This tree cut to its first ``num_nodes`` nodes (root included), for vLLM scheduling only
        a prefix of the drafted nodes: for ``num_nodes`` < :attr:`num_nodes` it is the tree
        :func:`merge_proposals` gives with ``node_budget = num_nodes - 1``: the slots (in merge
        order: node, group, draw) up to the one that created the last kept node, every later one
        cut, duplicates included (so the cut never depends on a slot's own token); the whole tree
        is itself."""
        if not 1 <= num_nodes <= self.num_nodes:
            raise ValueError(f"a prefix of a {self.num_nodes}-node merged tree needs 1..{self.num_nodes} nodes, got {num_nodes}")
        if num_nodes == self.num_nodes:
            return self
        # Slots in merge order; the i-th slot pointing to a node is the i-th entry of its sources.
        groups: list[tuple[ProposalGroup, ...]] = []
        sources: list[list[tuple[int, int]]] = [list(self.sources[0])] + [[] for _ in range(1, num_nodes)]
        seen = [0] * self.num_nodes
        cut = num_nodes == 1  # a budget of 0 keeps no slot
        for j in range(num_nodes):
            kept = []
            for group in self.groups[j]:
                slots = []
                for child in group.children:
                    if cut:
                        break
                    sources[child].append(self.sources[child][seen[child]])
                    seen[child] += 1
                    slots.append(child)
                    # The slot that created the last kept node fills the budget: every later one is cut.
                    cut = child == num_nodes - 1
                if slots:
                    kept.append(ProposalGroup(group.drafter, group.source, group.rule, group.q, tuple(slots)))
            groups.append(tuple(kept))
        proposed = [()] + [tuple(sorted({k for k, _ in sources[j]})) for j in range(1, num_nodes)]
        return MergedTree(self.parents[:num_nodes], self.tokens[:num_nodes], self.depths[:num_nodes], groups,
                          proposed, [tuple(s) for s in sources], self.vocab_size)

    def path(self, node: int) -> list[int]:
        """Tokens root -> ``node`` (the root has none)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


def merge_proposals(proposals: Sequence[DrafterProposal], node_budget: int | None = None,
                    vocab_size: int | None = None) -> MergedTree:
    """Merge drafters' subtrees into one :class:`MergedTree` (one node per distinct token path).

    ``proposals``: one per drafter, in verification order (groups at a node are tried drafter by
    drafter in this order). ``node_budget``: the most non-root nodes (None: no limit). Slots are
    considered breadth-first over the merged tree (per node: drafter order, then the drafter's
    own node order, then draw order); a slot is kept iff its drafter node was merged, the earlier
    slots of its group were kept, and fewer than ``node_budget`` nodes existed before it was
    looked at (so the cut never depends on the slot's own token; a slot whose token path already
    exists costs nothing). ``vocab_size``: checks tokens; defaults to the draft rows' V.
    """
    if node_budget is not None and node_budget < 0:
        raise ValueError(f"node_budget must be >= 0 or None, got {node_budget}")
    widths = {p.vocab_size for p in proposals if p.vocab_size is not None}
    if vocab_size is not None:
        widths.add(int(vocab_size))
    if len(widths) > 1:
        raise ValueError(f"the draft rows (and vocab_size) give different vocabulary sizes: {sorted(widths)}")
    vocab_size = widths.pop() if widths else None
    if vocab_size is not None:
        for k, proposal in enumerate(proposals):
            if any(t >= vocab_size for t in proposal.tokens[1:]):
                raise ValueError(f"proposal {k}: tokens outside [0, {vocab_size})")

    parents, tokens, depths = [-1], [-1], [0]
    sources: list[list[tuple[int, int]]] = [[(k, 0) for k in range(len(proposals))]]
    groups: list[list[ProposalGroup]] = [[]]
    proposed: list[set[int]] = [set()]
    index: dict[tuple[int, int], int] = {}
    node = 0
    while node < len(parents):  # breadth-first: nodes are created in the order they are processed
        for k, own in sorted(sources[node]):
            proposal = proposals[k]
            own_tokens, rows = proposal.tokens, proposal.draft_probs
            slots = []
            for c in proposal.children[own]:
                if node_budget is not None and len(parents) - 1 >= node_budget:
                    break  # the rest of this group is cut (a prefix of its draws is kept)
                key = (node, own_tokens[c])
                if key not in index:
                    index[key] = len(parents)
                    parents.append(node)
                    tokens.append(own_tokens[c])
                    depths.append(depths[node] + 1)
                    sources.append([])
                    groups.append([])
                    proposed.append(set())
                merged = index[key]
                sources[merged].append((k, c))
                proposed[merged].add(k)
                slots.append(merged)
            if slots:
                groups[node].append(ProposalGroup(k, own, proposal.rule, None if rows is None else rows[own],
                                                  tuple(slots)))
        node += 1
    return MergedTree(parents, tokens, depths, [tuple(g) for g in groups], [tuple(sorted(s)) for s in proposed],
                      [tuple(s) for s in sources], vocab_size)


# ---------------------------------------------------------------------------------------------
# The rule at one node (shared by the sampled walk and the exact law)
# ---------------------------------------------------------------------------------------------


def _node_slots(tree: MergedTree, j: int, p0: torch.Tensor, greedy: bool,
                fault: str | None) -> Iterator[tuple[int, int, float] | torch.Tensor]:
    """The slots of node j in verification order: yields (child node, drafter, acceptance
    probability) for each, then the residual [V] to draw from when every slot was rejected. The
    caller stops iterating on an acceptance; resuming means the slot was rejected."""
    groups = tree.groups[j]
    model_q = next((g.q for g in groups if g.q is not None), None)
    p = p0
    for group in groups:
        rule, q = group.rule, group.q
        wrong_q = fault == "merged_wrong_q" and rule is AcceptanceRule.ONE_HOT and model_q is not None
        if wrong_q:
            rule, q = AcceptanceRule.IID, model_q
        elif greedy:
            rule = AcceptanceRule.ONE_HOT
        if fault == "merged_residual_not_updated":
            p = p0
        for c in group.children:
            x = tree.tokens[c]
            a = 1.0 if wrong_q and q[x] <= 0 else acceptance_probability(rule, p, q, x)
            yield c, group.drafter, a
            p, q = after_rejection(rule, p, q, x)
    yield p


def _prepare(tree: MergedTree, target_probs: torch.Tensor, greedy: bool, fault: str | None) -> torch.Tensor:
    if fault is not None and fault not in MERGED_FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {MERGED_FAULTS}")
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.num_nodes:
        raise ValueError(f"target_probs must be [{tree.num_nodes}, V], got shape {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if tree.vocab_size is not None and tree.vocab_size != vocab:
        raise ValueError(f"target_probs has V = {vocab}, the draft rows {tree.vocab_size}")
    bad = [i for i in range(1, tree.num_nodes) if not 0 <= tree.tokens[i] < vocab]
    if bad:
        raise ValueError(f"tokens outside [0, {vocab}) at nodes {bad}")
    target = _check_rows("target_probs", target_probs, range(tree.num_nodes))
    if greedy:  # the target is the one-hot at its argmax; every slot uses the one-hot rule
        target = torch.nn.functional.one_hot(target.argmax(-1), vocab).double()
    return target


class MergedWalk(NamedTuple):
    accepted: list[int]  # merged nodes root -> leaf, root excluded
    emitted: list[int]  # the accepted nodes' tokens + one more
    drafters: list[int]  # per accepted node: the drafter whose slot was accepted


def verify_merged_tree(tree: MergedTree, target_probs: torch.Tensor, generator: torch.Generator | None = None, *,
                       greedy: bool = False, fault: str | None = None) -> MergedWalk:
    """Walk the merged tree once: (accepted nodes, emitted tokens, accepting drafter per node).

    ``target_probs`` [N, V] (float64; other float dtypes converted; rows normalised within
    :data:`~proposers.tree_verify.PROB_TOLERANCE`): row j = the processed target after node j's
    path, row 0 after the root. One float64 uniform per tried slot and the final inverse-CDF draw
    come from ``generator``. ``greedy``: verify against one-hot(argmax P[j]) with the one-hot rule
    for every slot. ``fault`` in :data:`MERGED_FAULTS` (tests only).
    """
    target = _prepare(tree, target_probs, greedy, fault)
    j, accepted, drafters = 0, [], []
    while True:
        moved = False
        for item in _node_slots(tree, j, target[j], greedy, fault):
            if isinstance(item, torch.Tensor):
                final = int(sample(item[None], generator)[0])
                return MergedWalk(accepted, [tree.tokens[c] for c in accepted] + [final], drafters)
            c, drafter, a = item
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < a:
                accepted.append(c)
                drafters.append(drafter)
                j, moved = c, True
                break
        assert moved


def merged_emission_distribution(tree: MergedTree, target_probs: torch.Tensor, *, greedy: bool = False,
                                 fault: str | None = None) -> dict[tuple[int, ...], float]:
    """Exact law of :func:`verify_merged_tree`'s emitted tokens for this fixed merged tree:
    {emitted tokens: probability} (float64), every accept / reject branch and every final token
    followed with its probability, through the same per-node rule as the sampled walk."""
    target = _prepare(tree, target_probs, greedy, fault)
    law: dict[tuple[int, ...], float] = {}

    def walk(j: int, emitted: tuple[int, ...], weight: float) -> None:
        for item in _node_slots(tree, j, target[j], greedy, fault):
            if isinstance(item, torch.Tensor):
                for token, prob in enumerate(item.tolist()):
                    if prob > 0:
                        key = emitted + (token,)
                        law[key] = law.get(key, 0.0) + weight * prob
                return
            c, _, a = item
            if a > 0:
                walk(c, emitted + (tree.tokens[c],), weight * a)
            weight *= 1 - a
            if weight <= 0:
                return

    walk(0, (), 1.0)
    return law
