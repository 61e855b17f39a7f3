"""Draft from a weighted mixture of 1–3 draft models (one model: plain draft-model drafting).

Each step every draft model runs one batched forward; their next-token distributions are mixed,
m = Σ_d w_d · softmax(logits_d), and the request's own temperature, top-k and top-p are applied
to log m. Greedy requests take the argmax of m; others sample from the processed mixture, and
that processed mixture is returned as q for exact verification. Weights are uniform by default;
with ``adapt_weights`` they are the posterior of a Bayesian mixture with forgetting: each draft's
log-weight gains the log-probability it gave to every token the target emitted at a verified
position (the exponentially weighted forecaster for log loss, which tracks the best draft or the
best blend). The weights are per request: a request drafts with the population's weights (every
request's verdicts) until its first verdict, then with its own posterior, whose prior is the
population's weights at that moment and whose evidence is its own verdicts only, so a code request
and a prose request served together each weight the draft that fits their own text within a few
tokens. A seeded request's prior is the configured weights (its text depends on its own history
alone). Any weights are exact: q is whatever was sampled from.

Routing (``route``): instead of mixing, each request is drafted by one draft alone, the one whose
mean log-probability of the request's last ``route_window`` context tokens (its prompt, at its first
draft) is highest, decided once per request (:meth:`DraftRuntime.mean_log_likelihood`). Only that
draft forwards the request: a code request served beside a prose one gets the code draft, each at
the cost of one draft. The choice depends on the request's own prompt alone (a seeded request
stays reproducible), and any choice is exact: q is the routed draft's processed distribution.

Rows draft only as far as their own γ: a row whose γ is reached (adaptive γ gives each its
own, the draft's maximum length clips some) leaves the batched forward, so it is never
extended past its γ or pushed to positions beyond the draft's ``max_position_embeddings``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.draft_runtime import LOG_FLOOR, DraftBatch, DraftRuntime
from vllm_specplugin.proposers.metrics import DraftMetrics, accepted_count
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs_rows, sample_rows

# Defaults of the EnsembleProposer parameters of the same names (documented there).
FORGETTING = 0.01
MIN_WEIGHT = 0.02
ROUTE_WINDOW = 32  # routing: the context tokens (the prompt's last) each draft is scored on


@dataclass
class _Scores:
    """What the adaptive weight update needs about one pending draft: each draft d's raw
    (unprocessed) log-probability of the token the target emits at every drafted position j.

    The emitted token is known only at the next step. At accepted positions it is the drafted
    token, whose log-probability is kept now (``drafted``). At the rejected position it can be
    any token, so lean drafts keep their final hidden state and log-normaliser, from which one
    token's logit is a dot product with the LM head row (exact, no [V] vector kept); drafts on
    the transformers path keep their distribution row.
    """

    drafted: torch.Tensor  # [γ, D] float32: log q_d(drafted token)
    lse: torch.Tensor  # [γ, D] float32: logsumexp of draft d's logits
    hidden: list[torch.Tensor | None]  # per draft: [γ, hidden_d] in its dtype (lean drafts), else None
    rows: list[torch.Tensor | None]  # per draft: [γ, V] float32 q_d (transformers-path drafts), else None

    def nbytes(self, draft: int) -> int:
        """Bytes held for draft ``draft``: its column of ``drafted`` and ``lse``, and its states."""
        kept = self.hidden[draft] if self.hidden[draft] is not None else self.rows[draft]
        return 2 * self.drafted.shape[0] * 4 + kept.numel() * kept.element_size()


@dataclass
class _StepScores:
    """One draft step's share of the live rows' :class:`_Scores`, rows in ``live`` order."""

    where: dict[int, int]  # batch row -> its index among this step's live rows
    drafted: torch.Tensor  # [live, D] float32
    lse: torch.Tensor  # [live, D] float32
    hidden: list[torch.Tensor | None]  # per draft [live, hidden_d], or None (transformers path)
    probs: list[torch.Tensor | None]  # per draft [live, V] float32 where hidden is None


@dataclass
class _Pending:
    """The last draft handed out for a request, kept until its outcome is seen."""

    context_length: int
    tokens: list[int]
    top_tokens: list[list[int]]  # per draft model, per position: that draft's own argmax
    scores: _Scores | None = None  # adaptive weights only


class EnsembleProposer(Proposer):
    """The mixture-of-drafts proposer; with one runtime it is the single-draft proposer.

    Adaptive weights (``adapt_weights``), per request (see the module docstring; :attr:`weights`
    are the population's, :meth:`row_weights` a request's own):

    - ``forgetting``: per verified token, the accumulated log-evidence shrinks by this factor,
      so the weights reflect roughly the last 1 / ``forgetting`` verified tokens (100 by
      default). Larger: follows a change in which draft fits the text faster, with noisier
      weights; 0: never forgets (converges on the draft best over the whole run).
    - ``min_weight``: the floor of every adapted weight (before renormalising), so a draft that
      fell behind keeps being mixed in and scored, and can come back when the text changes.
      Costs up to that share of the mixture's mass on a poor draft.

    Routing (``route``, see the module docstring): ``route_window`` is how many of the context's
    last tokens each draft is scored on at a request's first draft (32: about 3-4 ms per draft
    forward of that window on the demo drafts, once per request). Not with ``adapt_weights`` or
    ``weights`` (those mix the drafts).

    Memory: per request with a pending draft, adaptive weights keep (see :class:`_Scores`)
    γ · Σ_d (8 + hidden_d · s_d) bytes for lean drafts (hidden size hidden_d, element size s_d
    of the draft's dtype) and γ · (8 + 4 · V) for a draft on the transformers path; each draft's
    part counts in that draft's memory budget. Example: three bfloat16 drafts of hidden size
    896 at γ = 4 keep 4 · 3 · (8 + 1792) = 21.6 kB per request (the full [γ, D, V] float32
    distributions at V = 152k would be 7.3 MB).
    """

    def __init__(
        self,
        runtimes: Sequence[DraftRuntime],
        weights: Sequence[float] | None = None,
        *,
        adapt_weights: bool = False,
        forgetting: float = FORGETTING,
        min_weight: float = MIN_WEIGHT,
        route: bool = False,
        route_window: int = ROUTE_WINDOW,
    ):
        if not 1 <= len(runtimes) <= 3:
            raise ValueError(f"an ensemble takes 1 to 3 draft models, got {len(runtimes)}")
        if not 0 <= forgetting < 1 or not 0 <= min_weight <= 1:
            raise ValueError(f"need 0 <= forgetting < 1 and 0 <= min_weight <= 1, got {forgetting} and {min_weight}")
        vocab_sizes = {rt.vocab_size for rt in runtimes}
        if len(vocab_sizes) != 1:
            names = ", ".join(f"{rt.path} ({rt.vocab_size})" for rt in runtimes)
            raise ValueError(f"draft models disagree on vocabulary size: {names}")
        if route and (adapt_weights or weights is not None):
            raise ValueError("route drafts each request with one draft; weights and adapt_weights mix them: "
                             "give one of the two")
        if route_window < 1:
            raise ValueError(f"route_window must be >= 1, got {route_window}")
        if weights is None:
            weights = [1.0] * len(runtimes)
        if len(weights) != len(runtimes) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"need {len(runtimes)} non-negative weights, not all zero; got {list(weights)}")
        self.runtimes = list(runtimes)
        self.vocab_size = vocab_sizes.pop()
        self.prior = torch.tensor(weights, dtype=torch.float32) / sum(weights)
        self.adapt_weights = adapt_weights
        self.forgetting = forgetting
        self.min_weight = min_weight
        self._log_evidence = torch.zeros(len(runtimes))
        self.names = _unique_names([rt.name for rt in runtimes])
        self.metrics = DraftMetrics(self.names)
        self._pending: dict[str, _Pending] = {}
        self._last_call: tuple[float, set[str]] | None = None
        # Seeded requests start from the prior, not the population's weights: those come from
        # every request's outcomes, and a seeded request's text may depend only on its own history.
        self._seeded: set[str] = set()
        # Each request's own (prior weights [D], log-evidence [D]) (CPU float32), from its first
        # verdict on: the population's weights then (a seeded request's: the configured ones) and
        # its own verdicts only. Not the population's evidence, which is worth ~1 / forgetting
        # tokens and would outweigh a request's own text for most of its length.
        self._request_evidence: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.route = route
        self.route_window = route_window
        self._routes: dict[str, int] = {}  # routing: request id -> the index of the draft that drafts it
        self._update_weights()
        self.fixed_weights = self._weights.clone()

    @property
    def weights(self) -> torch.Tensor:
        return self._weights

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._seeded.discard(request_id)
        self._request_evidence.pop(request_id, None)
        self._routes.pop(request_id, None)
        for rt in self.runtimes:
            rt.free(request_id)  # also what set_resident_bytes counted for it

    def tracked_request_ids(self) -> set[str]:
        ids = set(self._pending) | set(self._request_evidence) | set(self._routes)
        for rt in self.runtimes:
            ids.update(rt.request_ids)
        return ids

    @torch.no_grad()
    def branch_distributions(self, request_id: str, context: Sequence[int], paths: list[list[int]]) -> torch.Tensor:
        """The unprocessed mixture m after ``context + path``, for each path [len(paths), V] (token
        trees). The request's caches keep holding ``context``."""
        return self.branch_distributions_of([(request_id, context, paths)])[0]

    @torch.no_grad()
    def branch_distributions_of(self, items: Sequence[tuple[str, Sequence[int], list[list[int]]]]) -> list[torch.Tensor]:
        """:meth:`branch_distributions` for several requests (each at most once) in one forward per
        draft: ``items`` are (request id, context, paths); returns one [len(paths), V] per item."""
        items = [(rid, list(context), paths) for rid, context, paths in items]
        if self.route:
            self.route_requests([rid for rid, _, _ in items], [context for _, context, _ in items])
            return self._routed_probs(len(items), lambda rt, mine: DraftBatch.branches_of(rt, [items[k] for k in mine]),
                                      [rid for rid, _, _ in items], [len(paths) for _, _, paths in items])
        row_ids = [rid for rid, _, paths in items for _ in paths]
        mixture = self._mixture(lambda rt: DraftBatch.branches_of(rt, items), row_ids)
        return list(mixture.split([len(paths) for _, _, paths in items]))

    @torch.no_grad()
    def root_distribution(self, request_id: str, context: Sequence[int]) -> torch.Tensor:
        """The unprocessed mixture m after ``context`` [V]; leaves the caches holding ``context``."""
        return self.root_distributions([request_id], [context])[0]

    @torch.no_grad()
    def root_distributions(self, request_ids: Sequence[str], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """:meth:`root_distribution` for several requests in one forward per draft: [len(ids), V]."""
        if self.route:
            self.route_requests(request_ids, contexts)
            parts = self._routed_probs(len(request_ids), lambda rt, mine: rt.open_batch(
                [request_ids[k] for k in mine], [list(contexts[k]) for k in mine]), request_ids, [1] * len(request_ids))
            return torch.cat(parts)
        return self._mixture(lambda rt: rt.open_batch(list(request_ids), [list(c) for c in contexts]), request_ids)

    def route_requests(self, request_ids: Sequence[str], contexts: Sequence[Sequence[int]]) -> None:
        """Routing: give every request not yet routed its draft, the one with the highest mean
        log-probability of its context's last ``route_window`` tokens (the first draft when the
        context is shorter than 2 tokens, or on a tie)."""
        for rid, context in zip(request_ids, contexts):
            if rid in self._routes:
                continue
            window = list(context[-(self.route_window + 1):])
            chosen = 0
            if len(window) >= 2 and len(self.runtimes) > 1:
                scores = [rt.mean_log_likelihood(window) for rt in self.runtimes]
                chosen = max(range(len(scores)), key=scores.__getitem__)
            self._routes[rid] = chosen
            self.metrics.routed[self.names[chosen]] += 1

    def route_of(self, request_id: str) -> int | None:
        """Routing: the index of the draft that drafts ``request_id`` (None: not routed yet)."""
        return self._routes.get(request_id)

    def _routed_probs(self, count: int, open_subset, request_ids: Sequence[str], rows_per_item: Sequence[int]):
        """Routing: softmax of each item's routed draft, [rows_per_item[k], V] per item k of ``count``;
        ``open_subset(runtime, item indices)`` opens that draft's batch over those items (rows in order)."""
        out: list[torch.Tensor | None] = [None] * count
        for d, rt in enumerate(self.runtimes):
            mine = [k for k in range(count) if self._routes[request_ids[k]] == d]
            if not mine:
                continue
            batch = open_subset(rt, mine)
            probs = batch.logits.float().softmax(-1)
            batch.close()
            for k, part in zip(mine, probs.split([rows_per_item[k] for k in mine])):
                out[k] = part
        return out

    def row_weights(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The mixture weights of each row's request: [len(request_ids), D] float32 (CPU). With
        adaptive weights a request's own once it has a verdict; before, the population's
        (:attr:`weights`), or :attr:`fixed_weights` for a seeded request. Routing: one-hot on a
        routed request's draft."""
        weights = self._weights.expand(len(request_ids), -1).clone()
        if self.route:
            for row, rid in enumerate(request_ids):
                if rid in self._routes:
                    weights[row] = 0.0
                    weights[row, self._routes[rid]] = 1.0
        if self.adapt_weights:
            for row, rid in enumerate(request_ids):
                own = self._request_evidence.get(rid)
                if own is not None:
                    weights[row] = self._posterior(*own)
                elif rid in self._seeded:
                    weights[row] = self.fixed_weights
        return weights

    def _mixture(self, open_batch, request_ids: Sequence[str]) -> torch.Tensor:
        """Σ_d w_d softmax(logits_d) over the batch each runtime opens with ``open_batch``, whose
        rows are ``request_ids``' (weights per row: :meth:`row_weights`)."""
        mixture = None
        weights = self.row_weights(request_ids)
        for d, rt in enumerate(self.runtimes):
            batch = open_batch(rt)
            probs = batch.logits.float().softmax(-1)
            part = weights[:, d : d + 1].to(probs.device) * probs
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
            gamma = self.room(request.request_id, len(request.context), request.gamma)
            if gamma < request.gamma and gamma == 0:
                self.metrics.fallback_requests += 1
            if gamma > 0 and request.context:
                active.append((index, request, gamma))
        if active:
            self.draw_chains(active, drafts)
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.sync_cost_counters()
        return drafts

    def room(self, request_id: str, context_length: int, gamma: int) -> int:
        """Draft tokens every draft model can still take after this context (at most ``gamma``)."""
        return min(rt.room(request_id, context_length, gamma) for rt in self.runtimes)

    def prepare(self, requests: Sequence[DraftRequest]) -> None:
        """Nothing to take from the requests besides their contexts (a heads drafter takes the
        target's hidden states here; TreeProposer calls it before growing its trees)."""

    def sync_cost_counters(self) -> None:
        self.metrics.tokens_forwarded = sum(rt.tokens_forwarded for rt in self.runtimes)
        self.metrics.prefix_hit_tokens = sum(rt.prefix_cache.hit_tokens for rt in self.runtimes if rt.prefix_cache)

    def draw_chains(self, active: list[tuple[int, DraftRequest, int]], drafts: list[Draft],
                    row_params: list[SamplingParams] | None = None) -> None:
        """The chain loop: for each (index, request, gamma) of ``active``, ``gamma`` tokens drawn one
        after another from the processed mixture (argmax for greedy rows), written to
        ``drafts[index]`` as Draft(tokens, rows [gamma, V] float32: the q each token was drawn
        from). One batched forward per draft model per position. ``row_params`` (per active row):
        process the rows with these instead of the requests' own (TreeProposer: T = 1 rows for a
        greedy request's acceptance model; its tokens stay the argmax). TreeProposer uses it for
        the steps whose tree would be the chain. Routing: each request's rows on its routed draft only
        (one batch per draft over the requests routed to it)."""
        if not self.route:
            self._draw_chains(active, drafts, row_params, list(range(len(self.runtimes))))
            return
        self.route_requests([request.request_id for _, request, _ in active], [request.context for _, request, _ in active])
        for d in range(len(self.runtimes)):
            mine = [k for k, (_, request, _) in enumerate(active) if self._routes[request.request_id] == d]
            if mine:
                self._draw_chains([active[k] for k in mine], drafts, [row_params[k] for k in mine] if row_params else None,
                                  [d])

    def _draw_chains(self, active, drafts, row_params, used: list[int]) -> None:
        """:meth:`draw_chains` on the drafts ``used`` (indices into ``runtimes``; every row's weights
        over the others are 0 when fewer than all)."""
        ids = [request.request_id for _, request, _ in active]
        contexts = [list(request.context) for _, request, _ in active]
        gammas = [gamma for _, _, gamma in active]
        batches = [self.runtimes[d].open_batch(ids, contexts) for d in used]
        weights = self.row_weights(ids)[:, used].to(batches[0].logits.device)  # [B, len(used)]
        tokens: list[list[int]] = [[] for _ in active]
        rows: list[list[torch.Tensor]] = [[] for _ in active]
        top_tokens = [[[] for _ in self.runtimes] for _ in active]
        steps: list[_StepScores] = []  # adaptive weights only
        live = list(range(len(active)))  # rows still drafting; row r drafts gammas[r] tokens
        logits = [batch.logits for batch in batches]  # per draft [len(live), V] float32
        for step in range(max(gammas)):
            per_draft = torch.stack([part.softmax(-1) for part in logits])  # [D, len(live), V]
            mixture = torch.einsum("bd,dbv->bv", weights[live], per_draft)
            q = processed_probs_rows(mixture.log(), [(row_params[r] if row_params else active[r][1].params) for r in live])
            chosen = self._choose(q, [active[r][1] for r in live])
            own_top = per_draft.argmax(-1).T.tolist()  # [len(live), len(used)]
            if self.adapt_weights:
                steps.append(self._step_scores(live, logits, per_draft, batches, chosen))
            for i, r in enumerate(live):
                tokens[r].append(chosen[i])
                rows[r].append(q[i])
                for d, token in zip(used, own_top[i]):
                    top_tokens[r][d].append(token)
            going = [i for i, r in enumerate(live) if step + 1 < gammas[r]]
            if not going:
                break
            live = [live[i] for i in going]
            logits = [batch.extend([chosen[i] for i in going], rows=live) for batch in batches]
        for batch in batches:
            batch.close()
        for row, (index, request, _) in enumerate(active):
            drafts[index] = Draft(tokens[row], torch.stack(rows[row]))
            scores = self._row_scores(steps, row) if steps else None
            self._pending[request.request_id] = _Pending(len(request.context), tokens[row], top_tokens[row], scores)
            if scores is not None:
                for d, rt in enumerate(self.runtimes):
                    rt.set_resident_bytes(request.request_id, scores.nbytes(d))

    @staticmethod
    def _step_scores(live, logits, per_draft, batches, chosen) -> _StepScores:
        lse = torch.stack([part.logsumexp(-1) for part in logits], -1)  # [len(live), D]
        index = torch.tensor(chosen, device=lse.device)[:, None]
        drafted = torch.cat([part.gather(-1, index) for part in logits], -1) - lse  # [len(live), D]
        hidden = [batch.hidden for batch in batches]
        probs = [per_draft[d] if hidden[d] is None else None for d in range(len(batches))]
        return _StepScores({r: i for i, r in enumerate(live)}, drafted, lse, hidden, probs)

    def _row_scores(self, steps: list[_StepScores], row: int) -> _Scores:
        """Row ``row``'s :class:`_Scores`, from the steps it drafted in (the first γ of them);
        copies, so nothing of the step's [live, V] tensors stays referenced."""
        mine = [(step, step.where[row]) for step in steps if row in step.where]

        def gather(parts) -> torch.Tensor:
            return torch.stack([part[i] for part, (_, i) in zip(parts, mine)])

        hidden, kept_rows = [], []
        for d in range(len(self.runtimes)):
            lean = mine[0][0].hidden[d] is not None
            hidden.append(gather([step.hidden[d] for step, _ in mine]) if lean else None)
            kept_rows.append(None if lean else gather([step.probs[d] for step, _ in mine]))
        return _Scores(gather([s.drafted for s, _ in mine]), gather([s.lse for s, _ in mine]), hidden, kept_rows)

    @staticmethod
    def _choose(q: torch.Tensor, requests: list[DraftRequest]) -> list[int]:
        """Argmax for greedy rows (q is one-hot there), one sample per other row."""
        sampled = sample_rows(q, [request.generator for request in requests])
        greedy = torch.tensor([request.params.greedy for request in requests], device=q.device)
        return torch.where(greedy, q.argmax(-1), sampled).tolist()

    # -- learning from the target's verdicts -----------------------------------------------

    def _observe(self, request: DraftRequest) -> None:
        """Score the request's previous draft against the tokens the target emitted since."""
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and pending.scores is not None:
            for rt in self.runtimes:
                rt.set_resident_bytes(request.request_id, 0)
        if pending is None or len(request.context) <= pending.context_length:
            return
        emitted = list(request.context[pending.context_length:])
        accepted = accepted_count(pending.tokens, emitted)
        self.metrics.record_outcome(len(pending.tokens), accepted)
        verified = min(accepted + 1, len(pending.tokens), len(emitted))  # accepted ones + the rejected one
        for d, name in enumerate(self.names):
            if len(pending.top_tokens[d]) < verified:  # routing: a draft that did not draft this request
                continue
            hits = sum(pending.top_tokens[d][j] == emitted[j] for j in range(verified))
            self.metrics.agreement[name] += hits
            self.metrics.verified_positions[name] += verified
        if self.adapt_weights and verified and pending.scores is not None:
            gained = self._log_likelihood(pending, emitted[:verified])
            decay = (1 - self.forgetting) ** verified
            rid = request.request_id
            prior, own = self._request_evidence.get(rid) or (
                self.fixed_weights if request.seeded else self._weights, torch.zeros_like(self._log_evidence))
            self._request_evidence[rid] = (prior, decay * own + gained)
            self._log_evidence = decay * self._log_evidence + gained
            self._update_weights()

    def _log_likelihood(self, pending: _Pending, emitted: list[int]) -> torch.Tensor:
        """Σ_j log q_d(emitted[j]) over the verified positions, per draft: [D] float32 (CPU)."""
        scores = pending.scores
        verified = len(emitted)
        missed = [j for j in range(verified) if emitted[j] != pending.tokens[j]]  # at most one
        total = scores.drafted[:verified].clone()  # [verified, D]
        if missed:
            where = torch.tensor(missed, device=total.device)
            tokens = torch.tensor([emitted[j] for j in missed], device=total.device)
            for d, rt in enumerate(self.runtimes):
                if scores.hidden[d] is not None:
                    total[where, d] = rt.token_logits(scores.hidden[d][where], tokens) - scores.lse[where, d]
                else:
                    total[where, d] = scores.rows[d][where, tokens].clamp_min(1e-12).log()
        return total.clamp_min(LOG_FLOOR).sum(0).cpu()

    def _posterior(self, prior: torch.Tensor, log_evidence: torch.Tensor) -> torch.Tensor:
        """The weights after ``log_evidence`` [D]: prior x exp(evidence), floored at min_weight."""
        posterior = prior * torch.softmax(log_evidence - log_evidence.max(), 0)
        weights = (posterior / posterior.sum()).clamp_min(self.min_weight)
        return weights / weights.sum()

    def _update_weights(self) -> None:
        self._weights = self._posterior(self.prior, self._log_evidence) if self.adapt_weights else self.prior.clone()
        self.metrics.weights = dict(zip(self.names, self._weights.tolist()))

    def time_step(self, now: float, requests: Sequence[DraftRequest]) -> None:
        """Count the time since the previous call as step time when a request spans both calls
        (the engine was busy stepping it; an idle gap has no request in common)."""
        self._seeded.update(request.request_id for request in requests if request.seeded)
        self._last_call = self.metrics.time_step(self._last_call, now, {request.request_id for request in requests})


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return unique
