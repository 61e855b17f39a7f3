"""The engine-agnostic draft runtime: vocabulary check, incremental KV cost, rollback, memory."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.draft_runtime import DraftModelError, DraftRuntime
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.verification.algorithm import process_logits
from vllm_specplugin.verification.drivers import REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-tiny")
VOCAB = 4096
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runtime():
    return DraftRuntime(DRAFT, target_vocab_size=VOCAB)


def context(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


def test_vocabulary_mismatch_names_both_models(random_target):
    with pytest.raises(DraftModelError, match=r"vocabulary size 512, but models/demo/target has 4096"):
        DraftRuntime(random_target, target_vocab_size=4096, target_name="models/demo/target")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DraftModelError, match="no config.json"):
        DraftRuntime(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("context_length", [100, 800])
def test_step_cost_grows_with_new_tokens_not_context(runtime, context_length):
    """After the first step, a step forwards the new tokens plus gamma - 1 drafts, whatever the context."""
    gamma, rid = 3, f"cost-{context_length}"
    ctx = context(context_length)
    before = runtime.tokens_forwarded
    first = runtime.draft(rid, ctx, gamma, GREEDY)
    assert runtime.tokens_forwarded - before == context_length + gamma - 1
    # The target accepted two drafts and added one token of its own.
    ctx = ctx + first.token_ids[:2] + [7]
    before = runtime.tokens_forwarded
    runtime.draft(rid, ctx, gamma, GREEDY)
    assert runtime.tokens_forwarded - before == 1 + gamma - 1
    runtime.free(rid)


def test_rollback_matches_a_fresh_cache(runtime):
    """Drafts after a rejection equal those drafted from scratch on the same context."""
    ctx = context(60, seed=1)
    first = runtime.draft("rollback", ctx, 4, GREEDY)
    ctx = ctx + first.token_ids[:1] + [11]  # one accepted, then a correction
    incremental = runtime.draft("rollback", ctx, 4, GREEDY)
    fresh = DraftRuntime(DRAFT, target_vocab_size=VOCAB).draft("fresh", ctx, 4, GREEDY)
    assert incremental.token_ids == fresh.token_ids
    torch.testing.assert_close(incremental.probs, fresh.probs)
    runtime.free("rollback")


def test_q_is_the_distribution_drawn_from(runtime):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    generator = torch.Generator().manual_seed(0)
    draft = runtime.draft("q", context(40, seed=2), 5, params, generator)
    assert draft.probs.shape == (5, VOCAB)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(5))
    for token, row in zip(draft.token_ids, draft.probs):
        assert row[token] > 0
        assert int((row > 0).sum()) <= 20
    greedy = runtime.draft("q", context(40, seed=2), 3, GREEDY)
    assert all(float(row.max()) == 1.0 for row in greedy.probs)
    runtime.free("q")


def test_processing_matches_the_reference(runtime):
    """Draft-side processing is the harness's float64 reference (vLLM's conventions)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    for params in [SamplingParams(0.7, 50, 0.9), SamplingParams(1.3, 0, 0.8), SamplingParams(1.0, 5, 1.0)]:
        expected = process_logits(logits.double().numpy(), params.temperature, params.top_k, params.top_p)
        got = processed_probs(logits, params).double().numpy()
        assert set(np.nonzero(got)[0]) == set(np.nonzero(expected)[0])
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_context_beyond_draft_length_falls_back_once(runtime, caplog):
    too_long = context(runtime.max_length, seed=4)
    with caplog.at_level(logging.WARNING, logger="vllm_specplugin.proposers.draft_runtime"):
        assert runtime.draft("long", too_long, 3, GREEDY).token_ids == []
        assert runtime.draft("long", too_long + [5], 3, GREEDY).token_ids == []
    messages = [r.getMessage() for r in caplog.records if "maximum length" in r.getMessage()]
    assert len(messages) == 1 and "plain decoding continues" in messages[0]
    near = context(runtime.max_length - 2, seed=5)
    assert len(runtime.draft("near", near, 5, GREEDY).token_ids) == 2  # clipped, not dropped
    runtime.free("long"), runtime.free("near")


def test_no_leak_over_1000_requests_and_budget_holds():
    small = DraftRuntime(DRAFT, target_vocab_size=VOCAB, memory_budget_mb=0.5)
    for i in range(1000):
        small.draft(f"r{i}", context(8, seed=i), 2, GREEDY)
        if i % 2:
            small.free(f"r{i}")
        assert small.cache_bytes <= small.memory_budget_bytes or small.num_cached_requests == 1
    assert small.evictions > 0
    for i in range(1000):
        small.free(f"r{i}")
    assert small.num_cached_requests == 0 and small.cache_bytes == 0


@pytest.mark.parametrize("name", ["draft-small", "draft-distill", "target"])
def test_lean_llama_forward_equals_transformers(name):
    """The lean forward path gives transformers' logits, batched, ragged and incremental."""
    path = os.path.join(REPO_ROOT, "models", "demo", name)
    lean = DraftRuntime(path, target_vocab_size=VOCAB)
    plain = DraftRuntime(path, target_vocab_size=VOCAB, lean_forward=False)
    assert lean.lean is not None and plain.lean is None
    contexts = [context(37, seed=10), context(5, seed=11), context(60, seed=12)]
    batches = [rt.open_batch(["a", "b", "c"], contexts) for rt in (lean, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=1e-4, rtol=1e-4)
    for token in (3, 99):
        torch.testing.assert_close(
            batches[0].extend([token] * 3), batches[1].extend([token] * 3), atol=1e-4, rtol=1e-4
        )


def test_lean_forward_is_not_used_where_it_does_not_apply(random_target):
    from transformers import AutoConfig

    from vllm_specplugin.proposers.lean_llama import LeanLlama

    runtime_ = DraftRuntime(random_target)
    assert LeanLlama.supports(runtime_.model)
    config = AutoConfig.from_pretrained(random_target)
    config.attention_bias = True
    runtime_.model.config = config
    assert not LeanLlama.supports(runtime_.model)
