"""Adaptive γ: how many tokens to draft for each request, from its recent acceptance.

:class:`AdaptiveGamma` wraps any proposer. Per request it tracks the per-token acceptance α
with an exponential moving average and picks γ for the next step:

- ``threshold`` mode (the default rule): γ + 1 when α > ``raise_above``, γ − 1 when
  α < ``lower_below``, within [``gamma_min``, γ_max];
- ``cost_model`` mode: the γ in [0, γ_max] that maximises the expected speedup
  E(γ) / (1 + cγ). E(γ), the expected tokens per step, comes from acceptance by draft position
  over all requests (:class:`PositionAcceptance`; acceptance comes in runs, which the i.i.d.
  (1 − α^(γ+1)) / (1 − α) underestimates at large γ), each position's log-odds moved by how far
  the request's own α is from the population's; with no positions measured yet it is the i.i.d.
  form at the request's α. c is configured, or measured while serving by
  :class:`StepCostModel`: the cost of one more draft token for this request (drafting it, plus
  verifying it: the target step grows with the tokens it verifies, which the classic model
  ignores and which dominates on a compute-bound CPU) over the request's share of a step without
  drafts.

In both modes a request at γ = 0 (possible with ``gamma_min`` 0) is probed with γ = 1 every
``probe_every`` steps, so that its α stays current: γ = 0 means "stop drafting while it does not
pay", and the probes let the request come back once it pays again. Every request at γ = 0 probes
in the same step (each ``probe_every``-th call), so a probe step verifies one draft token per
such request: the fixed cost of a step that has drafts at all (vLLM's rejection sampler in place
of its plain sampler, the draft's forwards) is then spread over the batch in the measured cost
per verified token, where staggered probes (one or two per step) put all of it on one or two
tokens. (c stays a price per token; ``max_batch`` caps drafting by batch size where a machine's
crossover is known.) A new request starts from the acceptance this proposer has recently seen over all requests
(``population_alpha``, an exponential average of every request's measured outcomes), and from
``initial_alpha`` before any outcome: a fixed start below the break-even α kept each new request
at γ = 0 until its probes had raised its average (at batch 16 on the memory-bound pair, c ≈ 0.8
against a start of 0.7: the first 16–24 of a 64-token request's steps went undrafted).

Acceptance of a position is measured only where it is drafted, so a position whose estimate
fell below what pays would never be tested again: every ``probe_every``-th step each request
drafting 1 ≤ γ < γ_max drafts γ + 1 (``cost_model`` mode), until position γ + 1 has been tested
1/weight (100) times.

The slope b is measured only where the number of verified draft tokens varies; at a constant γ
it does not, and b would stay 0 (c the draft's cost alone). So each batch-size class starts with
slope probes: halfway between explorations (``probe_every``-th calls, offset by half), every
drafting request drafts half its γ, until that class has seen 8 steps whose draft count differed
from its average (``StepCostModel.slope_measured``). A configured ``cost_ratio`` needs none.

In a batch (``cost_model`` mode), every request whose drafts pay at all drafts one common γ, the
one best for the batch (Σ E(α_i, γ) / (1 + cγ)): the draft model forwards the whole batch once
per position, so a step costs about what its longest draft costs. A request whose drafts do not
pay stays at γ = 0 but probes with one token in every such step (the forwards run anyway), so one
unlucky rejection does not idle it for ``probe_every`` steps. Step costs are measured per
batch-size class (1, 2–3, 4–7, 8–15, 16–31, ...), since a draft token costs several times less in
a batch of 16 than alone; only in steps where every drafting request also drafted in the step
before (after undrafted steps the draft model first catches up on the tokens those steps
emitted, which is not the price of a draft token); and as plain means over the first
1/forgetting steps, so a slow first step does not weigh on them for long.

Steps that admit a request are left out of the measured costs: its prompt was prefilled in the
target step just before and is prefilled by the drafts in this call, which a decoding step does
not pay (at concurrency 4 with 64-token outputs, one step in 16 carries a prompt's prefill, which
inflated the measured c several-fold and made the rule pick γ ≈ 1).

Batch-aware back-off: in a step with more than ``max_batch`` requests nobody drafts (γ = 0),
because large batches make the target step compute-bound and speculation stops paying.
Changing γ never affects exactness: each draft is verified the same way whatever its length.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.metrics import accepted_count
from vllm_specplugin.stats.speedup import expected_tokens_by_position

GAMMA_MODES = ("threshold", "cost_model")


@dataclass(frozen=True)
class GammaPolicy:
    mode: str = "threshold"
    gamma_min: int = 1
    raise_above: float = 0.8
    lower_below: float = 0.6
    ema_weight: float = 0.3  # weight of the newest step in the acceptance average
    max_batch: int | None = None  # back-off: no drafting in steps with more requests than this
    cost_ratio: float | None = None  # c for cost_model; None: measured while serving
    probe_every: int = 8  # at γ = 0, draft γ = 1 every this many steps (cost_model: at 1 ≤ γ < k, γ + 1)
    initial_alpha: float = 0.7  # a new request's acceptance estimate before any outcome was seen
    population_weight: float = 0.05  # weight of each measured outcome in the population's average α

    def __post_init__(self):
        if self.mode not in GAMMA_MODES:
            raise ValueError(f"mode must be one of {GAMMA_MODES}, got {self.mode!r}")
        if self.gamma_min < 0:
            raise ValueError(f"gamma_min must be >= 0, got {self.gamma_min}")
        if not 0 <= self.lower_below <= self.raise_above <= 1:
            raise ValueError(
                f"need 0 <= lower_below <= raise_above <= 1, got {self.lower_below} and {self.raise_above}"
            )
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if not 0 <= self.initial_alpha <= 1:
            raise ValueError(f"initial_alpha must be in [0, 1], got {self.initial_alpha}")
        if not 0 < self.population_weight <= 1:
            raise ValueError(f"population_weight must be in (0, 1], got {self.population_weight}")


class StepCostModel:
    """Measured step costs: target time = a + b·D for D draft tokens verified in a step (least
    squares over recent steps, exponentially forgotten), and draft time d per draft token."""

    MIN_STEPS = 8
    MIN_VARIED_STEPS = 8  # steps whose draft count differed from the average: enough to measure b

    def __init__(self, forgetting: float = 0.05):
        self.forgetting = forgetting
        self.steps = 0
        self.varied_steps = 0  # steps with D at least a quarter (and one token) away from the average
        self._moments = None  # E[x], E[y], E[xx], E[xy]
        self.slope = 0.0  # b: seconds per verified draft token
        self.draft_per_token: float | None = None  # d
        self.draft_steps = 0

    def _weight(self, count: int) -> float:
        # The plain mean of the first 1/forgetting observations, then an exponential average: a
        # fixed small weight from the first observation on would keep that one (often a slow,
        # cold step) dominant for dozens of steps (at forgetting 0.05, 63% of it after 9 more).
        return max(self.forgetting, 1.0 / count)

    def observe_target(self, draft_tokens: int, seconds: float) -> None:
        x, y = float(draft_tokens), seconds
        new = (x, y, x * x, x * y)
        self.steps += 1
        if self._moments is None:
            self._moments = new
        else:
            if abs(x - self._moments[0]) >= max(1.0, 0.25 * self._moments[0]):
                self.varied_steps += 1
            w = self._weight(self.steps)
            self._moments = tuple((1 - w) * old + w * value for old, value in zip(self._moments, new))
        mean_x, mean_y, mean_xx, mean_xy = self._moments
        variance = mean_xx - mean_x**2
        if variance > 1e-6:  # keep the last slope while the draft length does not vary
            self.slope = max(0.0, (mean_xy - mean_x * mean_y) / variance)

    @property
    def slope_measured(self) -> bool:
        """Whether the draft count has varied enough for b to be measured (while every step
        verifies the same number of draft tokens, b is indistinguishable from the base a)."""
        return self.varied_steps >= self.MIN_VARIED_STEPS

    def observe_draft(self, draft_tokens: int, seconds: float) -> None:
        if draft_tokens:
            per_token = seconds / draft_tokens
            self.draft_steps += 1
            d = self.draft_per_token
            w = self._weight(self.draft_steps)
            self.draft_per_token = per_token if d is None else (1 - w) * d + w * per_token

    @property
    def base(self) -> float:
        """a: seconds of a target step without drafts (the fit's intercept; call after observe_target)."""
        mean_x, mean_y = self._moments[0], self._moments[1]
        return max(mean_y - self.slope * mean_x, 1e-6)

    def cost_ratio(self, batch_size: int) -> float | None:
        """c for one request: (b + d) over its share of a step without drafts, a / batch."""
        if self.steps < self.MIN_STEPS or self.draft_per_token is None:
            return None
        return (self.slope + self.draft_per_token) / (self.base / max(batch_size, 1))


def _logit(p):
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-3, 1 - 1e-3)
    return np.log(p) - np.log1p(-p)


class PositionAcceptance:
    """Acceptance by draft position over all requests: ``conditional[k - 1]`` estimates
    P(position k accepted | positions 1..k−1 accepted), an exponential average (plain over the
    first 1/weight observations) of every tested position's outcome.

    Acceptance comes in runs: once a draft has a few tokens accepted the next is likelier
    accepted. On the memory-bound demo pair at γ = 6 (batch 1, T = 0) the positions' acceptance
    was 0.99, 0.98, 0.94, 0.89, 0.86, 0.85 (6.51 tokens per step) where the per-token α of 0.918
    predicts 5.55: a model with one α prices the last positions at 0.6 and chooses γ too short.

    ``weight`` 0.01 (about the last 100 outcomes of a position): rates near 1 move by the weight
    at each rejection, and at 0.05 one or two rejections took a position's estimate from 0.99 to
    0.87 (simulated, seed 11). A request's own recent acceptance enters through its α (see
    :meth:`AdaptiveGamma.expected_tokens`), so this population curve may change slowly.

    A position's first outcomes are averaged with ``prior_count`` pseudo-outcomes at the prior
    the caller gives (the population's α): served, the warm-up's first test of position 3 was a
    rejection, which alone set its estimate to 0, and the controller then drafted γ = 2 for the
    whole run (1.41x plain where γ = 6 ran at 2.24x). The prior softens such a start; the
    controller's exploration (one position beyond γ every ``probe_every`` steps) undoes it."""

    def __init__(self, weight: float = 0.01, prior_count: int = 2):
        self.weight = weight
        self.prior_count = prior_count
        self.rates: list[float] = []  # conditional acceptance of positions 1, 2, ...
        self.counts: list[int] = []  # outcomes seen per position, pseudo-outcomes included

    def observe(self, drafted: int, accepted: int, prior: float) -> None:
        """One verified draft: ``drafted`` tokens, of which the first ``accepted`` were accepted
        (positions after the first rejection were not tested). ``prior``: the starting estimate
        of a position tested for the first time."""
        for k in range(min(drafted, accepted + 1)):
            outcome = 1.0 if k < accepted else 0.0
            if k == len(self.rates):
                self.rates.append(prior)
                self.counts.append(self.prior_count)
            self.counts[k] += 1
            w = max(self.weight, 1.0 / self.counts[k])
            self.rates[k] = (1 - w) * self.rates[k] + w * outcome

    def settled(self, position: int) -> bool:
        """Whether position ``position`` (1-based) has been tested 1/weight times, after which its
        estimate is an exponential average rather than the plain mean of a few outcomes."""
        return position <= len(self.counts) and self.counts[position - 1] >= 1.0 / self.weight

    def conditional(self, positions: int, fallback: float) -> np.ndarray:
        """Estimates for positions 1..``positions`` (shape [positions], float64): a position never
        tested takes the deepest tested position's rate, or ``fallback`` when none was."""
        known = self.rates[:positions]
        fill = known[-1] if known else fallback
        return np.array(known + [fill] * (positions - len(known)), dtype=np.float64)


@dataclass
class _RequestState:
    gamma: int
    alpha: float
    pending: tuple[int, list[int]] | None = None  # (context length, drafted tokens) of the last draft
    drafted_last_step: bool = True  # False: its draft model skipped the last step and must catch up


class AdaptiveGamma(Proposer):
    """Chooses each request's γ, then lets ``inner`` draft that many tokens."""

    def __init__(self, inner: Proposer, policy: GammaPolicy = GammaPolicy(), clock=time.perf_counter):
        self.inner = inner
        self._clock = clock  # seconds (float); tests drive a synthetic one
        self.policy = policy
        self.vocab_size = inner.vocab_size
        self.metrics = getattr(inner, "metrics", None)
        self._states: dict[str, _RequestState] = {}
        self._cost_ratio = policy.cost_ratio
        # Step costs per batch-size class (1, 2–3, 4–7, 8–15, ...): a draft token costs 1.5 ms at
        # batch 1 and 0.5 ms at batch 16 on the memory-bound pair (the draft forwards the batch
        # together), so costs measured at one size do not price another.
        self.step_costs_by_batch: dict[int, StepCostModel] = {}
        self._last_call_end: float | None = None
        self._last_ids: set[str] = set()
        self._last_drafted = 0
        self._last_batch_class = 1
        self._calls = 0  # propose calls so far: requests at γ = 0 probe together every probe_every-th
        self.population_alpha = policy.initial_alpha  # recent acceptance over all requests; a new one starts here
        self.position_acceptance = PositionAcceptance()

    @staticmethod
    def batch_class(batch_size: int) -> int:
        """The power of two at or below ``batch_size``: the key of its step-cost model."""
        return 1 << (max(batch_size, 1).bit_length() - 1)

    def _costs(self, batch_class: int) -> StepCostModel:
        return self.step_costs_by_batch.setdefault(batch_class, StepCostModel())

    @property
    def step_costs(self) -> StepCostModel:
        """The step-cost model of the last call's batch-size class."""
        return self._costs(self._last_batch_class)

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.inner.free(request_id)

    def tracked_request_ids(self) -> set[str]:
        return set(self._states) | self.inner.tracked_request_ids()

    def gamma_of(self, request_id: str) -> int | None:
        state = self._states.get(request_id)
        return None if state is None else state.gamma

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = self._clock()
        self._calls += 1
        ids = {r.request_id for r in requests}
        # A request seen for the first time was prefilled by the target's last step and is
        # prefilled by the drafts now: this step's costs are not a decoding step's.
        admitting = any(r.request_id not in self._states for r in requests)
        if self._last_call_end is not None and ids & self._last_ids and not admitting:
            # The engine's work since our last call: one target step verifying what we drafted.
            self._costs(self._last_batch_class).observe_target(self._last_drafted, started - self._last_call_end)
        batch_class = self.batch_class(len(requests))
        if self.policy.cost_ratio is None:
            self._cost_ratio = self._costs(batch_class).cost_ratio(len(requests))
        for request in requests:
            self._observe(request)
        back_off = self.policy.max_batch is not None and len(requests) > self.policy.max_batch
        own_best, common = {}, None
        if self.policy.mode == "cost_model" and not back_off:
            longest = max(r.gamma for r in requests)
            tokens = {r.request_id: self.expected_tokens(r.request_id, longest) for r in requests}
            own_best = {r.request_id: self._own_best(tokens[r.request_id][: r.gamma + 1]) for r in requests}
            if len(requests) > 1:
                common = self._common_gamma(requests, tokens, own_best)
        # Exploration: a position is tested only when drafted, so one whose estimate fell (a
        # rejection in its first tests) would never be drafted again; every probe_every-th step
        # each drafting request drafts one position more than the model chose, until that
        # position has been tested 1/weight times (where γ stays low, a draft position more in
        # one step of eight is a lasting cost for what is then a settled estimate).
        explore = self.policy.mode == "cost_model" and self._calls % self.policy.probe_every == 0
        # Slope probe: with γ constant every step verifies the same number of draft tokens, and
        # the verification cost per token b cannot be told from the step's base cost (served at
        # batch 32-48 it kept b at 0, c at the draft cost alone, and γ at 5-6 where every γ ran
        # below plain). Halfway between explorations, each drafting request drafts half its γ
        # until this batch-size class has seen enough steps of a different draft count.
        slope_probe = (self.policy.mode == "cost_model" and self.policy.cost_ratio is None and not back_off
                       and self._calls % self.policy.probe_every == self.policy.probe_every // 2
                       and not self._costs(batch_class).slope_measured)
        chosen = []
        for request in requests:
            gamma = 0 if back_off else min(request.gamma, self._choose(request, own_best.get(request.request_id), common))
            if (explore and 0 < gamma < request.gamma and self._states[request.request_id].gamma > 0
                    and not self.position_acceptance.settled(gamma + 1)):
                gamma += 1
            elif slope_probe and gamma > 1:
                gamma //= 2
            chosen.append(dataclasses.replace(request, gamma=gamma))
        if self.metrics is not None:
            self.metrics.backoff_steps += back_off
            for request in chosen:
                self.metrics.gamma_chosen[request.gamma] = self.metrics.gamma_chosen.get(request.gamma, 0) + 1
        # A request drafting after undrafted steps (a probe, a return from γ = 0) first forwards
        # every token those steps emitted through its draft model: at batch 16 with probes every
        # 8 steps that catch-up doubled the measured cost per draft token, which then kept γ at 0.
        catching_up = any(r.gamma > 0 and not self._states[r.request_id].drafted_last_step for r in chosen)
        draft_started = self._clock()
        drafts = self.inner.propose(chosen)
        drafted = sum(len(d.token_ids) for d in drafts)
        if not admitting and not catching_up:
            self._costs(batch_class).observe_draft(drafted, self._clock() - draft_started)
        for request, draft in zip(requests, drafts):
            state = self._states[request.request_id]
            state.pending = (len(request.context), list(draft.token_ids)) if draft.token_ids else None
            state.drafted_last_step = bool(draft.token_ids)
        self._last_call_end = self._clock()
        self._last_ids = ids
        self._last_drafted = drafted
        self._last_batch_class = batch_class
        return drafts

    def _observe(self, request: DraftRequest) -> None:
        state = self._states.get(request.request_id)
        if state is None:
            # A seeded request starts from the fixed initial_alpha: its text may depend only on its own history.
            start = self.policy.initial_alpha if request.seeded else self.population_alpha
            self._states[request.request_id] = _RequestState(gamma=request.gamma, alpha=start)
            return
        if state.pending is None:
            return
        context_length, drafted = state.pending
        emitted = list(request.context[context_length:])
        state.pending = None
        if not emitted:
            return
        accepted = accepted_count(drafted, emitted)
        tested = min(len(drafted), accepted + 1)  # positions after the first rejection were not tested
        outcome = accepted / tested
        weight = self.policy.ema_weight
        state.alpha = (1 - weight) * state.alpha + weight * outcome
        w = self.policy.population_weight
        self.population_alpha = (1 - w) * self.population_alpha + w * outcome
        self.position_acceptance.observe(len(drafted), accepted, prior=self.population_alpha)

    def _step_cost_ratio(self) -> float:
        return self._cost_ratio if self._cost_ratio is not None else 0.1  # until steps are measured

    def expected_tokens(self, request_id: str, gamma_max: int) -> np.ndarray:
        """Expected tokens per step of this request for γ = 0..``gamma_max`` (shape
        [gamma_max + 1], float64): the population's acceptance by position, each position's
        log-odds moved by how far this request's α is from the population's (a request like the
        average one gets the population's curve; one that is often rejected, a lower one)."""
        shift = _logit(self._states[request_id].alpha) - _logit(self.population_alpha)
        rates = self.position_acceptance.conditional(gamma_max, fallback=self.population_alpha)
        return expected_tokens_by_position(1.0 / (1.0 + np.exp(-(_logit(rates) + shift))))

    def _own_best(self, tokens: np.ndarray) -> int:
        """The cost model's γ for a request alone, from its :meth:`expected_tokens` for
        γ = 0..γ_max: the γ ≥ 1 with the highest E(γ) / (1 + cγ), or 0 when none beats 1
        (ties to the smaller γ)."""
        if len(tokens) < 2:
            return 0
        gammas = np.arange(1, len(tokens))
        speedups = tokens[1:] / (1.0 + self._step_cost_ratio() * gammas)
        best = int(np.argmax(speedups))
        return int(gammas[best]) if speedups[best] > 1.0 else 0

    def _common_gamma(self, requests: Sequence[DraftRequest], tokens: dict[str, np.ndarray],
                      own_best: dict[str, int]) -> int | None:
        """One draft length for every request of a batch whose drafts pay at all: the γ that
        maximises the batch's expected tokens over its step cost, Σ E_i(γ) / (1 + cγ).

        The draft model forwards the whole batch once per draft position, so a step costs about
        what its longest draft costs; requests choosing their own γ (1 to 6 side by side at
        batch 16) paid for six forwards and drafted on average three (1.06x plain where every
        request at γ = 4 ran at 1.32x, served, same run)."""
        paying = [tokens[r.request_id] for r in requests if own_best[r.request_id] > 0]
        if not paying:
            return None
        gammas = np.arange(1, len(paying[0]))
        total = np.sum(paying, axis=0)[1:]
        return int(gammas[int(np.argmax(total / (1.0 + self._step_cost_ratio() * gammas)))])

    def _choose(self, request: DraftRequest, own_best: int | None = None, common: int | None = None) -> int:
        """``own_best``: :meth:`_own_best` of this request (cost_model mode); ``common``: the
        batch's γ from :meth:`_common_gamma`, or None alone or when no request's drafts pay."""
        state = self._states[request.request_id]
        gamma_max = request.gamma
        policy = self.policy
        floor = min(policy.gamma_min, gamma_max)
        if policy.mode == "threshold":
            if state.alpha > policy.raise_above:
                state.gamma += 1
            elif state.alpha < policy.lower_below:
                state.gamma -= 1
            state.gamma = max(floor, min(state.gamma, gamma_max))
        else:
            best = own_best
            if best > 0 and common is not None:
                best = min(common, gamma_max)
            state.gamma = max(floor, best)
        if state.gamma > 0:
            return state.gamma
        if common is not None:
            # The batch drafts anyway: a probe costs one draft row and one verified token, and
            # it keeps α current every step. One rejection takes α from 0.9 to 0.63 (ema_weight
            # 0.3), under the break-even α ≈ c ≈ 0.7 at batch 16, and probes every probe_every
            # steps kept 3–7 of 16 requests idle in every step.
            return min(1, gamma_max)
        if self._calls % policy.probe_every == 0:
            return min(1, gamma_max)  # a probe keeps alpha current (γ itself stays 0 until α says so)
        return 0

    @property
    def cost_ratio(self) -> float | None:
        return self._cost_ratio
