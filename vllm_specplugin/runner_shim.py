"""The runner shim: what vLLM 0.32's custom_class path does not give a proposer, and back.

vLLM calls a custom_class proposer with batch rows only, and never asks it for draft
probabilities (only its draft-model branch reads ``take_last_draft_probs()``), so verification
treats every draft as one-hot. The shim wraps ``GPUModelRunner.propose_draft_token_ids``:
before the call it hands the proposer a :class:`BatchView` (request ids, sampling settings,
seeds, live requests); after it, it stores the proposer's q where the rejection sampler reads
draft probabilities (``_draft_probs`` / ``_draft_prob_req_ids``). With the shim off, a proposer
gets no BatchView and must draft deterministically (one-hot verification is then exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.config import SpecPluginConfig


@dataclass(frozen=True)
class BatchView:
    req_ids: list[str]  # row -> request id
    params: list[SamplingParams]  # row -> the request's temperature, top-k, top-p
    seeds: list[int | None]  # row -> the request's seed (None: unseeded)
    live_request_ids: frozenset[str]  # every request the runner still holds (finished ones are gone)


def batch_view(runner) -> BatchView:
    batch = runner.input_batch
    req_ids = list(batch.req_ids)
    params, seeds = [], []
    for row in range(len(req_ids)):
        params.append(
            SamplingParams(
                temperature=float(batch.temperature_cpu[row]),
                top_k=int(batch.top_k_cpu[row]),
                top_p=float(batch.top_p_cpu[row]),
            )
        )
        generator = batch.generators.get(row)
        seeds.append(None if generator is None else int(generator.initial_seed()))
    return BatchView(req_ids, params, seeds, frozenset(runner.requests))


def _shim_enabled(runner) -> bool:
    enabled = getattr(runner, "_specplugin_shim_enabled", None)
    if enabled is None:
        spec = runner.speculative_config
        config = SpecPluginConfig.from_additional_config(getattr(runner.vllm_config, "additional_config", None))
        enabled = bool(spec is not None and spec.method == "custom_class" and config.runner_shim)
        runner._specplugin_shim_enabled = enabled
    return enabled


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplugin.patches import wrap_once

    wrap_once(GPUModelRunner, "propose_draft_token_ids", _shimmed_propose_draft_token_ids)


def _shimmed_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        use = _shim_enabled(self) and hasattr(drafter, "set_batch_view")
        if use:
            drafter.set_batch_view(batch_view(self))
        draft_token_ids = original(self, *args, **kwargs)
        if use:
            probs = drafter.take_last_draft_probs()
            if probs is not None:
                self._draft_probs = probs
                self._draft_prob_req_ids = self.input_batch.req_ids.copy()
        return draft_token_ids

    return propose_draft_token_ids
