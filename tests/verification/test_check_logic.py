"""The check's analysis path without an engine: exact samples pass, wrong-temperature samples fail."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from vllm_specplugin.verification.check import CheckReport, analyse, random_prompts
from vllm_specplugin.verification.drivers import REPO_ROOT, SamplingConfig
from vllm_specplugin.verification.plots import plot_report
from vllm_specplugin.verification.reference import ProcessedConditionals, TargetReference

N, M = 1500, 2


def sample_from_reference(reference, prompt, temperature, top_k, top_p, seed):
    """Autoregressive exact sampling from the reference's processed conditionals (numpy)."""
    rng = np.random.default_rng(seed)
    first_logits = reference.prefix_logits(prompt, np.zeros((1, M), dtype=np.int64))[()]
    probs0 = ProcessedConditionals({(): first_logits}, temperature, top_k, top_p)(())
    first = rng.choice(len(probs0), size=N, p=probs0)
    samples = np.zeros((N, M), dtype=np.int64)
    samples[:, 0] = first
    logits = reference.prefix_logits(prompt, samples)  # covers every (first,) prefix
    cond = ProcessedConditionals(logits, temperature, top_k, top_p)
    for i in range(N):
        p = cond((int(first[i]),))
        samples[i, 1] = rng.choice(len(p), p=p)
    return samples


@pytest.fixture(scope="module")
def reference(peaked_target):
    return TargetReference(peaked_target)


@pytest.mark.statistical
@pytest.mark.parametrize("sampled_temperature,should_pass", [(1.0, True), (0.8, False)])
def test_analyse(reference, sampled_temperature, should_pass):
    prompt = random_prompts(512, 1, seed=3)[0]
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=M, n=N, seed=0)
    samples = sample_from_reference(reference, prompt, sampled_temperature, 50, 0.9, seed=7)
    case = analyse(reference, [prompt], [samples.tolist()], config, alpha=0.01, delta=0.1,
                   method="pearson", acceptance_rate=None, generate_s=0.0)
    assert (case.pvalue >= 0.01) is should_pass, case.pvalue
    assert case.power_at_delta > 0.9
    assert len(case.node_pvalues) >= 1


def test_cli_help():
    result = subprocess.run([sys.executable, "-m", "verification", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for option in ("--speculative-config", "--temperature", "--samples", "--driver", "--json", "--plot"):
        assert option in result.stdout


def test_plot_report(tmp_path):
    from vllm_specplugin.verification.check import CaseReport

    case = CaseReport(
        name="T=1 top_k=50 top_p=0.9", sampling={}, n_prompts=1, samples_per_prompt=10, tokens_per_sample=3,
        statistic=1.0, df=1, pvalue=0.5, pvalue_holm=0.5, n_nodes=3, impossible_count=0, worst_node={},
        node_pvalues=(0.1, 0.5, 0.9), power_at_delta=0.99, power_at_observed=0.01, acceptance_rate=None,
        generate_s=0.0, rejected=False,
    )
    report = CheckReport(model="m", speculative_config=None, additional_config=None, injected_fault=None,
                         driver="offline", alpha=0.01, delta=0.1, method="pearson", cases=(case,),
                         startup_s=0.0, wall_s=0.0)
    path = plot_report(report, {case.name: list(case.node_pvalues)}, str(tmp_path / "r.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert report.verdict == "PASS" and '"verdict": "PASS"' in report.to_json()
