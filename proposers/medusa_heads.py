"""Medusa heads as the plugin's drafter: chains, or trees grown by TreeProposer, each token drawn
from its head's processed distribution, with that q for verification.

vLLM 0.32's own ``medusa`` method drafts each head's argmax and verifies it as one-hot; here the heads'
distributions go through the request's temperature / top-k / top-p and the drafts are sampled from
them (the argmax at T = 0), verified with min(1, p/q); with ``tree_drafting`` the heads' candidates
form a token tree (Medusa's tree attention), verified whole by the plugin's tree verification.

Engine-agnostic. A Medusa head reads one thing: the target's final normed hidden state h at the
newest verified position (the position whose output is the newest token, len(context) - 2). Head
j (0-based) maps it to the distribution of the token j + 1 places after the newest one:
``x = h; x = x + silu(W x + b)`` per layer, logits = ``lm_head(x)``; so the distribution at depth j
of a tree does not depend on the drafted tokens above it (the heads never see them), which is
exactly Medusa's proposal, and as valid a q as any: verification needs only the distribution each
token was drawn from.

The checkpoint is the one vLLM loads for ``method: "medusa"`` (written by models/heads.py):
``config.json`` (num_heads, num_hidden_layers, hidden_size, vocab_size, original_lm_head) and
``blocks.{j}.layers.{l}.{weight,bias}`` plus ``lm_head.weight`` (one LM head shared by the heads).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.eagle_head import HeadCheckpointError
from vllm_specplugin.proposers.lean_llama import TORCH_KERNELS, LeanKernels
from vllm_specplugin.proposers.metrics import DraftMetrics, accepted_count
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample


class MedusaHeadsProposer(Proposer):
    """Drafts from Medusa heads (see the module docstring)."""

    def __init__(self, checkpoint: str | Path, device: str | torch.device = "cpu", name: str | None = None,
                 kernels: LeanKernels | None = None, dtype: torch.dtype | str = torch.float32):
        from safetensors.torch import load_file

        path = Path(checkpoint)
        self.device = torch.device(device)
        # The dtype the heads compute in (their checkpoint is bfloat16; the distributions are
        # softmaxed in float32 either way) and the products' kernels: torch's by default, vLLM's
        # prepacked oneDNN products from the vLLM adapter (vllm_specplugin/draft_kernels.py), as for
        # an EAGLE head. A step at batch 1 is memory-bound: the shared LM head (V x d) is most of it.
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"MedusaHeadsProposer dtype must be float32, bfloat16 or float16, got {self.dtype}")
        for needed in ("config.json", "model.safetensors"):
            if not (path / needed).is_file():
                raise HeadCheckpointError(f"Medusa heads checkpoint {path}: {needed} is missing")
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") != "medusa":
            raise HeadCheckpointError(f"{path} is model_type={cfg.get('model_type')!r}, not a Medusa checkpoint")
        if not cfg.get("original_lm_head", False):
            raise HeadCheckpointError(f"Medusa heads {path}: one LM head per head (original_lm_head false) is "
                                      "not supported")
        tensors = load_file(str(path / "model.safetensors"))
        self.num_heads, layers = int(cfg["num_heads"]), int(cfg["num_hidden_layers"])
        try:
            blocks = [[(tensors[f"blocks.{j}.layers.{l}.weight"].to(self.device, self.dtype),
                        tensors[f"blocks.{j}.layers.{l}.bias"].to(self.device, self.dtype))
                       for l in range(layers)] for j in range(self.num_heads)]
            lm_head = tensors["lm_head.weight"].to(self.device, self.dtype)  # [V, d]
        except KeyError as exc:
            raise HeadCheckpointError(f"Medusa heads {path}: weight {exc} is missing") from None
        self.kernels = kernels or TORCH_KERNELS
        linear = self.kernels.linear
        self._blocks = [[(linear(weight), bias) for weight, bias in block] for block in blocks]  # per head, per layer
        self._lm = linear(lm_head)
        self.lm_head = lm_head
        self.hidden_size = int(cfg["hidden_size"])
        self.vocab_size = int(self.lm_head.shape[0])
        self.name = name or path.name
        self.metrics = DraftMetrics([self.name])
        self._state: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (position, h [d])
        # request id -> this step's T = 1 distributions of heads 0..k-1, [k, V] float32 (k grows on demand)
        self._dists: dict[str, torch.Tensor] = {}
        self._depth: dict[str, int] = {}  # request id -> the heads this step will read (from room())
        self._pending: dict[str, tuple[int, list[int]]] = {}
        self._last_call: tuple[float, set[str]] | None = None

    # -- the Proposer interface --------------------------------------------------------------

    def free(self, request_id: str) -> None:
        for table in (self._state, self._dists, self._pending, self._depth):
            table.pop(request_id, None)

    def tracked_request_ids(self) -> set[str]:
        return set(self._state) | set(self._pending)

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        self.time_step(started, requests)
        self.prepare(requests)
        drafts = [self.empty_draft() for _ in requests]
        active = []
        for index, request in enumerate(requests):
            self._observe(request)
            gamma = self.room(request.request_id, len(request.context), request.gamma)
            if gamma == 0 and request.gamma > 0:
                self.metrics.fallback_requests += 1  # no state for the newest verified position
            if gamma > 0:
                active.append((index, request, gamma))
        self.draw_chains(active, drafts)
        for index, request, _ in active:
            self._pending[request.request_id] = (len(request.context), list(drafts[index].token_ids))
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.metrics.tracked_requests = len(self._state)
        return drafts

    # -- the drafter interface TreeProposer grows trees with (as EnsembleProposer's) ---------

    def prepare(self, requests: Sequence[DraftRequest]) -> None:
        """Keep each request's newest hidden state; forget last step's distributions."""
        for request in requests:
            self._dists.pop(request.request_id, None)
            hidden = request.hidden_states
            if hidden is None or hidden.shape[0] == 0:
                continue
            if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size:
                raise ValueError(f"request {request.request_id}: hidden states {tuple(hidden.shape)}, expected "
                                 f"[n, {self.hidden_size}] (the target's final normed hidden states)")
            newest = int(request.hidden_start) + int(hidden.shape[0]) - 1
            self._state[request.request_id] = (newest, hidden[-1].to(self.device, torch.float32))

    def room(self, request_id: str, context_length: int, gamma: int) -> int:
        """Up to the number of heads, when the request has the state of its newest verified position."""
        state = self._state.get(request_id)
        room = min(gamma, self.num_heads) if state is not None and state[0] == context_length - 2 else 0
        self._depth[request_id] = room  # the heads to compute in one pass (one read of the LM head)
        return room

    def root_distributions(self, request_ids: Sequence[str], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Head 0's unprocessed (T = 1) distribution per request: [len(ids), V] float32."""
        self._compute(request_ids, 1)
        return torch.stack([self._distributions(rid, 1)[0] for rid in request_ids])

    def branch_distributions_of(self, items) -> list[torch.Tensor]:
        """Per (request id, context, paths): the distribution after each path, head len(path)'s:
        [len(paths), V] float32 (a path as deep as the heads has none: TreeProposer's depth is capped
        by :meth:`room`)."""
        return [torch.stack([self._distributions(rid, len(path) + 1)[len(path)] for path in paths])
                for rid, _, paths in items]

    def draw_chains(self, active, drafts: list[Draft], row_params: list[SamplingParams] | None = None) -> None:
        """Chains: token j drawn from head j's distribution processed with the request's parameters
        (``row_params`` instead for the rows, as EnsembleProposer.draw_chains), the argmax for a
        greedy request; written to ``drafts[index]`` for each (index, request, gamma) of ``active``."""
        self._compute([request.request_id for _, request, _ in active], 1)
        for i, (index, request, gamma) in enumerate(active):
            dists = self._distributions(request.request_id, gamma)  # [gamma, V]
            q = processed_probs(dists.log(), row_params[i] if row_params else request.params)
            if request.params.greedy:
                tokens = q.argmax(-1).tolist()
            else:
                tokens = [int(sample(q[j], request.generator)) for j in range(gamma)]
            drafts[index] = Draft(tokens, q)

    def time_step(self, now: float, requests: Sequence[DraftRequest]) -> None:
        self._last_call = self.metrics.time_step(self._last_call, now, {request.request_id for request in requests})

    def sync_cost_counters(self) -> None:
        """Nothing to gather."""

    # -- the heads ---------------------------------------------------------------------------

    def _distributions(self, request_id: str, heads: int | None = None) -> torch.Tensor:
        """The T = 1 distributions of heads 0..heads-1 (default: every head) from the request's newest
        state: [heads, V] float32, computed on first need."""
        heads = self.num_heads if heads is None else heads
        self._compute([request_id], heads)
        return self._dists[request_id][:heads]

    def _compute(self, request_ids: Sequence[str], heads: int) -> None:
        """Compute, for the requests that lack them, their heads' distributions up to at least
        ``heads`` and up to the depth room() granted this step, all requests and heads in one pass
        per product: each head's residual blocks over the stacked states [R, d], then one LM head
        product over [R * k, d] (the weights are read once per step, not once per request or head)."""
        need = [rid for rid in request_ids
                if rid not in self._dists or self._dists[rid].shape[0] < min(heads, self.num_heads)]
        if not need:
            return
        k = min(self.num_heads, max(max(heads, self._depth.get(rid, 0)) for rid in need))
        h = torch.stack([self._state[rid][1] for rid in need]).to(self.dtype)  # [R, d]
        outs = []
        for block in self._blocks[:k]:
            x = h
            for linear, bias in block:
                x = x + F.silu(linear(x) + bias)
            outs.append(x)
        stacked = torch.stack(outs, 1).reshape(len(need) * k, -1).contiguous()  # [R * k, d], request-major
        dists = self._lm(stacked).float().softmax(-1).view(len(need), k, -1)
        for i, rid in enumerate(need):
            self._dists[rid] = dists[i]

    def _observe(self, request: DraftRequest) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or len(request.context) <= pending[0]:
            return
        emitted = list(request.context[pending[0]:])
        self.metrics.record_outcome(len(pending[1]), accepted_count(pending[1], emitted))
