"""Throughput of every proposer against plain decoding and vLLM's built-in methods, in one run.

One server per configuration (plain first, so every speedup has its baseline from this run),
each at batch 1 and batch 16, temperatures 0 and 1, on held-out code prompts. pytest-benchmark
times each workload (one round: a round is seconds of real serving); ``extra_info`` carries the
cost model (α, γ, c, mean accepted length, the Leviathan bound) and the within-run speedup.
Issue 5's comparison (single drafts, the ensemble, vLLM's draft_model with the best draft) is
the subset without the strategies.

``-m short -k batch1-T0`` is the CI tier: plain, vLLM's draft_model and the plugin's single draft.
"""

from __future__ import annotations

import importlib.util

import pytest

from vllm_specplugin.throughput.bench import (
    ServedConfig,
    benchmark_throughput,
    builtin_draft_model_config,
    plugin_config,
    served_fixture,
)
from vllm_specplugin.throughput.workloads import heldout_prompts

pytestmark = [pytest.mark.server]

GAMMA = 3
MAX_TOKENS = 64
DRAFTS = ["draft-distill", "draft-small", "draft-tiny"]
SUFFIX_AVAILABLE = importlib.util.find_spec("arctic_inference") is not None
SHORT = {"plain", "vllm draft_model[draft-distill]", "plugin draft-distill"}

CONFIGS = [
    ServedConfig("plain"),
    ServedConfig("vllm ngram", {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}),
    builtin_draft_model_config("draft-distill", GAMMA),
    *[plugin_config(f"plugin {d}", [d], GAMMA) for d in DRAFTS],
    plugin_config("plugin ensemble(distill+small+tiny)", DRAFTS, GAMMA),
    plugin_config("plugin ensemble(distill+small+tiny) adaptive weights", DRAFTS, GAMMA, adapt_draft_weights=True),
    plugin_config("plugin draft-distill adaptive gamma", ["draft-distill"], 5,
                  adaptive_gamma={"mode": "threshold", "max_batch": 16}),
    plugin_config("plugin draft-distill tree", ["draft-distill"], GAMMA,
                  tree_drafting={"node_budget": 12, "branching": 3}),
    plugin_config("plugin draft-distill prefix sharing", ["draft-distill"], GAMMA, prefix_sharing=True),
]
if SUFFIX_AVAILABLE:
    CONFIGS.insert(2, ServedConfig("vllm suffix", {"method": "suffix", "num_speculative_tokens": GAMMA}))

WORKLOADS = [(1, 0.0), (1, 1.0), (16, 0.0), (16, 1.0)]
PROMPTS = {1: 4, 16: 16}  # prompts per workload: batch 1 sends 4 one after another

served = served_fixture(
    [pytest.param(c, marks=pytest.mark.short) if c.name in SHORT else c for c in CONFIGS]
)


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_throughput(benchmark, bench_results, served, batch, temperature):
    benchmark_throughput(
        benchmark, bench_results.setdefault("throughput", []), served, heldout_prompts(PROMPTS[batch]),
        batch=batch, temperature=temperature, max_tokens=MAX_TOKENS,
    )


def test_suffix_decoding_is_reported_when_missing():
    if SUFFIX_AVAILABLE:
        pytest.skip("suffix decoding is benchmarked above")
    pytest.skip("vLLM's suffix method needs the arctic_inference package, which is not installed here")
