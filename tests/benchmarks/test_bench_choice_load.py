"""The drafter choice under load (issue 31's concurrency goals): the mixed workload at concurrency
4, 16 and 48 and a bursty schedule (4 requests one at a time, a burst of 48 at once, 4 one at a
time again), against plain decoding and the best single drafters of the batch-1 runs, in one run.

Served on the heterogeneous family (``models/demo-mix``), plain first: plain decoding; vLLM's
``suffix`` (γ 4) when ``arctic-inference`` is importable (``make arctic``, then
``PYTHONPATH=runs/arctic-site``); the plugin's draft-prose chain at γ 4 and draft-code chain at γ 6
(the best model-draft chains of the baseline); the drafter choice (suffix or draft-prose at γ 4,
``num_speculative_tokens`` 6) and the choice with draft-prose's dynamic tree of 6 (verified whole) as
configured in ``test_bench_choice.py``; and two floors, servers that
speculate but (almost) never draft: the same choice with every option priced out, and vLLM's
``ngram`` asking for a 16-token match (what serving through the speculative path costs by itself);
and plain decoding with async scheduling off, which vLLM 0.32 does for every ``custom_class`` server.

Workloads: ``throughput.workloads.MIXED_PHASES`` ("c4", "c16", "c48", "bursty") of the mixed
stream, each request at its category's temperature, setting 0 (code, prose and copy at T = 0,
creative at 1.0) and setting 1 (them at 1.0, creative at 1.3); 40 tokens per request; best of
``BENCH_ROUNDS`` (3) rounds. Goals (issue 31): the plugin's best configuration at least 1.1x the
best single-drafter chain at concurrency 4 and 16, at least 0.97x plain at 48 and on the bursty
schedule.

Run: ``PYTHONPATH=runs/arctic-site BENCH_ROUNDS=3 pytest tests/benchmarks/test_bench_choice_load.py -s -p no:cacheprovider``
(``BENCH_LOADS=c16,c48`` for a subset; ``BENCH_ENSEMBLE=1`` adds the code + prose ensemble with fixed
and with per-request adaptive weights). Results: runs/bench/choice_load-*.md / .json, and
docs/benchmarks.md ("The drafter choice under load").
"""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.throughput.bench import (PLAIN_ASYNC_OFF, ServedConfig, benchmark_workload, choice_floor_config,
                                              config_name, plugin_config, served_fixture)
from vllm_specplugin.throughput.workloads import mixed_phases

from .test_bench_choice import CHOICE_GAMMA, FAMILY, MAX_TOKENS
from .test_bench_choice import CONFIGS as BATCH1_CONFIGS

pytestmark = [pytest.mark.server]

# The batch-1 benchmark's servers (plain, vLLM suffix, the two best chains, the choice), shared.
SHARED = ("plain", "vllm suffix (γ 4)", "plugin draft-prose γ 4", "plugin draft-code γ 6",
          f"choice: suffix + draft-prose γ 4, k {CHOICE_GAMMA}",
          f"choice: suffix + draft-prose's tree of {CHOICE_GAMMA}, k {CHOICE_GAMMA}")
CONFIGS = [
    *[config for config in BATCH1_CONFIGS if config_name(config) in SHARED],
    # The floor: the same server whose choice never drafts (every option priced out, no probes),
    # i.e. the cost of serving through the speculative path at all; and vLLM's own (ngram that
    # needs a 16-token match, which this text almost never has).
    choice_floor_config("demo-mix/draft-prose", CHOICE_GAMMA),
    ServedConfig("vllm ngram n 16 (floor)",
                 {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 16, "prompt_lookup_max": 16}),
    # plain decoding served as vLLM serves custom_class (async scheduling off)
    PLAIN_ASYNC_OFF,
]
# The code + prose ensemble with fixed and with per-request adaptive weights (issue 31 item 3):
# BENCH_ENSEMBLE=1 (each request's mixture follows its own text where requests of both kinds interleave).
ENSEMBLES = [
    plugin_config("plugin ensemble(code+prose) γ 4", ["demo-mix/draft-code", "demo-mix/draft-prose"], 4),
    plugin_config("plugin ensemble(code+prose) γ 4, adaptive weights per request",
                  ["demo-mix/draft-code", "demo-mix/draft-prose"], 4, adapt_draft_weights=True),
]
if os.environ.get("BENCH_ENSEMBLE"):
    CONFIGS += ENSEMBLES
LOADS = os.environ.get("BENCH_LOADS", "c4,c16,c48,bursty").split(",")
SETTINGS = (0, 1)
served = served_fixture(CONFIGS, target=os.path.join(FAMILY, "target"))


@pytest.mark.skipif(not os.path.isdir(os.path.join(FAMILY, "draft-prose")),
                    reason="models/demo-mix is not built (python -m vllm_specplugin.models.mix all)")
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s}")
@pytest.mark.parametrize("load", LOADS)
def test_choice_under_load(benchmark, bench_results, served, load, setting):
    phases = mixed_phases(load, setting=setting)
    workload = f"mixed-T{setting}-{load}"
    benchmark.group = workload
    temperatures = [[p.temperature for p in prompts] for prompts, _ in phases]
    # run_phases takes one temperature list per phase, or, for one phase, that phase's list itself
    benchmark_workload(benchmark, bench_results.setdefault("choice_load", []), served,
                       phases=[([p.text for p in prompts], concurrency) for prompts, concurrency in phases],
                       temperature=temperatures if len(phases) > 1 else temperatures[0],
                       max_tokens=MAX_TOKENS, workload=workload)
