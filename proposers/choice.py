"""Which drafter drafts for each request at each step: the one with the best expected goodput.

:class:`DrafterChoice` holds a model proposer (one draft or an ensemble, chain or tree, or a
heads drafter: EAGLE, Medusa) and a zero-cost :class:`~vllm_specplugin.proposers.suffix.SuffixDrafter`.
An EAGLE head is handed the target's states of every request at every step, drafting or not
(with gamma 0 where another option was chosen), so that its cache holds every verified position
when it is chosen again. Per request and step it
compares three options by expected tokens per unit of step time (the classic speculative
speedup, with the verification's cost counted):

- the suffix chain of length L (when the context has a match): ``(1 + E(α_s, L)) / (1 + v·L)``;
- the model draft at γ = k (``model_gamma``, default ``num_speculative_tokens``, which also caps
  the suffix chain): ``(1 + A_m) / (1 + (c + v)·k)``;
- no draft: 1.

``E(α, L) = α + α² + ... + α^L`` is the expected number of accepted drafts of a chain of L at
per-token acceptance α, and A_m the request's measured accepted model drafts per step; c
(``draft_cost``) is one model-draft token's forward over a plain target step and v
(``verify_cost``) the target step's growth per verified draft token over a plain step (the
benchmarks measure both: c and r = 1 + v·γ beside every figure). Where the text repeats (a request
seen before, code, copy-edits, a greedy target that loops) the suffix wins at no draft cost; where
it does not (sampling at T = 1, new prose), the model draft wins; where neither is accepted,
nothing is drafted.

Why the model drafts k and not a γ chosen per step: its acceptance comes in runs (a draft that
gets its first tokens right tends to get the next ones right), so an i.i.d. estimate from the
per-token rate prices long drafts too low. Served on the mixed T = 1 workload, choosing γ from it
drafted 2.6 tokens a step on average and accepted 1.1-1.3 per step, where a fixed γ 4 accepted
2.1-2.8 (and γ 2 1.1-1.5). So the model's γ is the user's ``model_gamma`` (set it to the best fixed γ of
``make bench``; ``num_speculative_tokens`` may be larger, for the suffix's long chains), and the
choice is whether the model drafts at all.

With tree drafting (``tree_drafting``, the model proposer a TreeProposer verifying whole trees)
the model's option is its tree: priced at its node count N, ``(1 + A_m) / (1 + (c + v)·N)``, with
A_m the request's measured accepted path per step (the longest root path the emitted tokens
follow). Its shape stays the tree builder's (deep and narrow for a confident draft, wide for an
uncertain one); the choice decides whether it is drafted, against the suffix chain and nothing.
Suffix chains and model trees then share a step's batch: chains go to vLLM's chain sampler, trees
to the plugin's tree verification.

Acceptance is measured per request (accepted over tested positions, each an exponential average
with weight ``ema_weight``; :class:`Acceptance`):

- A_m from the model's own verified drafts (accepted drafts per step, at γ = k), starting from
  the prior ``model_prior`` · (1 + ``model_run_prior`` + ... + ``model_run_prior``^(k-1)): the
  first token accepted with one rate, each next one, given the one before, with a higher one
  (:meth:`ChoicePolicy.model_prior_accepted`; an i.i.d. prior priced drafts of 8 or more out, so they never drafted);
- α_s from the suffix chain proposed at *every* step, whether or not it was verified: a one-hot
  token x is accepted with the target's p(x), and the emitted token equals x with the same
  probability, because emitted tokens are exact samples of the target whichever draft was
  verified. So the match of the suffix chain against the emitted tokens measures α_s without
  spending a verification on it (leading matches over the positions the emitted tokens cover).

A draft is chosen only where its goodput is at least ``min_gain`` (1.1) times drafting nothing's:
where the predicted gain is thin, the measurement's noise decides, and a drafted step that does not
pay costs more than a draft-free one gains.

A request the model drafted for whose best option has become "no draft" drafts with the model
after ``probe_every`` such steps (then after twice as many each time), so that its A_m can come
back; one at "no draft" since it arrived follows the population's estimate and does not probe.
Nothing here changes what is emitted: each option is an exact draft with its own q (one-hot for
the suffix), and the choice is made before the step's verification, from earlier outcomes.

Costs under load. c and v above are a batch-1 machine's; in a batch of B requests a verified
draft token costs more of a request's share of the step (the target step turns compute-bound:
served on this 2-core CPU at concurrency 48, every drafter ran at 0.87-0.99x plain), and a draft
token less (the draft forwards the batch together). So with ``measure_costs`` (the default) the
choice measures both while serving, per batch-size class (1, 2-3, 4-7, 8-15, ...;
:class:`BatchCosts`): the target step's time against the draft tokens it verified, a + b·D (least
squares, :class:`~vllm_specplugin.proposers.gamma.StepCostModel`), and the model's drafting time
per draft token d; then v = b / (a / B) and c = d / (a / B), a request's price of one draft token
over its share of a plain step. Until a class has been measured (8 steps that admitted no request,
8 of them with a draft count away from the average; where the count has not varied by itself
after 8 steps, every other step of the class drafts nothing) it is priced by interpolating, in
log2 of the batch size, between the measured classes around it (below the smallest measured class:
between the configured c and v at batch 1 and that class; above the largest: as the largest), and
with none measured the configured c and v stand. Where even a draft the target
always accepts cannot pay, ``(1 + γ) / (1 + (c + v)·γ) <= 1``, a request at "no draft" does not
probe either: at concurrency 48 here nothing is drafted, as plain decoding.

Reproducibility. For a seeded request the choice depends on the request's own history only: its
own α (starting from fixed priors, not from the population's), its own step count, its own
context (the suffix drafter matches a seeded request at T > 0 against its own context only).
Costs are the configured ones (batch-1 costs, whatever the load: a seeded request keeps drafting
under load where an unseeded one stops), never timed. An unseeded request starts from the
population's recent α, kept apart for greedy and sampled requests (a suffix draft that greedy
requests accept nearly always is accepted with p(x) by a sampled one, so one average for both
would start sampled requests on suffix drafts that fail).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.gamma import AdaptiveGamma, StepCostModel
from vllm_specplugin.proposers.metrics import accepted_count, matched_prefix
from vllm_specplugin.proposers.suffix import SuffixDrafter
from vllm_specplugin.proposers.tree import chain_expected_accepted_length, tree_accepted_path

SUFFIX, MODEL, NONE = "suffix", "model", "none"
MAX_PROBE_INTERVAL = 64  # idle steps between a request's probes of the model, at most
logger = logging.getLogger("vllm.specplugin.choice")  # vLLM's handler prints it when served


@dataclass(frozen=True)
class ChoicePolicy:
    draft_cost: float = 0.12  # c: one model-draft token over a plain target step (benchmarks: 0.11-0.14 here)
    verify_cost: float = 0.07  # v: the target step's growth per verified draft token (r = 1 + v·γ)
    # Weight of the newest step in a request's acceptance averages. 0.3 reacted to two poor steps
    # of a 40-token request by drafting nothing for up to probe_every steps (14 of 24 steps
    # undrafted on a copy request at T = 1, where a fixed chain accepted 2.1 drafts a step).
    ema_weight: float = 0.1
    suffix_prior: float = 0.5  # a new request's per-token acceptance of suffix drafts
    model_prior: float = 0.6  # ... and of a model draft's first token
    # ... and of a model draft's next token once the one before was accepted: drafts accept in
    # runs, so an i.i.d. prior (this = model_prior) prices long drafts out. Measured conditional
    # acceptance at positions 2-8 (7 Dec, mixed T = 1, draft-code chains of 6 and 8): 0.74-0.95.
    # With 0.6 i.i.d., a chain or tree of 8 was priced at 0.98x drafting nothing and never drafted.
    model_run_prior: float = 0.8
    population_weight: float = 0.05  # weight of each outcome in the population's α (unseeded starts)
    probe_every: int = 4  # at "no draft", draft with the model every this many steps
    model_gamma: int | None = None  # the model's γ (None: num_speculative_tokens, which also caps the suffix)
    measure_costs: bool = True  # unseeded requests: c and v measured per batch-size class while serving
    # A draft must promise at least this many times the tokens per unit of step time of drafting
    # nothing: where the predicted gain is thin, noise decides (served at 4 requests, T = 1, model
    # drafts predicted at 1.06x ran at 0.91x the draft-free steps).
    min_gain: float = 1.1
    trace: str | None = None  # a file to append one JSON line per step to (what was measured and chosen)

    def __post_init__(self):
        for name in ("draft_cost", "verify_cost"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10:
                raise ValueError(f"{name} must be a number in [0, 10), got {value!r}")
        for name in ("ema_weight", "population_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("suffix_prior", "model_prior", "model_run_prior"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not 1 <= self.min_gain < 10:
            raise ValueError(f"min_gain must be a number in [1, 10), got {self.min_gain!r}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if not isinstance(self.measure_costs, bool):
            raise ValueError(f"measure_costs must be true or false, got {self.measure_costs!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ValueError(f"trace must be a file path or null, got {self.trace!r}")
        if self.model_gamma is not None and (isinstance(self.model_gamma, bool) or not isinstance(self.model_gamma, int)
                                             or self.model_gamma < 1):
            raise ValueError(f"model_gamma must be an integer >= 1 or null, got {self.model_gamma!r}")

    def model_prior_accepted(self, gamma: int) -> float:
        """A new request's expected accepted model drafts per step at γ: the first token accepted
        with ``model_prior``, each next one with ``model_run_prior`` given the one before,
        model_prior · (1 + run + ... + run^(γ-1)) (E(model_prior, γ) when the two are equal)."""
        return chain_expected_accepted_length([self.model_prior, self.model_run_prior], gamma)


@dataclass(frozen=True)
class Prices:
    """c and v of one batch-size class as measured (:meth:`BatchCosts.ratios`); a ChoicePolicy
    carries the configured ones under the same names."""

    draft_cost: float
    verify_cost: float


def chain_goodput(policy: ChoicePolicy | Prices, alpha: float, length: int) -> float:
    """Expected tokens per unit of step time of a zero-cost chain of ``length`` at per-token
    acceptance ``alpha``: ``(1 + E(α, L)) / (1 + v·L)``."""
    return (1 + expected_accepted(alpha, length)) / (1 + policy.verify_cost * length)


def model_goodput(policy: ChoicePolicy | Prices, accepted: float, gamma: int) -> float:
    """... of a model draft of γ tokens that accepts ``accepted`` per step: ``(1 + A) / (1 + (c + v)·γ)``."""
    return (1 + accepted) / (1 + (policy.draft_cost + policy.verify_cost) * gamma)


def expected_accepted(alpha: float, length: int) -> float:
    """E(α, L) = α + α² + ... + α^L: accepted drafts of a chain of L at per-token acceptance α."""
    total, term = 0.0, 1.0
    for _ in range(length):
        term *= alpha
        total += term
    return total


class Acceptance:
    """Per-token acceptance α as a ratio of exponential averages: accepted drafts over tested
    positions (a position past the first rejection is not tested). The ratio of averages, not the
    average of each step's ratio: a step's a / (a + 1) averages far below α (at α 0.78 per token,
    chains of 4 average 2.54 accepted, and their mean ratio is 0.58)."""

    __slots__ = ("accepted", "tested")

    def __init__(self, alpha: float, weight: float = 1.0):
        self.accepted, self.tested = alpha * weight, weight  # a prior worth `weight` tested positions

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

    def observe(self, accepted: int, tested: int, weight: float) -> None:
        self.accepted = (1 - weight) * self.accepted + weight * accepted
        self.tested = (1 - weight) * self.tested + weight * tested


class BatchCosts:
    """c and v measured while serving, per batch-size class (the power of two at or below B).

    Between two :meth:`step_started` calls the engine ran one target step over the drafts of the
    call before: its time and draft count feed the class's :class:`StepCostModel` (a + b·D), unless
    the step admitted a request (its prompt's prefill is not a decoding step's cost). The model's
    drafting time per draft token (d) is fed by :meth:`observe_draft`, catch-up forwards included:
    a request that switches from suffix drafts to the model pays them every time.

    A class is measured once it has seen ``StepCostModel.MIN_STEPS`` steps, ``MIN_VARIED_STEPS`` of
    them with a draft count away from the average. Where the count does not vary by itself (every
    request drafting the same chain), every other step of the class drafts nothing
    (:meth:`slope_probe`). Under a burst most steps admit a request, so a large class is measured
    late (served at concurrency 48: not within two rounds of 96 requests when probes came every 4th
    step after 16 steps), and the classes a burst passes through on its way up and down may never
    be; until then a class is priced from its measured neighbours (:meth:`ratios`)."""

    SLOPE_PROBE_EVERY = 2  # in an unmeasured class whose draft count does not vary, every this many steps nobody drafts

    def __init__(self, clock=time.perf_counter, batch1: tuple[float, float] | None = None):
        self.clock = clock  # seconds (float); tests drive a synthetic one
        self.batch1 = batch1  # (c, v) configured for batch 1: the low end below every measured class
        self.by_class: dict[int, StepCostModel] = {}
        self.batch_sizes: dict[int, float] = {}  # class -> the mean batch size of its measured steps
        self._last_end: float | None = None
        self._last_ids: set[str] = set()
        self._last_verified = 0
        self._last_batch = 1
        self._steps = 0
        self.last_target_s: float | None = None  # the target step before this call (None: first call)
        self._reported: set[int] = set()

    def model(self, batch_size: int) -> StepCostModel:
        return self.by_class.setdefault(AdaptiveGamma.batch_class(batch_size), StepCostModel())

    def step_started(self, request_ids: set[str], admitting: bool) -> None:
        started = self.clock()
        self._steps += 1
        self.last_target_s = None if self._last_end is None else started - self._last_end
        if self._last_end is not None and not admitting and request_ids & self._last_ids:
            model = self.model(self._last_batch)
            model.observe_target(self._last_verified, started - self._last_end)
            key = AdaptiveGamma.batch_class(self._last_batch)
            self.batch_sizes[key] = self.batch_sizes.get(key, self._last_batch) * 0.95 + 0.05 * self._last_batch

    def observe_draft(self, batch_size: int, drafted: int, seconds: float) -> None:
        self.model(batch_size).observe_draft(drafted, seconds)

    def step_ended(self, request_ids: set[str], batch_size: int, verified: int) -> None:
        """``verified``: the draft tokens this call handed the engine (all requests)."""
        self._last_end, self._last_ids, self._last_verified = self.clock(), request_ids, verified
        self._last_batch = batch_size

    def measured(self, batch_size: int) -> bool:
        model = self.by_class.get(AdaptiveGamma.batch_class(batch_size))
        return model is not None and model.steps >= StepCostModel.MIN_STEPS and model.slope_measured

    def slope_probe(self, batch_size: int) -> bool:
        """Whether this step should draft nothing, so that the class's draft count varies (at a
        steady draft count the slope b cannot be told from the base a). Only once the class has
        seen MIN_STEPS steps without enough variation: alone, a request's draft count often varies
        by itself (suffix chains, model drafts, nothing), and a probe step costs its drafts."""
        model = self.by_class.get(AdaptiveGamma.batch_class(batch_size))
        return (model is not None and model.steps >= StepCostModel.MIN_STEPS and not model.slope_measured
                and self._steps % self.SLOPE_PROBE_EVERY == 1)

    def ratios(self, batch_size: int) -> tuple[float | None, float] | None:
        """(c, v) for one request of a batch of ``batch_size``: the model's draft time per draft
        token and the target step's growth per verified draft token, each over the request's share
        of a step without drafts (a / B). c is the nearest class's where the model has not drafted
        in this one, None where it has drafted in none.

        An unmeasured class between two measured ones is priced by interpolating theirs in
        log2(batch size); one below every measured class, between the configured batch-1 prices
        (``batch1``, at batch 1) and the nearest measured class above it; one above every measured
        class, as the nearest measured class below it (at that class's mean batch size). None when
        no class is measured. Served at concurrency 48 (mixed workload, T = 1), the batch passes
        through classes 8-16 only as a round starts and ends, too briefly to be measured; priced
        at batch-1 prices there, the choice drafted 15-30 requests at once with the model (their
        draft prefills 290-440 ms a step) where class 32 said drafting cannot pay."""
        batch_class = AdaptiveGamma.batch_class(batch_size)
        if self.measured(batch_size):
            return self._class_ratios(batch_class, batch_size)
        measured = [k for k in self.by_class if self.measured(k)]
        below = [k for k in measured if k < batch_class]
        above = [k for k in measured if k > batch_class]
        if not above:
            if not below:
                return None
            return self._class_ratios(max(below), self._mean_size(max(below)))
        high = min(above)
        high_size = self._mean_size(high)
        c_high, v_high = self._class_ratios(high, high_size)
        if below:
            low = max(below)
            low_size = self._mean_size(low)
            c_low, v_low = self._class_ratios(low, low_size)
        elif self.batch1 is not None:
            low_size, (c_low, v_low) = 1, self.batch1
        else:
            return c_high, v_high
        span = math.log2(high_size) - math.log2(low_size)
        t = 1.0 if span <= 0 else min(1.0, max(0.0, (math.log2(max(batch_size, 1)) - math.log2(low_size)) / span))
        c = c_low if c_high is None else c_high if c_low is None else c_low + t * (c_high - c_low)
        return c, v_low + t * (v_high - v_low)

    def _mean_size(self, batch_class: int) -> float:
        """The mean batch size of a class's measured steps (the class's key before any)."""
        return self.batch_sizes.get(batch_class, batch_class)

    def _class_ratios(self, batch_class: int, batch_size: float) -> tuple[float | None, float]:
        """(c, v) of a measured class for a request of a batch of ``batch_size``."""
        model = self.by_class[batch_class]
        share = model.base / max(batch_size, 1)
        v = model.slope / share
        c = None if model.draft_per_token is None else model.draft_per_token / share
        if c is None:  # the model has not drafted in this class: the nearest class where it has, at its batch size
            drafted = [k for k in self.by_class if self.measured(k) and self.by_class[k].draft_per_token is not None]
            if drafted:
                nearest = min(drafted, key=lambda k: (abs(k.bit_length() - batch_class.bit_length()), -k))
                other = self.by_class[nearest]
                c = other.draft_per_token / (other.base / max(self._mean_size(nearest), 1))
        if batch_class not in self._reported:
            self._reported.add(batch_class)
            logger.info("drafter choice: batch class %d measured: v %.3f, c %s (plain step share %.2f ms)",
                        batch_class, v, "unmeasured" if c is None else f"{c:.3f}", share * 1e3)
        return c, v


@dataclass
class _RequestState:
    suffix: Acceptance  # per token
    model: Acceptance  # per model step: accepted drafts over steps (a chain of k is not i.i.d. tokens)
    context_length: int = -1  # the context's length when the last proposal was made
    suffix_tokens: list[int] = dataclasses.field(default_factory=list)  # proposed, verified or not
    model_tokens: list[int] | None = None  # the model's chain, when it was the one verified
    # The model's tree (node tokens [N - 1], parents [N]), when it was the one verified at the
    # request's γ (a probe's or a shortened tree says nothing of k's).
    model_tree: tuple[list[int], list[int]] | None = None
    model_nodes: int = 0  # the node count of the model's last full tree: its drafts' price (0: γ)
    verified: str = NONE  # which drafter's proposal the target verified
    idle_steps: int = 0  # consecutive steps at "no draft"
    probe_interval: int = 0  # idle steps until the next probe (0: probe_every); doubles after each probe
    sampled: bool = False  # T > 0 (its population average is the sampled requests')
    model_chosen: bool = False  # the model has drafted for it by goodput (not only as a probe)
    gamma: int = 0  # the model's γ: the request's first budget (k, unless max_model_len is near)

    @property
    def suffix_alpha(self) -> float:
        return self.suffix.alpha

    @suffix_alpha.setter
    def suffix_alpha(self, alpha: float) -> None:
        self.suffix = Acceptance(alpha)

    @property
    def model_accepted(self) -> float:
        """Accepted model drafts per model step (at γ = k)."""
        return self.model.alpha

    @model_accepted.setter
    def model_accepted(self, accepted: float) -> None:
        self.model = Acceptance(accepted)


@dataclass(frozen=True)
class Choice:
    drafter: str  # SUFFIX, MODEL or NONE
    gamma: int  # tokens asked of it
    goodput: float  # the expected tokens per unit of step time that decided it


class DrafterChoice(Proposer):
    """Per request and step: the suffix drafter, the model proposer at some γ, or nothing."""

    def __init__(self, model: Proposer, suffix: SuffixDrafter, policy: ChoicePolicy = ChoicePolicy(),
                 clock=time.perf_counter):
        self.model = model
        self.suffix = suffix
        self.policy = policy
        self.vocab_size = model.vocab_size
        self.metrics = getattr(model, "metrics", None)
        self._states: dict[str, _RequestState] = {}
        # Recent acceptance over all requests, per drafter and per kind of request (greedy or
        # sampled: a one-hot suffix token is accepted with p(x), which sampling spreads thin).
        self.population = {(SUFFIX, sampled): Acceptance(policy.suffix_prior) for sampled in (False, True)}
        self._model_population: dict[tuple[int, bool], Acceptance] = {}  # (k, sampled) -> accepted per step
        self._prices_checked: set[int] = set()  # the γ whose prior has been checked against the prices
        self.last_choices: dict[str, Choice] = {}  # request id -> this step's choice (tests, logs)
        # measured c and v per batch-size class (unseeded requests)
        self.costs = BatchCosts(clock, batch1=(policy.draft_cost, policy.verify_cost))
        self.last_prices: ChoicePolicy | Prices = policy  # the prices unseeded requests were chosen at
        # Opened here, so that a path that cannot be written fails at start-up, not at every step.
        self._trace_file = open(policy.trace, "a", buffering=1) if policy.trace else None

    @property
    def population_alpha(self) -> dict[tuple[str, bool], float]:
        """(SUFFIX, sampled) -> the recent per-token acceptance of suffix drafts over all requests
        of that kind."""
        return {key: acceptance.alpha for key, acceptance in self.population.items()}

    def model_prior(self, gamma: int) -> float:
        """A new seeded request's accepted model drafts per step at γ (:meth:`ChoicePolicy.model_prior_accepted`)."""
        return self.policy.model_prior_accepted(gamma)

    def _model_population_of(self, gamma: int, sampled: bool) -> Acceptance:
        key = (gamma, sampled)
        if key not in self._model_population:
            self._model_population[key] = Acceptance(self.model_prior(gamma))
        return self._model_population[key]

    def _warn_if_priced_out(self, gamma: int) -> None:
        """Say so (once per γ) where the configured prices and priors never let the model draft at
        γ: a request then never measures it, so only measured costs (unseeded requests) could
        change that."""
        if gamma in self._prices_checked:
            return
        self._prices_checked.add(gamma)
        prior = self.model_prior(gamma)
        if gamma > 0 and model_goodput(self.policy, prior, gamma) <= self.policy.min_gain:
            logger.warning(
                "drafter choice: at γ %d the model's prior (%.2f accepted per step: model_prior %.2f, "
                "model_run_prior %.2f) at draft_cost %.3f and verify_cost %.3f is priced below min_gain "
                "%.2f: seeded requests never draft with the model, unseeded ones only if measured costs "
                "are lower. Lower suffix_drafting.model_gamma (or the tree's node_budget), or raise the "
                "priors.", gamma, prior, self.policy.model_prior, self.policy.model_run_prior,
                self.policy.draft_cost, self.policy.verify_cost, self.policy.min_gain)

    @property
    def inner(self) -> Proposer:
        """The model proposer (tree_verification.tree_proposer walks ``inner`` to the TreeProposer)."""
        return self.model

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.suffix.free(request_id)
        self.model.free(request_id)

    def tracked_request_ids(self) -> set[str]:
        return set(self._states) | self.model.tracked_request_ids()

    # -- acceptance ------------------------------------------------------------------------

    def _state(self, request: DraftRequest) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            sampled = request.params.temperature > 0
            gamma = request.gamma if self.policy.model_gamma is None else min(request.gamma, self.policy.model_gamma)
            request = dataclasses.replace(request, gamma=gamma)
            if request.seeded:  # fixed priors: nothing from other requests
                state = _RequestState(Acceptance(self.policy.suffix_prior), Acceptance(self.model_prior(request.gamma)),
                                      sampled=sampled, gamma=request.gamma)
            else:
                state = _RequestState(Acceptance(self.population[SUFFIX, sampled].alpha),
                                      Acceptance(self._model_population_of(request.gamma, sampled).alpha),
                                      sampled=sampled, gamma=request.gamma)
            self._states[request.request_id] = state
            self._warn_if_priced_out(request.gamma)
        return state

    def _update(self, state: _RequestState, drafter: str, accepted: int, tested: int) -> None:
        """SUFFIX: ``accepted`` of ``tested`` positions; MODEL: ``accepted`` drafts in ``tested`` (1) steps."""
        if tested <= 0:
            return
        (state.suffix if drafter == SUFFIX else state.model).observe(accepted, tested, self.policy.ema_weight)
        population = (self.population[SUFFIX, state.sampled] if drafter == SUFFIX
                      else self._model_population_of(state.gamma, state.sampled))
        population.observe(accepted, tested, self.policy.population_weight)

    def _observe(self, request: DraftRequest, state: _RequestState) -> None:
        if state.context_length < 0:
            return
        emitted = list(request.context[state.context_length:])
        if emitted:
            drafted = state.suffix_tokens
            matched = matched_prefix(drafted, emitted)
            # Positions past the emitted tokens were not observed; past the first mismatch not tested.
            self._update(state, SUFFIX, matched, min(len(drafted), matched + 1, len(emitted)))
            if state.verified == SUFFIX and drafted and self.metrics is not None:
                self.metrics.record_outcome(len(drafted), matched)  # the model proposer counts its own
                self.metrics.suffix_drafted_tokens += len(drafted)
                self.metrics.suffix_accepted_tokens += matched
            if state.model_tokens:
                if len(state.model_tokens) == state.gamma:  # a probe's shorter draft does not say what k gives
                    self._update(state, MODEL, accepted_count(state.model_tokens, emitted), 1)
            if state.model_tree is not None:
                # A tree's accepted drafts: the longest root path the emitted tokens follow.
                self._update(state, MODEL, len(tree_accepted_path(*state.model_tree, emitted)), 1)
        state.suffix_tokens, state.model_tokens, state.model_tree, state.verified = [], None, None, NONE

    # -- the choice ------------------------------------------------------------------------

    def choose(self, request: DraftRequest, state: _RequestState, suffix_length: int,
               prices: ChoicePolicy | Prices | None = None) -> Choice:
        """The best option at ``prices`` (c and v; the configured ones when None)."""
        prices = self.policy if prices is None else prices
        best = Choice(NONE, 0, 1.0)
        gamma = min(request.gamma, state.gamma)
        # a draft must beat the best so far, and drafting nothing by min_gain; a tree of N nodes
        # costs N draft tokens' drafting and verification (its accepted path is at most its depth)
        goodput = model_goodput(prices, state.model_accepted, min(state.model_nodes, gamma) or gamma)
        if goodput > max(best.goodput, self.policy.min_gain):
            best = Choice(MODEL, gamma, goodput)
        if suffix_length:
            goodput = chain_goodput(prices, state.suffix_alpha, suffix_length)
            if goodput > max(best.goodput, self.policy.min_gain):
                best = Choice(SUFFIX, suffix_length, goodput)
        state.model_chosen = state.model_chosen or best.drafter == MODEL
        if best.drafter == NONE and request.gamma > 0:
            state.idle_steps += 1
            # A probe lets a request the model drafted for come back after poor steps, unless even
            # a draft the target always accepts would not pay at these prices (a large batch on a
            # compute-bound machine). A request at "no draft" since it arrived does not probe: it
            # started from the population's estimate, which the requests that draft keep current,
            # and one probe moves its own by ema_weight only (served at 4 requests, T = 1, the
            # arrivals' probes were most of the model steps, each costing 2.5-3 draft-free steps).
            # Each probe that leaves the request at "no draft" doubles the wait for the next (up to
            # MAX_PROBE_INTERVAL steps).
            interval = state.probe_interval or self.policy.probe_every
            if (state.model_chosen and state.idle_steps >= interval
                    and model_goodput(prices, gamma, gamma) > self.policy.min_gain):
                best = Choice(MODEL, gamma, 1.0)
                state.idle_steps = 0
                state.probe_interval = min(2 * interval, max(MAX_PROBE_INTERVAL, self.policy.probe_every))
        else:
            state.idle_steps = 0
            state.probe_interval = 0
        return best

    def _prices(self, batch_size: int) -> tuple[ChoicePolicy | Prices, bool]:
        """(prices for this step's unseeded requests, whether they should draft nothing this step
        so that an unmeasured batch-size class sees its draft count vary)."""
        if not self.policy.measure_costs:
            return self.policy, False
        ratios = self.costs.ratios(batch_size)
        slope_probe = self.costs.slope_probe(batch_size)
        if ratios is None:
            return self.policy, slope_probe
        c, v = ratios
        return Prices(self.policy.draft_cost if c is None else c, v), slope_probe

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(requests)
        to_model: list[tuple[int, DraftRequest]] = []
        self.last_choices = {}
        ids = {r.request_id for r in requests}
        # A request seen for the first time was prefilled by the last target step: not a decoding step's cost.
        admitting = any(r.request_id not in self._states for r in requests)
        if self.policy.measure_costs:
            self.costs.step_started(ids, admitting)
        prices, slope_probe = self._prices(len(requests))
        self.last_prices = prices
        # Tokens the last step emitted for the requests it had (the trace's goodput figure).
        emitted = 0 if not self.policy.trace else sum(
            len(r.context) - self._states[r.request_id].context_length for r in requests
            if r.request_id in self._states and self._states[r.request_id].context_length >= 0)
        draft_s = 0.0
        for i, request in enumerate(requests):
            state = self._state(request)
            self._observe(request, state)
            chain = self.suffix.chain(request)
            state.context_length = len(request.context)
            state.suffix_tokens = list(chain.tokens)
            if request.gamma <= 0 or (slope_probe and not request.seeded):
                choice = Choice(NONE, 0, 1.0)
            elif request.seeded:  # its own history only: the configured prices, whatever the load
                choice = self.choose(request, state, len(chain.tokens))
            else:
                choice = self.choose(request, state, len(chain.tokens), prices)
            self.last_choices[request.request_id] = choice
            if self.metrics is not None:
                name = f"choice_{choice.drafter}_steps"
                setattr(self.metrics, name, getattr(self.metrics, name) + 1)
            state.verified = choice.drafter
            if choice.drafter == MODEL:
                to_model.append((i, dataclasses.replace(request, gamma=choice.gamma)))
            elif choice.drafter == SUFFIX:
                tokens = list(chain.tokens)
                drafts[i] = Draft(tokens, self.suffix.one_hot(tokens))
        # A heads drafter (EAGLE) keeps a cache of every verified position's target state: it
        # takes the states of the requests it does not draft for too, with gamma 0 (no draft).
        modelled = {i for i, _ in to_model}
        absorbing = [dataclasses.replace(request, gamma=0) for i, request in enumerate(requests)
                     if request.hidden_states is not None and i not in modelled]
        if absorbing and not to_model:
            self.model.propose(absorbing)
        if to_model:
            # A request new to the draft model prefills its whole context there: not a draft token's price.
            tracked = self.model.tracked_request_ids()
            fresh = any(request.request_id not in tracked for _, request in to_model)
            draft_started = self.costs.clock()
            model_drafts = self.model.propose([request for _, request in to_model] + absorbing)[:len(to_model)]
            draft_s = self.costs.clock() - draft_started
            # (Not left out when the step admits a request: under a burst most steps do, and a
            # new request's draft prefill is already left out as `fresh`.)
            if self.policy.measure_costs and not fresh:
                self.costs.observe_draft(len(requests), sum(len(d.token_ids) for d in model_drafts), draft_s)
            if len(model_drafts) != len(to_model):
                raise RuntimeError(f"the model proposer returned {len(model_drafts)} drafts for {len(to_model)} requests")
            for (i, request), draft in zip(to_model, model_drafts):
                drafts[i] = draft
                state = self._states[request.request_id]
                if draft.parents is None:
                    state.model_tokens = list(draft.token_ids)
                elif draft.token_ids and request.gamma == state.gamma:  # a submitted tree (verify "tree")
                    state.model_tree = (list(draft.token_ids), list(draft.parents))
                    state.model_nodes = len(draft.token_ids)
        for i, request in enumerate(requests):
            if drafts[i] is None:
                drafts[i] = self.empty_draft()
        verified = sum(len(d.token_ids) for d in drafts)
        if self.policy.measure_costs:
            self.costs.step_ended(ids, len(requests), verified)
        if self.policy.trace:
            self._write_trace(len(requests), admitting, emitted, draft_s, verified, prices, slope_probe)
        return drafts  # type: ignore[return-value]

    def _write_trace(self, batch: int, admitting: bool, emitted: int, draft_s: float, verified: int,
                     prices: ChoicePolicy | Prices, slope_probe: bool) -> None:
        """One JSON line: the target step before this call (seconds; None at the first), the tokens
        it emitted for the requests still here, this call's model drafting time, the draft tokens
        handed to the engine, the prices unseeded requests were chosen at, the choices, the mean
        goodput the model's choices were made at (a probe's is 1.0)."""
        kinds = [choice.drafter for choice in self.last_choices.values()]
        predicted = [choice.goodput for choice in self.last_choices.values() if choice.drafter == MODEL]
        self._trace_file.write(json.dumps({
            "batch": batch, "admitting": admitting, "target_s": self.costs.last_target_s, "emitted": emitted,
            "draft_s": draft_s, "verified": verified, "measured": self.costs.measured(batch),
            "draft_cost": prices.draft_cost, "verify_cost": prices.verify_cost, "slope_probe": slope_probe,
            "suffix": kinds.count(SUFFIX), "model": kinds.count(MODEL), "none": kinds.count(NONE),
            "model_predicted": sum(predicted) / len(predicted) if predicted else None}) + "\n")
