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
when nothing matched: the model's tree is then the draft, unchanged).

Whether the model drafts at all. A model's tree costs a draft forward per level and a tree
verification; a zero-cost chain that the target keeps accepting (repeated text at T = 0) is worth
more alone, at its full length and verified as a chain. So per request and step, with the
drafter choice's goodput model (:mod:`proposers.choice`, its default costs c 0.12 and v 0.07):
the zero-cost chain alone, ``(1 + E(α_z, L)) / (1 + v·L)``, against the merged tree,
``(1 + A_m) / (1 + (c + v)·k)``, where α_z is the request's per-token acceptance of its longest
zero-cost chain, measured at every step against the emitted tokens (they are exact target
samples whoever drafted), and A_m the nodes of the model's tree that the emitted tokens follow per
step. The model skipped, its estimate is refreshed every ``probe_every`` (4) such steps by
drafting with it. Both start from fixed priors for a seeded request and from the recent average
of unseeded requests (greedy and sampled apart) for the others.

Every choice here depends only on the request's own context, history and settings (a seeded
request's suffix match uses its own context only), so a seeded request stays reproducible; none
looks at this step's target, so any split is exact and only its speed is at stake.

Requests that must be chains (``tree_ok`` false), and proposers that verify chains, get the model's
draft unchanged: merging needs tree verification.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.choice import Acceptance, ChoicePolicy, chain_goodput, model_goodput
from vllm_specplugin.proposers.merged_tree import DrafterProposal, MergedTree, merge_proposals
from vllm_specplugin.proposers.metrics import matched_prefix
from vllm_specplugin.proposers.tree import tree_accepted_path


@dataclasses.dataclass
class _MergeState:
    zero_cost: Acceptance  # per token, of the longest zero-cost chain
    model: Acceptance  # accepted model-tree nodes per step
    sampled: bool
    context_length: int = -1
    chain: list[int] = dataclasses.field(default_factory=list)  # the longest zero-cost chain proposed
    model_tree: tuple[list[int], list[int]] | None = None  # the model's (tokens, parents) when it drafted
    skipped: int = 0  # consecutive steps without the model


class MergedTreeProposer(Proposer):
    """A tree proposer's drafts merged with zero-cost drafters' chains into one tree per request.

    ``model``: the :class:`~proposers.tree.TreeProposer` (its ``verify`` must be ``"tree"`` for
    anything to merge). ``zero_cost``: (name, drafter) pairs, tried in this order before the model.
    ``last_trees[request_id]``: the tree drafted at the latest step, a :class:`MergedTree` when a
    zero-cost drafter proposed (with or without the model), else the model's own
    :class:`~proposers.tree.TokenTree`; the tree verifier reads it. ``last_drafters[request_id]``: the names of the merged tree's drafters, in
    the order of its drafter indices.
    """

    def __init__(self, model, zero_cost: Sequence[tuple[str, Proposer]], zero_cost_share: float = 0.5,
                 policy: ChoicePolicy = ChoicePolicy(), skip_model: bool = True):
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
        self.policy = policy
        self.skip_model = skip_model  # False: the model drafts every step (no goodput rule)
        self._states: dict[str, _MergeState] = {}
        # Recent averages over unseeded requests, greedy and sampled apart: where new ones start.
        # The model's starts empty (its prior depends on γ) and is used once it holds about 14
        # steps' worth of outcomes (tested > 0.5 at population_weight 0.05).
        self._population = {(kind, sampled): (Acceptance(policy.suffix_prior) if kind == "zero_cost"
                                              else Acceptance(0.0, weight=1e-9))
                            for kind in ("zero_cost", "model") for sampled in (False, True)}
        self.skipped_model: dict[str, bool] = {}  # request id -> this step drafted without the model

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
        self._states.pop(request_id, None)
        self.skipped_model.pop(request_id, None)

    def tracked_request_ids(self) -> set[str]:
        ids = self.model.tracked_request_ids() | set(self.last_trees) | set(self._states)
        for _, drafter in self.zero_cost:
            ids |= drafter.tracked_request_ids()
        return ids

    def zero_cost_limit(self, gamma: int) -> int:
        return math.ceil(self.zero_cost_share * gamma)

    # -- whether the model drafts: the request's measured acceptance -------------------------

    def _state(self, request: DraftRequest) -> _MergeState:
        state = self._states.get(request.request_id)
        if state is None:
            sampled = request.params.temperature > 0
            model_prior = self.policy.model_prior_accepted(request.gamma)
            if request.seeded:  # fixed priors: nothing from other requests
                zero_cost, model = self.policy.suffix_prior, model_prior
            else:
                zero_cost = self._population["zero_cost", sampled].alpha
                population = self._population["model", sampled]
                model = population.alpha if population.tested > 0.5 else model_prior
            state = self._states[request.request_id] = _MergeState(Acceptance(zero_cost), Acceptance(model), sampled)
        return state

    def _update(self, state: _MergeState, kind: str, accepted: float, tested: float, seeded: bool) -> None:
        if tested <= 0:
            return
        (state.zero_cost if kind == "zero_cost" else state.model).observe(accepted, tested, self.policy.ema_weight)
        if not seeded:
            self._population[kind, state.sampled].observe(accepted, tested, self.policy.population_weight)

    def _observe(self, request: DraftRequest, state: _MergeState) -> None:
        """Score last step's zero-cost chain and model tree against the tokens emitted since."""
        emitted = list(request.context[state.context_length:]) if state.context_length >= 0 else []
        if emitted and state.chain:
            matched = matched_prefix(state.chain, emitted)
            self._update(state, "zero_cost", matched, min(len(state.chain), matched + 1, len(emitted)), request.seeded)
        if emitted and state.model_tree is not None:
            tokens, parents = state.model_tree
            self._update(state, "model", len(tree_accepted_path(tokens, parents, emitted)), 1, request.seeded)
        state.chain, state.model_tree = [], None
        state.context_length = len(request.context)

    def _skip_model(self, request: DraftRequest, state: _MergeState, length: int) -> bool:
        """The longest zero-cost chain (``length`` tokens) alone beats the merged tree, by the
        choice's goodput model; every ``probe_every``-th skipped step drafts with the model."""
        alone = chain_goodput(self.policy, state.zero_cost.alpha, length)
        merged = model_goodput(self.policy, state.model.alpha, request.gamma)
        skip = self.skip_model and length > 0 and alone >= merged
        if skip:
            state.skipped += 1
            if state.skipped % self.policy.probe_every == 0:
                skip = False  # a probe keeps the model's estimate current
        else:
            state.skipped = 0
        return skip

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        merging = [self.verify == "tree" and r.tree_ok and r.gamma > 0 for r in requests]
        # Zero-cost chains first, for the requests that may be merged trees (full length: a chain
        # drafting alone gets the whole budget; merged with the model's tree, it is capped).
        chains: list[list[tuple[str, list[int]]]] = [[] for _ in requests]
        asked = [r for r, m in zip(requests, merging) if m]
        rows = [i for i, m in enumerate(merging) if m]
        for name, drafter in self.zero_cost:
            for i, draft in zip(rows, drafter.propose(asked) if asked else []):
                if draft.token_ids:
                    chains[i].append((name, list(draft.token_ids)))
        model_requests = []
        for i, (request, found) in enumerate(zip(requests, chains)):
            if not merging[i]:
                model_requests.append(request)
                continue
            state = self._state(request)
            self._observe(request, state)
            longest = max((tokens for _, tokens in found), key=len, default=[])
            state.chain = list(longest)
            skip = self._skip_model(request, state, len(longest))
            self.skipped_model[request.request_id] = skip
            if self.metrics is not None:
                if skip:
                    self.metrics.choice_suffix_steps += 1
                else:
                    self.metrics.choice_model_steps += 1
            if skip:
                model_requests.append(dataclasses.replace(request, gamma=0))
                continue
            # The model gets what the (capped) zero-cost chains leave of the request's budget.
            limit = self.zero_cost_limit(request.gamma)
            chains[i] = found = [(name, tokens[:limit]) for name, tokens in found]
            added = merge_proposals([DrafterProposal.chain(tokens) for _, tokens in found]).num_nodes - 1 if found else 0
            model_requests.append(request if not added else dataclasses.replace(request, gamma=request.gamma - added))
        model_drafts = self.model.propose(model_requests)
        drafts = []
        for request, found, draft in zip(requests, chains, model_drafts):
            rid = request.request_id
            model_tree = self.model.last_trees.get(rid) if draft.token_ids else None
            if model_tree is not None and rid in self._states:
                self._states[rid].model_tree = (list(model_tree.tokens[1:]), list(model_tree.parents))
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
