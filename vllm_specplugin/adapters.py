"""Proposer classes that vLLM loads through ``speculative_config.method = "custom_class"``.

vLLM constructs ``Class(vllm_config)`` inside the worker and calls, at every step,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``.
Row i's context is ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` (this step's sampled tokens
included); an empty ``sampled_token_ids[i]`` means row i is not decoding this step.
"""

from __future__ import annotations

import numpy as np

from vllm_specplugin.config import SpecPluginConfig


class _CustomClassAdapter:
    """Shared start-up for the adapters: read k and the validated plugin config."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.config = SpecPluginConfig.from_additional_config(vllm_config.additional_config)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands over the target model here; these adapters do not need it."""

    def _room(self, num_tokens: int) -> int:
        """Draft tokens that still fit under max_model_len after a context of num_tokens."""
        return max(0, min(self.num_speculative_tokens, self.max_model_len - 1 - num_tokens))


class RepeatLastTokenProposer(_CustomClassAdapter):
    """Diagnostic proposer: drafts the last context token k times.

    Useless for speed, ideal as a probe: any verification bug that favours accepting drafts
    shows up as a raised rate of consecutive repeats, which plain sampling makes rare.
    """

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[row])
            room = self._room(num_tokens)
            if not sampled or room == 0:
                drafts.append([])
                continue
            drafts.append([int(token_ids_cpu[row, num_tokens - 1])] * room)
        return drafts
