"""Prefix sharing: 32 concurrent requests with one system prompt of about 230 tokens. Reported:
draft tokens forwarded and draft time with sharing against the same proposer without it."""

from __future__ import annotations

import pytest

from vllm_specplugin.throughput.bench import benchmark_workload, plugin_config, served_fixture
from vllm_specplugin.throughput.workloads import shared_system_prompt_requests

pytestmark = [pytest.mark.server]

CONFIGS = [
    plugin_config("draft-distill", ["draft-distill"], 3),
    plugin_config("draft-distill prefix sharing", ["draft-distill"], 3, prefix_sharing=True),
]

served = served_fixture(CONFIGS)


def test_prefix_sharing(benchmark, bench_results, served):
    results = bench_results.setdefault("prefix_sharing", [])
    result = benchmark_workload(
        benchmark, results, served, shared_system_prompt_requests(32), batch=32, temperature=1.0, max_tokens=32
    )
    forwarded = result.plugin.get("specplugin:tokens_forwarded_total", 0)
    hits = result.plugin.get("specplugin:prefix_hit_tokens_total", 0)
    benchmark.extra_info.update(draft_tokens_forwarded=forwarded, prefix_hit_tokens=hits)
    print(f"\n{result.config}: draft tokens forwarded {forwarded:.0f}, prefix hits {hits:.0f}, "
          f"draft time {result.draft_time_s:.2f} s")
    if "sharing" in result.config:
        assert hits > 0
