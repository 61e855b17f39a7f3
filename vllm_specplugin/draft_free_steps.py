"""Steps without drafts sample like plain decoding (vLLM 0.32).

A speculative engine sends every step through ``SpecDecodeMetadata`` and the rejection
sampler, even a step in which no request has a draft (adaptive γ backed off, a batch above
``max_batch``, drafts dropped after a failure). The rejection sampler then only samples each
request's bonus token, but at the price of its own machinery (per-token expansion of the
sampling settings, the recovered-token pass, output parsing): at batch 16 on this CPU about
1 ms of a 11 ms step, which is why adaptive γ that stops drafting was still ~10% slower than a
plain engine.

For such a step, this wrapper of ``GPUModelRunner._prepare_inputs`` drops the metadata, so
``_sample`` takes vLLM's plain sampler. The result has the same distribution: with no drafts
the bonus token *is* a plain sample from the target (the plain sampler is the reference the
harness compares against). The logits indices are the same (the last scheduled token of each
request), and the sampled ids come back as ``[num_reqs, 1]``, which ``_bookkeeping_sync``
handles as in a plain engine. Only for the plugin's own proposers: vLLM's draft_model / EAGLE
paths read the metadata when they propose; the custom_class path does not.

Config: ``"draft_free_sampler": "plain"`` (default) or ``"rejection"`` (vLLM's behaviour).
"""

from __future__ import annotations

from vllm_specplugin import version
from vllm_specplugin.logging_utils import log_once

MODES = ("plain", "rejection")


def _is_ours(runner) -> bool:
    from vllm_specplugin.adapters import CustomClassAdapter

    return isinstance(getattr(runner, "drafter", None), CustomClassAdapter)


def _plain_when_draft_free(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_decode_metadata, max_num_sampled_tokens = original(
            self, scheduler_output, num_scheduled_tokens)
        if (spec_decode_metadata is not None and not scheduler_output.scheduled_spec_decode_tokens
                and _enabled(self)):
            # No request has a draft: logits_indices already holds one index per request.
            log_once("info", "specplugin: steps without drafts use vLLM's plain sampler "
                             "(draft_free_sampler: plain)")
            self.specplugin_plain_steps = getattr(self, "specplugin_plain_steps", 0) + 1
            return logits_indices, None, 1
        return logits_indices, spec_decode_metadata, max_num_sampled_tokens

    return _prepare_inputs


def _enabled(runner) -> bool:
    """Decided once per runner (its drafter and config are fixed after start-up)."""
    enabled = getattr(runner, "_specplugin_draft_free_plain", None)
    if enabled is None:
        from vllm_specplugin.config import SpecPluginConfig

        config = SpecPluginConfig.from_additional_config(getattr(runner.vllm_config, "additional_config", None))
        enabled = config.draft_free_sampler == "plain" and _is_ours(runner)
        runner._specplugin_draft_free_plain = enabled
    return enabled


def install() -> bool:
    """Wrap the runner (idempotent); True when installed (vLLM 0.32.x only)."""
    if not version.is_tested_version():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplugin.patches import wrap_once

    wrap_once(GPUModelRunner, "_prepare_inputs", _plain_when_draft_free, mark="_specplugin_draft_free")
    return True
