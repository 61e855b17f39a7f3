"""Tensor parallelism (issue 14 item 6): the plugin under ``tensor_parallel_size=2`` on vLLM-CPU
(one core per rank, ``VLLM_CPU_OMP_THREADS_BIND=0|1``).

Every rank drafts, but every rank verifies the output rank's drafts against its own q and appends
its own sampled tokens (vllm_specplugin/tensor_parallel.py). Here TP rank 1's q is perturbed
(``SPECPLUGIN_TP_FAULT=q_rank1``, what a rank-local float difference does):

- with the per-step agreement (the default) every step whose drafts or q differ is dropped on both
  ranks: the ranks' contexts never differ, and the outputs are complete;
- with the agreement off (``SPECPLUGIN_TP_CHECK=off``) the ranks' contexts diverge: the agreement is
  what keeps them together (this case is the test's proof that it can fail).

The counters come from each rank's report (``SPECPLUGIN_TP_REPORT_DIR``). Exactness under TP=2 is
in tests/statistical (``test_tensor_parallel_plugin_is_exact``), a load run in
``python -m vllm_specplugin.throughput.soak --short --tensor-parallel-size 2``.
Two engines, about 2.5 min on a quiet 2-core machine.
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

pytestmark = [pytest.mark.engine, pytest.mark.extended]  # two TP=2 engines (make test-extended)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "models", "demo")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # auto binding needs one NUMA node per rank
TP_OPTIONS = {"tensor_parallel_size": 2, "enforce_eager": True, "max_num_seqs": 16}
SPEC = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": 3}
PROMPTS = [[85, 4, 465, 354], [10, 276, 14, 290, 16], [7, 85, 32], [23, 21, 1362, 16, 386, 485]]
TASKS = [
    GenerationTask(PROMPTS, SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=24, n=2, seed=3)),
    GenerationTask(PROMPTS, SamplingConfig(temperature=0.0, max_tokens=24, n=1, seed=None)),
]


def tp_plugin_run(tmp_path, env: dict) -> tuple[list, list[dict]]:
    report_dir = tmp_path / "tp"
    report_dir.mkdir()
    run = run_offline(
        os.path.join(DEMO, "target"), TASKS, speculative_config=SPEC,
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-distill")]}},
        max_model_len=256, engine_options=TP_OPTIONS, log_path=str(tmp_path / "engine.log"),
        extra_env={**TP_ENV, "SPECPLUGIN_TP_REPORT_DIR": str(report_dir), **env},
    )
    reports = [json.loads((report_dir / f"rank-{r}.json").read_text()) for r in range(2)]
    return run.tasks, reports


def test_ranks_stay_together_when_one_ranks_q_differs(tmp_path):
    tasks, reports = tp_plugin_run(tmp_path, {"SPECPLUGIN_TP_FAULT": "q_rank1"})
    print("\n", reports)
    for task, config in zip(tasks, TASKS):
        for outputs in task.outputs:
            assert len(outputs) == config.sampling.n and all(len(o) == config.sampling.max_tokens for o in outputs)
    for report in reports:
        assert report["steps"] > 10 and report["disagreements"] > 0, report
        assert report["context_mismatches"] == 0, report


def test_ranks_diverge_without_the_agreement(tmp_path):
    """The fault above with the agreement off: the ranks' contexts differ (silent corruption)."""
    _, reports = tp_plugin_run(tmp_path, {"SPECPLUGIN_TP_FAULT": "q_rank1", "SPECPLUGIN_TP_CHECK": "off"})
    print("\n", reports)
    assert all(r["context_mismatches"] > 0 for r in reports), reports
