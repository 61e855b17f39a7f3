"""Shared fixtures: small peaked Llama checkpoints made once per test session, and vLLM's CPU rejection sampler."""

from __future__ import annotations

import pytest

from vllm_specplugin.models.random_llama import make_random_llama


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> str:
    """2-layer, 128-wide float32 Llama over a 512-token vocabulary, peaked next-token distributions."""
    return str(make_random_llama(tmp_path_factory.mktemp("models") / "target", seed=0))


@pytest.fixture(scope="session")
def peaked_target(tmp_path_factory) -> str:
    """As random_target with LM-head scale 15: max p 0.3-0.5, entropy ~2.6 nats, like real LMs.

    The statistical tests use it: near-uniform distributions make sparse bins and weak tests.
    """
    return str(make_random_llama(tmp_path_factory.mktemp("models") / "peaked-target", logit_scale=15.0, seed=0))


@pytest.fixture(scope="session")
def peaked_draft(tmp_path_factory) -> str:
    """peaked_target's weights with LM-head scale 10.5 (0.7x): acceptance sum min(p, q) ~0.72."""
    return str(make_random_llama(tmp_path_factory.mktemp("models") / "peaked-draft", logit_scale=10.5, seed=0))


@pytest.fixture(scope="session")
def unrelated_draft(tmp_path_factory) -> str:
    """A 1-layer random draft with the target's vocabulary and unrelated weights (acceptance ~3%).

    Low acceptance means most emitted tokens are resampled, which is where vLLM-CPU's expand bug
    shows most plainly.
    """
    return str(
        make_random_llama(tmp_path_factory.mktemp("models") / "unrelated-draft", num_layers=1, logit_scale=3.0, seed=1)
    )


@pytest.fixture(scope="module")
def cpu_rejection_sampler():
    """vLLM's rejection_sampler module with the CPU kernel fallbacks registered and the expand
    repair on; whatever expand implementation was registered before is put back afterwards."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU-only test")
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    from vllm_specplugin import sampler_repair

    before = sampler_repair.registered_expand_impl()
    sampler_repair.apply("on")
    assert sampler_repair.registered_expand_impl() is not None
    assert not sampler_repair.expand_is_broken(sampler_repair.registered_expand_impl())
    from vllm.v1.sample import rejection_sampler

    yield rejection_sampler
    if before is not None:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({sampler_repair.EXPAND_KERNEL: before})
