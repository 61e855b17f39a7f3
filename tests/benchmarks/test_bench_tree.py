"""Tree drafting against greedy chain drafting, in one run, at temperatures 0 and 1: the expected
accepted length of the chosen path (under the draft's own probabilities) and the measured one
(vLLM's counters). Both submit one-hot chains; the chain is the tree with branching 1."""

from __future__ import annotations

import pytest

from vllm_specplugin.throughput.bench import benchmark_workload, plugin_config, served_fixture
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
