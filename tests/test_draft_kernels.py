"""vLLM's CPU kernels for the drafts' lean forward (vllm_specplugin.draft_kernels): the same logits
as torch's kernels, and chosen as configured."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from vllm_specplugin.config import SpecPluginConfig, SpecPluginConfigError
from vllm_specplugin import draft_kernels as draft_kernels_module
from vllm_specplugin.draft_kernels import (VLLM_CPU_KERNELS, draft_kernels, onednn_linear, vllm_kernels_available,
                                            vllm_kernels_run)
from vllm_specplugin.proposers.draft_runtime import DraftBatch, DraftRuntime
from vllm_specplugin.proposers.lean_llama import TORCH_KERNELS
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-small")
VOCAB = 4096

needs_kernels = pytest.mark.skipif(vllm_kernels_available() is not None,
                                   reason=f"no vLLM CPU kernels here: {vllm_kernels_available()}")

# The logits comparisons run in a process of their own (test_comparisons_in_a_fresh_process). In
# one run of the whole suite on two xdist workers (AMD EPYC, AVX2, 1 Dec 2026) they failed in a
# worker that had run other tests before: the three-row extend after a 102-row prefill differed
# from torch's by up to 3.46 in every logit (oneDNN's product, alone and in the full forward),
# while the same module passed alone, after the rest of the unit tier, and after each module
# tried; the cause is not found (a note says so). A fresh process is what a vLLM worker is when
# it builds the drafts; what state broke the product in the long-lived one is still open.
FRESH_PROCESS_ENV = "SPECPLUGIN_KERNEL_COMPARISONS"
in_fresh_process = pytest.mark.skipif(os.environ.get(FRESH_PROCESS_ENV) != "1",
                                      reason="run by test_comparisons_in_a_fresh_process")


def test_vllm_kernels_are_available_on_the_cpu_wheel():
    """The CPU wheel the project pins has vLLM's oneDNN GEMM and its RMSNorm / RoPE / SiLU kernels;
    if they go, drafts silently lose half their speed, so this fails loudly instead."""
    assert vllm_kernels_available() is None


def vllm_kernels_or_fallback(dtype: str) -> bool:
    """True where vLLM's CPU kernels run ``dtype`` on this CPU. Elsewhere (bfloat16 on an AVX2-only
    CPU) checks what a user gets instead, torch's kernels under ``auto`` and a clear error under
    ``vllm``, and returns False: the caller's comparison has nothing to compare."""
    why_not = vllm_kernels_run(dtype)
    if why_not is None:
        return True
    assert "this CPU" in why_not, why_not
    assert draft_kernels("auto", "cpu", dtype) is None
    with pytest.raises(ValueError, match="cannot run"):
        draft_kernels("vllm", "cpu", dtype)
    return False


def _logits_agree(fast: DraftRuntime, plain: DraftRuntime, tolerance: float) -> None:
    """Batched, ragged (one long row, two short), incremental, and a token tree's masked rows."""
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (37, 5, 60)]
    batches = [rt.open_batch(["a", "b", "c"], contexts) for rt in (fast, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=tolerance, rtol=tolerance)
    for token in (3, 99):
        torch.testing.assert_close(
            batches[0].extend([token] * 3), batches[1].extend([token] * 3), atol=tolerance, rtol=tolerance
        )
    for batch in batches:
        batch.close()
    paths = [[5, 6], [5, 7], [8]]
    trees = [DraftBatch.branches(rt, "a", contexts[0] + [3, 99], paths) for rt in (fast, plain)]
    torch.testing.assert_close(trees[0].logits, trees[1].logits, atol=tolerance, rtol=tolerance)


@needs_kernels
@in_fresh_process
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_vllm_kernels_lean_forward_equals_torch(dtype, tolerance):
    """The forward on vLLM's kernels gives torch's logits up to float rounding (bfloat16: up to
    bfloat16 rounding of different summation orders)."""
    if not vllm_kernels_or_fallback(dtype):
        return
    fast = DraftRuntime(DRAFT, target_vocab_size=VOCAB, dtype=dtype, kernels=VLLM_CPU_KERNELS)
    plain = DraftRuntime(DRAFT, target_vocab_size=VOCAB, dtype=dtype)
    assert fast.lean.kernels.name == "vllm" and plain.lean.kernels.name == "torch"
    _logits_agree(fast, plain, tolerance)


@needs_kernels
@in_fresh_process
@pytest.mark.parametrize("kernel", ["rms_norm", "add_rms_norm", "make_rope", "silu_and_mul", "linear"])
def test_each_vllm_kernel_alone_equals_torch(kernel):
    """One vLLM kernel at a time among torch's: a wrong one is named by its own case."""
    mixed = dataclasses.replace(TORCH_KERNELS, name=f"torch+{kernel}", **{kernel: getattr(VLLM_CPU_KERNELS, kernel)})
    _logits_agree(DraftRuntime(DRAFT, target_vocab_size=VOCAB, kernels=mixed), DraftRuntime(DRAFT, target_vocab_size=VOCAB),
                  1e-4)


@needs_kernels
@in_fresh_process
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle_head_on_vllm_kernels_equals_torch(dtype):
    """The EAGLE head drafter (proposers/eagle_head.py) on vLLM's kernels drafts torch's: in float32
    the same greedy chain and the same q rows up to float rounding, and the same tree node
    distributions; in bfloat16 (different summation orders, each rounded) the same distributions
    within 0.05 in total variation."""
    from safetensors.torch import load_file

    from vllm_specplugin.proposers.base import DraftRequest
    from vllm_specplugin.proposers.eagle_head import EagleHeadProposer
    from vllm_specplugin.proposers.sampling import SamplingParams

    if not vllm_kernels_or_fallback(dtype):
        return
    target = load_file(os.path.join(REPO_ROOT, "models", "demo", "target", "model.safetensors"))
    heads = [EagleHeadProposer(os.path.join(REPO_ROOT, "models", "demo", "eagle"), kernels=kernels, dtype=dtype)
             for kernels in (VLLM_CPU_KERNELS, None)]
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(3, VOCAB, (40,), generator=gen).tolist()
    hidden = torch.randn(39, heads[0].weights.hidden_size, generator=gen)
    drafts, trees = [], []
    for head in heads:
        embed = target["model.embed_tokens.weight"]
        head.attach_target(embed, target.get("lm_head.weight", embed))  # demo target: tied
        request = DraftRequest("a", context, 5, SamplingParams(0.0), None, hidden_states=hidden, hidden_start=0)
        drafts.append(head.propose([request])[0])
        head.prepare([DraftRequest("a", context, 5, SamplingParams(0.0), None)])
        trees.append(head.branch_distributions_of([("a", context, [[], [5], [6], [5, 7]])])[0])
    assert heads[0].kernels.name == "vllm" and heads[1].kernels.name == "torch"
    assert heads[0].weights.fc.dtype == getattr(torch, dtype)
    if dtype == "float32":
        assert drafts[0].token_ids == drafts[1].token_ids
        torch.testing.assert_close(drafts[0].probs, drafts[1].probs, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(trees[0], trees[1], atol=1e-5, rtol=1e-4)
    else:
        assert drafts[0].probs.dtype == torch.float32
        total_variation = 0.5 * (trees[0] - trees[1]).abs().sum(-1)
        assert total_variation.max() < 0.05, total_variation


@needs_kernels
def test_comparisons_in_a_fresh_process():
    """The nine comparisons above, in a new pytest process: all must pass (none skipped)."""
    if os.environ.get(FRESH_PROCESS_ENV) == "1":
        pytest.skip("this is the fresh process")
    env = {**os.environ, FRESH_PROCESS_ENV: "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           __file__, "-k", "equals_torch"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(summary)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b9 passed\b", summary) and "skipped" not in summary, summary


def test_kernel_choice():
    assert draft_kernels("torch", "cpu") is None
    assert draft_kernels("auto", "cpu", "float32") is VLLM_CPU_KERNELS
    assert draft_kernels("auto", "cpu", "bfloat16") is (VLLM_CPU_KERNELS if vllm_kernels_run("bfloat16") is None else None)
    assert draft_kernels("auto", "cpu", "float16") is None  # torch, logged
    assert draft_kernels("auto", "cuda") is None
    assert VLLM_CPU_KERNELS.linear is onednn_linear
    with pytest.raises(ValueError, match="draft_kernels 'vllm' is not available: draft_dtype float16"):
        draft_kernels("vllm", "cpu", "float16")
    with pytest.raises(ValueError, match="draft_kernels must be one of"):
        draft_kernels("fast", "cpu")


def test_a_dtype_the_cpu_cannot_run_falls_back(monkeypatch, caplog):
    """Where the probe says no (as bfloat16 on an AVX2-only CPU, where oneDNN cannot make the
    product), ``auto`` takes torch's kernels and says why; ``vllm`` refuses with the reason."""
    reason = "vLLM's CPU kernels cannot run bfloat16 on this CPU (probe failed)"
    monkeypatch.setitem(draft_kernels_module._DTYPE_PROBES, "bfloat16", reason)
    with caplog.at_level("WARNING"):
        assert draft_kernels("auto", "cpu", "bfloat16") is None
    assert reason in caplog.text
    with pytest.raises(ValueError, match="not available: vLLM's CPU kernels cannot run bfloat16"):
        draft_kernels("vllm", "cpu", "bfloat16")
    assert draft_kernels("auto", "cpu", "float32") is (VLLM_CPU_KERNELS if vllm_kernels_run("float32") is None else None)


def test_the_float32_probe_runs_here():
    """float32 products need only AVX2: the probe must pass on any CPU the project supports."""
    assert vllm_kernels_run("float32") is None


def test_config_key():
    assert SpecPluginConfig.from_dict({}).draft_kernels == "auto"
    assert SpecPluginConfig.from_dict({"draft_kernels": "torch"}).draft_kernels == "torch"
    with pytest.raises(SpecPluginConfigError, match="draft_kernels"):
        SpecPluginConfig.from_dict({"draft_kernels": "mkl"})
    # The key's former name (products only) still works: onednn is now the whole vLLM kernel set.
    assert SpecPluginConfig.from_dict({"draft_gemm": "onednn"}).draft_kernels == "vllm"
    assert SpecPluginConfig.from_dict({"draft_gemm": "torch"}).draft_kernels == "torch"
    with pytest.raises(SpecPluginConfigError, match="draft_gemm"):
        SpecPluginConfig.from_dict({"draft_gemm": "mkl"})
    with pytest.raises(SpecPluginConfigError, match="draft_gemm"):
        SpecPluginConfig.from_dict({"draft_gemm": "torch", "draft_kernels": "vllm"})
