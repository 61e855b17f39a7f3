"""The lean forward's one-row fast path (proposers/lean_decode.py): the same logits as the lean
forward it wraps and as transformers, in float32 and bfloat16, for the one-token and catch-up
shapes, across steps of KV growth and rollback; other batches go to the wrapped forward."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.draft_runtime import DraftBatch, DraftRuntime
from vllm_specplugin.proposers.lean_decode import TORCH_OUT_KERNELS, LeanDecode
from vllm_specplugin.proposers.lean_llama import TORCH_KERNELS
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

from test_draft_kernels import vllm_kernels_or_fallback  # same directory (pytest rootdir import)
from test_proposers_draft_runtime import _tiny_checkpoint

DRAFT = os.path.join(REPO_ROOT, "models", "demo-mb", "draft")  # the memory-bound family's draft (bf16 checkpoint)
VOCAB = 4096


def context(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


def _vllm_kernels():
    """vLLM's CPU kernels and their out forms (draft_kernels.py)."""
    from vllm_specplugin.draft_kernels import VLLM_CPU_KERNELS, VLLM_OUT_KERNELS

    return VLLM_CPU_KERNELS, VLLM_OUT_KERNELS


KERNELS = {"torch": lambda: (TORCH_KERNELS, TORCH_OUT_KERNELS), "vllm": _vllm_kernels}
# bfloat16: the fast path's one fused final add-and-norm rounds once less than the lean forward's add,
# then norm; transformers' bfloat16 forward rounds elsewhere again. float32: float rounding only.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


def _runtimes(kernel_name: str, dtype: str, path: str = DRAFT, **kwargs):
    """(fast path, the lean forward alone, transformers) runtimes of one draft."""
    if kernel_name == "vllm" and not vllm_kernels_or_fallback(dtype):
        return None  # this CPU cannot (bfloat16 without AVX-512): the fallback was checked instead
    kernels, out_kernels = KERNELS[kernel_name]()
    if "fast_path" in inspect.signature(DraftRuntime).parameters:  # once the runtime wraps it itself
        kwargs["fast_path"] = False
    fast = DraftRuntime(path, target_vocab_size=VOCAB, dtype=dtype, kernels=kernels, **kwargs)
    fast.lean = LeanDecode(fast.lean, out_kernels)
    lean = DraftRuntime(path, target_vocab_size=VOCAB, dtype=dtype, kernels=kernels, **kwargs)
    assert type(lean.lean).__name__ == "LeanLlama"
    plain = DraftRuntime(path, target_vocab_size=VOCAB, dtype=dtype, lean_forward=False, **kwargs)
    return fast, lean, plain


def _speculate(runtimes, steps: int, gamma: int = 3, seed: int = 0, tolerance: float = 1e-4):
    """Draft ``gamma`` tokens per step (catch-up, then one-token extends of all but the last, as
    DraftRuntime.draft does), accept a varying prefix plus one token, and now and then tokens the
    draft never saw (a step without drafts): catch-ups of 1 to 5 tokens. Every forward's logits
    must agree across ``runtimes``."""
    rng = np.random.default_rng(seed)
    ctx = context(40, seed=seed)
    compared = 0
    for _ in range(steps):
        batches = [rt.open_batch(["r"], [ctx]) for rt in runtimes]
        for other in batches[1:]:
            torch.testing.assert_close(batches[0].logits, other.logits, atol=tolerance, rtol=tolerance)
        drafted = [int(batches[1].logits[0].argmax())]  # the lean forward's choice drives every runtime
        for _ in range(gamma - 1):
            out = [b.extend([drafted[-1]]) for b in batches]
            drafted.append(int(out[1][0].argmax()))
            for other in out[1:]:
                torch.testing.assert_close(out[0], other, atol=tolerance, rtol=tolerance)
            compared += 1
        for b in batches:
            b.close()
        accepted = int(rng.integers(0, gamma + 1))
        unseen = int(rng.integers(0, 3))  # tokens decoded without the draft
        ctx = ctx + drafted[:accepted] + rng.integers(3, VOCAB, size=1 + unseen).tolist()
        compared += 1
    return compared


@pytest.mark.parametrize("kernel_name", ["torch", "vllm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_path_equals_lean_forward_and_transformers(kernel_name, dtype):
    """Catch-up (1-4 tokens after a rollback) and one-token forwards over 8 steps, the KV buffer
    growing twice (16-token chunks): the fast path's logits are the wrapped lean forward's and
    transformers'."""
    runtimes = _runtimes(kernel_name, dtype, kv_chunk_tokens=16)
    if runtimes is None:
        return
    fast, lean, plain = runtimes
    _speculate([fast, lean, plain], steps=8, tolerance=TOLERANCE[dtype])
    assert fast._caches["r"].capacity > 40  # grown past its first chunks
    assert fast.lean.fast_forwards >= 8 * 3  # every forward after the prefill took the fast path
    sizes = set(fast.lean._buffers)  # one buffer set per new-token count seen
    assert sizes <= {1, 2, 3, 4, 5} and max(sizes) >= 3  # one-token forwards and catch-ups


@pytest.mark.parametrize("kernel_name", ["torch", "vllm"])
def test_fast_path_is_bitwise_the_lean_forward_in_float32(kernel_name):
    """Same kernels, same order: in float32 the one-token logits are the lean forward's bit for bit
    (only the final add-and-norm is fused, and float32 adds round the same)."""
    fast, lean, _ = _runtimes(kernel_name, "float32")
    batches = [rt.open_batch(["r"], [context(30, seed=5)]) for rt in (fast, lean)]
    for token in (7, 8, 9):
        a, b = (batch.extend([token]) for batch in batches)
        assert torch.equal(a, b)


def test_other_batches_go_to_the_wrapped_forward():
    """Several rows and long prefills are the wrapped forward's (no buffers kept for them); a
    single row after them takes the fast path again, on the same caches; so does a token tree's
    wave (one request's paths, merged into one masked row by the draft runtime)."""
    fast, lean, _ = _runtimes("torch", "float32")
    contexts = [context(60, seed=1), context(7, seed=2)]
    batches = [rt.open_batch(["a", "b"], contexts) for rt in (fast, lean)]
    assert fast.lean.fast_forwards == 0  # "a"'s 59-token solo prefill, then one forward of two rows
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batches[0].extend([3, 4]), batches[1].extend([3, 4]), atol=1e-5, rtol=1e-5)
    for b in batches:
        b.close()
    assert fast.lean.fast_forwards == 0 and not fast.lean._buffers
    singles = [rt.open_batch(["b"], [contexts[1] + [4, 9]]) for rt in (fast, lean)]
    torch.testing.assert_close(singles[0].logits, singles[1].logits, atol=1e-5, rtol=1e-5)
    assert fast.lean.fast_forwards == 1 and set(fast.lean._buffers) == {1}
    # A tree's waves: two paths (3 tokens, one masked row), then a path over its computed parent.
    trees = [DraftBatch.branches(rt, "a", contexts[0] + [3], [[5, 6], [8]]) for rt in (fast, lean)]
    assert trees[0].logits.shape == (2, fast.vocab_size)
    torch.testing.assert_close(trees[0].logits, trees[1].logits, atol=1e-5, rtol=1e-5)
    assert fast.lean.fast_forwards == 2 and set(fast.lean._buffers) == {1, 3}
    waves = [DraftBatch.branches(rt, "a", contexts[0] + [3], [[5, 6, 7], [8, 2]]) for rt in (fast, lean)]
    torch.testing.assert_close(waves[0].logits, waves[1].logits, atol=1e-5, rtol=1e-5)
    assert fast.lean.fast_forwards == 3 and set(fast.lean._buffers) == {1, 2, 3}


@pytest.mark.parametrize("kernel_name", ["torch", "vllm"])
def test_buffers_are_reused_and_outputs_are_fresh(kernel_name):
    """No new intermediate buffers per forward (the same storage every time), and the returned
    logits / hidden states are the caller's: a later forward does not overwrite them (vLLM's
    add-and-norm works in place, so this is where a buffer could leak out)."""
    fast, _, _ = _runtimes(kernel_name, "float32")
    batch = fast.open_batch(["r"], [context(10, seed=3)])
    first = batch.extend([5])
    kept, kept_hidden = first.clone(), batch.hidden.clone()
    hidden = batch.hidden
    buffers = fast.lean._buffers[1]
    pointers = [t.data_ptr() for t in (buffers.qkv, buffers.gate_up, buffers.act, buffers.down, buffers.o)]
    batch.extend([6])
    assert fast.lean._buffers[1] is buffers
    assert [t.data_ptr() for t in (buffers.qkv, buffers.gate_up, buffers.act, buffers.down, buffers.o)] == pointers
    assert torch.equal(first, kept) and torch.equal(hidden, kept_hidden)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_fast_path_with_grouped_query_attention_and_qkv_bias(tmp_path, kind):
    path = _tiny_checkpoint(tmp_path / kind, kind)
    fast, lean, plain = _runtimes("torch", "float32", path=path, kv_chunk_tokens=16)
    assert fast.lean.num_kv_heads == 2
    _speculate([fast, lean, plain], steps=5, seed=4)
