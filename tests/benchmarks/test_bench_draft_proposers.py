"""Issue 5's comparison, in one run: the plugin's single drafts and ensemble against vLLM's own
draft_model method with the best draft, and plain decoding, on held-out code prompts.

One server per configuration (plain first, so every speedup has its baseline from this run);
each configuration runs batch 1 and batch 16 at temperatures 0 and 1. The workload's wall time
is what pytest-benchmark times (one round: a round is tens of seconds of real serving).
"""

from __future__ import annotations

import pytest

from verification.bench import (
    ServedConfig,
    benchmark_workload,
    builtin_draft_model_config,
    plugin_config,
    served_fixture,
)
from verification.workloads import heldout_prompts

pytestmark = [pytest.mark.server]

GAMMA = 3
MAX_TOKENS = 64
CONFIGS = [
    ServedConfig("plain"),
    plugin_config("plugin draft-distill", ["draft-distill"], GAMMA),
    plugin_config("plugin draft-small", ["draft-small"], GAMMA),
    plugin_config("plugin draft-tiny", ["draft-tiny"], GAMMA),
    plugin_config("plugin ensemble(distill+small+tiny)", ["draft-distill", "draft-small", "draft-tiny"], GAMMA),
    plugin_config(
        "plugin ensemble(distill+small+tiny) adaptive weights", ["draft-distill", "draft-small", "draft-tiny"], GAMMA,
        adapt_draft_weights=True,
    ),
    builtin_draft_model_config("draft-distill", GAMMA),
]
WORKLOADS = [(1, 0.0), (1, 1.0), (16, 0.0), (16, 1.0)]
PROMPTS = {1: 4, 16: 16}  # prompts per workload: batch 1 sends 4 one after another


served = served_fixture(CONFIGS)


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_draft_proposers(benchmark, bench_results, served, batch, temperature):
    results = bench_results.setdefault("draft_proposers", [])
    result = benchmark_workload(
        benchmark, results, served, heldout_prompts(PROMPTS[batch]),
        batch=batch, temperature=temperature, max_tokens=MAX_TOKENS,
    )
    if served[0].gamma:
        assert result.drafts > 0
