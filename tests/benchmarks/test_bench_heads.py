"""Throughput of trained Medusa and EAGLE heads (vLLM's own ``method: "medusa"`` and ``"eagle"``) against
plain decoding and the draft models, in one run (issue 16).

Heads made by ``python -m vllm_specplugin.models.heads`` / ``models.eagle`` (``make heads``) and
committed next to each target: ``models/demo/{medusa,eagle}`` (the 4.46 M target) and
``models/demo-mb/{medusa,eagle}`` (the memory-bound 31.5 M target; a configuration whose heads are not
built is skipped). Per target, one server per configuration, plain first so every ratio has its
baseline from the same minutes: vLLM's Medusa with k = 4 heads, vLLM's EAGLE with 3 draft tokens
(one layer drafting autoregressively; 3 = the positions its card measures), vLLM's draft_model with
the best draft, and the plugin with the same draft
(``extra_info``: α, γ, c, r, mean accepted length). Batch 1 and 16, T = 0 and 1, held-out prompts.

    BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_heads.py -s
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin.throughput.bench import (
    DEMO,
    DEMO_MB,
    ServedConfig,
    benchmark_throughput,
    builtin_draft_model_config,
    plugin_config,
    served_fixture,
)
from vllm_specplugin.throughput.workloads import heldout_prompts

pytestmark = [pytest.mark.server]

MAX_TOKENS = 64
WORKLOADS = [(1, 0.0), (1, 1.0), (16, 0.0), (16, 1.0)]
PROMPTS = {1: 4, 16: 16}


def medusa_config(heads_dir: str) -> ServedConfig:
    """vLLM's built-in Medusa: k = the checkpoint's num_heads (each head drafts one position)."""
    k = json.load(open(os.path.join(heads_dir, "config.json")))["num_heads"]
    return ServedConfig(f"vllm medusa[{os.path.relpath(heads_dir, os.path.dirname(DEMO))}]",
                        {"method": "medusa", "model": heads_dir, "num_speculative_tokens": k})


EAGLE_DRAFT_TOKENS = 3


def eagle_config(heads_dir: str) -> ServedConfig:
    """vLLM's built-in EAGLE (EAGLE-1 head, models/eagle.py) drafting EAGLE_DRAFT_TOKENS tokens."""
    return ServedConfig(f"vllm eagle[{os.path.relpath(heads_dir, os.path.dirname(DEMO))}]",
                        {"method": "eagle", "model": heads_dir, "num_speculative_tokens": EAGLE_DRAFT_TOKENS})


def configs(family_dir: str, draft: str, gamma: int, best: ServedConfig | None = None) -> list:
    """Plain, the built heads (Medusa, EAGLE), vLLM's draft_model and the plugin with ``draft``, and
    the plugin's ``best`` configuration where given."""
    out = [ServedConfig("plain")]
    for name, make in (("medusa", medusa_config), ("eagle", eagle_config)):
        heads_dir = os.path.join(family_dir, name)
        if os.path.exists(os.path.join(heads_dir, "config.json")):
            out.append(make(heads_dir))
        else:
            print(f"test_bench_heads: {heads_dir} not built (make heads): its configuration is left out")
    out += [builtin_draft_model_config(draft, gamma), plugin_config(f"plugin {draft}", [draft], gamma)]
    return out + ([best] if best else [])


served = served_fixture(configs(DEMO, "draft-distill", 3))
# The plugin's best configuration on the memory-bound family (as in test_bench_memory_bound.py).
BEST_MB = plugin_config("plugin demo-mb/draft bfloat16 adaptive gamma (cost model)", ["demo-mb/draft"], 6,
                        draft_dtype="bfloat16", adaptive_gamma={"mode": "cost_model", "gamma_min": 0, "max_batch": 4})
served_mb = served_fixture(configs(DEMO_MB, "demo-mb/draft", 4, BEST_MB), target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_throughput_heads_demo(benchmark, bench_results, served, batch, temperature):
    benchmark_throughput(benchmark, bench_results.setdefault("throughput_heads_demo", []), served,
                         heldout_prompts(PROMPTS[batch]), batch=batch, temperature=temperature, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_throughput_heads_memory_bound(benchmark, bench_results, served_mb, batch, temperature):
    benchmark_throughput(benchmark, bench_results.setdefault("throughput_heads_memory_bound", []), served_mb,
                         heldout_prompts(PROMPTS[batch]), batch=batch, temperature=temperature, max_tokens=MAX_TOKENS)


# --- the EAGLE head as the plugin's drafter (issue 33) ---------------------------------------
# The same head served by vLLM's own "eagle" (greedy drafts, one-hot verification; k = 3 and 8) and
# by the plugin (eagle_head: sampled chains verified against q, k = 3; dynamic trees of 8 and 16 nodes
# verified whole; the chain and the tree of 8 again with the head in bfloat16), next to plain decoding and the best 4.46 M draft model (vLLM's draft_model, gamma
# 4), on the memory-bound target at batch 1. SPECPLUGIN_BENCH_EAGLE_DIR serves another head (e.g. a long
# training's, models/demo-mb/eagle-long).
#
#     BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_heads.py -k eagle_head_plugin -s

EAGLE_MB = os.environ.get("SPECPLUGIN_BENCH_EAGLE_DIR", os.path.join(DEMO_MB, "eagle"))
HEAD_WORKLOADS = [(1, 0.0), (1, 1.0)]
HEAD_PROMPTS = 6


def plugin_eagle_config(heads_dir: str, k: int = EAGLE_DRAFT_TOKENS, tree: dict | None = None,
                        kind: str = "eagle", dtype: str | None = None) -> ServedConfig:
    """The plugin's EAGLE head drafter (MultiDraftProposer with eagle_head; ``kind`` "medusa": its
    Medusa heads drafter, medusa_heads) drafting k tokens, or trees of k nodes (``tree``:
    tree_drafting) verified whole; ``dtype``: the head's draft_dtype (default float32)."""
    head = os.path.relpath(heads_dir, os.path.dirname(DEMO))
    name = f"plugin {kind}[{head}] k={k}" if tree is None else f"plugin {kind}[{head}] {tree.get('shape', 'fixed')} tree {k}"
    if tree is not None and "branching" in tree:
        name += f" (branching {tree['branching']})"
    options = {"eagle_head" if kind == "eagle" else "medusa_heads": heads_dir}
    if dtype is not None:
        name += f" {dtype}"
        options["draft_dtype"] = dtype
    if tree is not None:
        options["tree_drafting"] = {"node_budget": k, "verify": "tree", **tree}
    return ServedConfig(name, {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                               "num_speculative_tokens": k}, {"specplugin": options})


def vllm_eagle_config(heads_dir: str, k: int) -> ServedConfig:
    config = eagle_config(heads_dir)
    return ServedConfig(f"{config.name} k={k}", dict(config.speculative_config, num_speculative_tokens=k))


served_eagle_head = served_fixture(
    [ServedConfig("plain"), vllm_eagle_config(EAGLE_MB, 3), vllm_eagle_config(EAGLE_MB, 8),
     plugin_eagle_config(EAGLE_MB), plugin_eagle_config(EAGLE_MB, 8, {"shape": "dynamic"}),
     plugin_eagle_config(EAGLE_MB, 16, {"shape": "dynamic"}), plugin_eagle_config(EAGLE_MB, dtype="bfloat16"),
     plugin_eagle_config(EAGLE_MB, 8, {"shape": "dynamic"}, dtype="bfloat16"),
     builtin_draft_model_config("demo-mb/draft", 4)],
    target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("batch,temperature", HEAD_WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in HEAD_WORKLOADS])
def test_throughput_eagle_head_plugin(benchmark, bench_results, served_eagle_head, batch, temperature):
    heads_at_batch_one(benchmark, bench_results, "throughput_eagle_head_plugin", served_eagle_head, batch, temperature)


def heads_at_batch_one(benchmark, bench_results, table: str, served, batch: int, temperature: float) -> None:
    """One workload of a heads group (HEAD_PROMPTS held-out prompts, MAX_TOKENS each) into ``table``."""
    benchmark_throughput(benchmark, bench_results.setdefault(table, []), served, heldout_prompts(HEAD_PROMPTS),
                         batch=batch, temperature=temperature, max_tokens=MAX_TOKENS)


# --- Medusa heads as the plugin's drafter (issue 33 item 2c) ---------------------------------
# The memory-bound target's Medusa heads (models/demo-mb/medusa, 4 heads) served by vLLM's own
# "medusa" (greedy chains of k = 2 and 4, one-hot verification) and by the plugin (medusa_heads:
# sampled chains of 2 verified against q; Medusa trees of 6 and 10 nodes, fixed (branching 3) and
# dynamic, each node's children drawn without replacement from the head of its depth, verified whole),
# at batch 1. SPECPLUGIN_BENCH_MEDUSA_DIR serves other heads (e.g. a long training's,
# models/demo-mb/medusa-long: make heads-medusa-long).
#
#     BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_heads.py -k medusa_heads_plugin -s

MEDUSA_MB = os.environ.get("SPECPLUGIN_BENCH_MEDUSA_DIR", os.path.join(DEMO_MB, "medusa"))


def vllm_medusa_config(heads_dir: str, k: int) -> ServedConfig:
    config = medusa_config(heads_dir)
    return ServedConfig(f"{config.name} k={k}", dict(config.speculative_config, num_speculative_tokens=k))


served_medusa_heads = served_fixture(
    [ServedConfig("plain"), vllm_medusa_config(MEDUSA_MB, 2), vllm_medusa_config(MEDUSA_MB, 4),
     plugin_eagle_config(MEDUSA_MB, 2, kind="medusa"),
     plugin_eagle_config(MEDUSA_MB, 6, {"shape": "fixed", "branching": 3}, kind="medusa"),
     plugin_eagle_config(MEDUSA_MB, 10, {"shape": "fixed", "branching": 3}, kind="medusa"),
     plugin_eagle_config(MEDUSA_MB, 6, {"shape": "dynamic"}, kind="medusa"),
     plugin_eagle_config(MEDUSA_MB, 10, {"shape": "dynamic"}, kind="medusa")],
    target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("batch,temperature", HEAD_WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in HEAD_WORKLOADS])
def test_throughput_medusa_heads_plugin(benchmark, bench_results, served_medusa_heads, batch, temperature):
    heads_at_batch_one(benchmark, bench_results, "throughput_medusa_heads_plugin", served_medusa_heads, batch,
                       temperature)


# --- every head, by vLLM and by the plugin, in one run (issue 33's table) -----------------------
# The memory-bound target's long heads side by side at batch 1: the EAGLE-1 head (models/demo-mb/
# eagle-long, 5.0 M tokens), the EAGLE-3 head (models/demo-mb/eagle3: make heads-eagle3) and the
# Medusa heads (models/demo-mb/medusa-long), each served by vLLM's own method (greedy chains, one-hot
# verification: eagle and eagle3 with k = 3 and 8, medusa with its best k = 2) and by the plugin
# (eagle_head / medusa_heads: sampled chains of 3 verified against q, dynamic trees verified whole;
# the heads in bfloat16 as the plugin serves them fastest), beside plain decoding and vLLM's
# draft_model with the best 4.46 M draft. SPECPLUGIN_BENCH_EAGLE3_DIR serves another EAGLE-3 head.
#
#     BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_heads.py -k heads_side_by_side -s

EAGLE3_SHIPPED = os.path.join(DEMO_MB, "eagle3")
EAGLE3_MB = os.environ.get("SPECPLUGIN_BENCH_EAGLE3_DIR", EAGLE3_SHIPPED)
EAGLE_LONG_MB = os.path.join(DEMO_MB, "eagle-long")
MEDUSA_LONG_MB = os.path.join(DEMO_MB, "medusa-long")


def vllm_eagle3_config(heads_dir: str, k: int) -> ServedConfig:
    """vLLM's built-in EAGLE-3 (models/eagle.py --method eagle3) drafting k tokens."""
    head = os.path.relpath(heads_dir, os.path.dirname(DEMO))
    return ServedConfig(f"vllm eagle3[{head}] k={k}", {"method": "eagle3", "model": heads_dir, "num_speculative_tokens": k})


served_heads_side_by_side = served_fixture(
    [ServedConfig("plain"),
     vllm_eagle_config(EAGLE_LONG_MB, 3), vllm_eagle_config(EAGLE_LONG_MB, 8),
     vllm_eagle3_config(EAGLE3_MB, 3), vllm_eagle3_config(EAGLE3_MB, 8),
     vllm_medusa_config(MEDUSA_LONG_MB, 2),
     plugin_eagle_config(EAGLE_LONG_MB, dtype="bfloat16"),
     plugin_eagle_config(EAGLE_LONG_MB, 8, {"shape": "dynamic"}, dtype="bfloat16"),
     plugin_eagle_config(EAGLE3_MB, dtype="bfloat16"),
     plugin_eagle_config(EAGLE3_MB, 8, {"shape": "dynamic"}, dtype="bfloat16"),
     plugin_eagle_config(MEDUSA_LONG_MB, 10, {"shape": "dynamic"}, kind="medusa"),
     builtin_draft_model_config("demo-mb/draft", 4)],
    target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("batch,temperature", HEAD_WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in HEAD_WORKLOADS])
def test_throughput_heads_side_by_side(benchmark, bench_results, served_heads_side_by_side, batch, temperature):
    heads_at_batch_one(benchmark, bench_results, "throughput_heads_side_by_side", served_heads_side_by_side, batch,
                       temperature)


# --- a candidate EAGLE-3 head against the shipped one, in one run ----------------------------
# A new training's head (SPECPLUGIN_BENCH_EAGLE3_CANDIDATE: its exported directory; the group is
# skipped without it) beside models/demo-mb/eagle3, each served by vLLM's eagle3 (k = 3) and by the
# plugin (chain of 3, dynamic tree of 8, bfloat16), with vLLM's eagle k = 8 and the plugin's EAGLE-1
# tree of 8 (the long head) for issue 33's tree goal, at batch 1, T = 0 and 1.
#
#     SPECPLUGIN_BENCH_EAGLE3_CANDIDATE=DIR BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_heads.py -k eagle3_candidate -s

EAGLE3_CANDIDATE = os.environ.get("SPECPLUGIN_BENCH_EAGLE3_CANDIDATE")
served_eagle3_candidate = served_fixture(
    [ServedConfig("plain"), vllm_eagle_config(EAGLE_LONG_MB, 8),
     plugin_eagle_config(EAGLE_LONG_MB, 8, {"shape": "dynamic"}, dtype="bfloat16")]
    + [config for head in (EAGLE3_SHIPPED, EAGLE3_CANDIDATE or EAGLE3_SHIPPED)
       for config in (vllm_eagle3_config(head, 3), plugin_eagle_config(head, dtype="bfloat16"),
                      plugin_eagle_config(head, 8, {"shape": "dynamic"}, dtype="bfloat16"))],
    target=os.path.join(DEMO_MB, "target"))


@pytest.mark.skipif(EAGLE3_CANDIDATE is None, reason="SPECPLUGIN_BENCH_EAGLE3_CANDIDATE (a candidate EAGLE-3 head's "
                    "directory) is not set")
@pytest.mark.parametrize("batch,temperature", HEAD_WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in HEAD_WORKLOADS])
def test_throughput_eagle3_candidate(benchmark, bench_results, served_eagle3_candidate, batch, temperature):
    heads_at_batch_one(benchmark, bench_results, "throughput_eagle3_candidate", served_eagle3_candidate, batch,
                       temperature)
