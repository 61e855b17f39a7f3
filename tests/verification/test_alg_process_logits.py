"""``verification.algorithm.process_logits`` mirrors vLLM's own target-logit processing.

Cross-checks the pure numpy reference against vLLM 0.32's CPU path (logits divided by the
temperature as ``apply_sampling_constraints`` does, then ``apply_top_k_top_p``) on hypothesis-made
rows with ties, -inf entries and boundary-hitting top-p values, in float64 so that the comparison
is of conventions (which tokens survive), not of float32 rounding. The exactness proofs in
``test_alg_exact.py`` use this reference, so this is what ties them to vLLM's real target.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplugin.verification import algorithm as alg

SETTINGS = settings(derandomize=True, deadline=None, max_examples=150, database=None)


def vllm_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    vocab = logits.shape[0]
    x = torch.tensor(logits, dtype=torch.float64).unsqueeze(0)
    if temperature < alg.SAMPLING_EPS:  # greedy requests use the raw argmax
        out = np.zeros(vocab)
        out[int(x.argmax(dim=-1))] = 1.0
        return out
    x = x / temperature
    # InputBatch stores a disabled top-k as the vocabulary size and passes None when no request
    # in the batch uses it; likewise top-p 1.0 / None.
    k = None if not 0 < top_k < vocab else torch.tensor([top_k])
    p = None if top_p >= 1.0 else torch.tensor([top_p], dtype=torch.float64)
    x = apply_top_k_top_p(x, k, p)
    return torch.softmax(x, dim=-1)[0].numpy()


@st.composite
def rows(draw):
    vocab = draw(st.integers(2, 8))
    kind = draw(st.sampled_from(["ints", "floats", "zeros"]))
    if kind == "ints":  # many exact ties
        row = [float(draw(st.integers(-2, 2))) for _ in range(vocab)]
    elif kind == "zeros":
        row = [0.0] * vocab
    else:
        row = [draw(st.floats(-5, 5)) for _ in range(vocab)]
    for i in range(vocab):
        if draw(st.integers(0, 5)) == 0:
            row[i] = -math.inf
    if all(v == -math.inf for v in row):
        row[0] = 0.0
    return np.array(row)


@SETTINGS
@given(rows(), st.sampled_from([0.0, 0.5, 1.0, 1.7]), st.integers(-1, 9),
       st.sampled_from([1.0, 0.99, 0.9, 0.75, 0.5, 0.25, 0.1]))
def test_process_logits_matches_vllm(row, temperature, top_k, top_p):
    ours = alg.process_logits(row, temperature, top_k, top_p)
    theirs = vllm_process(row, temperature, top_k, top_p)
    np.testing.assert_array_equal(ours > 0, theirs > 0)  # same surviving tokens
    np.testing.assert_allclose(ours, theirs, atol=1e-12)


def test_top_p_boundary_and_tie_conventions_match_vllm():
    """Documented conventions, checked on hand-made cases against vLLM itself."""
    cases = [
        (np.log([0.4, 0.3, 0.2, 0.1]), 1.0, 0, 0.7),   # dropped mass == 1 - p exactly
        (np.zeros(4), 1.0, 0, 0.5),                    # ties straddle the top-p boundary
        (np.array([1.0, 0.0, 1.0, 2.0]), 1.0, 2, 1.0),  # ties at the k-th value
        (np.array([0.0, 3.0, 3.0]), 0.0, 0, 1.0),        # greedy tie: first argmax
    ]
    for row, t, k, p in cases:
        np.testing.assert_allclose(alg.process_logits(row, t, k, p), vllm_process(row, t, k, p),
                                   atol=1e-12)
