"""Throughput of trained Medusa heads (vLLM's own ``method: "medusa"``) against plain decoding and the
draft models, in one run (issue 16).

Heads made by ``python -m vllm_specplugin.models.heads`` (``make heads``) and committed next to each
target: ``models/demo/medusa`` (the 4.46 M target) and ``models/demo-mb/medusa`` (the memory-bound
31.5 M target; its configurations are skipped when those heads are not built). Per target, one server
per configuration, plain first so every ratio has its baseline from the same minutes: vLLM's Medusa
with k = 4 heads, vLLM's draft_model with the best draft, and the plugin with the same draft
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


def configs(heads_dir: str, draft: str, gamma: int) -> list:
    mark = [] if os.path.exists(os.path.join(heads_dir, "config.json")) else [
        pytest.mark.skip(reason=f"{heads_dir} not built (make heads)")]
    out = [ServedConfig("plain"), builtin_draft_model_config(draft, gamma), plugin_config(f"plugin {draft}", [draft], gamma)]
    if not mark:
        out.insert(1, medusa_config(heads_dir))
    return [pytest.param(c, marks=mark) for c in out]


served = served_fixture(configs(os.path.join(DEMO, "medusa"), "draft-distill", 3))
served_mb = served_fixture(configs(os.path.join(DEMO_MB, "medusa"), "demo-mb/draft", 4),
                           target=os.path.join(DEMO_MB, "target"))


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_throughput_heads_demo(benchmark, bench_results, served, batch, temperature):
    benchmark_throughput(benchmark, bench_results.setdefault("throughput_heads_demo", []), served,
                         heldout_prompts(PROMPTS[batch]), batch=batch, temperature=temperature, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("batch,temperature", WORKLOADS, ids=[f"batch{b}-T{t:g}" for b, t in WORKLOADS])
def test_throughput_heads_memory_bound(benchmark, bench_results, served_mb, batch, temperature):
    benchmark_throughput(benchmark, bench_results.setdefault("throughput_heads_memory_bound", []), served_mb,
                         heldout_prompts(PROMPTS[batch]), batch=batch, temperature=temperature, max_tokens=MAX_TOKENS)
