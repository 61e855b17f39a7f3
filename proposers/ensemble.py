"""Draft from a weighted mixture of 1–3 draft models (one model: plain draft-model drafting).

Each step every draft model runs one batched forward; their next-token distributions are mixed,
m = Σ_d w_d · softmax(logits_d), and the request's own temperature, top-k and top-p are applied
to log m. Greedy requests take the argmax of m; others sample from the processed mixture, and
that processed mixture is returned as q for exact verification. Weights are uniform by default;
with ``adapt_weights`` they are the posterior of a Bayesian mixture with forgetting: each draft's
log-weight gains the log-probability it gave to every token the target emitted at a verified
position (the exponentially weighted forecaster for log loss, which tracks the best draft or the
best blend). Any weights are exact: q is whatever was sampled from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.draft_runtime import DraftBatch, DraftRuntime
from vllm_specplugin.proposers.metrics import DraftMetrics, accepted_count
from vllm_specplugin.proposers.sampling import processed_probs_rows, sample_rows

FORGETTING = 0.01  # per verified token, log-weights shrink by this factor (memory ~100 tokens)
MIN_WEIGHT = 0.02  # an adapted weight never drops below this, so a draft can come back


@dataclass
class _Pending:
    """The last draft handed out for a request, kept until its outcome is seen."""

    context_length: int
    tokens: list[int]
    top_tokens: list[list[int]]  # per draft model, per position: that draft's own argmax
    draft_probs: torch.Tensor | None = None  # [positions, D, V] raw draft distributions (adaptive weights)


class EnsembleProposer(Proposer):
    """The mixture-of-drafts proposer; with one runtime it is the single-draft proposer."""

    def __init__(
        self,
        runtimes: Sequence[DraftRuntime],
        weights: Sequence[float] | None = None,
        *,
        adapt_weights: bool = False,
    ):
        if not 1 <= len(runtimes) <= 3:
            raise ValueError(f"an ensemble takes 1 to 3 draft models, got {len(runtimes)}")
        vocab_sizes = {rt.vocab_size for rt in runtimes}
        if len(vocab_sizes) != 1:
            names = ", ".join(f"{rt.path} ({rt.vocab_size})" for rt in runtimes)
            raise ValueError(f"draft models disagree on vocabulary size: {names}")
        if weights is None:
            weights = [1.0] * len(runtimes)
        if len(weights) != len(runtimes) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"need {len(runtimes)} non-negative weights, not all zero; got {list(weights)}")
        self.runtimes = list(runtimes)
        self.vocab_size = vocab_sizes.pop()
        self.prior = torch.tensor(weights, dtype=torch.float32) / sum(weights)
        self.adapt_weights = adapt_weights
        self._log_evidence = torch.zeros(len(runtimes))
        self.names = _unique_names([rt.name for rt in runtimes])
        self.metrics = DraftMetrics(self.names)
        self._pending: dict[str, _Pending] = {}
        self._last_call: tuple[float, set[str]] | None = None
        self._update_weights()

    @property
    def weights(self) -> torch.Tensor:
        return self._weights

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        for rt in self.runtimes:
            rt.free(request_id)

    def tracked_request_ids(self) -> set[str]:
        ids = set(self._pending)
        for rt in self.runtimes:
            ids.update(rt.request_ids)
        return ids

    @torch.no_grad()
    def branch_distributions(self, request_id: str, context: Sequence[int], paths: list[list[int]]) -> torch.Tensor:
        """The unprocessed mixture m after ``context + path``, for each path [len(paths), V] (token
        trees). The request's caches keep holding ``context``."""
        return self._mixture(lambda rt: DraftBatch.branches(rt, request_id, list(context), paths))

    @torch.no_grad()
    def root_distribution(self, request_id: str, context: Sequence[int]) -> torch.Tensor:
        """The unprocessed mixture m after ``context`` [V]; leaves the caches holding ``context``."""
        return self._mixture(lambda rt: rt.open_batch([request_id], [list(context)]))[0]

    def _mixture(self, open_batch) -> torch.Tensor:
        """Σ_d w_d softmax(logits_d) over the batch each runtime opens with ``open_batch``."""
        mixture = None
        for weight, rt in zip(self._weights.tolist(), self.runtimes):
            batch = open_batch(rt)
            part = weight * batch.logits.float().softmax(-1)
            batch.close()
            mixture = part if mixture is None else mixture + part
        return mixture

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        self.time_step(started, requests)
        drafts = [self.empty_draft() for _ in requests]
        active: list[tuple[int, DraftRequest, int]] = []
        for index, request in enumerate(requests):
            self._observe(request)
            gamma = min(rt.room(request.request_id, len(request.context), request.gamma) for rt in self.runtimes)
            if gamma < request.gamma and gamma == 0:
                self.metrics.fallback_requests += 1
            if gamma > 0 and request.context:
                active.append((index, request, gamma))
        if active:
            self._draft(active, drafts)
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.sync_cost_counters()
        return drafts

    def sync_cost_counters(self) -> None:
        self.metrics.tokens_forwarded = sum(rt.tokens_forwarded for rt in self.runtimes)
        self.metrics.prefix_hit_tokens = sum(rt.prefix_cache.hit_tokens for rt in self.runtimes if rt.prefix_cache)

    def _draft(self, active: list[tuple[int, DraftRequest, int]], drafts: list[Draft]) -> None:
        ids = [request.request_id for _, request, _ in active]
        contexts = [list(request.context) for _, request, _ in active]
        params = [request.params for _, request, _ in active]
        gammas = [gamma for _, _, gamma in active]
        batches = [rt.open_batch(ids, contexts) for rt in self.runtimes]
        weights = self._weights.to(batches[0].logits.device)
        tokens: list[list[int]] = [[] for _ in active]
        rows: list[list[torch.Tensor]] = [[] for _ in active]
        top_tokens = [[[] for _ in self.runtimes] for _ in active]
        raw: list[torch.Tensor] = []  # per step [D, B, V], kept only for adaptive weights
        for step in range(max(gammas)):
            per_draft = torch.stack([batch.logits.float().softmax(-1) for batch in batches])  # [D, B, V]
            mixture = torch.einsum("d,dbv->bv", weights, per_draft)
            q = processed_probs_rows(mixture.log(), params)
            chosen = self._choose(q, active)
            own_top = per_draft.argmax(-1).T.tolist()  # [B, D]
            if self.adapt_weights:
                raw.append(per_draft)
            for row in range(len(active)):
                if step < gammas[row]:
                    tokens[row].append(chosen[row])
                    rows[row].append(q[row])
                    for d, token in enumerate(own_top[row]):
                        top_tokens[row][d].append(token)
            if step + 1 < max(gammas):
                for batch in batches:
                    batch.extend(chosen)
        for batch in batches:
            batch.close()
        for row, (index, request, _) in enumerate(active):
            drafts[index] = Draft(tokens[row], torch.stack(rows[row]))
            kept = torch.stack([r[:, row] for r in raw[: len(tokens[row])]]) if raw else None
            self._pending[request.request_id] = _Pending(len(request.context), tokens[row], top_tokens[row], kept)

    @staticmethod
    def _choose(q: torch.Tensor, active) -> list[int]:
        """Argmax for greedy rows (q is one-hot there), one sample per other row."""
        sampled = sample_rows(q, [request.generator for _, request, _ in active])
        greedy = torch.tensor([request.params.greedy for _, request, _ in active], device=q.device)
        return torch.where(greedy, q.argmax(-1), sampled).tolist()

    # -- learning from the target's verdicts -----------------------------------------------

    def _observe(self, request: DraftRequest) -> None:
        """Score the request's previous draft against the tokens the target emitted since."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or len(request.context) <= pending.context_length:
            return
        emitted = list(request.context[pending.context_length:])
        accepted = accepted_count(pending.tokens, emitted)
        self.metrics.record_outcome(len(pending.tokens), accepted)
        verified = min(accepted + 1, len(pending.tokens), len(emitted))  # accepted ones + the rejected one
        for d, name in enumerate(self.names):
            hits = sum(pending.top_tokens[d][j] == emitted[j] for j in range(verified))
            self.metrics.agreement[name] += hits
            self.metrics.verified_positions[name] += verified
        if self.adapt_weights and verified and pending.draft_probs is not None:
            index = torch.tensor(emitted[:verified], device=pending.draft_probs.device)
            probs = pending.draft_probs[:verified].gather(-1, index[:, None, None].expand(-1, len(self.names), 1))
            log_likelihood = probs.squeeze(-1).clamp_min(1e-12).log().sum(0).cpu()  # [D]
            self._log_evidence = (1 - FORGETTING) ** verified * self._log_evidence + log_likelihood
            self._update_weights()

    def _update_weights(self) -> None:
        weights = self.prior.clone()
        if self.adapt_weights:
            posterior = weights * torch.softmax(self._log_evidence - self._log_evidence.max(), 0)
            weights = (posterior / posterior.sum()).clamp_min(MIN_WEIGHT)
        self._weights = weights / weights.sum()
        self.metrics.weights = dict(zip(self.names, self._weights.tolist()))

    def time_step(self, now: float, requests: Sequence[DraftRequest]) -> None:
        """Count the time since the previous call as step time when a request spans both calls
        (the engine was busy stepping it; an idle gap has no request in common)."""
        ids = {request.request_id for request in requests}
        if self._last_call is not None and self._last_call[1] & ids:
            self.metrics.step_time_s += now - self._last_call[0]
            self.metrics.timed_steps += 1
        self._last_call = (now, ids)


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return unique
