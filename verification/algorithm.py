"""Exact (enumerative) reference model of speculative rejection sampling.

numpy / float64 only; no vLLM import. Two parts:

``process_logits``
    vLLM's target-logit processing (temperature, then top-k, then top-p) as a pure function of one
    logit row, mirroring ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints`` and
    ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch`` (the CPU path).

``chain_output_distribution``
    The exact distribution of the tokens emitted by ONE speculative step (1..gamma+1 tokens),
    obtained by enumerating every draft sequence and every accept/reject outcome, for an honest
    verifier or a deliberately faulty one.

What "exact" means for one step (the criterion ``exactness_deviation`` checks)
-------------------------------------------------------------------------------
Let ``E`` be the emitted sequence of a step (random length ``L`` in 1..gamma+1) and ``p_fn(s)`` the
target's next-token distribution after the emitted prefix ``s`` (the context before the step is
fixed and implicit). Speculative decoding reproduces the target's token stream iff for every
prefix ``s`` with ``P(E starts with s, L > |s|) > 0``::

    P(E[|s|] = y | E starts with s, L > |s|) = p_fn(s)(y)   for all y.            (*)

Why this is the right criterion: a step boundary after ``s`` starts a new step whose first token
is, by (*) applied with the empty prefix at the new context, again ``~ p_fn(s)``; so whether or not
the step continues, the next emitted token given everything observable so far (tokens AND step
boundaries) is ``~ p_fn(s)``, and the token stream has the target's law by the chain rule.
Equivalently, ``E`` has the law of "sample from the target token by token and, after prefix ``s``,
stop with a probability ``h(s)`` that depends on ``s`` only" (``implied_stop_hazards`` and
``stopped_target_distribution`` build that law; it equals ``E``'s law iff (*) holds). The first
token's marginal (``first_token_distribution``) must equal ``p_fn(())`` -- the ``s = ()`` case.
Comparing only the marginal of ``E`` with "plain sampling of L tokens" would be wrong, because L
is random and depends on the tokens.

Verification rules (``mode``)
-----------------------------
``"probabilistic"``: the draft ``x ~ q_fn(s)``; accept with probability ``min(1, p(x)/q(x))``; at
the first rejection emit ``y ~ norm(max(0, p - q))`` and stop; after gamma acceptances emit a bonus
``~ p_fn(s)``.

``"onehot"``: vLLM's rule when a proposer supplies no probabilities (``draft_probs=None``): the
verifier treats q as the one-hot at the draft, i.e. accept with probability ``p(x)``, otherwise emit
``y ~ norm(p with x removed)``. This is exact whatever rule chose the draft; ``q_fn`` here is the
draft's *sampling* distribution (a one-hot for a deterministic rule such as argmax or "repeat the
last token", see ``deterministic_draft``).

Faults (``fault``)
------------------
``"resample_from_p"``: on rejection, emit ``y ~ p`` instead of the residual.
``"lossy_threshold"``: accept with probability ``min(1, p/(tau q))`` (``fault_arg = tau``; tau < 1
accepts too often), residual unchanged.
``"wrong_q"``: drafts are sampled from ``q_fn`` but verification (acceptance ratio and residual)
uses ``fault_arg(prefix)`` instead, e.g. q at another temperature.
``"ignore_temperature"``: verification uses ``fault_arg(prefix)`` (e.g. the unprocessed T=1 target)
instead of ``p_fn`` (the target at the request's temperature), which stays the reference.
``"accept_all"``: every draft is accepted whatever the target says (the bonus token is honest).

``speculative_token_law`` is the closed form of the law of the token emitted at one drafted
position (the first token of a step, and, for these position-independent rules, any later
drafted position given the emitted prefix), vectorised over rows: what the statistical tier uses
to compute a fault's effect at the engine's actual contexts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS: temperature below this is greedy
MIN_TEMPERATURE = 1e-2  # vllm.sampling_params._MAX_TEMP: 0 < T < this is raised to this

Prefix = tuple[int, ...]
DistFn = Callable[[Prefix], np.ndarray]

FAULTS = (None, "resample_from_p", "lossy_threshold", "wrong_q", "ignore_temperature", "accept_all")
MODES = ("probabilistic", "onehot")


# ----------------------------------------------------------------------------------------------
# Logit processing
# ----------------------------------------------------------------------------------------------


def softmax(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    if not finite.any():
        raise ValueError("all logits are -inf")
    z = np.exp(x[finite] - x[finite].max())
    out[finite] = z / z.sum()
    return out


def process_logits(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Target probabilities after vLLM's sampling constraints, for one row of logits.

    Conventions mirrored from vLLM 0.32 (SamplingParams, InputBatch, apply_sampling_constraints,
    apply_top_k_top_p_pytorch / apply_top_k_only):

    * ``temperature < 1e-5`` is greedy: the one-hot at ``argmax`` (first index among ties, as
      ``torch.argmax``); top-k/top-p are irrelevant then. ``0 < T < 0.01`` is raised to 0.01.
      Otherwise logits are divided by T *before* top-k/top-p.
    * top-k: ``top_k <= 0`` (0 or -1) or ``top_k >= V`` is off. Otherwise every token whose logit is
      ``>=`` the k-th largest logit is kept: ties at the boundary are ALL kept (may keep > k).
    * top-p (after top-k, on the softmax of the top-k-masked logits): tokens are sorted by logit
      ascending with a stable sort (torch's CPU sort keeps ties in index order), the ascending
      cumulative mass ``c_j`` is formed, and token ``j`` is dropped iff ``c_j <= 1 - top_p``; the
      largest token is never dropped. Hence the kept set is the smallest set of top tokens whose
      mass is ``>= top_p`` (a prefix whose dropped mass equals ``1 - top_p`` exactly is dropped).
      Among tied logits straddling the boundary the LOWER index is dropped first. ``top_p >= 1`` is
      off (nothing with positive mass is dropped).
    """
    x = np.asarray(logits, dtype=np.float64).copy()
    if x.ndim != 1:
        raise ValueError("process_logits takes one row of logits")
    vocab = x.shape[0]
    if temperature < SAMPLING_EPS:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / max(float(temperature), MIN_TEMPERATURE)
    if 0 < top_k < vocab:
        kth = np.sort(x)[vocab - top_k]
        x[x < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending; ties in index order
        cum = np.cumsum(softmax(x)[order])
        drop = cum <= 1.0 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return softmax(x)


# ----------------------------------------------------------------------------------------------
# One speculative step, enumerated
# ----------------------------------------------------------------------------------------------


def deterministic_draft(rule: Callable[[Prefix], int], vocab: int) -> DistFn:
    """A draft *sampling* distribution for a deterministic rule: the one-hot at ``rule(prefix)``."""

    def q(prefix: Prefix) -> np.ndarray:
        out = np.zeros(vocab)
        out[rule(prefix)] = 1.0
        return out

    return q


def _normalised(v: np.ndarray) -> np.ndarray | None:
    total = v.sum()
    return None if total <= 0 else v / total


def chain_output_distribution(
    p_fn: DistFn,
    q_fn: DistFn,
    gamma: int,
    *,
    mode: str = "probabilistic",
    fault: str | None = None,
    fault_arg=None,
    prune: float = 0.0,
) -> dict[Prefix, float]:
    """Exact law of the sequence emitted by one speculative step, as ``{sequence: probability}``.

    ``p_fn(prefix)`` is the target (already processed) after the emitted prefix; ``q_fn(prefix)``
    the draft's sampling distribution after the same prefix (drafts agree with the emitted prefix
    while everything is accepted). Every draft token with positive draft probability and every
    accept/reject branch is enumerated (at most ``V**gamma`` paths times residual choices), so the
    result is exact up to float64 rounding. Branches of probability ``<= prune`` are dropped
    (default 0: none). See the module docstring for ``mode`` and ``fault``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}")
    if gamma < 0:
        raise ValueError("gamma must be >= 0")
    out: dict[Prefix, float] = defaultdict(float)

    def verify_p(prefix: Prefix) -> np.ndarray:
        return np.asarray(fault_arg(prefix) if fault == "ignore_temperature" else p_fn(prefix),
                          dtype=np.float64)

    def emit_from(prefix: Prefix, dist: np.ndarray, mass: float) -> None:
        for y in np.flatnonzero(dist):
            w = mass * dist[y]
            if w > prune:
                out[prefix + (int(y),)] += w

    def step(prefix: Prefix, pos: int, mass: float) -> None:
        p = verify_p(prefix)
        if pos == gamma:  # all drafts accepted: bonus token from the (verification) target
            emit_from(prefix, p, mass)
            return
        draw = np.asarray(q_fn(prefix), dtype=np.float64)
        if mode == "probabilistic":
            q = np.asarray(fault_arg(prefix), dtype=np.float64) if fault == "wrong_q" else draw
        for x in np.flatnonzero(draw):
            m = mass * draw[x]
            if m <= prune:
                continue
            if mode == "onehot":
                accept = p[x]
                residual = p.copy()
                residual[x] = 0.0
            else:
                if q[x] <= 0:  # vLLM rejects when the verification q(x) is 0
                    accept = 0.0
                else:
                    tau = fault_arg if fault == "lossy_threshold" else 1.0
                    accept = min(1.0, p[x] / (tau * q[x]))
                residual = np.maximum(p - q, 0.0)
            if fault == "accept_all":
                accept = 1.0
            if fault == "resample_from_p":
                residual = p
            if accept > 0:
                step(prefix + (int(x),), pos + 1, m * accept)
            if accept < 1:
                res = _normalised(residual)
                if res is None:
                    # Rejection with an empty residual happens only with probability 0 for an
                    # honest verifier; a faulty one may reach it: fall back to p (documented).
                    res = p / p.sum()
                emit_from(prefix, res, m * (1.0 - accept))

    step((), 0, 1.0)
    return dict(out)


def speculative_token_law(p, q, *, mode: str = "probabilistic", fault: str | None = None,
                          fault_arg=None) -> np.ndarray:
    """Law of the token emitted at a drafted position, in closed form, row-wise (float64).

    ``p``: the target (processed) at that context, ``q``: the draft's sampling distribution there
    (arrays ``[..., V]``). The draft ``x ~ q`` is accepted with probability ``a(x)``; otherwise the
    token comes from the residual ``r``: the law is ``q * a + (1 - sum(q * a)) * r``. Rules as in
    :func:`chain_output_distribution` (``fault_arg`` is an array here: the verification q for
    ``"wrong_q"``, the verification target for ``"ignore_temperature"``, tau for
    ``"lossy_threshold"``). An empty residual falls back to ``p``, as there. Equal to the first-token
    marginal of :func:`chain_output_distribution` (tested); honest rules give ``p``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}")
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError("p and q must have the same shape")
    verify_p = np.asarray(fault_arg, dtype=np.float64) if fault == "ignore_temperature" else p
    if mode == "onehot":
        # Accept x with probability p(x); otherwise y ~ p with x removed (renormalised).
        accept = np.ones_like(p) if fault == "accept_all" else verify_p
        rejected = q * (1.0 - accept)
        if fault == "resample_from_p":
            return q * accept + rejected.sum(-1, keepdims=True) * verify_p
        rest = 1.0 - verify_p
        # sum_x rejected[x] / rest[x] * (verify_p with x removed) = verify_p * (sum w - w)
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(rest > 0, rejected / np.where(rest > 0, rest, 1.0), 0.0)
        stuck = np.where(rest > 0, 0.0, rejected).sum(-1, keepdims=True)  # empty residual
        return q * accept + verify_p * (w.sum(-1, keepdims=True) - w) + stuck * verify_p
    q_verify = np.asarray(fault_arg, dtype=np.float64) if fault == "wrong_q" else q
    tau = float(fault_arg) if fault == "lossy_threshold" else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q_verify > 0, verify_p / (tau * np.where(q_verify > 0, q_verify, 1.0)), 0.0)
    accept = np.ones_like(p) if fault == "accept_all" else np.minimum(1.0, ratio)
    accepted = q * accept
    reject_mass = 1.0 - accepted.sum(-1, keepdims=True)
    residual = verify_p if fault == "resample_from_p" else np.maximum(verify_p - q_verify, 0.0)
    total = residual.sum(-1, keepdims=True)
    residual = np.where(total > 0, residual / np.where(total > 0, total, 1.0), verify_p)
    return accepted + np.clip(reject_mass, 0.0, None) * residual


# ----------------------------------------------------------------------------------------------
# Exactness criteria
# ----------------------------------------------------------------------------------------------


def _continuation_table(dist: dict[Prefix, float], vocab: int) -> dict[Prefix, np.ndarray]:
    """``{s: vector v}`` with ``v[y] = P(E starts with s + (y,))`` for every proper prefix s."""
    table: dict[Prefix, np.ndarray] = {}
    for seq, w in dist.items():
        for t in range(len(seq)):
            s = seq[:t]
            if s not in table:
                table[s] = np.zeros(vocab)
            table[s][seq[t]] += w
    return table


def next_token_conditionals(dist: dict[Prefix, float], vocab: int) -> dict[Prefix, np.ndarray]:
    """``{s: P(E[|s|] = . | E starts with s, L > |s|)}`` for every reachable continuing prefix."""
    return {s: v / v.sum() for s, v in _continuation_table(dist, vocab).items() if v.sum() > 0}


def first_token_distribution(dist: dict[Prefix, float], vocab: int) -> np.ndarray:
    out = np.zeros(vocab)
    for seq, w in dist.items():
        out[seq[0]] += w
    return out


def exactness_deviation(dist: dict[Prefix, float], p_fn: DistFn, vocab: int,
                        min_mass: float = 0.0) -> float:
    """Largest total-variation distance between a conditional in (*) and ``p_fn(s)``.

    Only prefixes whose continuation mass ``P(E starts with s, L > |s|)`` exceeds ``min_mass`` are
    compared (0: all reachable ones). 0 up to rounding iff the step is exact.
    """
    worst = 0.0
    for s, v in _continuation_table(dist, vocab).items():
        mass = v.sum()
        if mass <= min_mass:
            continue
        target = np.asarray(p_fn(s), dtype=np.float64)
        worst = max(worst, 0.5 * float(np.abs(v / mass - target / target.sum()).sum()))
    return worst


def implied_stop_hazards(dist: dict[Prefix, float]) -> dict[Prefix, float]:
    """``h(s) = P(L = |s| | E starts with s)`` for every reachable non-empty prefix s."""
    reach: dict[Prefix, float] = defaultdict(float)
    for seq, w in dist.items():
        for t in range(1, len(seq) + 1):
            reach[seq[:t]] += w
    return {s: dist.get(s, 0.0) / m for s, m in reach.items() if m > 0}


def stopped_target_distribution(p_fn: DistFn, hazard: Callable[[Prefix], float], max_len: int,
                                vocab: int) -> dict[Prefix, float]:
    """Law of plain target sampling stopped by a prefix-only rule.

    Sample ``y_1 ~ p_fn(())``, then after prefix s (``1 <= |s| < max_len``) stop with probability
    ``hazard(s)``, else sample the next token ``~ p_fn(s)``; always stop at ``max_len``. A step is
    exact iff its law equals this one with ``hazard = implied_stop_hazards(its law)``.
    """
    out: dict[Prefix, float] = defaultdict(float)

    def grow(s: Prefix, mass: float) -> None:
        p = np.asarray(p_fn(s), dtype=np.float64)
        for y in np.flatnonzero(p):
            seq, w = s + (int(y),), mass * p[y]
            h = 1.0 if len(seq) >= max_len else float(hazard(seq))
            if h > 0:
                out[seq] += w * h
            if h < 1:
                grow(seq, w * (1.0 - h))

    grow((), 1.0)
    return dict(out)


def distribution_tv(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


def acceptance_length_mean(dist: dict[Prefix, float]) -> float:
    """Expected number of tokens emitted by the step."""
    return float(sum(len(s) * w for s, w in dist.items()))


def markov_fn(table: Sequence[np.ndarray] | np.ndarray, rule: str = "last") -> DistFn:
    """A prefix-dependent distribution from a small table.

    ``rule="last"``: ``table[0]`` after the empty prefix, ``table[1 + last token]`` otherwise
    (shape ``(V + 1, V)``). ``rule="position"``: ``table[len(prefix)]``.
    """
    arr = np.asarray(table, dtype=np.float64)

    def fn(prefix: Prefix) -> np.ndarray:
        if rule == "position":
            return arr[len(prefix)]
        return arr[0] if not prefix else arr[1 + prefix[-1]]

    return fn
