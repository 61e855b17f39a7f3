"""Lossless verification of a token tree, engine-agnostic (torch; transformers for the reference).

One verify step walks the tree from the root (the last context token): at node j the children
are tried in draw order (increasing node index); child c with token x is accepted with the
rule's probability a, which moves the walk to c; a rejection updates the target residual p (and,
without replacement, the draft distribution) before the next sibling. When every child is
rejected, or at a leaf, one token is drawn from the residual (the full P[j] at a leaf). The
output, accepted tokens + that draw, is distributed exactly as sampling the target token by
token, provided the rule matches how the children were chosen:

* ``one_hot``: children fixed by any rule that does not look at the target (top-k trees, EAGLE-2
  reranking, greedy); accept with p[x], reject by zeroing p[x].
* ``iid``: children drawn i.i.d. from q[j] (SpecInfer); accept with min(1, p[x] / q[j][x]),
  residual max(p - q[j], 0).
* ``without_replacement``: children drawn one after another without replacement from q[j]
  (recursive rejection sampling); q is renormalised without each rejected token.

:func:`emission_distribution` follows the same walk with probabilities instead of draws, through
the same rule helpers, so tests can prove exactness by enumeration. ``fault`` injects the known
wrong variants (:data:`FAULTS`) for tests that must see them fail.

:class:`ReferenceTreeVerifier` runs a transformers causal LM over a tree in one forward (4-D
additive mask, positions n0 + depth) and compacts its ``DynamicCache`` to the accepted path.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample

if TYPE_CHECKING:  # proposers/tree.py uses this module's tree geometry
    from vllm_specplugin.proposers.tree import TokenTree

# How far a probability row may sum from 1 before it is refused (rows are then normalised: draws
# are from p / sum(p)). Only gross errors are refused: a float32 row over V tokens sums to 1 within
# about V * 2.4e-7 at worst (1 + 1.01e-6 seen at V = 4096, which a 1e-6 tolerance refused); the
# vLLM adapter allows the same 1e-3 for the q it hands over (adapters.Q_SUM_TOLERANCE).
PROB_TOLERANCE = 1e-3

# Known wrong variants, for fault injection:
#   residual_not_updated: after a rejected sibling the target residual p stays as it was.
#   q_not_updated: without replacement, q is not renormalised without the rejected tokens (that is,
#     the i.i.d. rule applied to children drawn without replacement).
#   iid_on_topk: the one-hot rule acts as the i.i.d. rule (min(1, p/q), max(p - q, 0)), i.e. the
#     i.i.d. rule applied to deterministically chosen (top-k) children.
FAULTS = ("residual_not_updated", "q_not_updated", "iid_on_topk")


class AcceptanceRule(str, Enum):
    ONE_HOT = "one_hot"
    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"


# ---------------------------------------------------------------------------------------------
# Tree geometry
# ---------------------------------------------------------------------------------------------


def _check_parents(parents: Sequence[int]) -> list[int]:
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {parents[:1]}")
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"parents must list parents first (0 <= parents[i] < i): parents[{i}] = {parent}")
    return parents


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root 0) of a parents-first tree."""
    parents = _check_parents(parents)
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i is True at i and at its ancestors (the root included)."""
    parents = _check_parents(parents)
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in range(1, len(parents)):
        mask[i] |= mask[parents[i]]  # parents first: the parent's row is complete
    return mask


def tree_positions(parents: Sequence[int], n0: int) -> torch.Tensor:
    """[N] int64 position ids n0 + depth (n0 = the root's position)."""
    return n0 + torch.tensor(tree_depths(parents), dtype=torch.int64)


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """Children per node in draw order (increasing node index)."""
    children: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents[1:], start=1):
        children[parent].append(i)
    return children


def draft_probs_from_tree(tree: TokenTree) -> torch.Tensor:
    """[N, V] float64 draft rows per parent (q[j] = what node j's children were drawn from) from
    ``tree.node_probs``, which is per child; rows of leaves are zeros."""
    node_probs = tree.node_probs.double().cpu()
    q = torch.zeros_like(node_probs)
    for j, kids in enumerate(tree_children(tree.parents)):
        if not kids:
            continue
        q[j] = node_probs[kids[0]]
        for kid in kids[1:]:
            if not torch.equal(node_probs[kid], node_probs[kids[0]]):
                raise ValueError(f"siblings {kids[0]} and {kid} carry different draft rows")
    return q


# ---------------------------------------------------------------------------------------------
# The acceptance rule (shared by the sampled walk and the exact enumeration)
# ---------------------------------------------------------------------------------------------


def _normalized(row: torch.Tensor) -> torch.Tensor | None:
    total = row.sum()
    return row / total if total > 0 else None


def acceptance_probability(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor | None, x: int,
                           fault: str | None = None) -> float:
    """Chance of accepting token ``x`` given the current residual ``p`` [V] and draft row ``q`` [V]
    (float64; q is the renormalised remainder for without-replacement)."""
    if rule is AcceptanceRule.ONE_HOT and fault != "iid_on_topk":
        return float(p[x])
    if q[x] <= 0:
        raise ValueError(f"token {x} has draft probability 0 under the {rule.value} rule: it cannot have been drawn")
    return min(1.0, float(p[x] / q[x]))


def after_rejection(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor | None, x: int,
                    fault: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual and draft row for the next sibling once token ``x`` is rejected (inputs unchanged)."""
    if rule is AcceptanceRule.WITHOUT_REPLACEMENT and fault != "q_not_updated":
        q_next = q.clone()
        q_next[x] = 0
        q_next = _normalized(q_next)
        if q_next is None:  # x held all of q: no sibling can follow
            q_next = torch.zeros_like(q)
    else:
        q_next = q
    if fault == "residual_not_updated":
        return p, q_next
    if rule is AcceptanceRule.ONE_HOT and fault != "iid_on_topk":
        p_next = p.clone()
        p_next[x] = 0
    else:
        p_next = (p - q).clamp(min=0)
    p_next = _normalized(p_next)
    # An empty residual means the rejection had probability 0 (up to rounding): keep p.
    return (p if p_next is None else p_next), q_next


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _check_rows(name: str, probs: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    probs = probs.detach().to("cpu", torch.float64)
    if not rows:
        return probs
    checked = probs[list(rows)]
    if not torch.isfinite(checked).all() or (checked < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    sums = checked.sum(-1)
    bad = (sums - 1).abs() > PROB_TOLERANCE
    if bad.any():
        row = list(rows)[int(bad.nonzero()[0])]
        raise ValueError(f"{name}[{row}] sums to {float(probs[row].sum())!r}, not 1 (tolerance {PROB_TOLERANCE})")
    probs = probs.clone()
    probs[list(rows)] = checked / sums[:, None]  # exactly normalised: draws are from p / sum(p)
    return probs


def _prepare(target_probs, draft_probs, parents, tokens, rule, greedy, fault):
    """Validated float64 inputs for one walk: (P [N, V], q [N, V] or None, children, tokens, rule)."""
    rule = AcceptanceRule(rule)
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
    parents = _check_parents(parents)
    tokens = [int(t) for t in tokens]
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [num_nodes, V], got shape {tuple(target_probs.shape)}")
    num_nodes, vocab = target_probs.shape
    if len(parents) != num_nodes or len(tokens) != num_nodes:
        raise ValueError(
            f"target_probs has {num_nodes} rows but parents has {len(parents)} and tokens {len(tokens)} entries"
        )
    bad_tokens = [i for i in range(1, num_nodes) if not 0 <= tokens[i] < vocab]
    if bad_tokens:
        raise ValueError(f"tokens outside [0, {vocab}) at nodes {bad_tokens}")
    children = tree_children(parents)
    target = _check_rows("target_probs", target_probs, range(num_nodes))
    if greedy:
        # Greedy: the target is the one-hot at its argmax, verified with the one-hot rule.
        target = torch.nn.functional.one_hot(target.argmax(-1), vocab).double()
        rule = AcceptanceRule.ONE_HOT
    needs_q = rule is not AcceptanceRule.ONE_HOT or fault == "iid_on_topk"
    draft = None
    if needs_q:
        if draft_probs is None:
            raise ValueError(f"the {rule.value} rule needs draft_probs")
        if tuple(draft_probs.shape) != (num_nodes, vocab):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}, target_probs {(num_nodes, vocab)}"
            )
        draft = _check_rows("draft_probs", draft_probs, [j for j in range(num_nodes) if children[j]])
    return target, draft, children, tokens, rule


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


def verify_tree_nodes(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    parents: Sequence[int],
    tokens: Sequence[int],
    rule: AcceptanceRule | str,
    generator: torch.Generator | None = None,
    *,
    greedy: bool = False,
    fault: str | None = None,
) -> tuple[list[int], list[int]]:
    """Walk the tree once; returns (accepted nodes root -> leaf, root excluded; emitted tokens).

    ``target_probs`` [N, V] (float64; other float dtypes are converted): P[j] = processed target
    distribution after node j, row 0 after the root. ``draft_probs`` [N, V] or None for the
    one-hot rule: q[j] = the processed draft distribution node j's children were drawn from
    (rows of leaves are ignored). ``parents`` [N] with parents[0] = -1 and parents[i] < i;
    ``tokens`` [N] (tokens[0] ignored). Uniforms and the final draw come from ``generator``
    (float64, inverse CDF). ``greedy``: verify against one-hot(argmax P[j]) with the one-hot rule.
    The emitted tokens are the accepted nodes' tokens plus one more, so len(tokens) >= 1.
    """
    target, draft, children, tokens, rule = _prepare(target_probs, draft_probs, parents, tokens, rule, greedy, fault)
    j, accepted = 0, []
    while True:
        p, q = target[j], (draft[j] if draft is not None else None)
        for c in children[j]:
            x = tokens[c]
            a = acceptance_probability(rule, p, q, x, fault)
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < a:
                accepted.append(c)
                j = c
                break
            p, q = after_rejection(rule, p, q, x, fault)
        else:  # every child rejected, or a leaf
            final = int(sample(p[None], generator)[0])
            return accepted, [tokens[c] for c in accepted] + [final]


def verify_tree(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    parents: Sequence[int],
    tokens: Sequence[int],
    rule: AcceptanceRule | str,
    generator: torch.Generator | None = None,
    *,
    greedy: bool = False,
    fault: str | None = None,
) -> list[int]:
    """The emitted tokens of :func:`verify_tree_nodes` (accepted path + one more)."""
    return verify_tree_nodes(target_probs, draft_probs, parents, tokens, rule, generator, greedy=greedy, fault=fault)[1]


def emission_distribution(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    parents: Sequence[int],
    tokens: Sequence[int],
    rule: AcceptanceRule | str,
    *,
    greedy: bool = False,
    fault: str | None = None,
) -> dict[tuple[int, ...], float]:
    """Exact law of :func:`verify_tree`'s output for this fixed tree: {emitted tokens: probability}.

    The same walk and rule helpers as :func:`verify_tree_nodes`, with every accept / reject branch
    and every final token followed with its probability instead of drawn (float64).
    """
    target, draft, children, tokens, rule = _prepare(target_probs, draft_probs, parents, tokens, rule, greedy, fault)
    law: dict[tuple[int, ...], float] = {}

    def walk(j: int, emitted: tuple[int, ...], weight: float) -> None:
        p, q = target[j], (draft[j] if draft is not None else None)
        for c in children[j]:
            x = tokens[c]
            a = acceptance_probability(rule, p, q, x, fault)
            if a > 0:
                walk(c, emitted + (x,), weight * a)
            weight *= 1 - a
            if weight == 0:
                return
            p, q = after_rejection(rule, p, q, x, fault)
        for token, prob in enumerate(p.tolist()):
            if prob > 0:
                key = emitted + (token,)
                law[key] = law.get(key, 0.0) + weight * prob

    walk(0, (), 1.0)
    return law


def drawn_children_law(p: np.ndarray, q: np.ndarray, count: int,
                       fault: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The law of one node's walk, over the draws of its ``count`` children drawn one after another
    without replacement from ``q`` and verified by recursive rejection sampling (the
    without-replacement rule of :func:`verify_tree_nodes`, or its ``q_not_updated`` fault).

    ``p``, ``q`` [V] float64 distributions at the node (target, draft). Returns (``accepted``
    [count, V]: accepted[i, y] = P(child i is accepted and carries y), ``residual`` [V]:
    P(every child rejected, the residual draw is y)); ``accepted.sum(0) + residual`` is the law of
    the node's next emitted token, which is ``p`` for the honest rule. The same rule as the
    sampled walk (accept min(1, p/qc), residual max(p - qc, 0), qc renormalised without each
    rejected child; an empty residual keeps p), vectorised over the draws: the tests check it
    against :func:`emission_distribution` averaged over every draw. Cost O(S^count) memory with S
    the tokens where p or q is positive (count <= 2 at V = 512; larger counts on small supports).
    """
    if fault not in (None, "q_not_updated"):
        raise ValueError(f"drawn_children_law models the without-replacement rule or its q_not_updated fault, not {fault!r}")
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    support = np.flatnonzero((p > 0) | (q > 0))  # other tokens are never drawn nor emitted
    accepted, residual = np.zeros((count, p.shape[0])), np.zeros(p.shape[0])
    sub_accepted, sub_residual = _drawn_law(p[support], q[support], q[support], count, fault is not None)
    accepted[:, support], residual[support] = sub_accepted, sub_residual
    return accepted, residual


def _normalized_rows(rows: np.ndarray, empty: np.ndarray | float) -> np.ndarray:
    total = rows.sum(-1, keepdims=True)
    return np.where(total > 0, rows / np.where(total > 0, total, 1.0), empty)


def _drawn_law(p, draw, rule_q, count, keep_q):
    """:func:`drawn_children_law` over leading batch axes: ``p`` the residual, ``draw`` the
    distribution the next child is drawn from, ``rule_q`` the q of the rule (``draw`` honestly;
    the original q when ``keep_q``, the fault). Returns ([count, ..., S], [..., S])."""
    if count == 0:
        return np.zeros((0,) + p.shape), p.copy()
    ratio = np.where(rule_q > 0, np.minimum(1.0, p / np.where(rule_q > 0, rule_q, 1.0)), 0.0)
    first = draw * ratio  # the first child is drawn and accepted
    rejected = draw * (1.0 - ratio)  # [..., S]: drawn and rejected, per token
    p_next = _normalized_rows(np.maximum(p - rule_q, 0.0), p)  # the same whichever token was rejected
    if count == 1:
        return first[None], rejected.sum(-1, keepdims=True) * p_next
    # One more axis: the rejected token x. The next child is drawn from draw without x.
    size = p.shape[-1]
    draw_next = _normalized_rows(np.where(np.eye(size, dtype=bool), 0.0, draw[..., None, :]), 0.0)
    rule_next = np.broadcast_to(rule_q[..., None, :], draw_next.shape) if keep_q else draw_next
    p_after = np.broadcast_to(p_next[..., None, :], draw_next.shape)
    rest, residual = _drawn_law(p_after, draw_next, rule_next, count - 1, keep_q)
    exhausted = draw_next.sum(-1, keepdims=True) == 0  # x held all of draw: no sibling follows
    rest, residual = np.where(exhausted, 0.0, rest), np.where(exhausted, p_after, residual)
    return (np.concatenate([first[None], np.einsum("...x,k...xv->k...v", rejected, rest)]),
            np.einsum("...x,...xv->...v", rejected, residual))


# ---------------------------------------------------------------------------------------------
# Reference verifier on a transformers model
# ---------------------------------------------------------------------------------------------


class ReferenceTreeVerifier:
    """Tree verification on a transformers causal LM (e.g. ``LlamaForCausalLM``, eager or sdpa)
    with a ``DynamicCache``, one request at a time.

    The cache holds the KV of ``cached_tokens``. A step's context must extend them by at least one
    token; its last token is the root. :meth:`tree_logits` runs one forward over the uncached
    context and the tree nodes (laid out after the context in node order); :meth:`compact` keeps
    the accepted path's KV in consecutive slots after the context and drops the rest, so
    afterwards ``cached_tokens`` = context + accepted tokens.
    """

    def __init__(self, model, params: SamplingParams = SamplingParams(),
                 rule: AcceptanceRule | str = AcceptanceRule.ONE_HOT):
        from transformers import DynamicCache

        self.model = model
        self.params = params
        self.rule = AcceptanceRule(rule)
        self.cache = DynamicCache(config=model.config)
        self.cached_tokens: list[int] = []
        self._pending: tuple[list[int], list[int], list[int]] | None = None  # context, parents, tokens

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[Q, K] bool -> [1, 1, Q, K] additive float mask in the model's dtype (eager adds it)."""
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.model.device)
        return mask.masked_fill(~visible.to(mask.device), torch.finfo(dtype).min)[None, None]

    @torch.no_grad()
    def tree_logits(self, context: Sequence[int], parents: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Logits after every node, [N, V] float32 (row 0: after the root = ``context[-1]``)."""
        if self._pending is not None:
            self.compact([])  # a tree that was never verified: keep only its context
        context, parents, tokens = [int(t) for t in context], _check_parents(parents), [int(t) for t in tokens]
        if len(tokens) != len(parents):
            raise ValueError(f"parents has {len(parents)} entries, tokens {len(tokens)}")
        cached, n = len(self.cached_tokens), len(context)
        if context[:cached] != self.cached_tokens or n <= cached:
            raise ValueError("the context must extend the cached tokens by at least one token (the root)")
        fresh = n - cached  # uncached context tokens, the root last
        query = fresh + len(tokens) - 1
        visible = torch.zeros(query, cached + query, dtype=torch.bool)
        visible[:, :cached] = True
        visible[:fresh, cached:n] = torch.ones(fresh, fresh, dtype=torch.bool).tril()  # context: causal
        visible[fresh:, cached:n] = True  # tree nodes see the whole context, the root included
        visible[fresh:, n:] = tree_attention_mask(parents)[1:, 1:]  # ... and their ancestors and themselves
        positions = torch.cat([torch.arange(cached, n), tree_positions(parents, n - 1)[1:]])
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([context[cached:] + tokens[1:]], device=device),
            attention_mask=self._mask(visible),
            position_ids=positions[None].to(device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self._pending = (context, parents, tokens)
        return out.logits[0, fresh - 1:].float()

    def compact(self, accepted_nodes: Sequence[int]) -> None:
        """Keep the KV of the accepted path (node indices root -> leaf, root excluded) right after
        the context and drop every other tree node."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        if self._pending is None:
            raise ValueError("compact() needs a tree_logits() call first")
        context, parents, tokens = self._pending
        accepted = [int(a) for a in accepted_nodes]
        previous = 0
        for node in accepted:
            if not 0 < node < len(parents) or parents[node] != previous:
                raise ValueError(f"accepted nodes {accepted} are not a path from the root")
            previous = node
        n, k = len(context), len(accepted)
        # Node a sits in slot n + a - 1 and was rotated for position n - 1 + depth(a): the accepted
        # node at depth i moves to slot n + i - 1, which is that very position.
        source = torch.tensor([n + a - 1 for a in accepted], dtype=torch.long)
        for layer in self.cache.layers:
            if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
                raise NotImplementedError(f"cache layer {type(layer).__name__} cannot be compacted")
            if k:
                index = source.to(layer.keys.device)
                layer.keys[..., n:n + k, :] = layer.keys[..., index, :]  # gathers a copy first
                layer.values[..., n:n + k, :] = layer.values[..., index, :]
        self.cache.crop(-(len(tokens) - 1 - k))  # a negative count removes that many from the end
        self.cached_tokens = context + [tokens[a] for a in accepted]
        self._pending = None

    def step(self, context: Sequence[int], tree: TokenTree, generator: torch.Generator | None = None,
             fault: str | None = None) -> tuple[list[int], list[int]]:
        """One full verify step: forward, processed target probs, the walk, compaction.

        Returns (accepted nodes, emitted tokens); the next context is ``context + emitted``.
        """
        logits = self.tree_logits(context, tree.parents, tree.tokens)
        target = processed_probs(logits, self.params).double()
        needs_q = self.rule is not AcceptanceRule.ONE_HOT or fault == "iid_on_topk"
        draft = draft_probs_from_tree(tree) if needs_q else None  # greedy ignores it
        accepted, emitted = verify_tree_nodes(target, draft, tree.parents, tree.tokens, self.rule, generator,
                                              greedy=self.params.greedy, fault=fault)
        self.compact(accepted)
        return accepted, emitted
