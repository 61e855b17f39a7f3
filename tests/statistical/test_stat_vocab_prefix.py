"""Engine-level exactness with a draft whose vocabulary is a strict prefix of the target's.

The target (peaked_target) has 512 ids; the draft is peaked_draft cut to its first 500 ids (its
embedding and LM head truncated, the same word tokenizer over 500 ids). The plugin pads the
draft's q with zeros to 512, so ids 500-511 are never drafted, and the target still emits them
(through the residual distribution), which the draft then reads as id 0. One engine, N = 2000
continuations of 3 tokens per prompt, the chain-rule chi-square test of
``verification.check`` (Holm over the cases at alpha = 0.01), as in
test_stat_engine_exactness.py.
"""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.verification.check import random_prompts, run_check
from vllm_specplugin.verification.drivers import REPO_ROOT, SamplingConfig

pytestmark = [pytest.mark.statistical, pytest.mark.engine]

DRAFT_VOCAB = 500
ALPHA = 0.01
N, M_TOKENS = 2000, 3
PROMPTS = random_prompts(512, 2, seed=1)
REPORT_DIR = os.path.join(REPO_ROOT, "runs", "statistical")


@pytest.fixture(scope="module")
def prefix_vocab_draft(tmp_path_factory, peaked_draft) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specplugin.models.random_llama import make_word_tokenizer

    path = tmp_path_factory.mktemp("models") / f"peaked-draft-{DRAFT_VOCAB}"
    model = AutoModelForCausalLM.from_pretrained(peaked_draft, dtype=torch.float32)
    model.resize_token_embeddings(DRAFT_VOCAB)  # keeps the first rows of the embedding and LM head
    model.save_pretrained(str(path))
    make_word_tokenizer(path, DRAFT_VOCAB)  # w0..: the same tokens as the target's first 500 ids
    return str(path)


def test_prefix_vocabulary_draft_is_exact(peaked_target, prefix_vocab_draft):
    samplings = [
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_tokens=M_TOKENS, n=N, seed=0),
        SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, max_tokens=M_TOKENS, n=N, seed=0),
    ]
    report = run_check(
        peaked_target, samplings, PROMPTS, alpha=ALPHA, delta=0.1, progress=False,
        speculative_config={
            "method": "custom_class",
            "model": "vllm_specplugin.adapters.MultiDraftProposer",
            "num_speculative_tokens": 3,
        },
        additional_config={"specplugin": {"drafts": [prefix_vocab_draft]}},
    )
    os.makedirs(REPORT_DIR, exist_ok=True)
    with open(os.path.join(REPORT_DIR, "honest_vocab_prefix.json"), "w") as f:
        f.write(report.to_json())
    print("\n" + report.format_table())
    for case in report.cases:
        assert case.impossible_count == 0 and not case.rejected, (case.name, case.pvalue, case.worst_node)
        assert case.power_at_delta >= 0.99, (case.name, case.power_at_delta)
        assert case.acceptance_rate and case.acceptance_rate > 0.05, (case.name, case.acceptance_rate)
    assert report.passed
