"""Throughput benchmarks (pytest-benchmark). Run with ``make bench``; ``make test`` skips them.

Results of one session are collected here and written, with the cost model next to every
figure, to ``runs/bench/<name>-<time>.{md,json}`` when the session ends.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from vllm_specplugin.throughput.bench import WorkloadResult, format_table
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

RESULTS: dict[str, list[WorkloadResult]] = {}


@pytest.fixture(scope="session")
def bench_results():
    yield RESULTS
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(REPO_ROOT, "runs", "bench")
    os.makedirs(out_dir, exist_ok=True)
    for name, results in RESULTS.items():
        baseline = {r.key: r.tokens_per_s for r in results if r.config == "plain"}
        table = format_table(results, baseline)
        print(f"\n\n{name}\n{table}\n")
        with open(os.path.join(out_dir, f"{name}-{stamp}.md"), "w") as f:
            f.write(f"# {name}\n\n{table}\n")
        with open(os.path.join(out_dir, f"{name}-{stamp}.json"), "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
