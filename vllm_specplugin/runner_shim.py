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

If the shim cannot hand q over, the step's drafts are dropped (plain decoding). Verifying them as
one-hot would be exact too (accept x with probability p(x), else sample p without x: the output
is p for ANY x drawn independently of the verifier's random numbers), but it accepts less than
min(1, p/q) and would hide a broken hand-over; what the rule must never see is a q other than the
one x was drawn from (fault g). A request whose q is missing while others have theirs is
verified one-hot alone (``_one_hot_only_where_q_is_missing``).
"""

from __future__ import annotations

import logging
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


@dataclass(frozen=True)
class TargetStates:
    """The target's final hidden states (after its last RMSNorm: what vLLM hands its own EAGLE and
    Medusa proposers; for an EAGLE-3 head its aux layers' states, concatenated, [n_r, A * d], what vLLM
    hands its own EAGLE-3) at the positions it verified this step, per batch row.

    ``rows[r]`` is ``[n_r, d]`` (the target's dtype, on the runner's device), a view of vLLM's
    hidden-state buffer valid only during this ``propose`` call, for context positions
    ``starts[r] .. starts[r] + n_r - 1``: every token the step computed for a prefill (chunk), and
    for a decode step the row's input token and its accepted drafts (rejected drafts' states are
    left out). None: no states for the row this step."""

    starts: list[int]
    rows: list[object]


# GPUModelRunner.propose_draft_token_ids's parameters after self (compat.py checks them).
PROPOSE_PARAMETERS = ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                      "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
                      "common_attn_metadata", "slot_mappings")


def target_states(runner, args: tuple, kwargs: dict) -> TargetStates:
    """Slice this step's hidden states per batch row (see :class:`TargetStates`).

    vLLM lays the step's tokens out row after row: row r's scheduled tokens are
    ``hidden_states[query_start_loc[r]:query_start_loc[r + 1]]``, at positions from
    ``input_batch.num_computed_tokens_cpu[r]`` (set before the step, advanced at the next one). Of
    a row's ``n`` scheduled tokens ``num_draft`` are drafts; with ``s`` tokens sampled the first
    ``n - num_draft + s - 1`` positions hold verified tokens (``s - 1`` drafts were accepted); a
    row that sampled nothing (a prefill chunk before the prompt's last) verified all ``n``. A token
    tree's verified rows are its root and accepted path (``_specplugin_tree_paths``, set by
    tree_verification's walk this step), gathered in depth order."""
    import torch

    named = dict(zip(PROPOSE_PARAMETERS, args))
    named.update(kwargs)
    hidden = named["hidden_states"]
    if getattr(getattr(runner, "drafter", None), "aux_hidden_state_layers", ()):
        # An EAGLE-3 head reads the residual stream after its target layers, concatenated
        # ([T, A * d]), as vLLM's own EAGLE-3 proposer does (aux_hidden_states_for_the_head).
        aux = named["aux_hidden_states"]
        if not aux:
            raise RuntimeError("the EAGLE-3 head needs the target's aux hidden states and this step has none")
        hidden = torch.cat(list(aux), -1)
    sampled = named["sampled_token_ids"]
    metadata = named["spec_decode_metadata"]
    query_start = named["common_attn_metadata"].query_start_loc_cpu.tolist()
    batch = runner.input_batch
    num_rows = len(batch.req_ids)
    num_drafts = list(metadata.num_draft_tokens) if metadata is not None else [0] * num_rows
    # Tree verification (tree_verification.py) verified a path of the tree's rows, root first.
    tree_paths = getattr(runner, "_specplugin_tree_paths", None) or {}
    starts, rows = [], []
    for row in range(num_rows):
        begin, end = int(query_start[row]), int(query_start[row + 1])
        path = tree_paths.get(batch.req_ids[row])
        if path is not None:
            starts.append(int(batch.num_computed_tokens_cpu[row]))
            rows.append(hidden[torch.tensor(path, device=hidden.device) + begin])
            continue
        n = end - begin
        got = len(sampled[row]) if isinstance(sampled, list) else 0
        verified = n if got == 0 else n - int(num_drafts[row]) + got - 1
        starts.append(int(batch.num_computed_tokens_cpu[row]))
        rows.append(hidden[begin:begin + verified] if verified > 0 else None)
    return TargetStates(starts, rows)


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
    wrap_once(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs", aux_hidden_states_for_the_head)
    wrap_once(GPUModelRunner, "_get_spec_decode_draft_probs", _one_hot_only_where_q_is_missing)


def aux_hidden_states_for_the_head(original):
    """An EAGLE-3 head (``eagle_head``) reads the target's residual stream after some of its layers.
    vLLM turns these aux outputs on only for its own ``eagle3`` method; with ``custom_class`` the
    wrapped setup (called at the end of load_model, before compilation) turns them on for the layers
    the plugin's head names (``drafter.aux_hidden_state_layers``): the model then returns (hidden
    states, aux states) and the runner hands both to propose_draft_token_ids."""
    def setup(self):
        layers = tuple(getattr(getattr(self, "drafter", None), "aux_hidden_state_layers", ()) or ())
        if not layers or not _shim_enabled(self):
            return original(self)
        from vllm.model_executor.models.interfaces import supports_eagle3

        from vllm_specplugin.config import SpecPluginConfigError

        model = self.get_model()
        if not supports_eagle3(model):
            raise SpecPluginConfigError("eagle_head", f"the target ({type(model).__name__}) cannot hand an EAGLE-3 "
                                        "head the states of its layers (it does not implement vLLM's SupportsEagle3)")
        self.use_aux_hidden_state_outputs = True
        model.set_aux_hidden_state_layers(layers)
        logger.info("specplugin: the target hands its EAGLE-3 head the states after layers %s", list(layers))

    return setup


def _shimmed_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        draft_token_ids = shimmed(self, *args, **kwargs)
        from vllm_specplugin import tensor_parallel

        state = tensor_parallel.group_state(self)
        if state is not None and isinstance(draft_token_ids, list):
            # Tensor parallelism: every rank verifies rank 0's drafts against its own q, so all
            # ranks must hold the same drafts and q, or all drop them (tensor_parallel.py).
            draft_token_ids = tensor_parallel.agree(self, state, draft_token_ids)
        return draft_token_ids

    def shimmed(self, *args, **kwargs):
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
        carried = _carried_q(self, view)  # before the drafter reuses its q buffer
        drafter.set_batch_view(view)
        if hasattr(drafter, "set_target_states"):  # a heads drafter reads the target's hidden states
            try:
                states = target_states(self, args, kwargs)
            except Exception:
                failures = getattr(self, "_specplugin_state_failures", 0) + 1
                self._specplugin_state_failures = failures
                if failures <= 10 or failures % 1000 == 0:
                    logger.exception("specplugin: the target's hidden states cannot be read from this step (%d "
                                     "such steps so far); the heads drafter drafts nothing for it", failures)
                states = None
            drafter.set_target_states(states)
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
            draft_token_ids = [[] for _ in draft_token_ids]
            probs = None
        else:
            self._specplugin_handover_failures = 0
        _hand_over(self, probs, view, draft_token_ids, carried)
        return draft_token_ids

    return propose_draft_token_ids


def _log_counted(runner, counter: str, level: int, message: str, *args) -> None:
    """Count an event on the runner (attribute ``counter``) and log it, with the count as the last
    argument, the first 10 times and every 1000th after."""
    count = getattr(runner, counter, 0) + 1
    setattr(runner, counter, count)
    if count <= 10 or count % 1000 == 0:
        logger.log(level, message, *args, count)


def _carried_q(runner, view: BatchView) -> dict:
    """q of drafts that vLLM's scheduler still holds for requests outside this step's batch.

    Under load a running request can miss a step (the step's token budget ran out before the
    scheduler reached it, e.g. behind a long chunked prefill): it leaves the runner's batch, but
    the scheduler keeps the drafts it got earlier and schedules them when the request is back.
    ``_get_spec_decode_draft_probs`` then looks their q up by request id in the LAST hand-over,
    which lacks it, and vLLM verifies the WHOLE step's drafts as one-hot ("Missing cached draft
    probabilities ... legacy speculative rejection behavior"): not exact for sampled drafts, and
    the reason seeded outputs changed with the load. So the shim carries such q rows over
    (request id -> [k, V], cloned before the drafter reuses its buffer) until the request is back.
    """
    carried = getattr(runner, "_specplugin_carried_q", None) or {}
    in_batch = set(view.req_ids)
    carried = {rid: q for rid, q in carried.items() if rid not in in_batch and rid in view.live_request_ids}
    last = getattr(runner, "_specplugin_last_handover", None)
    if last is not None:
        probs, req_ids, lengths = last
        for row, (rid, n) in enumerate(zip(req_ids, lengths)):
            if n and rid not in in_batch and rid in view.live_request_ids and rid not in carried:
                carried[rid] = probs[row].clone()
                _log_counted(runner, "_specplugin_carried_count", logging.INFO,
                             "specplugin: request %s has drafts scheduled but is not in this step's batch; its q "
                             "is kept for when vLLM verifies them (%d such request-steps so far)", rid)
    runner._specplugin_carried_q = carried
    return carried


def _hand_over(runner, probs, view: BatchView, draft_token_ids, carried: dict) -> None:
    """Store this step's q (rows = the batch) and the carried rows where vLLM's sampler reads them."""
    req_ids = list(view.req_ids)
    runner._specplugin_last_handover = (
        None if probs is None else (probs, req_ids, [len(d) for d in draft_token_ids]))
    if carried:
        import torch

        extra_ids = list(carried)
        extra = torch.stack([carried[rid] for rid in extra_ids])  # [c, k, V]
        if probs is not None:
            extra = torch.cat([probs, extra.to(probs.device)])
            extra_ids = req_ids + extra_ids
        runner._draft_probs, runner._draft_prob_req_ids = extra, extra_ids
    elif probs is not None:
        runner._draft_probs, runner._draft_prob_req_ids = probs, req_ids
    else:
        runner._draft_probs = runner._draft_prob_req_ids = None


def _one_hot_only_where_q_is_missing(original):
    """When some request's drafts have no q in the hand-over, vLLM 0.32 verifies the WHOLE step as
    one-hot. Here only that request's drafts get a q of their own, and every other request keeps its
    own q, so its outcome does not depend on another request's misfortune:

    - a drafted token x gets a one-hot q: exact for any proposal drawn independently of the
      verifier's random numbers (accept x with probability p(x), else sample p without x);
    - a placeholder draft (-1) gets a zero q row. vLLM's scheduler makes these itself: a request
      admitted with ONE token to compute (a one-token prompt) in a step where running requests decode
      and none of them is a prefill chunk is padded to 1 + k tokens with k drafts of -1
      (``Scheduler.schedule``, "Pad new decode requests to uniform spec decoding size"). The
      rejection kernels reject a draft < 0 (vLLM-CPU's only once sampler_repair has repaired it;
      unrepaired, the step is left to vLLM as before) and sample the recovered token from
      max(p - q, 0), which a zero row makes p: the same as vLLM's own one-hot path for -1."""
    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        probs, ids = self._draft_probs, self._draft_prob_req_ids
        if probs is None or ids is None or not _shim_enabled(self):
            return original(self, spec_decode_metadata)
        row_of = {rid: i for i, rid in enumerate(ids)}
        drafted = [(rid, n) for rid, n in zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens) if n]
        if all(rid in row_of for rid, _ in drafted):
            return original(self, spec_decode_metadata)
        import torch

        tokens = spec_decode_metadata.draft_token_ids.to(probs.device)  # [total drafts], batch order
        rows, start = [], 0
        for rid, n in drafted:
            row = row_of.get(rid)
            if row is None:
                draft = tokens[start:start + n].long()
                placeholder = draft < 0  # vLLM's padding at admission (docstring): q = 0, always rejected
                if bool(placeholder.any()) and not _placeholders_rejected(self):
                    # vLLM-CPU's kernel unrepaired (cpu_sampler_repair off): a zero q would make it
                    # accept -1 far more often than vLLM's one-hot path does; leave the step to vLLM.
                    return original(self, spec_decode_metadata)
                q = torch.nn.functional.one_hot(draft.clamp(min=0), probs.shape[-1]).to(probs.dtype)
                rows.append(q * (~placeholder).unsqueeze(-1).to(probs.dtype))
                if bool(placeholder.all()):
                    _log_counted(self, "_specplugin_placeholder_rows", logging.INFO,
                                 "specplugin: request %s was admitted with %d placeholder draft(s) (-1) of vLLM's "
                                 "scheduler; they are rejected (zero q), the step's other drafts verified against "
                                 "their q (%d such request-steps so far)", rid, n)
                else:
                    _log_counted(self, "_specplugin_one_hot_rows", logging.WARNING,
                                 "specplugin: request %s has %d draft(s) scheduled without a q in the hand-over; "
                                 "they are verified as one-hot (exact), the step's other drafts against their q "
                                 "(%d such request-steps so far)", rid, n)
            else:
                rows.append(probs[row, :n])
            start += n
        return torch.cat(rows).contiguous()

    return _get_spec_decode_draft_probs


def _placeholders_rejected(runner) -> bool:
    """Whether the rejection kernel in use rejects -1 drafts (sampler_repair); asked once per runner."""
    safe = getattr(runner, "_specplugin_placeholders_rejected", None)
    if safe is None:
        from vllm_specplugin import sampler_repair

        try:
            safe = sampler_repair.placeholder_drafts_are_rejected()
        except Exception:  # noqa: BLE001 - cannot tell: keep vLLM's own path
            logger.exception("specplugin: cannot probe the rejection kernel with -1 drafts")
            safe = False
        runner._specplugin_placeholders_rejected = safe
    return safe


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
