"""Suffix drafting with the per-request drafter choice (issue 31 items 2-3) against the best single
drafters of the baseline (``test_bench_baseline.py``), on the heterogeneous family
(``models/demo-mix``), in one run.

Served, plain first: plain decoding; vLLM's ``suffix`` (γ 4; its best γ in the baseline) when
``arctic-inference`` is importable (``make arctic``, then ``PYTHONPATH=runs/arctic-site``), else the
row is skipped, saying why; vLLM's ``ngram`` (γ 4); the plugin's best model-draft chains of the
baseline (draft-prose γ 4: code, prose, copy and creative; draft-code γ 6: mixed at T = 1); and the
plugin's suffix drafting with the drafter choice over draft-prose at ``num_speculative_tokens`` 6
and ``model_gamma`` 4 (the suffix drafts up to 6, the model 4: its best fixed γ in the baseline); and the merged
tree (``tree_drafting.merge``: suffix and n-gram chains and draft-prose's dynamic tree in one tree of
6 nodes, verified as a tree). Both suffix drafters once
more without their cache of past requests (vLLM: ``suffix_decoding_max_cached_requests`` 0; the
plugin: ``corpus_requests`` 0); and the choice with tree drafting (the suffix chain, draft-prose's
dynamic tree of 6 nodes verified whole, or nothing). For the T = 1 side (``-k draft-code``): vLLM's
``draft_model`` with draft-code (γ 6), draft-code's chains of 6 and 8 in bfloat16, its dynamic
trees of 8 and 12 nodes in float32 and bfloat16, the choice over its bfloat16 tree of 8 or 12, adaptive
γ up to 8 (cost model and thresholds) and the draft-code + draft-prose ensemble with per-request weights
(γ 6), both in bfloat16; and draft-code and draft-prose routed by prompt (``draft_routing``, γ 6, float32
and bfloat16; ``-k routed``).
The rounds repeat the same requests, so at T = 0 a cache of past
requests drafts a round's greedy outputs from the round before, which first-seen traffic does not get.
Workloads as in the baseline (4 held-out prompts per category, 40 tokens, batch 1; ``mixed-T0`` /
``mixed-T1``), best of ``BENCH_ROUNDS`` (3) rounds; α by position, mean accepted length, c and r
beside every figure (runs/bench/suffix_choice-*.md / .json).

Run: ``PYTHONPATH=runs/arctic-site BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_choice.py -s -p no:cacheprovider``
(21 servers: about 38 minutes on a quiet 2-core CPU; ``-k "not draft-code"``: 10 servers, about 16
minutes). Results: docs/benchmarks.md ("Suffix drafting and the drafter choice", "The T = 1 side").
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_specplugin.throughput.bench import (MODELS, ServedConfig, benchmark_workload, builtin_draft_model_config,
                                              plugin_config, served_fixture)
from vllm_specplugin.throughput.workloads import batch1_workloads

pytestmark = [pytest.mark.server]

FAMILY = os.path.join(MODELS, "demo-mix")
# Prompts per workload (mixed: per workload, whole blocks of four when a multiple of 4); more with
# BENCH_PROMPTS_PER_CATEGORY for a tighter figure (each round then takes proportionally longer).
PROMPTS_PER_CATEGORY = int(os.environ.get("BENCH_PROMPTS_PER_CATEGORY", "4"))
MAX_TOKENS = 40
CHOICE_GAMMA = 6
HAVE_ARCTIC = importlib.util.find_spec("arctic_inference") is not None

NO_ARCTIC = pytest.mark.skipif(not HAVE_ARCTIC, reason="vLLM's suffix method needs arctic-inference, not installed "
                               "(make arctic, then PYTHONPATH=runs/arctic-site)")
CONFIGS = [
    ServedConfig("plain"),
    pytest.param(ServedConfig("vllm suffix (γ 4)", {"method": "suffix", "num_speculative_tokens": 4}), marks=NO_ARCTIC),
    # The rounds repeat the same requests: at T = 0 a cache of past requests drafts round 2's
    # outputs from round 1's. Without it, each request is drafted from its own context only.
    pytest.param(ServedConfig("vllm suffix (γ 4), no cache of past requests",
                              {"method": "suffix", "num_speculative_tokens": 4,
                               "suffix_decoding_max_cached_requests": 0}), marks=NO_ARCTIC),
    ServedConfig("vllm ngram (n 2-4, γ 4)",
                 {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    plugin_config("plugin draft-prose γ 4", ["demo-mix/draft-prose"], 4),
    plugin_config("plugin draft-code γ 6", ["demo-mix/draft-code"], 6),
    plugin_config(f"choice: suffix + draft-prose γ 4, k {CHOICE_GAMMA}", ["demo-mix/draft-prose"], CHOICE_GAMMA,
                  suffix_drafting={"model_gamma": 4}),
    plugin_config(f"choice: suffix (own context only) + draft-prose γ 4, k {CHOICE_GAMMA}", ["demo-mix/draft-prose"],
                  CHOICE_GAMMA, suffix_drafting={"corpus_requests": 0, "model_gamma": 4}),
    # The choice with tree drafting: per request and step the suffix chain, draft-prose's dynamic
    # tree of k nodes verified whole, or nothing.
    plugin_config(f"choice: suffix + draft-prose's tree of {CHOICE_GAMMA}, k {CHOICE_GAMMA}", ["demo-mix/draft-prose"],
                  CHOICE_GAMMA, suffix_drafting={},
                  tree_drafting={"verify": "tree", "shape": "dynamic", "node_budget": CHOICE_GAMMA}),
    # The T = 1 side: draft-code (the best single drafter at T = 1), chains and dynamic trees
    # verified whole, in float32 and in its checkpoint's bfloat16 (selected with -k "draft-code").
    builtin_draft_model_config("demo-mix/draft-code", 6),
    *[plugin_config(f"plugin draft-code γ {g}, bfloat16", ["demo-mix/draft-code"], g, draft_dtype="bfloat16")
      for g in (6, 8)],
    *[plugin_config(f"plugin draft-code's tree of {n}{dt}", ["demo-mix/draft-code"], n,
                    tree_drafting={"verify": "tree", "shape": "dynamic", "node_budget": n},
                    **({"draft_dtype": "bfloat16"} if dt else {}))
      for dt in ("", ", bfloat16") for n in (8, 12)],
    *[plugin_config(f"choice: suffix + draft-code's tree of {n}, k {n}, bfloat16", ["demo-mix/draft-code"], n,
                    suffix_drafting={}, draft_dtype="bfloat16",
                    tree_drafting={"verify": "tree", "shape": "dynamic", "node_budget": n}) for n in (8, 12)],
    # The strategies on the T = 1 side, bfloat16 like the best chain: adaptive γ up to 8 by the cost
    # model and by thresholds (per request: on the mixed workload a code request and a creative one
    # at T = 1.3 accept differently), and the code + prose ensemble with per-request weights, γ 6.
    *[plugin_config(f"plugin draft-code adaptive γ ≤ 8 ({mode}), bfloat16", ["demo-mix/draft-code"], 8,
                    draft_dtype="bfloat16", adaptive_gamma={"mode": mode}) for mode in ("cost_model", "threshold")],
    plugin_config("plugin draft-code + draft-prose ensemble γ 6, per-request weights, bfloat16",
                  ["demo-mix/draft-code", "demo-mix/draft-prose"], 6, draft_dtype="bfloat16", adapt_draft_weights=True),
    # Routing (draft_routing "prompt"): each request drafted by draft-code or draft-prose alone, the
    # one that predicts its prompt best; chains of 6, in float32 and bfloat16.
    *[plugin_config(f"plugin draft-code | draft-prose routed by prompt γ 6{dt}", ["demo-mix/draft-code", "demo-mix/draft-prose"],
                    6, draft_routing="prompt", **({"draft_dtype": "bfloat16"} if dt else {}))
      for dt in ("", ", bfloat16")],
    # The same with the i.i.d. model prior of before 7 Dec (model_run_prior = model_prior), for the A/B.
    plugin_config(f"choice: suffix + draft-prose's tree of {CHOICE_GAMMA}, k {CHOICE_GAMMA}, i.i.d. prior",
                  ["demo-mix/draft-prose"], CHOICE_GAMMA, suffix_drafting={"model_run_prior": 0.6},
                  tree_drafting={"verify": "tree", "shape": "dynamic", "node_budget": CHOICE_GAMMA}),
    plugin_config(f"choice: suffix + draft-prose γ 4, k {CHOICE_GAMMA}, i.i.d. prior", ["demo-mix/draft-prose"],
                  CHOICE_GAMMA, suffix_drafting={"model_gamma": 4, "model_run_prior": 0.6}),
    # Several drafters in one tree (tree_drafting.merge): the suffix and n-gram chains (each at most
    # half of k) and draft-prose's dynamic tree with the rest, verified as one tree.
    plugin_config(f"merged tree: suffix + ngram + draft-prose, k {CHOICE_GAMMA}", ["demo-mix/draft-prose"],
                  CHOICE_GAMMA, tree_drafting={"verify": "tree", "shape": "dynamic", "node_budget": CHOICE_GAMMA,
                                               "merge": ["suffix", "ngram"]}),
]


WORKLOADS = batch1_workloads(PROMPTS_PER_CATEGORY) if os.path.isdir(FAMILY) else {}
served = served_fixture(CONFIGS, target=os.path.join(FAMILY, "target"))
SELECTED = os.environ.get("BENCH_WORKLOADS", "code,prose,copy,creative,mixed-T0,mixed-T1").split(",")


@pytest.mark.skipif(not os.path.isdir(os.path.join(FAMILY, "draft-tiny")),
                    reason="models/demo-mix is not built (python -m vllm_specplugin.models.mix all)")
@pytest.mark.parametrize("workload", SELECTED)
def test_suffix_choice(benchmark, bench_results, served, workload):
    prompts, temperatures = WORKLOADS[workload]
    benchmark.group = workload
    result = benchmark_workload(benchmark, bench_results.setdefault("suffix_choice", []), served, prompts,
                                batch=1, temperature=temperatures, max_tokens=MAX_TOKENS, workload=workload)
    if served[0].gamma:
        assert result.drafts > 0
