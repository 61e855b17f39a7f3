"""The single-drafter baseline (issue 30 item 5): per workload category, the best that one drafter
does on the heterogeneous family (``models/demo-mix``: a 31.5 M code + prose target, a code
specialist, a prose specialist and a tiny general draft).

Served configurations, in one run (plain first, so every ratio has its baseline from the same
minutes): plain decoding; vLLM's ``draft_model`` with each draft (γ 4); vLLM's ``ngram`` (γ 4,
n-grams of 2-4 tokens); vLLM's ``suffix`` when ``arctic-inference`` is installed (else the row is
skipped, saying why); the plugin with each draft at fixed γ 2, 4 and 6; and three of issue 31's
strategies in the same run (the code + prose ensemble at γ 4; dynamic trees of 8 nodes verified
as trees on that ensemble and on the tiny draft) with ``BENCH_STRATEGIES=1``. Workloads (held-out
prompts of ``throughput/workloads.py``, batch 1): ``code``, ``prose`` and ``copy`` at T = 0,
``creative`` at its own T (1.0 / 1.3 per prompt), and ``mixed`` (the four interleaved, each request
at its category's temperature) in setting 0 (T = 0 but creative) and setting 1 (T = 1 but creative
1.3). Best of ``BENCH_ROUNDS`` (3) rounds; α by position, mean accepted length, c and r beside
every figure (runs/bench/baseline_single_drafter-*.md / .json).

Run: ``make arctic`` (once: builds arctic-inference for vLLM's ``suffix`` into runs/arctic-site), then
``PYTHONPATH=runs/arctic-site BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_baseline.py -s -p no:cacheprovider``
(15 servers: 29 minutes on a quiet 2-core CPU; 4 prompts per category so that it fits a session). This is the table issue 31's strategies must beat
(docs/benchmarks.md, "The single-drafter baseline").
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_specplugin.throughput.bench import (
    MODELS,
    ServedConfig,
    benchmark_workload,
    builtin_draft_model_config,
    plugin_config,
    served_fixture,
)
from vllm_specplugin.throughput.workloads import batch1_workloads

pytestmark = [pytest.mark.server]

FAMILY = os.path.join(MODELS, "demo-mix")
DRAFTS = ("demo-mix/draft-code", "demo-mix/draft-prose", "demo-mix/draft-tiny")
GAMMAS = (2, 4, 6)
BUILTIN_GAMMA = 4
PROMPTS_PER_CATEGORY = 4
MAX_TOKENS = 40
HAVE_ARCTIC = importlib.util.find_spec("arctic_inference") is not None

CONFIGS = [
    ServedConfig("plain"),
    *[builtin_draft_model_config(draft, BUILTIN_GAMMA) for draft in DRAFTS],
    ServedConfig(f"vllm ngram (n 2-4, γ {BUILTIN_GAMMA})",
                 {"method": "ngram", "num_speculative_tokens": BUILTIN_GAMMA, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4}),
    pytest.param(
        ServedConfig(f"vllm suffix (γ {BUILTIN_GAMMA})", {"method": "suffix", "num_speculative_tokens": BUILTIN_GAMMA}),
        marks=pytest.mark.skipif(not HAVE_ARCTIC, reason="vLLM's suffix method needs arctic-inference, not installed "
                                 "(docs/benchmarks.md says why it does not install on this CPU)"),
    ),
    *[plugin_config(f"plugin {draft.split('/')[-1]} γ {gamma}", [draft], gamma) for draft in DRAFTS for gamma in GAMMAS],
]
# Strategies measured in the same run (issue 31), against the rows above: BENCH_STRATEGIES=1.
STRATEGIES = [
    plugin_config("strategy: ensemble(code+prose) γ 4", list(DRAFTS[:2]), 4),
    plugin_config("strategy: dynamic tree, ensemble(code+prose), 8 nodes", list(DRAFTS[:2]), 8,
                  tree_drafting={"node_budget": 8, "verify": "tree", "shape": "dynamic"}),
    plugin_config("strategy: dynamic tree, draft-tiny, 8 nodes", [DRAFTS[2]], 8,
                  tree_drafting={"node_budget": 8, "verify": "tree", "shape": "dynamic"}),
]
if os.environ.get("BENCH_STRATEGIES"):
    CONFIGS += STRATEGIES


WORKLOADS = batch1_workloads(PROMPTS_PER_CATEGORY) if os.path.isdir(FAMILY) else {}
served = served_fixture(CONFIGS, target=os.path.join(FAMILY, "target"))


@pytest.mark.skipif(not os.path.isdir(os.path.join(FAMILY, "draft-tiny")),
                    reason="models/demo-mix is not built (python -m vllm_specplugin.models.mix all)")
@pytest.mark.parametrize("workload", ["code", "prose", "copy", "creative", "mixed-T0", "mixed-T1"])
def test_single_drafter_baseline(benchmark, bench_results, served, workload):
    prompts, temperatures = WORKLOADS[workload]
    benchmark.group = workload
    result = benchmark_workload(benchmark, bench_results.setdefault("baseline_single_drafter", []), served, prompts,
                                batch=1, temperature=temperatures, max_tokens=MAX_TOKENS, workload=workload)
    if served[0].gamma:
        assert result.drafts > 0
