"""An EAGLE-1 head as the plugin's drafter: chains sampled from the head's processed distribution,
with the q each token was drawn from (probabilistic acceptance, min(1, p/q)).

vLLM 0.32's own ``eagle`` method drafts greedily, so at temperature > 0 its drafts are verified as
one-hot (accepted with probability p(x)); here the head's distribution goes through the request's
temperature / top-k / top-p and the draft is *sampled* from it, which accepts min(1, p/q) >= p(x).

Engine-agnostic: the head needs, besides the context's tokens, the target's hidden states (after
its final RMSNorm) at the positions the target just verified, handed over in
``DraftRequest.hidden_states`` / ``hidden_start`` (the vLLM runner shim fills them,
vllm_specplugin/runner_shim.py; from HF transformers, ``output_hidden_states=True``'s last entry).

The head (the checkpoint vLLM loads for ``method: "eagle"``; written by models/eagle.py):

* entry at position i: x_i = fc(cat(embed(t_{i+1}), f_i)), fc [d, 2d] without bias, f_i the
  target's normed hidden state at i, embed and LM head the target's (shared, frozen);
* one Llama decoder layer without input norm: causal attention over the entries (RoPE at i),
  g_i = r + mlp(rmsnorm(r)), r = x_i + o_proj(attention); no final norm;
* draft logits = lm_head(g_i) for token i + 2; the next draft step's entry is
  (drafted token, g_i) at position i + 1.

Per request the head keeps the keys and values of its entries (its one-layer KV cache) for the
positions whose target hidden states it has seen. An entry depends only on (token, feature,
position), so the cache follows verification by position: rows handed over for positions >= s
replace whatever the cache held from s on (rejected drafts never got entries: only verified
positions' states are handed over). A request can draft only when it has the entry of its last
verified position (the position before its newest token); otherwise it gets no draft that step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer
from vllm_specplugin.proposers.lean_llama import ROPE_TABLE_POSITIONS, TORCH_KERNELS, LeanKernels
from vllm_specplugin.proposers.metrics import DraftMetrics, accepted_count
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample

WEIGHT_NAMES = ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                "layers.0.post_attention_layernorm.weight", "layers.0.mlp.gate_proj.weight",
                "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight")


# EAGLE-3 (vLLM's Eagle3LlamaForCausalLM; models/eagle.py --method eagle3) adds these, and its
# config names the target layers it reads (eagle_config.eagle_aux_hidden_state_layer_ids).
EAGLE3_WEIGHT_NAMES = ("layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight",
                       "lm_head.weight")


class HeadCheckpointError(ValueError):
    """A head checkpoint this drafter cannot serve (missing file, weight or unsupported setting)."""


@dataclass
class EagleWeights:
    """The head's own weights (in the dtype asked for; float32 by default) and geometry, read from a
    vLLM EAGLE-1 or EAGLE-3 checkpoint (EAGLE-3: ``aux_layers`` non-empty and the four weights more)."""

    fc: torch.Tensor  # [d, 2d]; EAGLE-3 [d, A * d], A = len(aux_layers)
    q: torch.Tensor  # [H * hd, d]; EAGLE-3 [H * hd, 2d]
    k: torch.Tensor  # [Hkv * hd, d]; EAGLE-3 [Hkv * hd, 2d]
    v: torch.Tensor  # [Hkv * hd, d]; EAGLE-3 [Hkv * hd, 2d]
    o: torch.Tensor  # [d, H * hd]
    norm: torch.Tensor  # [d]
    gate: torch.Tensor  # [I, d]
    up: torch.Tensor  # [I, d]
    down: torch.Tensor  # [d, I]
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    rope_theta: float
    vocab_size: int
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose residual stream fc reads
    input_norm: torch.Tensor | None = None  # EAGLE-3 [d]: the embedding's RMSNorm
    hidden_norm: torch.Tensor | None = None  # EAGLE-3 [d]: the hidden state's RMSNorm
    final_norm: torch.Tensor | None = None  # EAGLE-3 [d]: before its own LM head
    lm_head: torch.Tensor | None = None  # EAGLE-3 [V, d]: its own

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> EagleWeights:
        from safetensors.torch import load_file

        path = Path(path)
        config_file, weights_file = path / "config.json", path / "model.safetensors"
        for needed in (config_file, weights_file):
            if not needed.is_file():
                raise HeadCheckpointError(f"EAGLE head checkpoint {path}: {needed.name} is missing")
        cfg = json.loads(config_file.read_text())
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise HeadCheckpointError(f"EAGLE head {path}: rope type {rope.get('rope_type')!r} is not supported "
                                      "(default RoPE only)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise HeadCheckpointError(f"EAGLE head {path}: attention / MLP biases are not supported")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise HeadCheckpointError(f"EAGLE head {path}: {cfg.get('num_hidden_layers')} layers; an EAGLE head has 1")
        eagle_config = cfg.get("eagle_config") or {}
        aux_layers = tuple(int(a) for a in eagle_config.get("eagle_aux_hidden_state_layer_ids") or ())
        if eagle_config and not aux_layers:
            raise HeadCheckpointError(f"EAGLE head {path}: an EAGLE-3 config without "
                                      "eagle_aux_hidden_state_layer_ids (the target layers it reads) is not supported")
        for key in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
            if eagle_config.get(key, cfg.get(key)):
                raise HeadCheckpointError(f"EAGLE head {path}: {key} is not supported (vLLM's default EAGLE-3 layout only)")
        if int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) != int(cfg["vocab_size"]):
            raise HeadCheckpointError(f"EAGLE head {path}: a reduced draft vocabulary (d2t) is not supported")
        names = WEIGHT_NAMES + (EAGLE3_WEIGHT_NAMES if aux_layers else ())
        tensors = load_file(str(weights_file))
        missing = [name for name in names if name not in tensors]
        if missing:
            kind = "EAGLE-3 checkpoint as vLLM's Eagle3LlamaForCausalLM" if aux_layers else \
                "EAGLE-1 checkpoint as vLLM's EagleLlamaForCausalLM"
            raise HeadCheckpointError(f"EAGLE head {path}: weights {missing} are missing (an {kind} loads it has "
                                      f"{list(names)})")
        w = [tensors[name].to(device=device, dtype=dtype).contiguous() for name in names]
        d = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        extra = dict(zip(("input_norm", "hidden_norm", "final_norm", "lm_head"), w[len(WEIGHT_NAMES):]))
        weights = cls(*w[:len(WEIGHT_NAMES)], n_heads=n_heads, n_kv=int(cfg.get("num_key_value_heads") or n_heads),
                      head_dim=int(cfg.get("head_dim") or d // n_heads), eps=float(cfg["rms_norm_eps"]),
                      rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                      vocab_size=int(cfg["vocab_size"]), aux_layers=aux_layers, **extra)
        width = (len(aux_layers) if aux_layers else 2) * d
        if tuple(weights.fc.shape) != (d, width):
            raise HeadCheckpointError(f"EAGLE head {path}: fc.weight is {tuple(weights.fc.shape)}, expected {(d, width)}")
        return weights

    @property
    def hidden_size(self) -> int:
        return self.fc.shape[0]

    @property
    def feature_size(self) -> int:
        """The width of the target states the head reads per position: d (EAGLE-1), A * d (EAGLE-3)."""
        return self.fc.shape[1] if self.aux_layers else self.hidden_size


@dataclass
class _HeadCache:
    """One request's head KV cache: entries for ``positions[:n]``, kept in position order."""

    keys: torch.Tensor  # [Hkv, capacity, hd] in the head's dtype, RoPE applied
    values: torch.Tensor  # [Hkv, capacity, hd]
    positions: list[int] = field(default_factory=list)
    # [<= 2, d]: the two newest entries' residuals (EAGLE-1: their inputs); the newest is the first
    # draft step's residual (the one before serves the fault injection of vllm_specplugin/faults.py only).
    recent_x: torch.Tensor | None = None
    # [<= 2, d or 2d]: the same entries' attention inputs (EAGLE-1: recent_x itself).
    recent_in: torch.Tensor | None = None
    # [H, 1, hd]: the newest entry's query, RoPE applied (computed with its keys and values, so
    # the first draft step needs no projection of its own).
    recent_q: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.positions)


@dataclass
class _Pending:
    context_length: int
    tokens: list[int]


class EagleHeadProposer(Proposer):
    """Drafts chains from an EAGLE-1 head (see the module docstring); needs the target's embedding
    and LM head (:meth:`attach_target`) before it drafts."""

    def __init__(self, checkpoint: str | Path, device: str | torch.device = "cpu", name: str | None = None,
                 kernels: LeanKernels | None = None, dtype: torch.dtype | str = torch.float32):
        self.device = torch.device(device)
        # The dtype the head computes in (weights, the shared embedding and LM head, its KV cache):
        # float32, or bfloat16 / float16 (half the bytes a step streams; the checkpoints are stored
        # in bfloat16). Logits are processed in float32 whatever it is: q is what is sampled from.
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"EagleHeadProposer dtype must be float32, bfloat16 or float16, got {self.dtype}")
        self.weights = EagleWeights.load(checkpoint, self.device, self.dtype)
        self.vocab_size = self.weights.vocab_size
        self.name = name or Path(checkpoint).name
        self.metrics = DraftMetrics([self.name])
        self.embed: torch.Tensor | None = None  # [V, d] in the head's dtype
        self.lm_head: torch.Tensor | None = None  # [V, d]: the target's (EAGLE-1) or its own (EAGLE-3)
        self._lm = None  # the LM head's product
        self._caches: dict[str, _HeadCache] = {}
        self._pending: dict[str, _Pending] = {}
        self._nodes: dict[str, dict] = {}  # request id -> this step's tree nodes (see prepare)
        self._last_call: tuple[float, set[str]] | None = None
        # The head's operations: torch's by default; the vLLM adapter passes vLLM's CPU
        # kernels (vllm_specplugin/draft_kernels.py: oneDNN's prepacked products, one-call RMSNorm,
        # RoPE and SiLU-and-mul), as for the draft models' lean forward. A head step at batch 1 is
        # memory-bound products (23 MB of float32 weights with the LM head on the memory-bound
        # pair, 11.5 MB in bfloat16) and a few dozen small operations; the projections are fused (q, k, v in one
        # product; gate and up in one) so each step reads each weight once.
        self.kernels = kernels or TORCH_KERNELS
        w = self.weights
        linear = self.kernels.linear
        self._q_size, self._k_size = w.n_heads * w.head_dim, w.n_kv * w.head_dim
        self._fc = linear(w.fc)
        self._qkv = linear(torch.cat([w.q, w.k, w.v]).contiguous())
        self._o = linear(w.o)
        self._gate_up = linear(torch.cat([w.gate, w.up]).contiguous())
        self._down = linear(w.down)
        # EAGLE-1 shares the target's LM head (from attach_target); EAGLE-3 has its own.
        if w.lm_head is not None:
            self.lm_head, self._lm = w.lm_head, linear(w.lm_head)
        inv = 1.0 / w.rope_theta ** (torch.arange(0, w.head_dim, 2, dtype=torch.float32, device=self.device) / w.head_dim)
        self._inv_freq = inv  # [hd / 2]
        self._rope_table(ROPE_TABLE_POSITIONS)

    def _rope_table(self, size: int) -> None:
        """RoPE's cos / sin tables for positions [0, size) (transformers' duplicated halves), read by
        index instead of computed per step; doubled when a position passes the end."""
        angles = torch.arange(size, dtype=torch.float32, device=self.device)[:, None] * self._inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)
        self._rope_cos, self._rope_sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        self._rope_fn = self.kernels.make_rope(self._rope_cos, self._rope_sin)
        self._rope_positions = size

    # -- set-up ------------------------------------------------------------------------------

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose residual stream an EAGLE-3 head reads (``hidden_states`` of a
        request: their concatenation, [n, A * d]); () for EAGLE-1 (the final normed states, [n, d])."""
        return self.weights.aux_layers

    def attach_target(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        """The target's token embedding and LM head, [V', d] each (V' >= the head's vocabulary: vLLM
        pads its vocabulary rows; only the first V are used). An EAGLE-3 head has its own LM head."""
        d, vocab = self.weights.hidden_size, self.vocab_size
        shared = (("embedding", embed),) + ((("LM head", lm_head),) if not self.aux_layers else ())
        for name, tensor in shared:
            if tensor is None or tensor.ndim != 2 or tensor.shape[1] != d or tensor.shape[0] < vocab:
                raise HeadCheckpointError(f"the target's {name} is {None if tensor is None else tuple(tensor.shape)}; "
                                          f"the head needs [>= {vocab}, {d}] (is the head trained for this target?)")
        self.embed = embed[:vocab].detach().to(self.device, self.dtype).contiguous()
        if not self.aux_layers:
            self.lm_head = lm_head[:vocab].detach().to(self.device, self.dtype).contiguous()
            self._lm = self.kernels.linear(self.lm_head)

    # -- the Proposer interface --------------------------------------------------------------

    def free(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._nodes.pop(request_id, None)

    def tracked_request_ids(self) -> set[str]:
        return set(self._caches) | set(self._pending)

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if self.embed is None:
            raise RuntimeError("EagleHeadProposer: attach_target() was not called (no embedding / LM head)")
        started = time.perf_counter()
        self.time_step(started, requests)
        drafts = []
        for request in requests:
            self._observe(request)
            cache = self._absorb(request)
            last = len(request.context) - 2  # the position whose entry drafts the next token
            if request.gamma <= 0 or cache is None or not cache.positions or cache.positions[-1] != last:
                if request.gamma > 0:
                    self.metrics.fallback_requests += 1  # no entry for the last verified position
                drafts.append(self.empty_draft())
                continue
            tokens, probs = self.draft_chain(cache, last, request)
            self._pending[request.request_id] = _Pending(len(request.context), tokens)
            drafts.append(Draft(tokens, probs))
        self.metrics.propose_calls += 1
        self.metrics.draft_time_s += time.perf_counter() - started
        self.metrics.tracked_requests = len(self._caches)
        return drafts

    # -- the head ----------------------------------------------------------------------------

    def _inputs(self, tokens: torch.Tensor, features: torch.Tensor, target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """An entry's (attention input, residual) from its token [n] int64 and its features: the
        target's states (``target``: [n, d], EAGLE-3 [n, A * d]) or a draft step's g [n, d].
        EAGLE-1: x = fc(cat(embed, f)) for both. EAGLE-3: h = fc(aux) for the target's states, g for
        a draft step's; attention input cat(rmsnorm(embed), rmsnorm(h)) [n, 2d], residual h."""
        w = self.weights
        if not w.aux_layers:
            x = self._fc(torch.cat([self.embed[tokens], features], -1))
            return x, x
        h = self._fc(features) if target else features
        embeds = self.kernels.rms_norm(self.embed[tokens], w.input_norm, w.eps)
        return torch.cat([embeds, self.kernels.rms_norm(h.contiguous(), w.hidden_norm, w.eps)], -1), h

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [n, d] -> the head's logits [n, V] (EAGLE-3: its final norm, then its own LM head)."""
        w = self.weights
        return self._lm(self.kernels.rms_norm(g.contiguous(), w.final_norm, w.eps) if w.aux_layers else g)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, d], positions [n] int64 -> (queries [H, n, hd], keys [Hkv, n, hd], values [Hkv, n, hd]),
        queries and keys rotated; one product for all three."""
        w = self.weights
        top = int(positions.max()) + 1
        if top > self._rope_positions:
            self._rope_table(1 << math.ceil(math.log2(top)))
        qkv = self._qkv(x)
        qk_size = self._q_size + self._k_size
        heads = self._rope_fn(positions, qkv[:, :qk_size], self._q_size)  # [n, H + Hkv, hd]
        values = qkv[:, qk_size:].view(-1, w.n_kv, w.head_dim)
        return heads[:, :w.n_heads].transpose(0, 1), heads[:, w.n_heads:].transpose(0, 1), values.transpose(0, 1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Queries q [H, n, hd] attending to all of keys / values [Hkv, m, hd] (no mask: each query
        is the newest entry of what it sees) -> [n, H * hd]."""
        rep = self.weights.n_heads // self.weights.n_kv
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None])[0]  # [H, n, hd]
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    def _after_attention(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The layer past its attention: g = r + mlp(rmsnorm(r)), r = x + o_proj(attention);
        x [n, d], attention [n, H * hd] -> g [n, d]."""
        w = self.weights
        r = x + self._o(attention)
        n = self.kernels.rms_norm(r, w.norm, w.eps)
        return r + self._down(self.kernels.silu_and_mul(self._gate_up(n)))

    def _root(self, cache: _HeadCache) -> torch.Tensor:
        """g [1, d] of the newest entry, attending to every entry (its query kept by _absorb)."""
        n = cache.n
        return self._after_attention(cache.recent_x[-1:], self._attend(cache.recent_q, cache.keys[:, :n], cache.values[:, :n]))

    def _absorb(self, request: DraftRequest) -> _HeadCache | None:
        """Add the entries of the positions whose target hidden states came with ``request``."""
        cache = self._caches.get(request.request_id)
        hidden = request.hidden_states
        if hidden is None or hidden.shape[0] == 0:
            return cache
        start = int(request.hidden_start)
        # An entry at i needs the token at i + 1: the newest position's entry waits for its token.
        count = min(int(hidden.shape[0]), len(request.context) - 1 - start)
        if count <= 0:
            return cache
        w = self.weights
        if hidden.ndim != 2 or hidden.shape[1] != w.feature_size:
            what = (f"the residual stream after target layers {list(w.aux_layers)}, concatenated" if w.aux_layers
                    else "the target's final normed hidden states")
            raise ValueError(f"request {request.request_id}: hidden states {tuple(hidden.shape)}, expected "
                             f"[n, {w.feature_size}] ({what})")
        if cache is None:
            capacity = max(64, 1 << math.ceil(math.log2(start + count + 1)))
            cache = self._caches[request.request_id] = _HeadCache(
                torch.empty(w.n_kv, capacity, w.head_dim, device=self.device, dtype=self.dtype),
                torch.empty(w.n_kv, capacity, w.head_dim, device=self.device, dtype=self.dtype))
        # Rows at positions >= start replace the cache's (recomputed after preemption, or the first
        # rows of a request whose earlier states were never seen, e.g. a prefix-cache hit).
        keep = next((j for j, p in enumerate(cache.positions) if p >= start), cache.n)
        del cache.positions[keep:]
        needed = keep + count
        self._reserve(cache, needed)
        tokens = torch.as_tensor(list(request.context[start + 1:start + 1 + count]), dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + count, device=self.device)
        inputs, x = self._inputs(tokens, hidden[:count].to(self.device, self.dtype).contiguous(), target=True)
        queries, keys, values = self._project(inputs, positions)
        cache.keys[:, keep:needed] = keys
        cache.values[:, keep:needed] = values
        cache.positions.extend(range(start, start + count))
        cache.recent_q = queries[:, -1:].clone()
        if count == 1 and cache.recent_x is not None and keep and cache.positions[-2:-1] == [start - 1]:
            cache.recent_x = torch.stack([cache.recent_x[-1], x[0]])
            cache.recent_in = torch.stack([cache.recent_in[-1], inputs[0]])
        else:
            cache.recent_x, cache.recent_in = x[-2:], inputs[-2:]
        return cache

    def draft_chain(self, cache: _HeadCache, last: int, request: DraftRequest, gamma: int | None = None,
                    row_params: SamplingParams | None = None) -> tuple[list[int], torch.Tensor]:
        """``gamma`` (default ``request.gamma``) tokens, each drawn from the processed head distribution
        of the step before (the argmax for greedy requests): (tokens, q [gamma, V] float32). ``row_params``:
        process the rows with these instead (TreeProposer: T = 1 rows for a greedy request's acceptance
        model; its tokens stay the argmax). The draft steps' own keys and values go to the cache's free
        slots past its entries (not committed: the next verified states overwrite them), so no step
        copies the cache."""
        gamma = request.gamma if gamma is None else gamma
        n = cache.n
        self._reserve(cache, n + gamma)
        g = self._root(cache)  # [1, d]
        params = row_params or request.params
        tokens: list[int] = []
        rows = []
        for step in range(gamma):
            q = processed_probs(self._logits(g)[0].float(), params)  # [V]
            token = int(q.argmax()) if request.params.greedy else int(sample(q, request.generator))
            tokens.append(token)
            rows.append(q)
            if step + 1 == gamma:
                break
            slot = n + step
            inputs, x = self._inputs(torch.tensor([token], device=self.device), g, target=False)  # [1, d]
            queries, k, v = self._project(inputs, torch.tensor([last + 1 + step], device=self.device))
            cache.keys[:, slot:slot + 1] = k
            cache.values[:, slot:slot + 1] = v
            g = self._after_attention(x, self._attend(queries, cache.keys[:, :slot + 1], cache.values[:, :slot + 1]))
        return tokens, torch.stack(rows)

    def _reserve(self, cache: _HeadCache, needed: int) -> None:
        """Grow the cache's buffers (doubling) to hold ``needed`` entries, keeping its ``n``."""
        if needed <= cache.keys.shape[1]:
            return
        w = self.weights
        capacity = 1 << math.ceil(math.log2(needed))
        for name in ("keys", "values"):
            old = getattr(cache, name)
            grown = torch.empty(w.n_kv, capacity, w.head_dim, device=self.device, dtype=self.dtype)
            grown[:, :cache.n] = old[:, :cache.n]
            setattr(cache, name, grown)

    def stale_first_q(self, cache: _HeadCache, last: int, request: DraftRequest) -> torch.Tensor | None:
        """The processed head distribution one position behind (the entry at ``last - 1`` as the
        query, keys up to it): [V] float32, or None without that entry. Only the fault injection
        (vllm_specplugin/faults.py: ``head_stale_states``) uses it."""
        if cache.n < 2 or cache.recent_x is None or cache.recent_x.shape[0] < 2 or cache.positions[-2] != last - 1:
            return None
        x = cache.recent_x[-2:-1]
        queries, _, _ = self._project(cache.recent_in[-2:-1], torch.tensor([last - 1], device=self.device))
        g = self._after_attention(x, self._attend(queries, cache.keys[:, :cache.n - 1], cache.values[:, :cache.n - 1]))
        return processed_probs(self._logits(g)[0].float(), request.params)

    # -- the drafter interface TreeProposer grows trees with (as EnsembleProposer's) ---------
    # A tree's node is the path of drafted tokens from the root (the newest verified position);
    # each node's head output is computed once per step, all the nodes TreeProposer asks for at
    # once in one batched pass per request (tree attention over the real entries and the node's
    # ancestors), and kept until the request's next step.

    def prepare(self, requests: Sequence[DraftRequest]) -> None:
        """Take the target's states each request brings and forget last step's tree nodes."""
        for request in requests:
            self._absorb(request)
            self._nodes.pop(request.request_id, None)

    def room(self, request_id: str, context_length: int, gamma: int) -> int:
        """``gamma`` when the head can draft after this context (it has the entry of the newest
        verified position, context_length - 2), else 0."""
        cache = self._caches.get(request_id)
        ready = cache is not None and bool(cache.positions) and cache.positions[-1] == context_length - 2
        return gamma if ready else 0

    def root_distributions(self, request_ids: Sequence[str], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The head's unprocessed (T = 1) distribution after each context: [len(ids), V] float32."""
        g = torch.stack([self._tree_nodes(rid, len(ctx) - 2)[()][0] for rid, ctx in zip(request_ids, contexts)])
        return self._logits(g).float().softmax(-1)

    def branch_distributions_of(self, items) -> list[torch.Tensor]:
        """``items``: (request id, context, paths); per item the head's unprocessed distribution after
        the context and each path (a list of drafted tokens): [len(paths), V] float32."""
        out = []
        for rid, context, paths in items:
            last = len(context) - 2
            nodes = self._tree_nodes(rid, last)
            keys = [tuple(int(t) for t in path) for path in paths]
            for depth in sorted({len(k) for k in keys if k not in nodes}):
                level = list(dict.fromkeys(k for k in keys if len(k) == depth and k not in nodes))
                missing = [k[:j] for k in level for j in range(1, depth) if k[:j] not in nodes]
                if missing:  # parents first (TreeProposer asks for them first; kept for any caller)
                    self.branch_distributions_of([(rid, context, [list(m) for m in dict.fromkeys(missing)])])
                self._expand(rid, last, level)
            g = torch.stack([nodes[k][0] for k in keys])
            out.append(self._logits(g).float().softmax(-1))
        return out

    def draw_chains(self, active, drafts: list[Draft], row_params: list[SamplingParams] | None = None) -> None:
        """The chain loop for TreeProposer's chain-shaped steps: ``active`` = (index, request, gamma),
        each written to ``drafts[index]`` (see :meth:`draft_chain`)."""
        for i, (index, request, gamma) in enumerate(active):
            cache = self._caches[request.request_id]
            tokens, probs = self.draft_chain(cache, len(request.context) - 2, request, gamma,
                                             row_params[i] if row_params else None)
            drafts[index] = Draft(tokens, probs)

    def time_step(self, now: float, requests: Sequence[DraftRequest]) -> None:
        self._last_call = self.metrics.time_step(self._last_call, now, {request.request_id for request in requests})

    def sync_cost_counters(self) -> None:
        """Nothing to gather (EnsembleProposer sums its draft models' counters here)."""

    def _tree_nodes(self, request_id: str, last: int) -> dict:
        """The request's node table {path: (g [d], k [Hkv, hd], v [Hkv, hd])}, with its root."""
        nodes = self._nodes.get(request_id)
        if nodes is None:
            cache = self._caches[request_id]
            if not cache.positions or cache.positions[-1] != last:
                raise RuntimeError(f"request {request_id}: the head has no entry for position {last}")
            nodes = self._nodes[request_id] = {(): (self._root(cache)[0], None, None)}
        return nodes

    def _expand(self, request_id: str, last: int, paths: list[tuple[int, ...]]) -> None:
        """Compute the nodes ``paths`` (all of one depth d >= 1, parents known) in one batched pass:
        node = (last token of the path, its parent's g) at position last + d, attending to the real
        entries and to its ancestors and itself."""
        w = self.weights
        cache, nodes = self._caches[request_id], self._nodes[request_id]
        depth, count = len(paths[0]), len(paths)
        parents_g = torch.stack([nodes[p[:-1]][0] for p in paths])  # [P, d]
        tokens = torch.tensor([p[-1] for p in paths], device=self.device)
        position = torch.full((count,), last + depth, device=self.device)
        inputs, x = self._inputs(tokens, parents_g, target=False)  # residual x [P, d]
        q, k, v = self._project(inputs, position)  # [H, P, hd], [Hkv, P, hd] x 2
        # The node's own path: ancestors at depths 1..d-1, then itself: [Hkv, P, d, hd].
        path_k = torch.stack([torch.stack([nodes[p[:j]][1] for j in range(1, depth)] + [k[:, i]], 1)
                              for i, p in enumerate(paths)], 1)
        path_v = torch.stack([torch.stack([nodes[p[:j]][2] for j in range(1, depth)] + [v[:, i]], 1)
                              for i, p in enumerate(paths)], 1)
        real_k, real_v = cache.keys[:, :cache.n], cache.values[:, :cache.n]
        rep = w.n_heads // w.n_kv
        if rep > 1:
            real_k, real_v = real_k.repeat_interleave(rep, 0), real_v.repeat_interleave(rep, 0)
            path_k, path_v = path_k.repeat_interleave(rep, 0), path_v.repeat_interleave(rep, 0)
        scale = w.head_dim ** -0.5
        scores = torch.cat([q @ real_k.transpose(-1, -2), torch.einsum("hpe,hpde->hpd", q, path_k)], -1) * scale
        probs = scores.softmax(-1)
        attention = probs[..., :cache.n] @ real_v + torch.einsum("hpd,hpde->hpe", probs[..., cache.n:], path_v)
        g = self._after_attention(x, attention.transpose(0, 1).reshape(count, -1))
        for i, path in enumerate(paths):
            nodes[path] = (g[i], k[:, i], v[:, i])

    # -- measuring ---------------------------------------------------------------------------

    def _observe(self, request: DraftRequest) -> None:
        """Score the request's previous draft against the tokens the target emitted since."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or len(request.context) <= pending.context_length:
            return
        emitted = list(request.context[pending.context_length:])
        accepted = accepted_count(pending.tokens, emitted)
        self.metrics.record_outcome(len(pending.tokens), accepted)
