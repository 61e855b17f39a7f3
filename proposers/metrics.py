"""Acceptance and cost counters a proposer keeps about its own drafts.

A proposer learns what the target did with its last draft from the request's next context:
the tokens added since are the accepted drafts followed by one token of the target's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def matched_prefix(drafted: list[int], emitted: list[int]) -> int:
    """How many leading drafted tokens the emitted tokens repeat."""
    matched = 0
    while matched < min(len(drafted), len(emitted)) and drafted[matched] == emitted[matched]:
        matched += 1
    return matched


def accepted_count(drafted: list[int], emitted: list[int]) -> int:
    """Drafts the target accepted: the emitted tokens start with them, then one token of its own."""
    return min(matched_prefix(drafted, emitted), max(len(emitted) - 1, 0))


@dataclass
class DraftMetrics:
    draft_names: list[str]
    propose_calls: int = 0
    draft_time_s: float = 0.0  # time inside propose()
    step_time_s: float = 0.0  # time between consecutive propose() calls of a busy engine
    timed_steps: int = 0
    drafted_tokens: int = 0  # drafts whose fate was observed
    accepted_tokens: int = 0
    verify_steps: int = 0  # observed (request, step) verifications
    fallback_requests: int = 0  # requests given no draft because of the draft's length limit
    tracked_requests: int = 0  # requests whose draft state is held right now
    backoff_steps: int = 0  # steps in which adaptive γ drafted nothing because the batch was large
    gamma_chosen: dict[int, int] = field(default_factory=dict)  # adaptive γ: requests x steps per γ
    # Drafter choice (proposers/choice.py): requests x steps drafted by the suffix drafter, by the
    # model proposer, by nothing; and the suffix drafts' tokens and accepted tokens.
    choice_suffix_steps: int = 0
    choice_model_steps: int = 0
    choice_none_steps: int = 0
    suffix_drafted_tokens: int = 0
    suffix_accepted_tokens: int = 0
    tokens_forwarded: int = 0  # real tokens run through the draft models (all drafts together)
    prefix_hit_tokens: int = 0  # tokens whose draft KV came from the shared prefix tree
    # Tree drafting: trees built, and the expected accepted length (under the draft) of the path
    # chosen and of the greedy chain in the same tree, summed over trees.
    trees: int = 0
    tree_expected_best: float = 0.0
    tree_expected_greedy: float = 0.0
    # Dynamic trees the calibrated model expected to be the chain, drafted by the chain loop.
    tree_chain_steps: int = 0
    # Tree verification (vllm_specplugin/tree_verification.py): trees verified (request x step),
    # their draft nodes, accepted nodes, accepted nodes that were not their parent's first child
    # (what tree verification adds over a chain), and requests x steps drafted as a chain because
    # they need a chain-only feature (penalties, logprobs, ...).
    tree_verify_steps: int = 0
    tree_nodes: int = 0
    tree_accepted_tokens: int = 0
    tree_non_first_child_accepted: int = 0
    tree_chain_fallbacks: int = 0
    # Tree walks that raised (the request emitted vLLM's first token only that step; logged).
    tree_walk_failures: int = 0
    # Merged trees (proposers/merged_proposer.py): trees verified with more than one drafter's
    # proposals, and their accepted nodes by the kind of drafter whose proposal was accepted.
    tree_merged_steps: int = 0
    tree_zero_cost_accepted: int = 0
    tree_model_accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Per draft: at verified positions, how often its own top token was the target's token.
    agreement: dict[str, int] = field(default_factory=dict)
    verified_positions: dict[str, int] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)  # routing: requests routed to each draft
    weights: dict[str, float] = field(default_factory=dict)
    # Health of drafting as a whole (kept by the vLLM adapter, vllm_specplugin/adapters.py).
    draft_failures: int = 0  # steps whose drafting raised (each decoded without drafts)
    drafting_disabled: int = 0  # 1 once repeated consecutive failures switched drafting off
    nonfinite_draft_rows: int = 0  # drafts dropped because q was NaN/inf/negative/not normalised
    draft_cache_evictions: int = 0  # per-request draft KV caches evicted by the memory budget
    draft_probs_buffer_bytes: int = 0  # the preallocated q buffer handed to vLLM (0: none)

    def __post_init__(self):
        for name in self.draft_names:
            self.agreement.setdefault(name, 0)
            self.verified_positions.setdefault(name, 0)
            self.routed.setdefault(name, 0)

    def time_step(self, last_call: tuple[float, set[str]] | None, now: float,
                  request_ids: set[str]) -> tuple[float, set[str]]:
        """Count the time since the previous propose() call (``last_call``: its time and request ids)
        as step time when a request spans both calls (the engine was busy stepping it; an idle gap
        has no request in common). Returns this call's (time, ids), the next call's ``last_call``."""
        if last_call is not None and last_call[1] & request_ids:
            self.step_time_s += now - last_call[0]
            self.timed_steps += 1
        return now, request_ids

    def record_outcome(self, drafted: int, accepted: int) -> None:
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for position in range(drafted):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < accepted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan")

    @property
    def mean_accepted_per_step(self) -> float:
        """Accepted drafts per verification, plus the target's own token (vLLM's 'mean acceptance length')."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else float("nan")

    @property
    def draft_time_fraction(self) -> float:
        return self.draft_time_s / self.step_time_s if self.step_time_s else float("nan")

    def snapshot(self) -> dict:
        return {
            "time": time.time(),
            "propose_calls": self.propose_calls,
            "draft_time_s": self.draft_time_s,
            "step_time_s": self.step_time_s,
            "timed_steps": self.timed_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "fallback_requests": self.fallback_requests,
            "tracked_requests": self.tracked_requests,
            "backoff_steps": self.backoff_steps,
            "gamma_chosen": {str(k): v for k, v in sorted(self.gamma_chosen.items())},
            "choice_suffix_steps": self.choice_suffix_steps,
            "choice_model_steps": self.choice_model_steps,
            "choice_none_steps": self.choice_none_steps,
            "suffix_drafted_tokens": self.suffix_drafted_tokens,
            "suffix_accepted_tokens": self.suffix_accepted_tokens,
            "tokens_forwarded": self.tokens_forwarded,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "trees": self.trees,
            "tree_expected_best": self.tree_expected_best,
            "tree_expected_greedy": self.tree_expected_greedy,
            "tree_chain_steps": self.tree_chain_steps,
            "tree_verify_steps": self.tree_verify_steps,
            "tree_nodes": self.tree_nodes,
            "tree_accepted_tokens": self.tree_accepted_tokens,
            "tree_non_first_child_accepted": self.tree_non_first_child_accepted,
            "tree_chain_fallbacks": self.tree_chain_fallbacks,
            "tree_walk_failures": self.tree_walk_failures,
            "tree_merged_steps": self.tree_merged_steps,
            "tree_zero_cost_accepted": self.tree_zero_cost_accepted,
            "tree_model_accepted": self.tree_model_accepted,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "agreement": dict(self.agreement),
            "verified_positions": dict(self.verified_positions),
            "routed": dict(self.routed),
            "weights": dict(self.weights),
            "draft_failures": self.draft_failures,
            "drafting_disabled": self.drafting_disabled,
            "nonfinite_draft_rows": self.nonfinite_draft_rows,
            "draft_cache_evictions": self.draft_cache_evictions,
            "draft_probs_buffer_bytes": self.draft_probs_buffer_bytes,
        }

    def summary(self) -> str:
        per_position = ", ".join(
            f"{a / d:.3f}" for a, d in zip(self.accepted_per_position, self.drafted_per_position) if d
        )
        per_draft = ", ".join(
            f"{name} {self.agreement[name] / n:.3f}" for name, n in self.verified_positions.items() if n
        )
        return (
            f"acceptance {self.acceptance_rate:.3f}, mean accepted length {self.mean_accepted_per_step:.2f}, "
            f"per position [{per_position}], per-draft top-1 agreement [{per_draft}], "
            f"draft time {self.draft_time_s:.2f} s = {self.draft_time_fraction:.1%} of step time"
        )
