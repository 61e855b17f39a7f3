"""The drafts' oneDNN products (vllm_specplugin.fast_linear): same logits as torch's, chosen as configured."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_specplugin.config import SpecPluginConfig, SpecPluginConfigError
from vllm_specplugin.fast_linear import draft_linear_factory, onednn_available, onednn_linear
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.verification.drivers import REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-small")
VOCAB = 4096

needs_onednn = pytest.mark.skipif(onednn_available() is not None, reason=f"no oneDNN here: {onednn_available()}")


def test_onednn_is_available_on_the_cpu_wheel():
    """The CPU wheel the project pins has vLLM's oneDNN GEMM; if it goes, drafts silently lose
    half their speed, so this fails loudly instead."""
    assert onednn_available() is None


@needs_onednn
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_onednn_lean_forward_equals_torch(dtype, tolerance):
    """Batched, ragged and incremental: the oneDNN forward's logits are the torch forward's up to
    float rounding (bfloat16: up to bfloat16 rounding of different summation orders)."""
    fast = DraftRuntime(DRAFT, target_vocab_size=VOCAB, dtype=dtype, make_linear=onednn_linear)
    plain = DraftRuntime(DRAFT, target_vocab_size=VOCAB, dtype=dtype)
    assert fast.lean.linear_backend == "onednn" and plain.lean.linear_backend == "torch_linear"
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (37, 5, 60)]
    batches = [rt.open_batch(["a", "b", "c"], contexts) for rt in (fast, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=tolerance, rtol=tolerance)
    for token in (3, 99):
        torch.testing.assert_close(
            batches[0].extend([token] * 3), batches[1].extend([token] * 3), atol=tolerance, rtol=tolerance
        )


def test_factory_choice():
    assert draft_linear_factory("torch", "cpu") is None
    assert draft_linear_factory("auto", "cpu", "float32") is onednn_linear
    assert draft_linear_factory("auto", "cpu", "bfloat16") is onednn_linear
    assert draft_linear_factory("auto", "cpu", "float16") is None  # torch, logged
    assert draft_linear_factory("auto", "cuda") is None
    with pytest.raises(ValueError, match="draft_gemm 'onednn' is not available: draft_dtype float16"):
        draft_linear_factory("onednn", "cpu", "float16")
    with pytest.raises(ValueError, match="draft_gemm must be one of"):
        draft_linear_factory("fast", "cpu")


def test_config_key():
    assert SpecPluginConfig.from_dict({}).draft_gemm == "auto"
    assert SpecPluginConfig.from_dict({"draft_gemm": "torch"}).draft_gemm == "torch"
    with pytest.raises(SpecPluginConfigError, match="draft_gemm"):
        SpecPluginConfig.from_dict({"draft_gemm": "mkl"})
