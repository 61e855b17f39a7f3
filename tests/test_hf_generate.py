"""The plugin's proposers inside transformers' generate() (proposers/hf_generate.py), fast checks.

Greedy output equals plain greedy ``generate()`` for every proposer stack; the three entry
points (callable ``custom_generate``, :func:`speculative_generate`, the local
``custom_generate/`` directory) give the same samples under one seed; the target is processed
exactly as transformers' sampling and the harness's reference process it; a small-N exactness
check passes, and a target processed wrongly is caught. The full statistical check is
tests/statistical/test_stat_hf_generate.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.hf_generate import (CUSTOM_GENERATE_DIR, SpeculativeStats, build_proposer,
                                                   processed_target_scores, speculative_decoding,
                                                   speculative_generate)
from vllm_specplugin.verification.algorithm import process_logits
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.verification.drivers import SamplingConfig

DEMO = os.path.join(REPO_ROOT, "models", "demo")
TARGET = os.path.join(DEMO, "target")
DISTILL, SMALL = os.path.join(DEMO, "draft-distill"), os.path.join(DEMO, "draft-small")
PROMPT = [[0, 57, 812, 33, 1290, 7, 401, 77]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


STACKS = {
    "one draft": dict(drafts=[DISTILL]),
    "ensemble + adaptive gamma": dict(drafts=[DISTILL, SMALL], adaptive_gamma=True, adapt_weights=True),
    "tree + adaptive gamma": dict(drafts=[DISTILL], tree_drafting={"node_budget": 8, "branching": 2},
                                  adaptive_gamma={"mode": "cost_model", "gamma_min": 0}),
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_greedy_equals_plain_generate(target, stack):
    options = dict(STACKS[stack])
    proposer = build_proposer(options.pop("drafts"), target=target, **options)
    input_ids = torch.tensor(PROMPT)
    plain = target.generate(input_ids, do_sample=False, max_new_tokens=40)
    stats = SpeculativeStats()
    out = speculative_generate(target, input_ids, proposer=proposer, do_sample=False, max_new_tokens=40,
                               num_speculative_tokens=4, stats=stats)
    assert out.tolist() == plain.tolist()
    assert stats.emitted == 40 and stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted
    assert stats.accepted > 0  # the demo drafts agree with the target on greedy text
    assert not proposer.tracked_request_ids()  # the request was freed


def test_eos_and_stopping_match_plain_generate(target):
    input_ids = torch.tensor(PROMPT)
    plain = target.generate(input_ids, do_sample=False, max_new_tokens=30)[0, len(PROMPT[0]):].tolist()
    eos = plain[11]  # a token greedy decoding emits mid-way: generation must stop right after it
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=30, eos_token_id=eos)
    proposer = build_proposer([DISTILL], target=target)
    out = speculative_generate(target, input_ids, proposer=proposer, do_sample=False, max_new_tokens=30,
                               eos_token_id=eos)
    assert out.tolist() == expected.tolist()
    assert out[0, -1].item() == eos and out.shape[1] <= len(PROMPT[0]) + 12


def test_entry_points_give_the_same_samples(target):
    """The callable custom_generate, speculative_generate and the local custom_generate/ directory
    are one loop: same seed, same tokens (T = 0.8 with top-k and top-p)."""
    input_ids = torch.tensor(PROMPT)
    sampling = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=24)
    outs = []
    torch.manual_seed(3)
    outs.append(speculative_generate(target, input_ids, proposer=build_proposer([DISTILL], target=target),
                                     num_speculative_tokens=3, **sampling))
    torch.manual_seed(3)
    outs.append(target.generate(input_ids, custom_generate=speculative_decoding,
                                proposer=build_proposer([DISTILL], target=target), num_speculative_tokens=3,
                                **sampling))
    torch.manual_seed(3)
    outs.append(target.generate(input_ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True,
                                drafts=[DISTILL], num_speculative_tokens=3, **sampling))
    assert outs[0].shape == (1, len(PROMPT[0]) + 24)
    assert outs[0].tolist() == outs[1].tolist() == outs[2].tolist()
    # A generator makes a run reproducible without the global seed.
    runs = [speculative_generate(target, input_ids, proposer=build_proposer([DISTILL], target=target),
                                 generator=torch.Generator().manual_seed(5), **sampling) for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()


def _prepared_processor(target, **generate_kwargs):
    """The logits processor transformers' generate() prepares for these arguments."""
    seen = {}

    def spy(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        seen["processor"], seen["config"] = logits_processor, generation_config
        return input_ids

    target.generate(torch.tensor(PROMPT), custom_generate=spy, max_new_tokens=3, **generate_kwargs)
    return seen["processor"], seen["config"]


@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.7, 50, 0.9), (1.3, 5, 0.8), (0.5, 0, 0.6)],
                         ids=lambda s: "T{}-k{}-p{}".format(*s))
def test_target_processing_matches_transformers_and_the_reference(target, sampling):
    """p = softmax(float64) of the scores transformers' own warpers produce (temperature, top-k,
    top-p), which equals the harness's exact reference processing (vLLM's order) row by row.

    Exact ties straddling the top-p boundary are the one difference: transformers sorts with
    torch's unstable sort, vLLM (and the reference) with a stable one, so among tied tokens they
    may keep different ones (the same number). Row 1 has 10 tied maxima."""
    temperature, top_k, top_p = sampling
    processor, _ = _prepared_processor(target, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, :10] = logits[1].max()  # ties at the top
    input_ids = torch.tensor([PROMPT[0] + [5, 6, 7, 8]])
    p = torch.softmax(processed_target_scores(processor, input_ids, logits).double(), -1).numpy()
    for row in range(5):
        expected = process_logits(logits[row].double().numpy(), temperature, top_k, top_p)
        if row == 1:  # tied: the same support size and the same sorted probabilities
            assert (p[row] > 0).sum() == (expected > 0).sum()
            np.testing.assert_allclose(np.sort(p[row]), np.sort(expected), atol=1e-6)
            continue
        np.testing.assert_array_equal(p[row] > 0, expected > 0)
        np.testing.assert_allclose(p[row], expected, atol=1e-6)


def test_transformers_default_top_k_is_applied(target):
    """generate(do_sample=True) without top_k samples with transformers' default top-k of 50: the
    plugin's path processes the target with the same processor, and drafts with the same top-k."""
    from vllm_specplugin.proposers.hf_generate import _draft_params

    processor, config = _prepared_processor(target, do_sample=True)
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1))
    scores = processed_target_scores(processor, torch.tensor(PROMPT), logits)
    assert int(torch.isfinite(scores).sum()) == 50
    assert _draft_params(config).top_k == 50


def test_each_row_is_processed_with_its_own_prefix():
    lengths = []

    def recorder(input_ids, scores):
        lengths.append(input_ids.shape[1])
        return scores

    from transformers import LogitsProcessorList

    processed_target_scores(LogitsProcessorList([recorder]), torch.arange(10)[None], torch.zeros(4, 16))
    assert lengths == [7, 8, 9, 10]  # context of 7, then one more drafted token per row


def test_refuses_what_it_cannot_do(target):
    proposer = build_proposer([DISTILL], target=target)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, torch.tensor(PROMPT * 2), proposer=proposer, max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown fault"):
        speculative_generate(target, torch.tensor(PROMPT), proposer=proposer, max_new_tokens=2, fault="nope")
    with pytest.raises(ValueError, match="verify must be 'chain'"):
        build_proposer([DISTILL], target=target, tree_drafting={"verify": "tree"})
    with pytest.raises(ValueError, match="proposer="):
        target.generate(torch.tensor(PROMPT), custom_generate=speculative_decoding, max_new_tokens=2)


def test_small_exactness_check_and_a_wrong_target_is_caught(peaked_target, peaked_draft):
    """Small N (CPU-light): the plugin's path passes the chain-rule test at T = 1; with the
    target's logits left unprocessed at top-k 5 it samples tokens the processed target cannot
    emit, and the support check fails it."""
    from vllm_specplugin.verification.check import random_prompts
    from vllm_specplugin.verification.hf_driver import run_hf_check

    prompts = random_prompts(512, 2, seed=0)
    honest = run_hf_check(peaked_target, [SamplingConfig(1.0, 0, 1.0, max_tokens=3, n=150)], prompts,
                          drafts=[peaked_draft], proposer_options={"adaptive_gamma": True})
    assert honest.passed, honest.format_table()
    (case,) = honest.cases
    assert case.tokens_checked == 2 * 150 * 3 and case.acceptance_rate > 0.3
    wrong = run_hf_check(peaked_target, [SamplingConfig(1.0, 5, 1.0, max_tokens=3, n=40)], prompts,
                         drafts=[peaked_draft], fault="unprocessed_target")
    assert not wrong.passed and wrong.cases[0].impossible_count > 0, wrong.format_table()


def test_assisted_driver_counts_transformers_steps(peaked_target, peaked_draft):
    from vllm_specplugin.verification.drivers import GenerationTask
    from vllm_specplugin.verification.hf_driver import run_hf

    run = run_hf(peaked_target, [GenerationTask([[5, 6, 7]], SamplingConfig(1.0, 0, 1.0, max_tokens=6, n=4))],
                 mode="assisted", drafts=[peaked_draft])
    (task,) = run.tasks
    assert [len(s) for s in task.outputs[0]] == [6] * 4  # EOS off: every sample is max_tokens long
    metrics = task.spec_decode_metrics
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert 0 <= metrics["vllm:spec_decode_num_accepted_tokens"] <= metrics["vllm:spec_decode_num_draft_tokens"]
