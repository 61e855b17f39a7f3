"""Predicted tokens per target pass for whole-tree verification, the best single path and the
plain chain, from the target's and the draft's probabilities, as the verifiers use them.

For a (target, draft) pair of HF checkpoints, the benchmark's held-out prompts and a temperature
T, the target's own continuation of each prompt is generated (greedy at T = 0; sampled at T with
a fixed seed), and at every position t of it (context = prompt + continuation[:t]) this computes
the law of the number of tokens one target pass emits (accepted drafts + the one bonus /
resampled token) under:

* **whole tree** (``verify = "tree"``): at T = 0 the draft's top-k tree (:func:`build_tree` on the
  draft's T = 1 probabilities, as ``TreeProposer`` builds it for greedy requests) walked with
  greedy verification (one-hot rule on δ(argmax P)); at T > 0 trees drawn without replacement
  (:func:`build_sampled_tree`) walked with recursive rejection sampling. Given a tree the law is
  exact (:func:`tree_pass_law`: the verifier's own rule helpers ``acceptance_probability`` /
  ``after_rejection`` followed with probabilities instead of draws); at T > 0 the expectation over
  the draft's draws of the tree is a Monte Carlo average over ``draws`` trees per position (a
  standard error is reported; exact enumeration over the draws, :func:`sampled_tree_law_exact`,
  is only feasible on tiny vocabularies and is what the unit tests check the estimator against);
* **best path** (``verify = "chain"``): the path to ``TokenTree.best_node`` of the same top-k tree,
  submitted with one-hot q and verified by vLLM's chain sampler: accept x with p(x), i.e. the
  one-hot rule on a chain (greedy at T = 0);
* **chain**: the plain draft chain of ``depth`` tokens (greedy at T = 0; drawn from the draft at
  T > 0, standard rejection sampling, i.e. the without-replacement rule with one child), exact
  per drawn chain and Monte Carlo over the draws at T > 0; and the textbook formula
  E = 1 + Σ_k Π_{i≤k} α_i with α_i = Σ_x min(p, q) along the target's continuation
  (teacher-forced; the i.i.d. approximation, which ignores that after an acceptance the next
  draft token is conditioned on a drafted, not the target's, prefix).

Two averages are printed. *Per position*: the mean over every position of the expected tokens
per pass there. vLLM's counter (``1 + accepted / drafts``) is a *per-pass* average: passes land
only on the positions reached after each pass's jump (a pass at t emits k tokens, the next pass is
at t + k), so positions where passes emit many tokens are skipped more often, and the per-pass
average is a ratio of sums, E[tokens] / E[passes], not a mean of per-position means. The
per-pass column corrects for it with the jump chain along the same continuation: from the first
pass (position 1, after the prefill's token) to ``max_tokens``, N(t) = 1 + Σ_k P_t(k) N(t + k)
passes and T(t) = Σ_k P_t(k) (k + T(t + k)) tokens (N = T = 0 at t ≥ max_tokens; an overshooting
last pass counts all its tokens, as vLLM's counters do), summed over prompts; per pass =
Σ T(1) / Σ N(1). It still walks the one continuation: after a pass that emits k tokens the
actual next context is a fresh target sample, not the fixed continuation (at T = 0 they are the
same).

Also printed: the draft-only prediction the plugin counts today (``tree_expected_best``:
1 + the best path's expected accepted length under the draft's own probabilities).

Target and draft run in float32 (as the benchmark serves them) through transformers, one
forward per tree forest with a tree attention mask over a cached prefix (positions n0 + depth);
distinct paths are evaluated once per position. No vLLM import.

CLI::

    nice -n 19 python -m vllm_specplugin.throughput.tree_prediction --prompts 4 --temperatures 0,1 \\
        --measured runs/bench/tree_verification-20261201-030624.json \\
        --measured runs/bench/tree_verification-20261201-032721.json --json /tmp/pred.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_specplugin.paths import models_dir, require_demo_models
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample
from vllm_specplugin.proposers.tree import (TokenTree, build_dynamic_tree, build_sampled_tree, build_tree,
                                           enumerate_draws, expected_chain_and_tree, predicted_first_acceptance)
from vllm_specplugin.proposers.tree_verify import (AcceptanceRule, acceptance_probability, after_rejection,
                                                   draft_probs_from_tree, tree_attention_mask, tree_children,
                                                   tree_depths)

MODELS = models_dir()
METHODS = ("tree", "best_path", "chain", "chain_formula", "draft_only_best")


# ---------------------------------------------------------------------------------------------
# Exact laws (float64)
# ---------------------------------------------------------------------------------------------


def _rows64(rows: torch.Tensor, needed: Sequence[int]) -> torch.Tensor:
    rows = rows.detach().to("cpu", torch.float64).clone()
    for j in needed:
        total = rows[j].sum()
        if not total > 0:
            raise ValueError(f"row {j} has no mass")
        rows[j] = rows[j] / total
    return rows


def tree_pass_law(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, parents: Sequence[int],
                  tokens: Sequence[int], rule: AcceptanceRule | str, *, greedy: bool = False) -> np.ndarray:
    """Exact law of the number of tokens one walk of this fixed tree emits: [max depth + 2] float64,
    entry k = P(k tokens: k - 1 accepted nodes + the residual / bonus draw); entry 0 is 0.

    ``target_probs`` [N, V]: P[j] after node j (row 0 after the root); ``draft_probs`` [N, V] the
    rows node j's children were drawn from (None for the one-hot rule); ``greedy`` walks
    δ(argmax P) with the one-hot rule, as the plugin does for greedy requests. The walk is
    :func:`~vllm_specplugin.proposers.tree_verify.verify_tree_nodes`'s (children in node order,
    the same ``acceptance_probability`` / ``after_rejection``), followed with probabilities.
    """
    rule = AcceptanceRule(rule)
    parents, tokens = [int(p) for p in parents], [int(t) for t in tokens]
    children = tree_children(parents)
    depths = tree_depths(parents)
    target = _rows64(target_probs, range(len(parents)))
    if greedy:
        target = torch.nn.functional.one_hot(target.argmax(-1), target.shape[-1]).double()
        rule = AcceptanceRule.ONE_HOT
    draft = None
    if rule is not AcceptanceRule.ONE_HOT:
        if draft_probs is None:
            raise ValueError(f"the {rule.value} rule needs draft_probs")
        draft = _rows64(draft_probs, [j for j in range(len(parents)) if children[j]])
    law = np.zeros(max(depths) + 2)

    def walk(j: int, weight: float) -> None:
        p, q = target[j], (draft[j] if draft is not None else None)
        for c in children[j]:
            a = acceptance_probability(rule, p, q, tokens[c])
            if a > 0:
                walk(c, weight * a)
            weight *= 1 - a
            if weight <= 0:
                return
            p, q = after_rejection(rule, p, q, tokens[c])
        law[depths[j] + 1] += weight

    walk(0, 1.0)
    return law


def chain_pass_law(alphas: Sequence[float]) -> np.ndarray:
    """Law of the tokens per pass of a chain whose i-th draft is accepted with probability
    ``alphas[i]`` given the ones before it were: P(k) = Π_{i<k-1} α_i · (1 - α_{k-1}), the last
    entry Π α. For a sampled chain with α_i = Σ min(p_i, q_i) this is the textbook i.i.d.
    formula (E = 1 + Σ_k Π_{i≤k} α_i); for a greedy chain pass 0/1 acceptance indicators."""
    law = np.zeros(len(alphas) + 2)
    survive = 1.0
    for k, alpha in enumerate(alphas):
        law[k + 1] = survive * (1 - alpha)
        survive *= alpha
    law[len(alphas) + 1] = survive
    return law


def expected_tokens(law: np.ndarray) -> float:
    return float(np.dot(np.arange(len(law)), law))


def alpha(p: torch.Tensor, q: torch.Tensor) -> float:
    """Σ_x min(p(x), q(x)) (float64): the chance a token drawn from q is accepted against p."""
    return float(torch.minimum(p.double() / p.double().sum(), q.double() / q.double().sum()).sum())


def _chain_tree(path_tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    return list(range(-1, len(path_tokens))), [-1] + [int(t) for t in path_tokens]


def path_rows(tree: TokenTree, rows_of: Callable[[list[tuple[int, ...]]], torch.Tensor]) -> torch.Tensor:
    """The target rows after each node of ``tree`` (row 0: after the root), from ``rows_of(paths)``."""
    return rows_of([tuple(tree.path(n)) for n in range(tree.num_nodes)])


def sampled_tree_law_exact(root_q: torch.Tensor, expand: Callable[[list[list[int]]], torch.Tensor],
                           target_of: Callable[[list[tuple[int, ...]]], torch.Tensor], node_budget: int,
                           depth: int, branching: int) -> np.ndarray:
    """The law of :func:`tree_pass_law` averaged over every tree :func:`build_sampled_tree` can
    draw (each draw sequence replayed once, depth-first), walked with the without-replacement
    rule: exact, for tiny vocabularies only (the unit tests' reference for the Monte Carlo mean)."""
    total: np.ndarray | None = None

    def walk(draw):
        tree = build_sampled_tree(root_q, expand, node_budget, depth, branching, draw=draw)
        law = tree_pass_law(path_rows(tree, target_of), draft_probs_from_tree(tree), tree.parents, tree.tokens,
                            tree.rule)
        return np.pad(law, (0, depth + 2 - len(law)))

    for prob, law in enumerate_draws(walk):
        total = law * prob if total is None else total + law * prob
    return total


# ---------------------------------------------------------------------------------------------
# Models: tree forwards over a cached prefix, memoised per position
# ---------------------------------------------------------------------------------------------


def trie(paths: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int], dict[tuple[int, ...], int]]:
    """A parents-first tree holding every path and its prefixes (node 0 = the empty path):
    (parents, tokens, {path: node})."""
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, tokens = [-1], [-1]
    for path in sorted({p[:k] for p in paths for k in range(1, len(p) + 1)}, key=len):
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        tokens.append(path[-1])
    return parents, tokens, index


class PrefixModel:
    """A causal LM (float32, transformers) with a ``DynamicCache`` of the context less its last
    token; :meth:`tree_logits` runs [last token (the root) + tree nodes] in one forward with the
    tree mask (positions n0 + depth) and drops their K/V again; :meth:`advance` appends a token."""

    def __init__(self, path: str, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="sdpa").to(device).eval()
        self.device = device
        self.vocab = self.model.config.vocab_size
        self.cache = None
        self.context: list[int] = []

    @torch.no_grad()
    def reset(self, context: Sequence[int]) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.context = [int(t) for t in context]
        if len(self.context) > 1:
            self.model(input_ids=torch.tensor([self.context[:-1]], device=self.device), past_key_values=self.cache,
                       use_cache=True)

    @torch.no_grad()
    def advance(self, token: int) -> None:
        """The context grows by ``token``: the old root's K/V join the cache."""
        n = len(self.context) - 1
        self.model(input_ids=torch.tensor([[self.context[-1]]], device=self.device),
                   position_ids=torch.tensor([[n]], device=self.device), past_key_values=self.cache, use_cache=True)
        self.context.append(int(token))

    @torch.no_grad()
    def tree_logits(self, parents: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        n0 = len(self.context) - 1
        size = len(parents)
        visible = torch.zeros(size, n0 + size, dtype=torch.bool)
        visible[:, :n0] = True
        visible[:, n0:] = tree_attention_mask(parents)
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        positions = n0 + torch.tensor(tree_depths(parents), dtype=torch.long)
        ids = [self.context[-1]] + [int(t) for t in tokens[1:]]
        out = self.model(input_ids=torch.tensor([ids], device=self.device),
                         attention_mask=mask[None, None].to(self.device), position_ids=positions[None].to(self.device),
                         past_key_values=self.cache, use_cache=True)
        self.cache.crop(-size)  # drop the root and the nodes again
        return out.logits[0].float().cpu()


class RowCache:
    """Processed rows after each path (tuple of tokens after the root) at one position, computed
    once: missing paths are run as one tree of them and their prefixes (every node's row kept)."""

    def __init__(self, model: PrefixModel, transform: Callable[[torch.Tensor], torch.Tensor]):
        self.model, self.transform = model, transform
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.forwards = self.nodes = 0

    def __call__(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        paths = [tuple(int(t) for t in p) for p in paths]
        missing = [p for p in paths if p not in self.rows]
        if missing:
            parents, tokens, index = trie(missing)
            rows = self.transform(self.model.tree_logits(parents, tokens))
            self.forwards += 1
            self.nodes += len(parents)
            for path, node in index.items():
                self.rows.setdefault(path, rows[node])
        return torch.stack([self.rows[p] for p in paths])


# ---------------------------------------------------------------------------------------------
# One position
# ---------------------------------------------------------------------------------------------


@dataclass
class Setting:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    budgets: tuple[int, ...] = (8, 16, 32)
    depth: int = 4
    branching: int = 3
    draws: int = 8  # Monte Carlo trees (and chains) per position at T > 0
    # (alpha, confidence) by depth: also predict TreeProposer's dynamic tree of each budget calibrated
    # so ("dynamic N") and the chain of N drafts it is compared with ("chain N").
    dynamic: tuple[list[float], list[float]] | None = None

    @property
    def greedy(self) -> bool:
        return SamplingParams(self.temperature).greedy

    @property
    def params(self) -> SamplingParams:
        """The request's processing (target rows, and the draft's rows at T > 0)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def draft_params(self) -> SamplingParams:
        """What TreeProposer builds trees on: greedy requests use the draft at T = 1."""
        return SamplingParams(1.0) if self.greedy else self.params


@dataclass
class PositionResult:
    laws: dict[str, np.ndarray]  # key "tree 8", "best_path 8", "chain", "chain_formula", "draft_only_best 8"
    draw_means: dict[str, list[float]] = field(default_factory=dict)  # per-draw expectations (Monte Carlo keys)
    # Per depth d (index d - 1) of the "chain" drafts: [P(reach the node), P(accept it), P(reach) x its
    # draft-as-proxy prediction], averaged over the draws: TreeProposer's calibration, measured exactly.
    calibration: np.ndarray | None = None
    trees: dict[str, list[TokenTree]] = field(default_factory=dict)  # the drawn trees (keep_trees only)


def _pad(law: np.ndarray, size: int) -> np.ndarray:
    return np.pad(law, (0, size - len(law)))


def predict_position(setting: Setting, draft_rows: RowCache, target_rows: RowCache,
                     generator: torch.Generator, keep_trees: bool = False) -> PositionResult:
    """Laws of tokens per pass at one position (the row caches hold this position's rows); the
    chain formula's law is added by :func:`run_prompt`, which knows α ahead of the position."""
    depth, size = setting.depth, setting.depth + 2
    root_q = draft_rows([()])[0]

    def expand(paths):
        return draft_rows(paths)

    topk = {b: build_tree(root_q, expand, b, depth, setting.branching) for b in setting.budgets}
    sampled: dict[int, list[TokenTree]] = {}
    chains: list[TokenTree] = []
    if setting.greedy:
        greedy_chain = _greedy_chain(root_q, draft_rows, depth)
    else:
        for b in setting.budgets:
            sampled[b] = [build_sampled_tree(root_q, expand, b, depth, setting.branching, generator)
                          for _ in range(setting.draws)]
        chains = [build_sampled_tree(root_q, expand, depth, depth, 1, generator) for _ in range(setting.draws)]
    # Every target row needed, in one forward.
    wanted = [tuple(t.path(n)) for t in topk.values() for n in range(t.num_nodes)]
    wanted += [tuple(t.path(n)) for ts in sampled.values() for t in ts for n in range(t.num_nodes)]
    wanted += [tuple(t.path(n)) for t in chains for n in range(t.num_nodes)]
    if setting.greedy:
        wanted += [tuple(greedy_chain[:k]) for k in range(depth + 1)]
    target_rows(wanted)

    out = PositionResult({})
    greedy = setting.greedy
    if setting.dynamic is not None:
        _predict_dynamic(setting, root_q, expand, draft_rows, target_rows, generator, out)
    for b, tree in topk.items():
        node = tree.best_node(max_depth=depth)
        path = tree.path(node)
        parents, tokens = _chain_tree(path)
        rows = target_rows([tuple(path[:k]) for k in range(len(path) + 1)])
        out.laws[f"best_path {b}"] = _pad(tree_pass_law(rows, None, parents, tokens, "one_hot", greedy=greedy), size)
        out.draw_means[f"draft_only_best {b}"] = [1 + tree.expected_accepted_length(node)]
        if greedy:
            out.laws[f"tree {b}"] = _pad(tree_pass_law(path_rows(tree, target_rows), None, tree.parents, tree.tokens,
                                                       "one_hot", greedy=True), size)
    if greedy:
        out.laws["chain"] = _greedy_chain_law(greedy_chain, target_rows, size)
    else:
        for b, trees in sampled.items():
            _add_drawn_laws(out, f"tree {b}", trees, target_rows, size)
        _add_drawn_laws(out, "chain", chains, target_rows, size)
        out.calibration = np.mean([chain_calibration(t, path_rows(t, target_rows)) for t in chains], axis=0)
        if keep_trees:
            out.trees = {**{f"tree {b}": trees for b, trees in sampled.items()}, "chain": chains}
    return out


def _greedy_chain(root_q: torch.Tensor, draft_rows: RowCache, length: int) -> list[int]:
    """The draft's argmax chain of ``length`` tokens from ``root_q``."""
    chain, node_q = [], root_q
    for _ in range(length):
        chain.append(int(node_q.argmax()))
        node_q = draft_rows([tuple(chain)])[0]
    return chain


def _greedy_chain_law(chain: Sequence[int], target_rows: RowCache, size: int) -> np.ndarray:
    """The law of ``chain`` walked greedily (one-hot rule on the target's argmax), padded to ``size``."""
    parents, tokens = _chain_tree(chain)
    rows = target_rows([tuple(chain[:k]) for k in range(len(chain) + 1)])
    return _pad(tree_pass_law(rows, None, parents, tokens, "one_hot", greedy=True), size)


def _add_drawn_laws(out: PositionResult, key: str, trees: Sequence[TokenTree], target_rows: RowCache,
                    size: int) -> None:
    """``out.laws[key]``: the mean law of the drawn ``trees``, each walked by its own rule with the rows
    its children were drawn from; ``out.draw_means[key]``: each tree's expected tokens."""
    laws = [_pad(tree_pass_law(path_rows(t, target_rows), draft_probs_from_tree(t), t.parents, t.tokens, t.rule),
                 size) for t in trees]
    out.laws[key] = np.mean(laws, axis=0)
    out.draw_means[key] = [expected_tokens(law) for law in laws]


def chain_calibration(chain: TokenTree, target: torch.Tensor) -> np.ndarray:
    """[depth, 3] for one drawn chain (rule without_replacement, one child per node) and its target rows
    ``target`` [depth + 1, V] (row j after node j): per depth, P(the walk reaches the node), P(it is
    accepted) and P(reach) x the node's draft-as-proxy prediction (Σ q², as TreeProposer records it)."""
    out = np.zeros((chain.num_nodes - 1, 3))
    reach = 1.0
    for node in range(1, chain.num_nodes):
        q = chain.node_probs[node].double()
        q = q / q.sum()
        p = target[node - 1].double()
        p = p / p.sum()
        token = chain.tokens[node]
        accept = acceptance_probability(AcceptanceRule(chain.rule), p, q, token)
        out[node - 1] = (reach, reach * accept, reach * predicted_first_acceptance(q, chain.rule, token))
        reach *= accept
    return out


def _predict_dynamic(setting: Setting, root_q: torch.Tensor, expand, draft_rows: RowCache, target_rows: RowCache,
                     generator: torch.Generator, out: PositionResult) -> None:
    """Laws of "dynamic N" (build_dynamic_tree of N nodes, as TreeProposer grows it with
    setting.dynamic's calibration; drawn children at T > 0, top-k at T = 0) and "chain N" (N drafts:
    drawn at T > 0, the argmax at T = 0) for each budget N."""
    alpha, confidence = setting.dynamic
    greedy = setting.greedy
    for budget in setting.budgets:
        size = budget + 2
        if greedy:
            tree = build_dynamic_tree(root_q, expand, budget, budget, children="topk", alpha=alpha, confidence=confidence)
            target_rows([tuple(tree.path(n)) for n in range(tree.num_nodes)])
            out.laws[f"dynamic {budget}"] = _pad(tree_pass_law(path_rows(tree, target_rows), None, tree.parents,
                                                               tree.tokens, "one_hot", greedy=True), size)
            out.laws[f"chain {budget}"] = _greedy_chain_law(_greedy_chain(root_q, draft_rows, budget), target_rows,
                                                            size)
            continue
        for key, build in ((f"dynamic {budget}", lambda: build_dynamic_tree(
                root_q, expand, budget, budget, children="sampled", alpha=alpha, confidence=confidence,
                generator=generator)), (f"chain {budget}", lambda: build_sampled_tree(
                root_q, expand, budget, budget, 1, generator))):
            trees = [build() for _ in range(setting.draws)]
            target_rows([tuple(t.path(n)) for t in trees for n in range(t.num_nodes)])
            _add_drawn_laws(out, key, trees, target_rows, size)


# ---------------------------------------------------------------------------------------------
# Along a continuation; the pass-sequence correction
# ---------------------------------------------------------------------------------------------


def per_pass(laws: Sequence[np.ndarray], start: int, end: int) -> tuple[float, float]:
    """Expected (tokens, passes) of the jump chain from position ``start`` until ``end``: a pass at
    t emits k ~ laws[t] tokens and the next pass is at t + k."""
    passes = np.zeros(end + len(laws[start]) + 1)
    tokens = np.zeros_like(passes)
    for t in range(end - 1, start - 1, -1):
        law = laws[t]
        ks = np.arange(len(law))
        passes[t] = 1 + float(np.dot(law, passes[t + ks]))
        tokens[t] = float(np.dot(law, ks + tokens[t + ks]))
    return tokens[start], passes[start]


@dataclass
class PromptRun:
    laws: dict[str, list[np.ndarray]]  # per key, per position t = 1 .. max_tokens - 1
    draw_means: dict[str, list[list[float]]]
    target_forward_nodes: int = 0
    draft_forward_nodes: int = 0
    calibration: np.ndarray | None = None  # Σ over positions of PositionResult.calibration


def run_prompt(target: PrefixModel, draft: PrefixModel, prompt_ids: list[int], setting: Setting, max_tokens: int,
               seed: int, progress=None) -> PromptRun:
    """Generate the target's continuation (``max_tokens`` + depth tokens) and predict at positions
    1 .. max_tokens - 1 (vLLM's first pass follows the prefill's token)."""
    generator = torch.Generator().manual_seed(seed)
    draw_generator = torch.Generator().manual_seed(seed + 1)
    target_params, draft_params = setting.params, setting.draft_params

    def target_transform(logits):
        # Greedy walks use the argmax of these rows (tree_pass_law greedy=True).
        return processed_probs(logits, SamplingParams(1.0) if setting.greedy else target_params).double()

    def draft_transform(logits):
        return processed_probs(logits, draft_params)

    target.reset(prompt_ids)
    draft.reset(prompt_ids)
    horizon = max_tokens + setting.depth
    run = PromptRun({}, {})
    alphas, results = [], []
    for t in range(horizon):
        target_rows, draft_rows = RowCache(target, target_transform), RowCache(draft, draft_transform)
        p, q = target_rows([()])[0], draft_rows([()])[0]
        # α of the chain the plain proposer drafts here: the greedy draft's argmax agreement at
        # T = 0, Σ min(p, q) with the draft's processed q at T > 0.
        if setting.greedy:
            alphas.append(float(int(p.argmax()) == int(q.argmax())))
        else:
            alphas.append(alpha(p, q))
        if 1 <= t < max_tokens:
            results.append((t, predict_position(setting, draft_rows, target_rows, draw_generator)))
            run.target_forward_nodes += target_rows.nodes
            run.draft_forward_nodes += draft_rows.nodes
            if progress is not None:
                progress.update(1)
        token = int(p.argmax()) if setting.greedy else int(sample(p[None], generator)[0])
        target.advance(token)
        draft.advance(token)
    # chain_formula needs α ahead of each position: fill it in now.
    for t, result in results:
        result.laws["chain_formula"] = chain_pass_law(alphas[t:t + setting.depth])
        for key, law in result.laws.items():
            run.laws.setdefault(key, []).append(law)
        for key, means in result.draw_means.items():
            run.draw_means.setdefault(key, []).append(means)
        if result.calibration is not None:
            run.calibration = result.calibration if run.calibration is None else run.calibration + result.calibration
    return run


def measured_calibration(runs: Sequence[PromptRun]) -> tuple[list[float], list[float]] | None:
    """(alpha, confidence) by depth of the runs' drawn chains (T > 0): P(accept | reached) and the
    mean draft-as-proxy prediction of the nodes reached, the calibration TreeProposer measures."""
    totals = [r.calibration for r in runs if r.calibration is not None]
    if not totals:
        return None
    total = np.sum(totals, axis=0)
    reach = np.maximum(total[:, 0], 1e-300)
    return (total[:, 1] / reach).tolist(), (total[:, 2] / reach).tolist()


def summarise(runs: Sequence[PromptRun], max_tokens: int) -> dict[str, dict]:
    """Per key: per-position mean, its Monte Carlo standard error, per-pass (jump chain) mean and
    the per-pass standard deviation of tokens (for the sampling error of a measurement)."""
    out = {}
    for key in runs[0].laws:
        laws = [law for r in runs for law in r.laws[key]]
        means = np.array([expected_tokens(law) for law in laws])
        second = np.array([float(np.dot(np.arange(len(law)) ** 2, law)) for law in laws])
        tokens = passes = 0.0
        for r in runs:
            seq = [None] + r.laws[key]  # index = position (1 ..)
            seq += [r.laws[key][-1]] * (len(r.laws[key][-1]) + 1)  # beyond max_tokens: never used
            tk, ps = per_pass(seq, 1, max_tokens)
            tokens, passes = tokens + tk, passes + ps
        mc_se = None
        draw_means = [m for r in runs for m in r.draw_means.get(key, [])]
        if draw_means and len(draw_means[0]) > 1:
            variances = np.array([np.var(m, ddof=1) / len(m) for m in draw_means])
            mc_se = float(math.sqrt(variances.sum()) / len(draw_means))
        out[key] = {
            "per_position": float(means.mean()),
            "per_pass": tokens / passes,
            "per_pass_sd": float(math.sqrt(max(0.0, second.mean() - means.mean() ** 2))),
            "mc_se": mc_se,
            "positions": len(laws),
        }
    for key in [k for k in runs[0].draw_means if k.startswith("draft_only_best")]:
        values = [m[0] for r in runs for m in r.draw_means[key]]
        out[key] = {"per_position": float(np.mean(values)), "per_pass": None, "per_pass_sd": None, "mc_se": None,
                    "positions": len(values)}
    return out


# ---------------------------------------------------------------------------------------------
# Measured figures and the table
# ---------------------------------------------------------------------------------------------


def load_measured(paths: Sequence[str]) -> dict[tuple[str, int, float], dict]:
    """{(config, batch, T): {"per_pass", "passes", "files"}} pooled over files (1 + Σ accepted / Σ drafts)."""
    pooled: dict[tuple[str, int, float], dict] = {}
    for path in paths:
        with open(path) as f:
            for entry in json.load(f):
                if not entry.get("drafts"):
                    continue
                key = (entry["config"], int(entry["batch"]), float(entry["temperature"]))
                slot = pooled.setdefault(key, {"accepted": 0.0, "drafts": 0.0, "files": [], "values": []})
                slot["accepted"] += entry["accepted_tokens"]
                slot["drafts"] += entry["drafts"]
                slot["files"].append(os.path.basename(path))
                slot["values"].append(round(entry["mean_accepted_length"], 3))
    return {k: {"per_pass": 1 + v["accepted"] / v["drafts"], "passes": v["drafts"], "files": v["files"],
                "values": v["values"]} for k, v in pooled.items()}


def _measured_name(key: str) -> str | None:
    kind, _, budget = key.partition(" ")
    return {"tree": f"tree {budget}", "best_path": f"best path {budget}", "chain": "chain",
            "chain_formula": "chain"}.get(kind)


def table(predictions: dict[float, dict[str, dict]], measured: dict, first: dict[float, dict[str, dict]] | None = None,
          batches=(1, 16)) -> tuple[str, list[dict]]:
    """Markdown "predicted vs measured". The benchmark's batch-1 workload is prompt 0 alone and its
    batch-16 workload prompts 0-15: with ``first`` (the same summary over prompt 0 only) the b1
    comparison uses it, b16 the summary over all the prompts predicted."""
    header = ("| T | method | predicted / position | predicted / pass (jump chain) | prompt 0 / pass | MC s.e. | "
              + " | ".join(f"measured b{b} (passes, ± sampling s.e.) | rel. diff b{b}" for b in batches) + " |")
    lines = [header, "|" + "---|" * (6 + 2 * len(batches))]
    rows = []
    for temperature, summary in predictions.items():
        for key, s in summary.items():
            name = _measured_name(key)
            alone = (first or {}).get(temperature, {}).get(key)
            cells, row = [], {"temperature": temperature, "method": key, **s, "prompt0": alone, "measured": {}}
            for b in batches:
                m = measured.get((name, b, float(temperature))) if name else None
                basis = alone if (b == 1 and alone is not None) else s
                reference = basis["per_pass"] if basis["per_pass"] is not None else basis["per_position"]
                if m:
                    rel = reference / m["per_pass"] - 1
                    # At T = 0 the passes are deterministic: no sampling error to quote.
                    se = (basis["per_pass_sd"] / math.sqrt(m["passes"])) if basis.get("per_pass_sd") and temperature else None
                    row["measured"][b] = {**m, "relative_difference": rel, "sampling_se": se}
                    cells.append(f"{m['per_pass']:.2f} ({m['passes']:.0f}" + (f", ±{se:.2f}" if se else "") + ")")
                    cells.append(f"{rel:+.1%}")
                else:
                    cells += ["-", "-"]
            mc = f"{s['mc_se']:.3f}" if s.get("mc_se") else "-"
            per_pass_text = f"{s['per_pass']:.3f}" if s["per_pass"] is not None else "-"
            alone_text = f"{alone['per_pass']:.3f}" if alone and alone["per_pass"] is not None else "-"
            lines.append(f"| {temperature:g} | {key} | {s['per_position']:.3f} | {per_pass_text} | {alone_text} "
                         f"| {mc} | " + " | ".join(cells) + " |")
            rows.append(row)
    return "\n".join(lines), rows


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.throughput.tree_prediction",
        description="Predicted tokens per target pass (whole tree, best path, chain) from the target's and the "
                    "draft's probabilities, beside measured ones (runs/bench/tree_verification-*.json).")
    parser.add_argument("--target", default=os.path.join(MODELS, "demo-mb", "target"))
    parser.add_argument("--draft", default=os.path.join(MODELS, "demo-mb", "draft"))
    parser.add_argument("--prompts", type=int, default=4, help="the first N held-out prompts (the benchmark: 1 at "
                        "batch 1, 16 at batch 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="continuation length (the benchmark's max_tokens)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--top-k", type=int, default=0, help="0: off (the benchmark sets none)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--budgets", default="8,16,32")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--branching", type=int, default=3)
    parser.add_argument("--draws", type=int, default=8, help="Monte Carlo trees / chains per position at T > 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--measured", action="append", default=[], help="a tree_verification-*.json (repeatable)")
    parser.add_argument("--alpha", help="comma-separated acceptance of a first child by depth: also predict the "
                        "dynamic tree of each budget calibrated so ('dynamic N') and the chain of N ('chain N'); "
                        "a run at T > 0 prints the chains' own (alpha, confidence) to pass here")
    parser.add_argument("--confidence", help="comma-separated mean draft-as-proxy prediction by depth (with --alpha)")
    parser.add_argument("--branch-cost", type=float, default=None,
                        help="with --alpha: also print TreeProposer's decision (expect_chain) at this branch_cost")
    parser.add_argument("--json", help="write predictions (and the measured comparison) here")
    args = parser.parse_args(argv)
    require_demo_models(args.target, args.draft)

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_specplugin.throughput.workloads import heldout_prompts

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    target, draft = PrefixModel(args.target), PrefixModel(args.draft)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts(args.prompts)]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    budgets = tuple(int(b) for b in args.budgets.split(","))
    dynamic = None
    if args.alpha:
        if not args.confidence:
            parser.error("--alpha needs --confidence (the same length)")
        dynamic = ([float(x) for x in args.alpha.split(",")], [float(x) for x in args.confidence.split(",")])
    predictions: dict[float, dict] = {}
    first: dict[float, dict] = {}
    calibrations: dict[float, tuple] = {}
    cost = {}
    with tqdm(total=len(temperatures) * len(prompts) * (args.max_tokens - 1), desc="positions", file=sys.stderr) as bar:
        for temperature in temperatures:
            setting = Setting(temperature, args.top_k, args.top_p, budgets, args.depth, args.branching, args.draws,
                              dynamic)
            runs = [run_prompt(target, draft, ids, setting, args.max_tokens, args.seed + 1000 * i, bar)
                    for i, ids in enumerate(prompts)]
            predictions[temperature] = summarise(runs, args.max_tokens)
            calibrations[temperature] = measured_calibration(runs)
            first[temperature] = summarise(runs[:1], args.max_tokens)
            cost[temperature] = {"target_nodes": sum(r.target_forward_nodes for r in runs),
                                 "draft_nodes": sum(r.draft_forward_nodes for r in runs)}
    wall = time.perf_counter() - started
    measured = load_measured(args.measured)
    text, rows = table(predictions, measured, first)
    print(f"\ntarget {args.target}, draft {args.draft}; {len(prompts)} prompts x {args.max_tokens - 1} positions; "
          f"depth {args.depth}, branching {args.branching}, budgets {budgets}, "
          f"{args.draws} draws per position at T > 0; "
          f"wall {wall:.0f} s")
    print(text)
    for temperature, found in calibrations.items():
        if found is not None:
            print(f"\nT = {temperature:g}: the drawn chains' (depth {args.depth}) calibration, for --alpha / --confidence:\n"
                  f"  --alpha {','.join(f'{a:.4f}' for a in found[0])} --confidence {','.join(f'{c:.4f}' for c in found[1])}")
    if dynamic is not None:
        from vllm_specplugin.proposers.tree import expect_chain

        for temperature in temperatures:
            for budget in budgets:
                e_chain, e_tree = expected_chain_and_tree(*dynamic, budget, budget, drawn=temperature > 0)
                summary = predictions[temperature]
                exact = summary[f"dynamic {budget}"]["per_position"] / summary[f"chain {budget}"]["per_position"]
                line = (f"T = {temperature:g}, {budget} nodes: the static model's tree / chain tokens per step "
                        f"{(1 + e_tree) / (1 + e_chain):.3f}, the exact laws' (per position) {exact:.3f}")
                if args.branch_cost is not None:
                    chain = expect_chain(*dynamic, budget, budget, temperature > 0, args.branch_cost)
                    line += f"; at branch_cost {args.branch_cost:g} TreeProposer drafts {'the chain' if chain else 'the tree'}"
                print(line)
    print("\nrel. diff = predicted per pass / measured - 1 (b1: prompt 0 alone, the benchmark's batch-1 workload; "
          "b16: every prompt predicted); ± = predicted per-pass s.d. / sqrt(passes), the sampling "
          "error a measurement of that many passes has (T > 0; at T = 0 the passes are deterministic). draft_only_best = 1 + tree_expected_best (the draft's own "
          "probabilities, what the plugin counts today).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "forward_nodes": cost, "rows": rows,
                       "calibration": {str(t): c for t, c in calibrations.items()}}, f, indent=1,
                      default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
