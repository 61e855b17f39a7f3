"""Trees against chains of as many drafts (issue 31 item 1's goals), in one run.

The memory-bound family (``models/demo-mb`` target): at N = 8 and 16 nodes, the plugin's tree
with the shape chosen per request from the draft's probabilities and the measured acceptance by
depth (``tree_drafting`` ``shape: "dynamic"``, ``verify: "tree"``: every node verified in one target
pass, children drawn without replacement at T > 0, top-k and the one-hot rule at T = 0) against a
chain of N drafts of the same draft (the plugin's sampled chain, ``num_speculative_tokens`` N), plain
decoding the baseline; batch 1 (4 held-out prompts one at a time) and 16 (16 prompts at once),
T = 0 and 1. Then the uncertain pair, where a tree should pay: the same target with the 0.37 M
``demo/draft-distill`` as the draft, N = 8, batch 1, T = 1.

Per row: tokens/s, its ratio to plain and to the chain of N in the same run (best of
``BENCH_ROUNDS`` rounds), tokens per target pass, α by position, c, and r = the target step over
a plain step at the same batch; the tree row also gives its r over the chain's (the goal: within
10%) and how many non-first children were accepted (the part of the acceptance a chain cannot have).

Run: ``BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_tree_shape.py -s -p no:cacheprovider``
(7 servers); tables land in runs/bench/tree_shape-*.md. Results: docs/strategies/tree.md.
"""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.throughput.bench import (DEMO_MB, ServedConfig, benchmark_workload, dynamic_tree_config,
                                              plugin_config, served_fixture)
from vllm_specplugin.throughput.workloads import heldout_prompts

pytestmark = [pytest.mark.server]

MB_DRAFT = "demo-mb/draft"
TINY_DRAFT = "demo/draft-distill"
NODES = (8, 16)
BATCHES = (1, 16)
MAX_TOKENS = 48


def _tree(nodes: int, draft: str = MB_DRAFT, label: str = "") -> ServedConfig:
    return dynamic_tree_config(f"tree {nodes}{label}", [draft], nodes)


CONFIGS = [ServedConfig("plain")] + [
    config for n in NODES for config in (plugin_config(f"chain {n}", [MB_DRAFT], n), _tree(n))
] + [plugin_config("chain 8, tiny draft", [TINY_DRAFT], 8), _tree(8, TINY_DRAFT, ", tiny draft")]

served = served_fixture(CONFIGS, target=os.path.join(DEMO_MB, "target"))


def _row(results, name: str, batch: int, temperature: float):
    return next((r for r in results if (r.config, r.batch, r.temperature) == (name, batch, temperature)), None)


def _prompts(batch: int) -> list[str]:
    return heldout_prompts(4 if batch == 1 else batch)


@pytest.mark.parametrize("batch", BATCHES, ids=[f"b{b}" for b in BATCHES])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_tree_shape(benchmark, bench_results, served, temperature, batch):
    config, _ = served
    tiny = config.name.endswith("tiny draft")
    if tiny and (batch, temperature) != (1, 1.0):
        pytest.skip("the tiny draft's pair is measured at batch 1, T = 1 only")
    results = bench_results.setdefault("tree_shape", [])
    result = benchmark_workload(benchmark, results, served, _prompts(batch), batch=batch, temperature=temperature,
                                max_tokens=MAX_TOKENS)
    plain = _row(results, "plain", batch, temperature)
    line = f"\n{config.name:22s} T={temperature:g} batch {batch:2d}: {result.tokens_per_s:.1f} tok/s"
    if plain is not None and config.name != "plain":
        r = result.verify_cost_ratio(plain.tokens_per_s)
        line += (f" = {result.tokens_per_s / plain.tokens_per_s:.2f}x plain; {result.mean_accepted_length:.2f} tokens "
                 f"per target pass" + (f", r {r:.2f}" if r else ""))
        benchmark.extra_info.update(verify_cost_r=r)
    if config.name.startswith("tree"):
        plugin = result.plugin
        verified = plugin.get("specplugin:tree_verify_steps_total", 0)
        non_first = plugin.get("specplugin:tree_non_first_child_accepted_total", 0)
        chain = _row(results, config.name.replace("tree", "chain"), batch, temperature)
        if chain is not None:
            r_tree, r_chain = (result.verify_cost_ratio(plain.tokens_per_s),
                               chain.verify_cost_ratio(plain.tokens_per_s)) if plain else (None, None)
            step = r_tree / r_chain if r_tree and r_chain else None
            benchmark.extra_info.update(speedup_vs_chain=result.tokens_per_s / chain.tokens_per_s,
                                        step_over_chain_step=step, trees_verified=verified,
                                        non_first_children_accepted=non_first)
            line += (f"; {result.tokens_per_s / chain.tokens_per_s:.2f}x the chain of as many drafts"
                     + (f", its step {step:.2f}x the chain's" if step else "")
                     + f"; trees verified {verified:.0f}, non-first children accepted {non_first:.0f}")
    print(line)
