"""Tree drafting and whole-tree verification, in one run, against plain decoding and chain drafting.

Two parts.

``test_tree_drafting`` (small family): the best path of a tree against the greedy chain, both
submitted as one-hot chains; the expected accepted length of the chosen path (under the draft's own
probabilities) and the measured one (vLLM's counters).

``test_tree_verification`` (issue 13 item 5, the memory-bound family ``models/demo-mb``): at node
budgets 8, 16 and 32 and the same depth (``DEPTH``), the tree verified as a whole
(``verify = "tree"``: every node in one target pass; T > 0 children drawn without replacement and
recursive rejection sampling, T = 0 top-k children and the one-hot rule) against the same trees'
best single path (``verify = "chain"``) and against plain chain drafting (the plugin's sampled
chain of ``DEPTH`` drafts), plain decoding the baseline, at batch 1 and 16, T = 0 and 1. Per
configuration: accepted tokens per target pass (measured: vLLM's counters; a draft-only estimate for the best
path at T = 0; the target-aware prediction of all three is ``python -m
vllm_specplugin.throughput.tree_prediction --measured runs/bench/tree_verification-*.json``), non-first children
accepted (the part of the acceptance a chain cannot have), throughput and its ratio to plain and
to the chain in the same run (best of ``BENCH_ROUNDS`` rounds), and r = target time per step over
a plain step at the same batch (``WorkloadResult.verify_cost_ratio``: the cost of the tree's query
tokens). Must show: at T = 1 the whole tree accepts more per target pass than its best path at
every budget.

Run (one server per configuration, ~1-3 min each to start on a quiet 2-core machine):
``BENCH_ROUNDS=3 .venv/bin/python -m pytest tests/benchmarks/test_bench_tree.py -k tree_verification
-p no:cacheprovider -s``; tables land in runs/bench/tree_verification-*.md. A subset:
``TREE_BENCH_BUDGETS=8 BENCH_ROUNDS=1 ... -k "tree_verification and T1 and b1"``.
"""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.throughput.bench import (DEMO_MB, ServedConfig, benchmark_workload, plugin_config,
                                              served_fixture)
from vllm_specplugin.throughput.workloads import heldout_prompts

pytestmark = [pytest.mark.server]

GAMMA = 4
CONFIGS = [
    plugin_config("greedy chain", ["draft-distill"], GAMMA, tree_drafting={"node_budget": GAMMA, "branching": 1}),
    plugin_config("tree (16 nodes, branching 3)", ["draft-distill"], GAMMA,
                  tree_drafting={"node_budget": 16, "branching": 3}),
]

served = served_fixture(CONFIGS)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_tree_drafting(benchmark, bench_results, served, temperature):
    results = bench_results.setdefault("tree_drafting", [])
    result = benchmark_workload(
        benchmark, results, served, heldout_prompts(4), batch=1, temperature=temperature, max_tokens=64
    )
    trees = result.plugin.get("specplugin:trees_total", 0)
    expected_best = result.plugin.get("specplugin:tree_expected_best_total", 0) / trees if trees else None
    expected_greedy = result.plugin.get("specplugin:tree_expected_greedy_total", 0) / trees if trees else None
    measured = result.mean_accepted_length - 1  # accepted drafts per verification
    benchmark.extra_info.update(
        expected_accepted_best=expected_best, expected_accepted_greedy=expected_greedy, measured_accepted=measured
    )
    print(f"\n{result.config} T={temperature:g}: expected accepted (chosen path) {expected_best:.3f}, "
          f"(greedy chain) {expected_greedy:.3f}; measured accepted per step {measured:.3f}")
    assert trees > 0 and expected_best >= expected_greedy - 1e-9


# --- whole-tree verification on the memory-bound family (issue 13 item 5) ------------------------

MB_DRAFT = "demo-mb/draft"
DEPTH = 4  # every tree and the chain draft this deep
# TREE_BENCH_BUDGETS=8 runs a subset (each budget serves two configurations).
BUDGETS = tuple(int(b) for b in os.environ.get("TREE_BENCH_BUDGETS", "8,16,32").split(","))
BRANCHING = 3
BATCHES = (1, 16)
MAX_TOKENS = 48


def _tree(budget: int, verify: str) -> ServedConfig:
    # verify = tree submits every node: num_speculative_tokens must hold the whole budget.
    return plugin_config(f"{'tree' if verify == 'tree' else 'best path'} {budget}", [MB_DRAFT],
                         budget if verify == "tree" else DEPTH,
                         tree_drafting={"node_budget": budget, "branching": BRANCHING, "max_depth": DEPTH,
                                        "verify": verify})


# "chain N": a chain as long as the tree has nodes, so a tree step of N is compared with a chain
# step of N (the query tokens are the same; the difference is the tree's own cost).
TREE_CONFIGS = [ServedConfig("plain"), plugin_config("chain", [MB_DRAFT], DEPTH)] + [
    config for budget in BUDGETS
    for config in ([plugin_config(f"chain {budget}", [MB_DRAFT], budget)] if budget != DEPTH else [])
    + [_tree(budget, verify) for verify in ("chain", "tree")]]

tree_served = served_fixture(TREE_CONFIGS, target=os.path.join(DEMO_MB, "target"))


def _throughput(results, name: str, batch: int, temperature: float) -> float | None:
    return next((r.tokens_per_s for r in results
                 if (r.config, r.batch, r.temperature) == (name, batch, temperature)), None)


@pytest.mark.parametrize("batch", BATCHES, ids=[f"b{b}" for b in BATCHES])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_tree_verification(benchmark, bench_results, tree_served, temperature, batch):
    config, _ = tree_served
    results = bench_results.setdefault("tree_verification", [])
    prompts = heldout_prompts(batch)
    result = benchmark_workload(benchmark, results, tree_served, prompts, batch=batch, temperature=temperature,
                                max_tokens=MAX_TOKENS)
    plugin = result.plugin
    per_pass = result.mean_accepted_length  # tokens per target pass (accepted drafts + the target's own)
    trees = plugin.get("specplugin:trees_total", 0)
    predicted_best = 1 + plugin.get("specplugin:tree_expected_best_total", 0) / trees if trees else None
    verified = plugin.get("specplugin:tree_verify_steps_total", 0)
    non_first = plugin.get("specplugin:tree_non_first_child_accepted_total", 0)
    chain = _throughput(results, "chain", batch, temperature)
    plain = _throughput(results, "plain", batch, temperature)
    benchmark.extra_info.update(
        tokens_per_target_pass=per_pass, draft_only_best_path_per_pass=predicted_best, trees_verified=verified,
        non_first_children_accepted=non_first, speedup_vs_chain=result.tokens_per_s / chain if chain else None,
    )
    same_length = _throughput(results, f"chain {config.name.split()[-1]}", batch, temperature) \
        if config.name.startswith("tree") else None
    vs = " ".join(f"{r:.2f}x {n}" for n, r in (("plain", plain and result.tokens_per_s / plain),
                                               ("chain", chain and result.tokens_per_s / chain),
                                               ("chain of as many nodes", same_length and result.tokens_per_s / same_length))
                  if r)
    r_cost = result.verify_cost_ratio(plain)
    print(f"\n{config.name:12s} T={temperature:g} batch {batch:2d}: {per_pass:.3f} tokens per target pass"
          + (f" (draft-only best-path estimate {predicted_best:.3f}; the target-aware prediction: "
             "python -m vllm_specplugin.throughput.tree_prediction)" if predicted_best and not temperature else "")
          + (f", trees verified {verified:.0f}, non-first children accepted {non_first:.0f}" if verified else "")
          + f"; {result.tokens_per_s:.1f} tok/s {vs}" + (f", r {r_cost:.2f}" if r_cost else ""))
    if config.name.startswith("tree"):
        assert verified > 0  # the trees were verified as trees
        best = next((r for r in results if r.config == config.name.replace("tree", "best path")
                     and (r.batch, r.temperature) == (batch, temperature)), None)
        if best is not None and temperature > 0:
            # The must-show: a whole tree accepts more per target pass than its best path.
            assert per_pass > best.mean_accepted_length, (per_pass, best.mean_accepted_length)
