"""Draft-side draws are exact with respect to q (float32, as vLLM receives it) at large vocabularies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.sampling import (
    SamplingParams,
    cdf_rows,
    invert_cdf,
    processed_probs,
    processed_probs_rows,
    sample,
    sample_rows,
)
from vllm_specplugin.stats import counts_from_samples, gof_test

VOCAB = 152064  # Qwen2.5-7B's embedding rows
INTERVAL_TOLERANCE = 1e-12


def large_vocabulary_q(seed: int) -> torch.Tensor:
    """[4, VOCAB] float32 q as the proposers make them: plain, top-k (zeros), top-p, and a very
    peaked row whose tail reaches probabilities far below float64's resolution near 1."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, VOCAB, generator=generator) * 4
    logits[3] *= 3
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=20000),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=1.0),
    ]
    return processed_probs_rows(logits, params)


def test_every_token_owns_an_interval_of_length_q():
    """Deterministic: under the float64 CDF each token's interval of points has length q_i (as
    float64 of the float32 q) within 1e-12, the searchsorted convention maps both ends of it to
    i, and zeros own empty intervals (never drawn)."""
    q = large_vocabulary_q(seed=0)
    q64 = q.double()
    cdf = cdf_rows(q)
    assert cdf.dtype == torch.float64 and cdf.shape == q.shape
    below = torch.cat([torch.zeros(q.shape[0], 1, dtype=torch.float64), cdf[:, :-1]], 1)  # cdf[i - 1]
    lengths = cdf - below
    assert float((lengths - q64).abs().max()) <= INTERVAL_TOLERANCE
    assert bool((lengths[q == 0] == 0).all()) and int((q == 0).sum()) > 100_000  # top-k and top-p zeros
    # A positive q whose interval is empty is below float64's resolution at that height of the CDF.
    reachable = lengths > 0
    unreachable = q64[(q > 0) & ~reachable]
    assert unreachable.numel() > 0 and float(unreachable.max()) <= INTERVAL_TOLERANCE  # the peaked row
    assert bool((q[reachable] > 0).all())
    # Both ends of every non-empty interval map to its token: the lowest point (inclusive) and
    # the largest float64 below the next token's start.
    ids = torch.arange(VOCAB).expand_as(q)
    lowest = invert_cdf(cdf, below, q)
    highest = invert_cdf(cdf, torch.nextafter(cdf, torch.tensor(-1.0, dtype=torch.float64)), q)
    assert torch.equal(lowest[reachable], ids[reachable])
    assert torch.equal(highest[reachable], ids[reachable])
    # The top of the range (a uniform of 1 - 2^-53 rounding up) goes to the last drawable token.
    top = invert_cdf(cdf, cdf[:, -1:].contiguous(), q).squeeze(-1)
    last = torch.tensor([int(row.nonzero().max()) for row in q])
    assert torch.equal(top, last)


def test_sample_uses_the_same_exact_inversion():
    """``sample`` (single requests) draws like ``sample_rows``: the token owning the generator's
    float64 uniform in the float64 CDF (not torch.multinomial's float32 exponential race)."""
    q = large_vocabulary_q(seed=1)
    cdf = cdf_rows(q)
    for seed in range(20):
        row = seed % q.shape[0]
        token = sample(q[row], torch.Generator().manual_seed(seed))
        uniform = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        expected = invert_cdf(cdf[row:row + 1], uniform[:, None] * cdf[row:row + 1, -1:], q[row:row + 1])
        assert int(token) == int(expected)
    tokens = sample(q[:2], torch.Generator().manual_seed(0))
    assert tokens.shape == (2,) and tokens.dtype == torch.int64


@pytest.mark.statistical
def test_sample_rows_draws_q_at_large_vocabulary():
    """Chi-square (bins from the probabilities, expected >= 5, a remainder bin; fixed seeds) of
    sample_rows at V = 152064, for two distributions drawn in alternate rows of each call (rows
    must not mix), half of the rows with their own generators. alpha = 0.001 per distribution."""
    q = large_vocabulary_q(seed=2)[:2]  # plain softmax; top-k with zeros
    draws_per_q, rows_per_call = 20_000, 32
    batch = q.repeat(rows_per_call // 2, 1)  # rows alternate q[0], q[1]
    generators = [torch.Generator().manual_seed(100 + row) if row % 4 < 2 else None for row in range(rows_per_call)]
    samples = [[], []]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(draws_per_q // (rows_per_call // 2)):
            tokens = sample_rows(batch, generators)
            samples[0].append(tokens[0::2])
            samples[1].append(tokens[1::2])
    for which in range(2):
        counts = counts_from_samples(torch.cat(samples[which]).numpy(), VOCAB)
        result = gof_test(counts, q[which].double().numpy())
        assert result.impossible_count == 0
        assert result.n_bins > 100 and result.binning.remainder_bin is not None
        assert result.pvalue >= 0.001, (which, result.pvalue, result.statistic, result.df)


def test_seeded_rows_are_reproducible():
    q = large_vocabulary_q(seed=3)[:3]
    first = sample_rows(q, [torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)])
    again = sample_rows(q, [torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(12)])
    assert first[0] == again[0] and first[2] == again[2]
    assert bool((q[torch.arange(3), first] > 0).all())
    np.testing.assert_array_equal(first.shape, (3,))


def test_rows_with_their_own_parameters_are_processed_with_them():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(0.7, 50, 0.9), SamplingParams(1.0), SamplingParams(0.7, 50, 0.9),
              SamplingParams(temperature=0.0), SamplingParams(1.3, 0, 0.8)]
    rows = processed_probs_rows(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(rows[row], processed_probs(logits[row], p))
    torch.testing.assert_close(processed_probs_rows(logits, [params[1]] * 5), processed_probs(logits, params[1]))
