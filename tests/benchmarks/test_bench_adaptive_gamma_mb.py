"""Adaptive γ against every fixed γ on the memory-bound family, in one run: a mixed workload
(repeated code, where the draft agrees with the target, and random tokens, where it does not) at
batch 1, and held-out prompts at batch 16, where speculation stops paying on this CPU (fixed
γ = 4 measured 0.86x plain) and adaptive γ must back off to at least plain decoding's speed."""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.throughput.bench import DEMO_MB, ServedConfig, benchmark_workload, plugin_config, served_fixture
from vllm_specplugin.throughput.workloads import heldout_prompts, repetitive_code_prompts, unpredictable_prompts

pytestmark = [pytest.mark.server]

DRAFT = "demo-mb/draft"
K = 6  # num_speculative_tokens: the largest γ
MAX_BATCH = 4  # as in test_bench_memory_bound.py: speculation pays up to batch 4 here
CONFIGS = [
    ServedConfig("plain"),
    *[plugin_config(f"fixed gamma={g}", [DRAFT], g) for g in (1, 2, 4, 6)],
    plugin_config("adaptive gamma (cost model)", [DRAFT], K,
                  adaptive_gamma={"mode": "cost_model", "gamma_min": 0, "max_batch": MAX_BATCH}),
    # γ by the measured cost model alone: where the cap's crossover (measured on 1 Dec) does not hold.
    plugin_config("adaptive gamma (cost model, no batch cap)", [DRAFT], K,
                  adaptive_gamma={"mode": "cost_model", "gamma_min": 0}),
]
WORKLOADS = {
    "mixed-batch1": (repetitive_code_prompts(4) + unpredictable_prompts(4), 1, 0.0),
    "heldout-batch16": (heldout_prompts(16), 16, 0.0),
}

served = served_fixture(CONFIGS, target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_adaptive_gamma_memory_bound(benchmark, bench_results, served, workload):
    prompts, batch, temperature = WORKLOADS[workload]
    results = bench_results.setdefault(f"adaptive_gamma_mb-{workload}", [])
    benchmark_workload(benchmark, results, served, prompts, batch=batch, temperature=temperature, max_tokens=64)
