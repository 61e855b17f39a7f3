"""The runner shim: what vLLM 0.32's custom_class path does not give a proposer, and back.

vLLM calls a custom_class proposer with batch rows only, and never asks it for draft
probabilities (only its draft-model branch reads ``take_last_draft_probs()``), so verification
treats every draft as one-hot. The shim wraps ``GPUModelRunner.propose_draft_token_ids``:
before the call it hands the proposer a :class:`BatchView` (request ids, sampling settings,
seeds, live requests); after it, it stores the proposer's q where the rejection sampler reads
draft probabilities (``_draft_probs`` / ``_draft_prob_req_ids``). With the shim off, a proposer
gets no BatchView and must draft deterministically (one-hot verification is then exact).

The boundary, both ways (vLLM 0.32, ``gpu_model_runner.py`` / ``gpu_input_batch.py``):

- read: ``input_batch.req_ids`` (``list[str]``, row -> request id, ``num_reqs`` long);
  ``input_batch.temperature_cpu`` / ``top_p_cpu`` (numpy float32) and ``top_k_cpu`` (numpy
  int32) indexed by row; a greedy request has temperature 0.0, and top-k off is stored as the
  vocabulary size, top-p off as 1.0; ``input_batch.generators`` (``dict[int, torch.Generator]``,
  row -> the generator of a seeded request; ``initial_seed()`` is the request's seed);
  ``runner.requests`` (``dict[str, CachedRequestState]``, every live request).
- written: ``runner._draft_probs`` = the drafter's ``take_last_draft_probs()``, a
  ``torch.Tensor`` ``[num_reqs, k, V]`` float32 on the runner's device, and
  ``runner._draft_prob_req_ids`` = the ``req_ids`` its rows belong to. At the next step
  ``_get_spec_decode_draft_probs`` takes ``_draft_probs[row, :num_draft]`` for each request
  with drafts, by request id, and concatenates them (``[total drafts, V]``) for the rejection
  sampler, which needs V = the width of the target's logits.

If the shim cannot hand q over, the step's drafts are dropped (plain decoding) rather than
verified as one-hot: drafts sampled at T > 0 are only exact against the q they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_specplugin.config import SpecPluginConfig
from vllm_specplugin.logging_utils import get_logger
from vllm_specplugin.proposers.sampling import SamplingParams

logger = get_logger()

MAX_CONSECUTIVE_HANDOVER_FAILURES = 3  # failed hand-overs of q in a row before the shim switches off


@dataclass(frozen=True)
class BatchView:
    req_ids: list[str]  # row -> request id
    params: list[SamplingParams]  # row -> the request's temperature, top-k, top-p
    seeds: list[int | None]  # row -> the request's seed (None: unseeded)
    live_request_ids: frozenset[str]  # every request the runner still holds (finished ones are gone)
    # row -> the request may be drafted as a token tree (tree verification on and the request
    # needs no chain-only feature); empty: no row may (vllm_specplugin/tree_verification.py).
    tree_ok: tuple[bool, ...] = ()


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
    from vllm_specplugin import tree_verification

    return BatchView(req_ids, params, seeds, frozenset(runner.requests), tree_verification.tree_rows(runner, req_ids))


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
        if not (_shim_enabled(self) and hasattr(drafter, "set_batch_view")):
            return original(self, *args, **kwargs)
        try:
            view = batch_view(self)
        except Exception:
            # vLLM's batch is not what the shim reads (compat.py should have said so): go on
            # without the shim, whose drafts are greedy and exact as one-hot.
            logger.exception("specplugin: runner shim cannot read the input batch; switching the shim off")
            self._specplugin_shim_enabled = False
            return original(self, *args, **kwargs)
        drafter.set_batch_view(view)
        draft_token_ids = original(self, *args, **kwargs)
        try:
            probs = drafter.take_last_draft_probs()
            _check_probs(probs, draft_token_ids, len(view.req_ids))
        except Exception:
            failures = getattr(self, "_specplugin_handover_failures", 0) + 1
            self._specplugin_handover_failures = failures
            logger.exception("specplugin: the drafter's q cannot be handed to vLLM (%d time(s) in a row); this "
                             "step decodes without drafts", failures)
            if failures >= MAX_CONSECUTIVE_HANDOVER_FAILURES:
                logger.error("specplugin: switching the runner shim OFF after %d failed hand-overs in a row: drafts "
                             "are greedy from now on, verified as one-hot (exact)", failures)
                self._specplugin_shim_enabled = False
            self._draft_probs = None
            self._draft_prob_req_ids = None
            return [[] for _ in draft_token_ids]
        self._specplugin_handover_failures = 0
        if probs is not None:
            self._draft_probs = probs
            self._draft_prob_req_ids = list(view.req_ids)
        return draft_token_ids

    return propose_draft_token_ids


def _check_probs(probs, draft_token_ids, num_reqs: int) -> None:
    """q must cover every draft: [num_reqs, >= longest draft, V] float32 (no device sync)."""
    import torch

    drafted = max((len(d) for d in draft_token_ids), default=0)
    if probs is None:
        if drafted:
            raise ValueError("drafts without q")
        return
    if not (
        isinstance(probs, torch.Tensor) and probs.dtype == torch.float32 and probs.ndim == 3
        and probs.shape[0] == num_reqs and probs.shape[1] >= drafted and len(draft_token_ids) == num_reqs
    ):
        raise ValueError(
            f"q of shape {tuple(getattr(probs, 'shape', ()))} and dtype {getattr(probs, 'dtype', None)} "
            f"for {len(draft_token_ids)} draft rows of at most {drafted} tokens and {num_reqs} requests; "
            "expected [num_reqs, >= longest draft, V] float32"
        )
