"""Exact (enumerative) model of vLLM 0.32's block verification (``rejection_sample_method: "block"``).

numpy / float64 only; no vLLM import. A line-by-line port of the arithmetic of vLLM 0.32's Triton
kernels in ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py`` (Model Runner V2, the
only place vLLM implements block verification; Sun et al. 2024, arXiv:2403.10444, Algorithm 2):

* ``_compute_cumulative_log_p_kernel``: ``log p_i = min(log p_{i-1} + log M_b(x_i) - log M_s(x_i), 0)``,
  ``p_0 = 1`` (M_b: the processed target at draft position i, M_s: the draft's distribution);
* ``_compute_local_residual_mass_kernel``: the residual mass at position i + 1,
  ``sum_x max(p_i M_b(x | x^i) - M_s(x | x^i), 0)``;
* ``_rejection_kernel`` (``USE_BLOCK_VERIFICATION``): for i = 1..gamma-1
  ``h_i = mass / (mass + 1 - p_i)`` (1 where the denominator is 0), ``h_gamma = p_gamma``; one uniform
  ``u_i`` per position; the accepted length is ``tau = max{i : u_i <= h_i}`` (0 if none);
* ``_resample_kernel``: after ``tau < gamma`` the next token is drawn from
  ``max(p_tau M_b(. | x^tau) - M_s(. | x^tau), 0)`` normalised (``p_0 = 1``); after ``tau = gamma``
  from the target (the bonus token).

Without draft probabilities (``one_hot=True``: vLLM's ``HAS_DRAFT_LOGITS = False``, a proposer that
hands no q) vLLM uses the closed forms for ``M_s = one-hot at the draft``: ``p_i = prod M_b(x_j)``,
mass ``p_i (1 - M_b(x_{i+1}))``, and a residual that is the target without the rejected draft.

:func:`block_output_distribution` enumerates every draft sequence and every ``tau`` and returns
the exact law of the tokens one step emits, in the form ``verification.algorithm`` checks
(``exactness_deviation``: criterion (*) there). ``faults`` are wrong variants (tests show they
are caught): ``"unscaled_residual"`` (the residual ``max(M_b - M_s, 0)`` of token-wise
verification after a block decision), ``"h_without_mass"`` (``h_i = p_i``, dropping the
look-ahead residual mass); a faulty rule that reaches an empty residual emits from the target there.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product

import numpy as np

from vllm_specplugin.verification.algorithm import DistFn, Prefix

FAULTS = (None, "unscaled_residual", "h_without_mass")
ROUNDING = 1e-12  # P(tau = t) below this with an empty residual is float64 rounding of 0


def block_decision(p_rows: np.ndarray, q_rows: np.ndarray, drafts, *, one_hot: bool = False,
                   fault: str | None = None) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """One step's block decision, as vLLM computes it, for fixed drafts.

    ``p_rows``: ``[gamma + 1, V]`` the processed target at each draft position and the bonus
    position; ``q_rows``: ``[gamma, V]`` the draft's distribution at each draft position;
    ``drafts``: the gamma draft tokens. Returns (``P(tau = t)`` for t = 0..gamma, the normalised
    distribution of the token emitted after ``tau = t`` for each t, the target for t = gamma;
    None where ``P(tau = t) = 0`` and the residual is empty).
    """
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}")
    p_rows = np.asarray(p_rows, dtype=np.float64)
    q_rows = np.asarray(q_rows, dtype=np.float64)
    gamma = len(drafts)
    ratio = [1.0]  # p_0 .. p_gamma
    for i, x in enumerate(drafts):
        q_x = 1.0 if one_hot else q_rows[i, x]
        ratio.append(min(ratio[-1] * p_rows[i, x] / q_x, 1.0))
    h = [1.0]  # h_0 = 1: tau = 0 is always possible
    for i in range(1, gamma + 1):
        if i == gamma or fault == "h_without_mass":
            h.append(ratio[i])
            continue
        if one_hot:
            mass = ratio[i] * (1.0 - p_rows[i, drafts[i]])
        else:
            mass = float(np.maximum(ratio[i] * p_rows[i] - q_rows[i], 0.0).sum())
        denom = mass + 1.0 - ratio[i]
        h.append(mass / denom if denom > 0.0 else 1.0)
    tau = np.array([h[t] * np.prod([1.0 - h[j] for j in range(t + 1, gamma + 1)]) for t in range(gamma + 1)])
    emitted: list[np.ndarray | None] = []
    for t in range(gamma + 1):
        if t == gamma:
            dist = p_rows[gamma]
        elif one_hot:
            dist = p_rows[t].copy()
            dist[drafts[t]] = 0.0  # p_tau cancels under normalisation
        else:
            scale = 1.0 if fault == "unscaled_residual" else ratio[t]
            dist = np.maximum(scale * p_rows[t] - q_rows[t], 0.0)
        total = dist.sum()
        emitted.append(dist / total if total > 0 else None)
    return tau, emitted


def block_output_distribution(p_fn: DistFn, q_fn: DistFn, gamma: int, *, one_hot: bool = False,
                              fault: str | None = None) -> dict[Prefix, float]:
    """Exact law of the sequence one block-verified step emits, ``{sequence: probability}``.

    Drafts ``x_i ~ q_fn(x^{i-1})`` (the draft's sampling distribution, also its verification
    ``M_s`` unless ``one_hot``), target ``p_fn(prefix)`` (processed). Enumerates every draft
    sequence with positive probability (``V**gamma`` at most) and every ``tau``.
    """
    vocab = len(np.asarray(p_fn(())))
    out: dict[Prefix, float] = defaultdict(float)
    for drafts in product(range(vocab), repeat=gamma):
        q_rows = [np.asarray(q_fn(drafts[:i]), dtype=np.float64) for i in range(gamma)]
        weight = float(np.prod([q_rows[i][x] for i, x in enumerate(drafts)]))
        if weight <= 0.0:
            continue
        p_rows = np.stack([np.asarray(p_fn(drafts[:i]), dtype=np.float64) for i in range(gamma + 1)])
        tau, emitted = block_decision(p_rows, np.stack(q_rows) if gamma else np.zeros((0, vocab)), drafts,
                                      one_hot=one_hot, fault=fault)
        for t in range(gamma + 1):
            if tau[t] <= 0.0:
                continue
            dist = emitted[t]
            if dist is None and tau[t] <= ROUNDING:
                continue  # float64 rounding of a probability that is 0 (p = q: an empty residual)
            if dist is None:
                if fault is None:
                    raise ValueError(f"tau = {t} has probability {tau[t]:g} but an empty residual (drafts {drafts})")
                dist = p_rows[t] / p_rows[t].sum()  # a faulty rule may get there: fall back to the target
            for y in np.flatnonzero(dist):
                out[tuple(drafts[:t]) + (int(y),)] += weight * tau[t] * dist[y]
    return dict(out)
