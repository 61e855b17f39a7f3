"""Proposer classes that vLLM loads through ``speculative_config.method = "custom_class"``.

vLLM constructs ``Class(vllm_config)`` inside the worker and calls, at every step,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``.
Row i's context is ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` (this step's sampled tokens
included); an empty ``sampled_token_ids[i]`` means row i is not decoding this step.
"""

from __future__ import annotations

import numpy as np

from vllm_specplugin.config import SpecPluginConfig
from vllm_specplugin.logging_utils import get_logger

logger = get_logger()


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

    def _drafting_rows(self, sampled_token_ids, num_tokens_no_spec):
        """(row, context length, room) for each row that decodes this step and has room to draft."""
        for row, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[row])
            room = self._room(num_tokens)
            if sampled and room > 0:
                yield row, num_tokens, room


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
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for row, num_tokens, room in self._drafting_rows(sampled_token_ids, num_tokens_no_spec):
            drafts[row] = [int(token_ids_cpu[row, num_tokens - 1])] * room
        return drafts


class MultiDraftProposer(_CustomClassAdapter):
    """Draft models as a vLLM proposer: one draft, or an ensemble of 2–3 whose predictions are mixed.

    Configured from ``additional_config["specplugin"]``: ``drafts``, ``draft_weights``,
    ``draft_dtype``, ``draft_memory_budget_mb``, ``adapt_draft_weights``, and the strategies
    ``adaptive_gamma``, ``tree_drafting``, ``prefix_sharing``. With the runner shim
    (default) requests are keyed by id, sampled with their own temperature/top-k/top-p and
    verified against q; without it they are keyed by batch row and drafted greedily (one-hot).
    """

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        import torch

        from vllm_specplugin.proposers.draft_runtime import DraftRuntime
        from vllm_specplugin.proposers.ensemble import EnsembleProposer
        from vllm_specplugin.proposers.gamma import AdaptiveGamma
        from vllm_specplugin.proposers.tree import TreeProposer
        from vllm_specplugin.config import SpecPluginConfigError
        from vllm_specplugin.metrics import MetricsPublisher

        if not self.config.drafts:
            raise SpecPluginConfigError(
                "drafts", f"{type(self).__name__} needs 1 to 3 draft checkpoint directories, got none"
            )
        model_config = vllm_config.model_config
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        budget = self.config.draft_memory_budget_mb / len(self.config.drafts)
        runtimes = [
            DraftRuntime(
                path,
                target_vocab_size=model_config.get_vocab_size(),
                target_name=str(model_config.model),
                dtype=self.config.draft_dtype,
                device=str(device),
                memory_budget_mb=budget,
                prefix_sharing=self.config.prefix_sharing,
                prefix_block_size=self.config.prefix_block_size,
            )
            for path in self.config.drafts
        ]
        self.ensemble = EnsembleProposer(
            runtimes, self.config.draft_weights, adapt_weights=self.config.adapt_draft_weights
        )
        self.gamma_policy = self.config.gamma_policy()
        self.proposer = self.ensemble
        if self.config.tree_drafting is not None:
            self.proposer = TreeProposer(self.ensemble, **self.config.tree_drafting)
        if self.gamma_policy is not None:
            self.proposer = AdaptiveGamma(self.proposer, self.gamma_policy)
        self.device = device
        self._batch_view = None
        self._last_probs = None
        self._generators: dict[str, object] = {}
        self._warned_no_shim = False
        self.draft_failures = 0
        label = "ensemble" if len(runtimes) > 1 else "draft"
        self.publisher = MetricsPublisher(self.ensemble.metrics, f"{label}[{', '.join(self.ensemble.names)}]")
        logger.info(
            "specplugin %s proposer: drafts %s, weights %s, k=%d, %s, %s, prefix sharing %s, dtype %s, "
            "memory budget %d MiB",
            label, list(self.config.drafts), [round(w, 3) for w in self.ensemble.weights.tolist()],
            self.num_speculative_tokens,
            "fixed gamma" if self.gamma_policy is None else f"adaptive gamma {self.gamma_policy}",
            "chain drafting" if self.config.tree_drafting is None else f"tree drafting {self.config.tree_drafting}",
            "on" if self.config.prefix_sharing else "off",
            self.config.draft_dtype, self.config.draft_memory_budget_mb,
        )

    # -- runner shim hooks -----------------------------------------------------------------

    def set_batch_view(self, view) -> None:
        self._batch_view = view

    def take_last_draft_probs(self):
        probs, self._last_probs = self._last_probs, None
        return probs

    # -- vLLM's call -----------------------------------------------------------------------

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        import torch

        from vllm_specplugin.proposers.base import GREEDY, DraftRequest

        view, self._batch_view = self._batch_view, None
        self._last_probs = None
        if view is None and not self._warned_no_shim:
            self._warned_no_shim = True
            logger.warning(
                "specplugin: runner shim inactive; drafting greedily per batch row and vLLM verifies "
                "the drafts as one-hot (exact, with lower acceptance at temperature > 0)."
            )
        rows: list[int] = []
        requests: list[DraftRequest] = []
        for row, num_tokens, room in self._drafting_rows(sampled_token_ids, num_tokens_no_spec):
            context = token_ids_cpu[row, :num_tokens].tolist()
            if view is None:
                requests.append(DraftRequest(f"row-{row}", context, room, GREEDY))
            else:
                rid = view.req_ids[row]
                requests.append(DraftRequest(rid, context, room, view.params[row], self._generator(rid, view.seeds[row])))
            rows.append(row)
        drafts = self._propose_or_fall_back(requests)
        output: list[list[int]] = [[] for _ in sampled_token_ids]
        for row, draft in zip(rows, drafts):
            output[row] = draft.token_ids
        if view is not None:
            probs = torch.zeros(
                len(sampled_token_ids), self.num_speculative_tokens, self.proposer.vocab_size,
                dtype=torch.float32, device=self.device,
            )
            for row, draft in zip(rows, drafts):
                if draft.token_ids:
                    probs[row, : len(draft.token_ids)] = draft.probs
            self._last_probs = probs
            self._forget_finished(view.live_request_ids)
        return output

    def _propose_or_fall_back(self, requests):
        """Drafting must never take the engine down: on an error this step drafts nothing (plain
        decoding, no token lost), the affected requests' draft state is dropped, and the log says so."""
        try:
            return self.proposer.propose(requests)
        except Exception:
            self.draft_failures += 1
            if self.draft_failures == 1 or self.draft_failures % 100 == 0:
                logger.exception(
                    "specplugin: drafting failed (%d time(s) so far); this step decodes without drafts",
                    self.draft_failures,
                )
            for request in requests:
                try:
                    self.proposer.free(request.request_id)
                except Exception:
                    pass
            return [self.proposer.empty_draft() for _ in requests]

    def _generator(self, request_id: str, seed: int | None):
        """Seeded requests draft reproducibly from their own stream (vLLM's generator is left alone)."""
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            import torch

            generator = torch.Generator(device=self.device).manual_seed((seed * 0x9E3779B1 + 1) % 2**63)
            self._generators[request_id] = generator
        return generator

    def _forget_finished(self, live: frozenset[str]) -> None:
        for rid in self.proposer.tracked_request_ids() - live:
            self.proposer.free(rid)
        for rid in set(self._generators) - live:
            del self._generators[rid]
        self.ensemble.metrics.tracked_requests = len(self.proposer.tracked_request_ids())
