"""The check's analysis path without an engine, on exact samples from the reference.

* exact samples pass and wrong-temperature samples fail (T > 0);
* T = 0: the greedy sequences pass, one non-argmax token anywhere fails, every token is checked;
* a case that checked no token fails;
* the reported power is the power of the combined decision (not of a first-token test alone);
* calibration: the harness's p-values on exact samples of the real peaked model are uniform;
* the power computed from a sampler's exact law (``plan_power``) predicts its rejection rate;
* ``run_check`` with a callable driver (as the transformers driver uses it): exact samples pass,
  wrong-temperature ones fail, the driver's name and settings are reported.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as sst

from vllm_specplugin import stats
from vllm_specplugin.verification.check import (CaseReport, CheckReport, analyse, decide, plan_power,
                                                random_prompts, run_check, speculative_law)
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.verification.drivers import EngineRun, SamplingConfig, TaskResult
from vllm_specplugin.verification.plots import plot_report
from vllm_specplugin.verification.reference import TargetReference, sample_tree, target_law

N, M = 1500, 2


@pytest.fixture(scope="module")
def reference(peaked_target):
    return TargetReference(peaked_target)


def exact_samples(reference, prompt, temperature, top_k, top_p, n=N, m=M, seed=7):
    return sample_tree(target_law(reference, prompt, temperature, top_k, top_p), n, m, np.random.default_rng(seed))


def run_analyse(reference, prompts, outputs, config, alpha=0.01):
    return analyse(reference, prompts, outputs, config, alpha=alpha, delta=0.1, method="pearson",
                   acceptance_rate=None, generate_s=0.0)


@pytest.mark.statistical
@pytest.mark.parametrize("sampled_temperature,should_pass", [(1.0, True), (0.8, False)])
def test_analyse(reference, sampled_temperature, should_pass):
    prompt = random_prompts(512, 1, seed=3)[0]
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=M, n=N, seed=0)
    samples = exact_samples(reference, prompt, sampled_temperature, 50, 0.9)
    case = run_analyse(reference, [prompt], [samples.tolist()], config)
    assert (case.pvalue >= 0.01) is should_pass, case.pvalue
    assert case.tokens_checked == N * M and case.n_nodes >= case.n_chi2_nodes >= 1
    assert len(case.node_pvalues) >= 1


def greedy_outputs(reference, prompts, tokens):
    outputs = []
    for prompt in prompts:
        out: list[int] = []
        for _ in range(tokens):
            out.append(int(np.argmax(reference.next_logits(prompt, [tuple(out)])[0])))
        outputs.append(out)
    return outputs


def test_greedy_support_check_visits_every_token(reference):
    """T = 0, one continuation per prompt: every node has n = 1. The exact argmax sequences pass with
    every token checked; one wrong token anywhere (here the 20th of one prompt) fails the case."""
    prompts = random_prompts(512, 8, length=(4, 20), seed=5)
    config = SamplingConfig(temperature=0.0, max_tokens=24, n=1, seed=None)
    outputs = greedy_outputs(reference, prompts, 24)
    (case,) = decide([run_analyse(reference, prompts, [[o] for o in outputs], config)], 0.01)
    assert not case.rejected and case.pvalue == 1.0 and case.df == 0 and np.isnan(case.power_at_delta)
    assert case.tokens_checked == 8 * 24 and case.n_nodes == 8 * 24 and case.n_chi2_nodes == 0
    assert case.near_tie_accepted == 0
    bad = [list(o) for o in outputs]
    bad[3][19] = (bad[3][19] + 1) % 512
    (case,) = decide([run_analyse(reference, prompts, [[o] for o in bad], config)], 0.01)
    assert case.rejected and case.pvalue == 0.0 and case.impossible_count == 1
    assert case.worst_node["prompt_index"] == 3 and case.worst_node["position"] == 19
    assert case.tokens_checked == 8 * 24 - 4  # the 4 tokens after the wrong one are not queried


def test_greedy_near_tie_is_counted(reference):
    """A token within the tie tolerance of the maximum is accepted, and counted as such."""
    prompt = random_prompts(512, 1, seed=5)[0]
    logits = reference.next_logits(prompt, [()])[0].astype(np.float64)
    first, second = np.argsort(-logits)[:2]
    gap = float(logits[first] - logits[second])
    config = SamplingConfig(temperature=0.0, max_tokens=1, n=1, seed=None)
    case = analyse(reference, [prompt], [[[int(second)]]], config, alpha=0.01, delta=0.1, method="pearson",
                   acceptance_rate=None, generate_s=0.0, tie_tolerance=gap * 1.01)
    assert case.impossible_count == 0 and case.near_tie_nodes == 1 and case.near_tie_accepted == 1
    assert case.notes and "near-tie" in case.notes[0]
    case = analyse(reference, [prompt], [[[int(second)]]], config, alpha=0.01, delta=0.1, method="pearson",
                   acceptance_rate=None, generate_s=0.0, tie_tolerance=gap * 0.99)
    assert case.impossible_count == 1


def test_a_case_that_checked_nothing_fails(reference):
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=3, n=10, seed=0)
    prompt = random_prompts(512, 1, seed=3)[0]
    for outputs in ([[]], [[[], []]]):  # no sample; samples with no token
        case = run_analyse(reference, [prompt], outputs, config)
        assert case.tokens_checked == 0 and case.rejected and case.pvalue == 0.0
        (decided,) = decide([case], 0.01)
        assert decided.rejected
    # decide() rejects a no-token case whatever its p-value says
    passing = dataclasses.replace(case, pvalue=1.0, rejected=False)
    assert decide([passing], 0.01)[0].rejected and decide([passing], 0.01, 10)[0].rejected


@pytest.mark.statistical
def test_power_is_the_power_of_the_combined_decision(reference):
    """power_at_delta uses the combined df (all nodes, all prompts) at the case's level: lower than a
    standalone first-token test's power, equal to stats.chain_power_for_tv."""
    prompts = random_prompts(512, 2, seed=0)
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=3, n=800, seed=0)
    outputs = [exact_samples(reference, p, 1.0, 50, 0.9, n=800, m=3, seed=i).tolist() for i, p in enumerate(prompts)]
    alpha = 0.01 / 27
    case = run_analyse(reference, prompts, outputs, config, alpha=alpha)
    assert case.power_at_delta == pytest.approx(stats.chain_power_for_tv([800, 800], 0.1, case.df, alpha))
    root = stats.probability_bins(target_law(reference, prompts[0], 1.0, 50, 0.9)([()])[0], 800)
    standalone = stats.power_for_tv(800, 0.1, root.n_bins - 1, alpha)
    assert case.df > 2 * (root.n_bins - 1) and case.power_at_delta < standalone
    print(f"decision power {case.power_at_delta:.3f} (df {case.df}) vs first-token test {standalone:.3f}")
    # The same TV at token 2 (the first token speculation acts on) is seen only through the
    # samples at testable position-2 nodes: fewer than N per prompt, so less power.
    second = sum(n.n for n in stats.combine_chain_results([
        stats.chain_test(np.asarray(o), lambda s, p=p: target_law(reference, p, 1.0, 50, 0.9)([tuple(s)])[0],
                         min_node_samples=10, tv_ci=False) for p, o in zip(prompts, outputs)]).nodes
                 if n.position == 1 and n.testable)
    assert 0 < second < 1600
    assert case.power_at_delta_speculative == pytest.approx(stats.chain_power_for_tv([second], 0.1, case.df, alpha))
    assert case.power_at_delta_speculative < case.power_at_delta


def test_planned_power_at_the_first_speculated_token(reference):
    """plan_power reports the power for the TV at token 2 beside token 1's; with one token per
    sample there is no position 2, so that power is 0 (a plan that visits no node cannot pass)."""
    prompts = random_prompts(512, 2, seed=0)
    alpha = 0.01 / 49
    long = plan_power(reference, prompts, SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=3,
                                                         n=3000, seed=0), alpha=alpha, delta=0.1, reps=1)
    short = plan_power(reference, prompts, SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1,
                                                          n=3000, seed=0), alpha=alpha, delta=0.1, reps=1)
    assert 0.99 <= long.power_speculative <= long.power
    assert short.power > 0.99 and short.power_speculative == 0.0


@pytest.mark.statistical
def test_harness_is_calibrated_on_exact_samples(reference):
    """Under H0 (exact samples of the peaked model, the tier's config at N = 400, 2 prompts), the
    case p-values are uniform: KS p > 0.001 over 300 seeded runs, and the rejection rate at 0.05 is
    within 4 binomial SE of 0.05. (Measured: KS p and rates printed.)"""
    prompts = random_prompts(512, 2, seed=0)
    laws = [target_law(reference, p, 1.0, 50, 0.9) for p in prompts]
    rng = np.random.default_rng(11)
    pvalues = []
    for _ in range(300):
        results = []
        for law in laws:
            samples = sample_tree(law, 400, 3, rng)
            results.append(stats.chain_test(samples, lambda s, law=law: law([tuple(s)])[0], tv_ci=False))
        pvalues.append(stats.combine_chain_results(results).pvalue)
    pvalues = np.array(pvalues)
    ks = sst.kstest(pvalues, "uniform").pvalue
    rate = float(np.mean(pvalues < 0.05))
    print(f"calibration: KS p {ks:.3f}, rejection rate at 0.05: {rate:.3f}, at 0.01: {np.mean(pvalues < 0.01):.3f}")
    assert ks > 0.001
    assert abs(rate - 0.05) <= 4 * np.sqrt(0.05 * 0.95 / len(pvalues))


@pytest.mark.statistical
def test_plan_power_predicts_the_rejection_rate(reference, peaked_draft):
    """A mild fault (lossy threshold tau = 0.6, draft_model-style q, T = 1) at N = 300, m = 2: plan_power's
    noncentral chi-square power from the exact law matches the rejection rate of 200 simulated runs
    within 4 binomial SE (so "power by computation" is the power of the decision)."""
    prompts = random_prompts(512, 2, seed=0)
    config = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_tokens=2, n=300, seed=0)
    draft = TargetReference(peaked_draft)
    law_for_prompt = speculative_law(lambda p: target_law(draft, p, 1.0), fault="lossy_threshold", fault_arg=0.6)
    alpha = 0.01
    plan = plan_power(reference, prompts, config, alpha=alpha, law_for_prompt=law_for_prompt, reps=20, seed=3)
    predicted = float(np.mean([stats.chain_power(lam, df, alpha) for lam, df in zip(plan.noncentrality, plan.df)]))
    targets = [target_law(reference, p, 1.0) for p in prompts]
    laws = [law_for_prompt(p, t) for p, t in zip(prompts, targets)]
    rng = np.random.default_rng(12)
    rejected = []
    for _ in range(200):
        results = [stats.chain_test(sample_tree(law, config.n, config.max_tokens, rng), lambda s, t=t: t([tuple(s)])[0],
                                    tv_ci=False)
                   for law, t in zip(laws, targets)]
        rejected.append(stats.combine_chain_results(results).pvalue < alpha)
    rate = float(np.mean(rejected))
    se = np.sqrt(predicted * (1 - predicted) / len(rejected))
    print(f"plan_power: predicted {predicted:.3f} (min over runs {plan.power:.3f}), simulated {rate:.3f} (SE {se:.3f})")
    assert 0.1 < predicted < 0.9  # a regime where the comparison means something
    assert abs(rate - predicted) <= 4 * se


def test_cli_help():
    result = subprocess.run([sys.executable, "-m", "vllm_specplugin.verification", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for option in ("--speculative-config", "--temperature", "--samples", "--driver", "--json", "--plot",
                   "--greedy-prompts", "--greedy-tokens"):
        assert option in result.stdout


def test_plot_report(tmp_path):
    case = CaseReport(
        name="T=1 top_k=50 top_p=0.9", sampling={}, n_prompts=1, samples_per_prompt=10, tokens_per_sample=3,
        statistic=1.0, df=1, pvalue=0.5, pvalue_holm=0.5, n_nodes=3, n_chi2_nodes=1, tokens_checked=30,
        impossible_count=0, worst_node={}, node_pvalues=(0.1, 0.5, 0.9), power_at_delta=0.99, case_alpha=0.01,
        acceptance_rate=None, generate_s=0.0, rejected=False,
    )
    report = CheckReport(model="m", speculative_config=None, additional_config=None, injected_fault=None,
                         driver="offline", alpha=0.01, delta=0.1, method="pearson", cases=(case,),
                         startup_s=0.0, wall_s=0.0)
    path = plot_report(report, {case.name: list(case.node_pvalues)}, str(tmp_path / "r.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert report.verdict == "PASS" and '"verdict": "PASS"' in report.to_json()
    table = report.format_table()
    assert "95%" not in table and "CI" not in table  # no interval is claimed


@pytest.mark.statistical
@pytest.mark.parametrize("sampled_temperature,should_pass", [(1.0, True), (0.8, False)])
def test_run_check_with_a_callable_driver(reference, peaked_target, sampled_temperature, should_pass):
    """A driver drawing exact samples from the reference (at ``sampled_temperature``) goes through
    run_check's whole path: preparation, analyse, Holm decision, report."""
    seen = []

    def exact_driver(tasks):
        seen.extend(tasks)
        return EngineRun(startup_s=0.0, tasks=[TaskResult(
            outputs=[exact_samples(reference, p, sampled_temperature, t.sampling.top_k, t.sampling.top_p,
                                   n=t.sampling.n, m=t.sampling.max_tokens, seed=i).tolist()
                     for i, p in enumerate(t.prompts)],
            generate_s=0.0, spec_decode_metrics={}) for t in tasks])

    prompts = random_prompts(512, 2, seed=3)
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, max_tokens=M, n=N, seed=0)
    report = run_check(peaked_target, [config], prompts, driver=exact_driver, driver_name="exact",
                       speculative_config={"recorded": True}, reference=reference, progress=False)
    assert [t.prompts for t in seen] == [prompts] and report.driver == "exact"
    assert report.speculative_config == {"recorded": True}
    assert report.passed is should_pass, report.format_table()
    assert report.cases[0].tokens_checked == 2 * N * M
