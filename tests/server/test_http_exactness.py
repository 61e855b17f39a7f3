"""The exactness check through the real HTTP server (OpenAI API, token ids on, logprobs off)."""

from __future__ import annotations

import pytest

from vllm_specplugin.verification.check import random_prompts, run_check
from vllm_specplugin.verification.drivers import SamplingConfig

pytestmark = [pytest.mark.server, pytest.mark.statistical]

# One case, outside tests/statistical's Holm family: at 0.001 it adds at most 0.1% to the statistical
# tier's false-failure rate (0.01 there). N = 3000: the power of its decision (combined df ~370-400,
# level 0.001) at a binned TV of 0.1 at each prompt's first token is >= 0.9999 (asserted below).
ALPHA = 0.001


def test_http_driver_plugin_proposer_is_exact(peaked_target):
    spec = {"method": "custom_class", "model": "vllm_specplugin.adapters.RepeatLastTokenProposer",
            "num_speculative_tokens": 3}
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=3, n=3000, seed=0)
    report = run_check(peaked_target, [sampling], random_prompts(512, 2, seed=1), speculative_config=spec,
                       driver="http", alpha=ALPHA, progress=False)
    print("\n" + report.format_table())
    (case,) = report.cases
    assert case.acceptance_rate is not None  # counters read from /metrics
    assert case.tokens_checked == 2 * sampling.n * sampling.max_tokens  # every token support-checked
    assert case.power_at_delta >= 0.99, (case.power_at_delta, case.df)
    assert report.passed, case
