"""Drafters of different kinds merged into one token tree per request (issue 31 item 2).

:class:`MergedTreeProposer` wraps a :class:`~proposers.tree.TreeProposer` (draft models or heads,
drawing their own tree or chain) with zero-cost drafters (:class:`~proposers.suffix.SuffixDrafter`,
:class:`~proposers.ngram.NgramDrafter`; one-hot q). Per request that may be verified as a tree, it
asks the zero-cost drafters first (their chains cost no forward), gives the model what is left of
the request's node budget, and merges every proposal into one tree
(:func:`~proposers.merged_tree.merge_proposals`): one node per distinct token path, each node's
proposal groups tried in drafter order (zero-cost drafters first, then the model), each with its
own q. The engine verifies it with :func:`~proposers.merged_tree.verify_merged_tree`, SpecInfer's
multi-step rule across drafters, exact by enumeration (tests/test_tree_merged.py).

Budget. Of the request's γ (the rows vLLM verifies), the zero-cost chains take at most
``ceil(zero_cost_share * γ)`` tokens each; the model gets γ minus the distinct nodes they add (none
when nothing matched: the model's tree is then the draft, unchanged). Every choice here depends
only on the request's own context and settings (a seeded request's suffix match uses its own
context only), so a seeded request stays reproducible; none looks at the target, so any split is
exact and only its speed is at stake.

Requests that must be chains (``tree_ok`` false), and proposers that verify chains, get the model's
draft unchanged: merging needs tree verification.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.merged_tree import DrafterProposal, MergedTree, merge_proposals


class MergedTreeProposer(Proposer):
    """A tree proposer's drafts merged with zero-cost drafters' chains into one tree per request.

    ``model``: the :class:`~proposers.tree.TreeProposer` (its ``verify`` must be ``"tree"`` for
    anything to merge). ``zero_cost``: (name, drafter) pairs, tried in this order before the model.
    ``last_trees[request_id]``: the tree drafted at the latest step, a :class:`MergedTree` when
    several drafters proposed, else the model's own :class:`~proposers.tree.TokenTree`; the tree
    verifier reads it. ``last_drafters[request_id]``: the names of the merged tree's drafters, in
    the order of its drafter indices.
    """

    def __init__(self, model, zero_cost: Sequence[tuple[str, Proposer]], zero_cost_share: float = 0.5):
        if not 0 < zero_cost_share <= 1:
            raise ValueError(f"zero_cost_share must be in (0, 1], got {zero_cost_share!r}")
        if not zero_cost:
            raise ValueError("a merged tree needs at least one zero-cost drafter")
        self.model = model
        self.zero_cost = list(zero_cost)
        self.zero_cost_share = float(zero_cost_share)
        self.vocab_size = model.vocab_size
        self.verify = model.verify
        self.last_trees: dict[str, object] = {}
        self.last_drafters: dict[str, list[str]] = {}

    @property
    def metrics(self):
        return self.model.metrics

    @property
    def inner(self):  # what wrappers expose (tree_verification.tree_proposer walks .inner)
        return self.model

    def free(self, request_id: str) -> None:
        self.model.free(request_id)
        for _, drafter in self.zero_cost:
            drafter.free(request_id)
        self.last_trees.pop(request_id, None)
        self.last_drafters.pop(request_id, None)

    def tracked_request_ids(self) -> set[str]:
        ids = self.model.tracked_request_ids() | set(self.last_trees)
        for _, drafter in self.zero_cost:
            ids |= drafter.tracked_request_ids()
        return ids

    def zero_cost_limit(self, gamma: int) -> int:
        return math.ceil(self.zero_cost_share * gamma)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        merging = [self.verify == "tree" and r.tree_ok and r.gamma > 0 for r in requests]
        # Zero-cost chains first (capped), for the requests that may be merged trees.
        chains: list[list[tuple[str, list[int]]]] = [[] for _ in requests]
        asked = [dataclasses.replace(r, gamma=self.zero_cost_limit(r.gamma)) for r, m in zip(requests, merging) if m]
        rows = [i for i, m in enumerate(merging) if m]
        for name, drafter in self.zero_cost:
            for i, draft in zip(rows, drafter.propose(asked) if asked else []):
                if draft.token_ids:
                    chains[i].append((name, list(draft.token_ids)))
        # The model gets what the zero-cost chains leave of each request's budget.
        model_requests = []
        for request, found in zip(requests, chains):
            added = merge_proposals([DrafterProposal.chain(tokens) for _, tokens in found]).num_nodes - 1 if found else 0
            model_requests.append(request if not added else dataclasses.replace(request, gamma=request.gamma - added))
        model_drafts = self.model.propose(model_requests)
        drafts = []
        for request, found, draft in zip(requests, chains, model_drafts):
            rid = request.request_id
            model_tree = self.model.last_trees.get(rid) if draft.token_ids else None
            if not found:
                self._remember(rid, model_tree, ["model"] if model_tree is not None else [])
                drafts.append(draft)
                continue
            proposals = [DrafterProposal.chain(tokens, name=name) for name, tokens in found]
            names = [name for name, _ in found]
            if model_tree is not None:
                proposals.append(DrafterProposal.from_token_tree(model_tree, name="model"))
                names.append("model")
            tree = merge_proposals(proposals, node_budget=request.gamma, vocab_size=self.vocab_size)
            self._remember(rid, tree, names)
            tokens = tree.tokens[1:]
            probs = torch.nn.functional.one_hot(torch.tensor(tokens), self.vocab_size).float().to(draft.probs.device)
            # One-hot q for vLLM: should it verify these tokens as a chain (the merged tree is a
            # chain, or a prefix of one), accepting x with p(x) is exact whoever proposed x.
            drafts.append(Draft(tokens, probs, parents=list(tree.parents)))
        return drafts

    def _remember(self, request_id: str, tree, names: list[str]) -> None:
        if tree is None:
            self.last_trees.pop(request_id, None)
            self.last_drafters.pop(request_id, None)
        else:
            self.last_trees[request_id] = tree
            self.last_drafters[request_id] = names

    def accepted_drafter_kinds(self, request_id: str, drafters: Sequence[int]) -> tuple[int, int]:
        """(zero-cost, model) counts among the accepting drafters of a walk of this request's tree."""
        names = self.last_drafters.get(request_id, [])
        model = sum(1 for k in drafters if k < len(names) and names[k] == "model")
        return len(drafters) - model, model


def is_merged(tree) -> bool:
    return isinstance(tree, MergedTree)
