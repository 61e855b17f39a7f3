"""Adaptive γ against every fixed γ, in one run, on a workload that mixes predictable prompts
(repeated code: the drafts agree with the target) with unpredictable ones (random tokens), and
at batch 32, where speculation must not cost more than 5% against plain decoding."""

from __future__ import annotations

import pytest

from vllm_specplugin.throughput.bench import ServedConfig, benchmark_workload, plugin_config, served_fixture
from vllm_specplugin.throughput.workloads import heldout_prompts, repetitive_code_prompts, unpredictable_prompts

pytestmark = [pytest.mark.server]

K = 5  # num_speculative_tokens: the largest γ
BACK_OFF = 16  # adaptive configurations draft nothing in steps with more requests than this
CONFIGS = [
    ServedConfig("plain"),
    *[plugin_config(f"fixed gamma={g}", ["draft-distill"], g) for g in (1, 2, 3, 5)],
    plugin_config("adaptive gamma (threshold)", ["draft-distill"], K,
                  adaptive_gamma={"mode": "threshold", "max_batch": BACK_OFF}),
    plugin_config("adaptive gamma (cost model)", ["draft-distill"], K,
                  adaptive_gamma={"mode": "cost_model", "gamma_min": 0, "max_batch": BACK_OFF}),
]
MIXED = repetitive_code_prompts(8) + unpredictable_prompts(8)
WORKLOADS = {
    "mixed-batch16": (MIXED, 16, 0.0),
    "heldout-batch32": (heldout_prompts(32), 32, 0.0),
}

served = served_fixture(CONFIGS)


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_adaptive_gamma(benchmark, bench_results, served, workload):
    prompts, batch, temperature = WORKLOADS[workload]
    results = bench_results.setdefault(f"adaptive_gamma-{workload}", [])
    benchmark_workload(benchmark, results, served, prompts, batch=batch, temperature=temperature, max_tokens=64)
