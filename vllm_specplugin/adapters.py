"""Proposer classes that vLLM loads through ``speculative_config.method = "custom_class"``.

vLLM constructs ``Class(vllm_config)`` inside the worker and calls, at every step,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``.

The vLLM boundary, as vLLM 0.32's runner passes it (``GPUModelRunner.propose_draft_token_ids``):

- ``sampled_token_ids``: ``list[list[int]]``, one list per batch row (``len == num_reqs``); the
  tokens sampled for that row this step. Empty: the row is not decoding this step (a prefill
  chunk, or a request resumed without output) and gets no draft.
- ``num_tokens_no_spec``: numpy int32 ``[max_num_reqs]`` (only ``[:num_reqs]`` is meaningful).
- ``token_ids_cpu``: numpy int32 ``[max_num_reqs, max_model_len]``; row i's context is
  ``token_ids_cpu[i, :num_tokens_no_spec[i]]``, this step's sampled tokens included.
- Returned: ``list[list[int]]`` of ``num_reqs`` lists, each at most ``num_speculative_tokens``
  long (shorter or empty is allowed), token ids in ``[0, vocab)``.

With the runner shim, ``take_last_draft_probs()`` returns q (see :class:`MultiDraftProposer`).
"""

from __future__ import annotations

import numpy as np

from vllm_specplugin.config import SpecPluginConfig
from vllm_specplugin.logging_utils import get_logger
from vllm_specplugin.proposers.base import Proposer
from vllm_specplugin.proposers.sampling import draft_generator

logger = get_logger()


class CustomClassAdapter:
    """The base of the plugin's custom_class drafters (what the runner-side wrappers recognise as
    ours): shared start-up, k and the validated plugin config."""

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


class RepeatLastTokenProposer(CustomClassAdapter):
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


class MultiDraftProposer(CustomClassAdapter):
    """Draft models as a vLLM proposer: one draft, or an ensemble of 2–3 whose predictions are mixed.

    Configured from ``additional_config["specplugin"]``: ``drafts``, ``draft_weights``,
    ``draft_dtype``, ``draft_memory_budget_mb``, ``adapt_draft_weights``, and the strategies
    ``adaptive_gamma``, ``tree_drafting``, ``prefix_sharing``.

    With the runner shim (default) requests are keyed by id, sampled with their own
    temperature/top-k/top-p and verified against q, which :meth:`take_last_draft_probs` hands
    to the shim as a view ``[num_reqs, k, V]`` float32 on the runner's device (V: the target's
    vocabulary, ``model_config.get_vocab_size()``, the width of vLLM's logits) of one buffer
    ``[max_num_seqs, k, V]`` allocated at start-up: ``max_num_seqs × k × V × 4`` bytes (logged
    and exported as ``specplugin:draft_probs_buffer_bytes``). Row i holds the q of row i's
    draft at positions ``[:len(draft_i)]`` and zeros past them; vLLM reads only
    ``[row, :num_draft]`` (``GPUModelRunner._get_spec_decode_draft_probs``). One buffer is enough:
    vLLM consumes q at the next step's sampling, copying the rows it needs with ``torch.cat``,
    before it calls ``propose`` again (checked in ``vllm_specplugin/compat.py``).

    Without the shim requests are keyed by batch row and drafted greedily (verified as one-hot,
    which is exact); a row keeps its draft state only while its context continues the one it was
    drafted from (see :meth:`_row_key`).

    Faults never stop serving: a step whose drafting raises decodes without drafts (no token
    lost); after ``MAX_CONSECUTIVE_DRAFT_FAILURES`` failing steps in a row drafting is switched
    off with one error in the log and ``specplugin:drafting_disabled`` = 1. A draft whose q is
    not a probability distribution (NaN, inf, negative, not summing to 1) or whose tokens are
    out of range is dropped for its row and counted (``specplugin:nonfinite_draft_rows_total``).
    """

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        import torch

        from vllm_specplugin.config import SpecPluginConfigError
        from vllm_specplugin.metrics import MetricsPublisher

        if not self.config.drafts and not self.config.eagle_head and not self.config.medusa_heads:
            raise SpecPluginConfigError(
                "drafts", f"{type(self).__name__} needs 1 to 3 draft checkpoint directories (or eagle_head or "
                "medusa_heads), got none"
            )
        model_config = vllm_config.model_config
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.target_vocab_size = int(model_config.get_vocab_size())
        self._target_states = None
        self._draft_kernels = None
        if self.config.eagle_head or self.config.medusa_heads:
            from vllm_specplugin.draft_kernels import draft_kernels

            # A heads drafter runs in draft_dtype on the kernels draft_kernels chooses, as the
            # draft models do.
            dtype = self.config.draft_dtype
            kernels = self._draft_kernels = draft_kernels(self.config.draft_kernels, device, dtype)
            if self.config.eagle_head:
                from vllm_specplugin.proposers.eagle_head import EagleHeadProposer

                # The target's embedding and LM head come at load_model(); see there.
                proposer = self.head = EagleHeadProposer(self.config.eagle_head, device=device, kernels=kernels,
                                                         dtype=dtype)
            else:
                from vllm_specplugin.proposers.medusa_heads import MedusaHeadsProposer

                proposer = self.head = MedusaHeadsProposer(self.config.medusa_heads, device=device, kernels=kernels,
                                                           dtype=dtype)
            if self.config.tree_drafting is not None:
                proposer = _tree_proposer(self.head, self.config)
            runtimes, names, weights = [], [self.head.name], [1.0]
            self.gamma_policy, metrics = None, proposer.metrics
            # The head's chain, the suffix chain or nothing, per request and step (suffix_drafting).
            proposer, choice = _with_drafter_choice(proposer, self.config)
            _check_parallelism(vllm_config, None)
        else:
            self.head = None
            proposer, runtimes, names, weights, choice, metrics = self._build_drafts(vllm_config, model_config, device)
        if proposer.vocab_size > self.target_vocab_size:
            raise SpecPluginConfigError(
                ("eagle_head" if self.config.eagle_head else "medusa_heads" if self.head else "drafts"),
                f"the drafter's vocabulary ({proposer.vocab_size}) is larger "
                f"than the target's ({self.target_vocab_size})",
            )
        # From here on the adapter uses only the Proposer interface (propose, free,
        # tracked_request_ids, empty_draft, vocab_size), the metrics object and the runtimes'
        # eviction counters.
        self.proposer = proposer
        self.metrics = metrics
        self._runtimes = runtimes
        self.device = device
        self._batch_view = None
        self._last_probs = None
        self._generators: dict[str, object] = {}
        # Unseeded rows draw from this generator, reseeded every step from the engine seed and the
        # step count (the same on every TP rank), never from torch's default generator, which
        # vLLM's sampler draws from for unseeded requests (tensor_parallel.py says why).
        self._unseeded_generator = torch.Generator(device=device)
        self._unseeded_base = int(getattr(model_config, "seed", None) or 0)
        self._steps = 0
        self._warned_no_shim = False
        self._row_contexts: dict[int, list[int]] = {}  # shim off: the context each row-key drafted from
        # Tree verification (vllm_specplugin/tree_verification.py): request id -> (node tokens
        # [N - 1], parents [N]) of the trees drafted by the last propose(); read by the runner at
        # the next step, when vLLM schedules those nodes as the request's draft tokens.
        self.tree_plans: dict[str, tuple[list[int], list[int]]] = {}
        self.consecutive_failures = 0
        self.drafting_disabled = False
        # The q buffer handed to vLLM (shim on): allocated once, before vLLM profiles memory, so
        # that on CUDA its bytes come out of what --gpu-memory-utilization leaves for the KV cache.
        self._q_buffer = None
        self._q_rows_dirty = 0  # rows [:n] of the buffer may hold last step's q
        if self.config.runner_shim:
            max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
            self._q_buffer = torch.zeros(
                max_num_seqs, self.num_speculative_tokens, self.target_vocab_size, dtype=torch.float32, device=device
            )
        self.metrics.draft_probs_buffer_bytes = self.q_buffer_bytes
        label = ("eagle head" if self.config.eagle_head else "medusa heads" if self.head
                 else f"routed drafts ({self.config.draft_routing})" if self.config.draft_routing
                 else "ensemble" if len(runtimes) > 1 else "draft")
        self.publisher = MetricsPublisher(self.metrics, f"{label}[{', '.join(names)}]")
        if _tp_rank(vllm_config) > 0:
            self.publisher.path = None  # every TP rank drafts the same: /metrics counts rank 0's only
        logger.info(
            "specplugin %s proposer: drafts %s, weights %s, k=%d, %s, %s, prefix sharing %s, dtype %s, "
            "draft kernels %s, memory budget %d MiB, draft-probability buffer %s",
            label, list(self.config.drafts) or [self.config.eagle_head or self.config.medusa_heads],
            [round(w, 3) for w in weights],
            self.num_speculative_tokens,
            "fixed gamma" if self.gamma_policy is None else f"adaptive gamma {self.gamma_policy}",
            ("chain drafting" if self.config.tree_drafting is None else f"tree drafting {self.config.tree_drafting}")
            + ("" if choice is None else f", suffix drafting with drafter choice {self.config.suffix_drafting}"),
            "on" if self.config.prefix_sharing else "off",
            self.config.draft_dtype, "vLLM's CPU kernels (oneDNN products)" if self._draft_kernels else "torch's",
            self.config.draft_memory_budget_mb,
            "none (runner shim off)" if self._q_buffer is None else
            f"{list(self._q_buffer.shape)} float32 on {device} = {self.q_buffer_bytes / 2**20:.1f} MiB",
        )

    def _build_drafts(self, vllm_config, model_config, device):
        """The draft models and the strategies around them: (proposer, runtimes, names, weights, the
        drafter choice or None, metrics)."""
        from vllm_specplugin.proposers.draft_runtime import DraftRuntime
        from vllm_specplugin.proposers.ensemble import EnsembleProposer
        from vllm_specplugin.proposers.gamma import AdaptiveGamma
        from vllm_specplugin.draft_kernels import draft_kernels, draft_out_kernels

        # SPECPLUGIN_DRAFT_FAULT (robustness tests) wraps this class from above: install.install(),
        # at plugin load in every process, before the worker builds its proposer (faults.py).
        budget = self.config.draft_memory_budget_mb / len(self.config.drafts)
        kernels = self._draft_kernels = draft_kernels(self.config.draft_kernels, device, self.config.draft_dtype)
        runtimes = [
            DraftRuntime(
                path,
                target_vocab_size=self.target_vocab_size,
                target_name=str(model_config.model),
                target_path=str(getattr(model_config, "tokenizer", None) or model_config.model),  # vLLM's resolved tokenizer
                dtype=self.config.draft_dtype,
                device=str(device),
                memory_budget_mb=budget,
                prefix_sharing=self.config.prefix_sharing,
                prefix_block_size=self.config.prefix_block_size,
                kernels=kernels,
                out_kernels=draft_out_kernels(kernels),
                fast_path=self.config.draft_fast_path,
            )
            for path in self.config.drafts
        ]
        ensemble = EnsembleProposer(
            runtimes, self.config.draft_weights, adapt_weights=self.config.adapt_draft_weights,
            route=self.config.draft_routing == "prompt",
        )
        self.gamma_policy = self.config.gamma_policy()
        _check_parallelism(vllm_config, self.gamma_policy)
        proposer: Proposer = ensemble
        if self.config.tree_drafting is not None:
            proposer = _tree_proposer(ensemble, self.config)
        if self.gamma_policy is not None:
            proposer = AdaptiveGamma(proposer, self.gamma_policy)
        proposer, choice = _with_drafter_choice(proposer, self.config)
        return proposer, runtimes, ensemble.names, ensemble.weights.tolist(), choice, ensemble.metrics

    def load_model(self, target_model=None, *args, **kwargs) -> None:
        """vLLM hands over the target model: an EAGLE head shares its embedding and LM head (as vLLM's
        own EAGLE does); draft models do not need it."""
        if not hasattr(self.head, "attach_target"):  # no heads, or Medusa heads (their own LM head)
            return
        inner = getattr(target_model, "model", None)
        embed = getattr(getattr(inner, "embed_tokens", None), "weight", None)
        lm_head = getattr(getattr(target_model, "lm_head", None), "weight", None)
        if embed is None or lm_head is None:
            from vllm_specplugin.config import SpecPluginConfigError

            raise SpecPluginConfigError(
                "eagle_head", f"the target ({type(target_model).__name__}) has no model.embed_tokens.weight and "
                "lm_head.weight for the head to share (a Llama-style target is needed)")
        self.head.attach_target(embed, lm_head)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads (the runner shim turns their outputs on); ()."""
        return tuple(getattr(self.head, "aux_layers", ()) or ())

    def set_target_states(self, states) -> None:
        """The runner shim's :class:`~vllm_specplugin.runner_shim.TargetStates` for this step (or None)."""
        self._target_states = states

    @property
    def q_buffer_bytes(self) -> int:
        """Bytes of the preallocated q buffer: max_num_seqs × k × V × 4 (0 with the shim off)."""
        return 0 if self._q_buffer is None else self._q_buffer.numel() * self._q_buffer.element_size()

    # -- runner shim hooks -----------------------------------------------------------------

    def set_batch_view(self, view) -> None:
        self._batch_view = view

    def take_last_draft_probs(self):
        """q of the last :meth:`propose`, or None (no view given, nothing drafted, or drafting failed).

        A ``torch.Tensor`` ``[num_reqs, k, V]`` float32 on the runner's device: row i, position j
        is the distribution row i's j-th draft token was drawn from; positions at and past a
        row's draft length are zero (rows without a draft are all zero). It is a view of a
        buffer reused by the next :meth:`propose`, so it is valid until then; vLLM reads it at the
        next step's sampling, which comes first.
        """
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
        view, self._batch_view = self._batch_view, None
        self._last_probs = None
        self.tree_plans = {}  # last step's trees were verified (or dropped) before this call
        num_rows = len(sampled_token_ids)
        self._steps += 1
        self._unseeded_generator.manual_seed((self._unseeded_base * 0x9E3779B97F4A7C15 + self._steps * 0xBF58476D1CE4E5B9) % 2**63)
        if self.drafting_disabled:
            return [[] for _ in range(num_rows)]
        if view is None and not self._warned_no_shim:
            self._warned_no_shim = True
            logger.warning(
                "specplugin: runner shim inactive; drafting greedily per batch row and vLLM verifies "
                "the drafts as one-hot (exact, with lower acceptance at temperature > 0)."
            )
        step_ids: list[str] = []
        import torch

        try:
            # torch's default generator is vLLM's (unseeded sampling): drafting leaves it as it was.
            with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                output, probs = self._draft_step(view, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, step_ids)
        except Exception as exc:
            self._on_failure(exc, step_ids)
            return [[] for _ in range(num_rows)]
        self.consecutive_failures = 0
        self._last_probs = probs
        return output

    def _draft_step(self, view, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, step_ids: list[str]):
        """One step's drafting: (drafts per row, q view or None). ``step_ids`` collects the request
        ids handed to the proposer, so that a failure can drop exactly their state."""
        from vllm_specplugin.proposers.base import GREEDY, DraftRequest

        num_rows = len(sampled_token_ids)
        rows: list[int] = []
        requests: list[DraftRequest] = []
        states, self._target_states = self._target_states, None  # the runner shim's, for heads
        for row, num_tokens, room in self._drafting_rows(sampled_token_ids, num_tokens_no_spec):
            context = token_ids_cpu[row, :num_tokens].tolist()
            if view is None:
                rid = self._row_key(row, context)
                requests.append(DraftRequest(rid, context, room, GREEDY))
            else:
                rid = view.req_ids[row]
                tree_ok = bool(view.tree_ok[row]) if row < len(view.tree_ok) else False
                hidden, start = None, 0
                if states is not None:
                    hidden, start = states.rows[row], states.starts[row]
                requests.append(DraftRequest(rid, context, room, view.params[row], self._generator(rid, view.seeds[row]),
                                             tree_ok=tree_ok, seeded=view.seeds[row] is not None,
                                             hidden_states=hidden, hidden_start=start))
            step_ids.append(rid)
            rows.append(row)
        if states is not None and view is not None:
            # A head keeps the states of rows that verified tokens but draft nothing this step (a
            # prefill chunk before the prompt's last, no room left): its cache needs every position.
            drafting = set(rows)
            for row, hidden in enumerate(states.rows):
                if hidden is not None and row not in drafting:
                    rid = view.req_ids[row]
                    context = token_ids_cpu[row, : int(num_tokens_no_spec[row])].tolist()
                    requests.append(DraftRequest(rid, context, 0, view.params[row], hidden_states=hidden,
                                                 hidden_start=states.starts[row]))
                    step_ids.append(rid)
                    rows.append(row)
        drafts = self.proposer.propose(requests)
        if len(drafts) != len(requests):
            raise RuntimeError(f"the proposer returned {len(drafts)} drafts for {len(requests)} requests")
        output: list[list[int]] = [[] for _ in range(num_rows)]
        probs = None
        if view is None:
            valid = self._valid_drafts(drafts)
            for row, draft, ok in zip(rows, drafts, valid):
                if ok:
                    output[row] = list(draft.token_ids)
            self._drop_invalid(rows, requests, drafts, valid)
            self._forget_rows_beyond(num_rows)
        else:
            probs, valid = self._fill_q(num_rows, rows, drafts)
            for row, draft, ok in zip(rows, drafts, valid):
                if ok:
                    output[row] = list(draft.token_ids)
                    if draft.parents is not None and len(draft.parents) == len(draft.token_ids) + 1:
                        self.tree_plans[view.req_ids[row]] = (list(draft.token_ids), list(draft.parents))
            self._drop_invalid(rows, requests, drafts, valid)
            if not any(output):
                probs = None
            self._forget_finished(view.live_request_ids)
        self.metrics.draft_cache_evictions = sum(int(getattr(rt, "evictions", 0)) for rt in self._runtimes)
        return output, probs

    # -- q handed to vLLM ------------------------------------------------------------------

    def _fill_q(self, num_rows: int, rows: list[int], drafts):
        """Write each draft's q into the buffer's rows [:num_rows]; (that view, per draft: valid?)."""
        import torch

        k, vocab = self.num_speculative_tokens, self.target_vocab_size
        if self._q_buffer is None or num_rows > self._q_buffer.shape[0]:
            # vLLM never runs more than max_num_seqs rows; should it, grow rather than fail.
            logger.warning(
                "specplugin: %d batch rows exceed the draft-probability buffer (%s); reallocating",
                num_rows, None if self._q_buffer is None else self._q_buffer.shape[0],
            )
            self._q_buffer = torch.zeros(num_rows, k, vocab, dtype=torch.float32, device=self.device)
            self._q_rows_dirty = 0
            self.metrics.draft_probs_buffer_bytes = self.q_buffer_bytes
        buffer = self._q_buffer
        if self._q_rows_dirty:
            buffer[: self._q_rows_dirty].zero_()  # last step's q was consumed by vLLM's sampler
            self._q_rows_dirty = 0
        q = buffer[:num_rows]
        tokens = torch.zeros(num_rows, k, dtype=torch.long)
        positions = torch.zeros(num_rows, k, dtype=torch.bool)
        valid = [self._shape_ok(draft) for draft in drafts]
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            n = len(draft.token_ids)
            if n == 0 or not valid[i]:
                continue
            self._q_rows_dirty = max(self._q_rows_dirty, row + 1)
            q[row, :n, : draft.probs.shape[-1]].copy_(draft.probs)
            tokens[row, :n] = torch.tensor(draft.token_ids, dtype=torch.long)
            positions[row, :n] = True
        written = self._q_rows_dirty  # rows past it hold no draft: nothing to check there
        if written:
            bad_rows = _invalid_rows(q[:written], tokens[:written].to(q.device), positions[:written].to(q.device)).tolist()
            for i, row in enumerate(rows):
                if valid[i] and row < written and bad_rows[row]:
                    valid[i] = False
                    q[row].zero_()
        return q, valid

    def _shape_ok(self, draft) -> bool:
        """The draft's q is [len(tokens), V'] with V' <= V, and its tokens are in [0, V')."""
        n = len(draft.token_ids)
        if n == 0:
            return True
        probs = draft.probs
        return (
            n <= self.num_speculative_tokens
            and probs.ndim == 2 and probs.shape[0] == n and 0 < probs.shape[1] <= self.target_vocab_size
            and all(0 <= int(t) < probs.shape[1] for t in draft.token_ids)
        )

    def _valid_drafts(self, drafts) -> list[bool]:
        """Shim off: the same checks as :meth:`_fill_q`, on the drafts' own q (one pass)."""
        import torch

        valid = [self._shape_ok(draft) for draft in drafts]
        checked = [i for i, draft in enumerate(drafts) if valid[i] and draft.token_ids]
        if not checked:
            return valid
        k = max(len(drafts[i].token_ids) for i in checked)
        width = max(drafts[i].probs.shape[-1] for i in checked)
        device = drafts[checked[0]].probs.device
        q = torch.zeros(len(checked), k, width, dtype=torch.float32, device=device)
        tokens = torch.zeros(len(checked), k, dtype=torch.long)
        positions = torch.zeros(len(checked), k, dtype=torch.bool)
        for j, i in enumerate(checked):
            n = len(drafts[i].token_ids)
            q[j, :n, : drafts[i].probs.shape[-1]] = drafts[i].probs
            tokens[j, :n] = torch.tensor(drafts[i].token_ids, dtype=torch.long)
            positions[j, :n] = True
        for j, bad in enumerate(_invalid_rows(q, tokens.to(device), positions.to(device)).tolist()):
            if bad:
                valid[checked[j]] = False
        return valid

    def _drop_invalid(self, rows, requests, drafts, valid) -> None:
        """Count and log each dropped draft, and free its request's state (its draft KV may hold
        the same NaN; the next step starts it afresh)."""
        for row, request, draft, ok in zip(rows, requests, drafts, valid):
            if ok:
                continue
            self.metrics.nonfinite_draft_rows += 1
            count = self.metrics.nonfinite_draft_rows
            if count <= 10 or count % 100 == 0:
                logger.warning(
                    "specplugin: dropped the draft of request %s (batch row %d): its q is not a probability "
                    "distribution (NaN, inf, negative or not summing to 1) or a token is out of range; the row "
                    "decodes without a draft this step (%d such drafts so far, specplugin:nonfinite_draft_rows_total)",
                    request.request_id, row, count,
                )
            self._free_logged(request.request_id)

    # -- failures --------------------------------------------------------------------------

    def _on_failure(self, exc: BaseException, step_ids: list[str]) -> None:
        """This step drafts nothing (plain decoding, no token lost); the step's requests' draft
        state is dropped (it may be half-updated); repeated failures switch drafting off."""
        self.metrics.draft_failures += 1
        self.consecutive_failures += 1
        for request_id in step_ids:
            self._free_logged(request_id)
        if self.consecutive_failures >= MAX_CONSECUTIVE_DRAFT_FAILURES:
            self._disable(exc)
            return
        failures = self.metrics.draft_failures
        if failures <= 10 or failures % 100 == 0:  # the traceback the first time, one line after
            logger.warning(
                "specplugin: drafting failed (%d time(s) so far, %d in a row; drafting is switched off at %d "
                "in a row); this step decodes without drafts: %r",
                failures, self.consecutive_failures, MAX_CONSECUTIVE_DRAFT_FAILURES, exc,
                exc_info=(type(exc), exc, exc.__traceback__) if failures == 1 else None,
            )

    def _disable(self, exc: BaseException) -> None:
        self.drafting_disabled = True
        self.metrics.drafting_disabled = 1
        logger.error(
            "specplugin: drafting failed in %d consecutive steps; drafting is now DISABLED for this engine "
            "(specplugin:drafting_disabled = 1). The engine keeps serving with plain decoding; no token is "
            "lost. Restart the server to draft again. Last error:",
            self.consecutive_failures, exc_info=(type(exc), exc, exc.__traceback__),
        )
        try:
            tracked = set(self.proposer.tracked_request_ids())
        except Exception:
            logger.exception("specplugin: listing the draft state to free failed")
            tracked = set()
        for request_id in tracked:
            self._free_logged(request_id)
        self._generators.clear()
        self._row_contexts.clear()
        self._q_buffer = None  # hand the memory back to the allocator
        self._q_rows_dirty = 0
        self.metrics.draft_probs_buffer_bytes = 0
        self.metrics.tracked_requests = 0

    def _free_logged(self, request_id: str) -> None:
        """free() that never raises and never hides: an error is logged with its traceback."""
        try:
            self.proposer.free(request_id)
        except Exception:
            logger.exception("specplugin: freeing the draft state of request %s failed", request_id)

    # -- request identity ------------------------------------------------------------------

    def _generator(self, request_id: str, seed: int | None):
        """Seeded requests draft reproducibly from their own stream (vLLM's generator is left alone);
        unseeded ones from the proposer's per-step generator."""
        if seed is None:
            return self._unseeded_generator
        generator = self._generators.get(request_id)
        if generator is None:
            # Never vLLM's stream for any request seed (proposers/sampling.py: draft_generator).
            generator = self._generators[request_id] = draft_generator(seed, self.device)
        return generator

    def _row_key(self, row: int, context: list[int]) -> str:
        """Shim off: the state key of a batch row, which holds different requests over time.

        Without request ids, identity is inferred from the context: a row keeps its draft state
        only while its context continues the context it last drafted from (that context is a
        prefix, and one step adds 1 to k + 1 tokens). Otherwise another request has taken the
        row (vLLM condenses the batch as requests finish) and the row's state is freed before
        drafting, so no pending draft, acceptance metric, adaptive weight or γ is scored against
        another request's tokens. Two requests with identical token histories are
        indistinguishable; for them the state is the same either way, since drafting without
        the shim is greedy, a function of the context alone.
        """
        key = f"row-{row}"
        previous = self._row_contexts.get(row)
        if previous is not None and not (
            1 <= len(context) - len(previous) <= self.num_speculative_tokens + 1
            and context[: len(previous)] == previous
        ):
            self._free_logged(key)
        self._row_contexts[row] = context
        return key

    def _forget_rows_beyond(self, num_rows: int) -> None:
        """Shim off: rows past the batch hold nobody; any id-keyed state (a shim that went away)
        has no owner either."""
        for row in [r for r in self._row_contexts if r >= num_rows]:
            del self._row_contexts[row]
        for rid in self.proposer.tracked_request_ids():
            row = _row_of(rid)
            if row is None or row >= num_rows:
                self.proposer.free(rid)
        self._generators.clear()
        self.metrics.tracked_requests = len(self.proposer.tracked_request_ids())

    def _forget_finished(self, live: frozenset[str]) -> None:
        for rid in self.proposer.tracked_request_ids() - live:
            self.proposer.free(rid)
        for rid in set(self._generators) - live:
            del self._generators[rid]
        self._row_contexts.clear()
        self.metrics.tracked_requests = len(self.proposer.tracked_request_ids())


# Drafting steps failing in a row before drafting is switched off. A draft that fails on a
# fraction f of its steps at random hits this with probability f**8 per step (f = 0.3: once in
# 15,000 steps), so intermittent faults keep drafting between failures; a draft that always
# fails costs 8 wasted drafting attempts. (It was 3: a draft failing 20% of its steps was then
# switched off after 155 steps on average, about a second of serving.)
MAX_CONSECUTIVE_DRAFT_FAILURES = 8
Q_SUM_TOLERANCE = 1e-3  # |Σ q - 1| allowed in a q row handed to vLLM


def _with_drafter_choice(proposer, config: SpecPluginConfig):
    """``proposer`` wrapped in the drafter choice against the suffix drafter when
    ``suffix_drafting`` is set: (proposer, (suffix settings, choice policy) or None)."""
    choice = config.drafter_choice()
    if choice is None:
        return proposer, None
    from vllm_specplugin.proposers.choice import DrafterChoice
    from vllm_specplugin.proposers.suffix import SuffixDrafter

    suffix_settings, choice_policy = choice
    return DrafterChoice(proposer, SuffixDrafter(proposer.vocab_size, suffix_settings), choice_policy), choice


def _tree_proposer(drafter, config):
    """The TreeProposer over ``drafter`` (an EnsembleProposer or a heads drafter), wrapped in a
    MergedTreeProposer when tree_drafting.merge names zero-cost drafters."""
    from vllm_specplugin.proposers.tree import TreeProposer

    settings, merge, share, skip_model = config.tree_proposer_settings()
    proposer = TreeProposer(drafter, **settings)
    if not merge:
        return proposer
    from vllm_specplugin.proposers.merged_proposer import MergedTreeProposer
    from vllm_specplugin.proposers.ngram import NgramDrafter
    from vllm_specplugin.proposers.suffix import SuffixDrafter

    make = {"suffix": SuffixDrafter, "ngram": NgramDrafter}
    return MergedTreeProposer(proposer, [(name, make[name](proposer.vocab_size)) for name in merge], share,
                              skip_model=skip_model)


def _tp_rank(vllm_config) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if _tp_size(vllm_config) <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _tp_size(vllm_config) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1))


def _check_parallelism(vllm_config, gamma_policy) -> None:
    """Refuse what cannot keep the ranks' drafts equal (vllm_specplugin/tensor_parallel.py)."""
    from vllm_specplugin.config import SpecPluginConfigError

    parallel = getattr(vllm_config, "parallel_config", None)
    if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
        raise SpecPluginConfigError(
            "pipeline_parallel_size", "the plugin's draft proposers do not support pipeline parallelism (untested "
            "in vLLM 0.32: the stages that do not sample would draft from contexts they do not hold); use "
            "--tensor-parallel-size, or vLLM's own speculative methods")
    if (_tp_size(vllm_config) > 1 and gamma_policy is not None and gamma_policy.mode == "cost_model"
            and gamma_policy.cost_ratio is None):
        raise SpecPluginConfigError(
            "adaptive_gamma.cost_ratio", f"must be set with --tensor-parallel-size {_tp_size(vllm_config)}: "
            "a cost measured while serving differs between the ranks, which would then draft different gammas and "
            "verify different drafts (set cost_ratio, or use mode 'threshold')")


def _invalid_rows(q, tokens, positions):
    """Rows whose q is not a distribution the drafted token came from, at any drafted position.

    ``q`` [R, k, V'] float32, ``tokens`` [R, k] long (each < V'), ``positions`` [R, k] bool (the
    drafted positions). A position is valid when min q ≥ 0, |Σ q − 1| ≤ Q_SUM_TOLERANCE and
    q[token] > 0; NaN fails every comparison and ±inf fails the first or the second, so
    non-finite rows are caught too. Returns [R] bool, on q's device.
    """
    import torch

    ok = (q.amin(-1) >= 0) & ((q.sum(-1) - 1).abs() <= Q_SUM_TOLERANCE)
    ok &= q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0
    return (positions & ~ok).any(-1).to("cpu", torch.bool)


def _row_of(request_id: str) -> int | None:
    if request_id.startswith("row-") and request_id[4:].isdigit():
        return int(request_id[4:])
    return None
