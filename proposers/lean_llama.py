"""A lean forward pass for Llama-architecture drafts (Llama, and Qwen2's Llama-with-qkv-bias).

Small drafts are cheap in arithmetic but not in Python: transformers spends about 1.5 ms of
framework overhead per forward of a 2-layer model on CPU, more than the matrix products. This is
the same computation as ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (checked against them in
``tests/test_proposers_draft_runtime.py``) in a few dozen tensor operations, on the model's own
weights. Checkpoints it does not cover (other architectures, sliding windows, RoPE that changes
with the sequence length, output biases) use transformers.

The forward is *packed and ragged*: the new tokens of every row of a batch are one sequence
[T] (no padding) for the matrix products, and each row attends over its own per-request K/V
buffer, in which its new K/V are written in place (see :class:`RowAttention`). No cache is
copied or concatenated: a step's memory traffic is the new tokens plus one read of each row's
keys and values by attention.

Its operations go through a :class:`LeanKernels` set (default :data:`TORCH_KERNELS`). A draft
forward at batch 1 is a chain of matrix-vector products whose weights the target's step has just
evicted from the cache, so they run at memory speed, and a blocked, prepacked weight layout
streams about twice as fast as a plain row-major one; between them, every small elementwise
operation costs a few microseconds of dispatch, which at this size is as much as its work. The
vLLM adapter passes vLLM's own CPU kernels (``vllm_specplugin.draft_kernels``: oneDNN's prepacked
products, one-call RMSNorm with the residual add, RoPE and SiLU-and-mul, the kernels vLLM's
compiled CPU models run); outside vLLM the default is torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# RoPE variants whose effect is entirely in the rotary embedding's (static) inv_freq and
# attention_scaling, which the lean forward reads from the model; "dynamic" and "longrope"
# change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")

ROPE_TABLE_POSITIONS = 8192  # positions the RoPE table starts with (a few MiB at most)

# weight [out, in] (model dtype) -> a function x [T, in] -> x @ weight.T [T, out], both model dtype
LinearFactory = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def torch_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The default :data:`LinearFactory`: ``F.linear`` on the weight as it is."""
    return lambda x: F.linear(x, weight)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = residual + x
    return _torch_rms_norm(residual, weight, eps), residual


def _torch_make_rope(cos: torch.Tensor, sin: torch.Tensor):
    head_dim = cos.shape[1]

    def rope(positions: torch.Tensor, qk: torch.Tensor, q_size: int) -> torch.Tensor:
        heads = qk.view(qk.shape[0], -1, head_dim)  # query and key heads at once
        return heads * cos[positions][:, None] + _rotate_half(heads) * sin[positions][:, None]

    return rope


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class LeanKernels:
    """The operations of the lean forward (tensors in the model dtype; T = packed tokens).

    - ``linear``: a :data:`LinearFactory`;
    - ``rms_norm(x [T, hidden], weight, eps)`` -> normed [T, hidden];
    - ``add_rms_norm(x, residual, weight, eps)`` -> (norm(residual + x), residual + x); may
      reuse ``x`` and ``residual`` in place (the forward never reads them again);
    - ``make_rope(cos, sin)`` (tables [positions, head_dim], transformers' duplicated-half
      layout) -> ``rope(positions [T] int64, qk [T, q_size + k_size], q_size)`` -> the query
      and key heads rotated, [T, heads + kv_heads, head_dim], in place or not (``qk`` is a
      column slice of the projection's output, rows strided);
    - ``silu_and_mul(gate_up [T, 2 * ffn])`` -> silu(gate) * up [T, ffn].
    """

    name: str
    linear: LinearFactory
    rms_norm: Callable
    add_rms_norm: Callable
    make_rope: Callable
    silu_and_mul: Callable


TORCH_KERNELS = LeanKernels("torch", torch_linear, _torch_rms_norm, _torch_add_rms_norm, _torch_make_rope,
                            _torch_silu_and_mul)


@dataclass
class RowAttention:
    """Where one row's new tokens live and what they attend to.

    ``kv``: the request's buffer [layers, 2 (K, V), kv_heads, capacity, head_dim] in the model
    dtype. The row's ``n`` new tokens follow the previous row's in the packed batch; their K/V
    are written at buffer entries ``write_at .. write_at + n - 1``, and they attend to
    entries ``0 .. keys - 1``: all of them, causally for the new ones, when ``mask`` is None
    (then ``keys == write_at + n``), else where ``mask`` [n, keys] (bool) is True.
    """

    kv: torch.Tensor
    n: int
    write_at: int
    keys: int
    mask: torch.Tensor | None = None


class LeanLlama:
    """``forward_rows(input_ids, positions, rows, last)``, on a Llama/Qwen2 model's weights."""

    @staticmethod
    def supports(model) -> bool:
        config = model.config
        rope = getattr(config, "rope_parameters", None) or {}
        name = type(model).__name__
        layer_types = getattr(config, "layer_types", None) or []
        return (
            (
                (name == "LlamaForCausalLM" and not getattr(config, "attention_bias", False))
                or (name == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False))
            )
            and all(t == "full_attention" for t in layer_types)
            and not getattr(config, "mlp_bias", False)
            and getattr(config, "hidden_act", "silu") == "silu"
            and rope.get("rope_type", "default") in STATIC_ROPE_TYPES
            and getattr(config, "pretraining_tp", 1) == 1
        )

    def __init__(self, model, kernels: LeanKernels | None = None):
        self.kernels = kernels = kernels or TORCH_KERNELS
        make_linear = kernels.linear
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = []
        for layer in inner.layers:
            attn = layer.self_attn
            projections = [attn.q_proj, attn.k_proj, attn.v_proj]
            qkv_bias = None
            if attn.q_proj.bias is not None:  # Qwen2
                qkv_bias = torch.cat([p.bias for p in projections])
            self.layers.append((
                layer.input_layernorm.weight,
                make_linear(torch.cat([p.weight for p in projections]).contiguous()),
                qkv_bias,
                make_linear(attn.o_proj.weight.contiguous()),
                layer.post_attention_layernorm.weight,
                make_linear(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).contiguous()),
                make_linear(layer.mlp.down_proj.weight.contiguous()),
            ))
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight  # [V, hidden]
        self._lm_head = make_linear(self.lm_head.contiguous())
        self.dtype = self.embed.dtype
        self.hidden_size = self.embed.shape[1]
        # RoPE table [positions, head_dim] in the model dtype, computed as transformers does
        # (float32 angles, scaled, cast): a forward indexes it instead of computing cos and sin.
        # It covers every position of a short-context draft; long-context ones grow it on demand.
        self._inv_freq = inner.rotary_emb.inv_freq.float()
        self._rope_scaling = float(inner.rotary_emb.attention_scaling)
        self._max_positions = int(getattr(config, "max_position_embeddings", 2048))
        self._rope_table(min(self._max_positions, ROPE_TABLE_POSITIONS))

    def _rope_table(self, size: int) -> None:
        positions = torch.arange(size, device=self.embed.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        angles = torch.cat([freqs, freqs], -1)
        self.rope_cos = (angles.cos() * self._rope_scaling).to(self.dtype)
        self.rope_sin = (angles.sin() * self._rope_scaling).to(self.dtype)
        self._rope = self.kernels.make_rope(self.rope_cos, self.rope_sin)

    @torch.no_grad()
    def forward_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowAttention],
        last: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of the packed new tokens ``input_ids`` [T] at RoPE ``positions`` [T] (int64).

        Writes their K/V into each row's buffer. ``last`` [B] (int64): the packed index of the
        token whose next-token logits each row wants (None: no logits, e.g. a prefill). Returns
        (logits [B, V] float32, final normed hidden states [B, hidden] in the model dtype), or
        (None, None).
        """
        total = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        if self.rope_cos.shape[0] < self._max_positions:  # a long-context draft: is the table long enough?
            needed = int(positions.max()) + 1
            if needed > self.rope_cos.shape[0]:
                self._rope_table(max(needed, 2 * self.rope_cos.shape[0]))
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        gqa = self.num_kv_heads != self.num_heads
        kernels, eps = self.kernels, self.eps
        # Per row, views of its buffer for every layer, made once per forward (per-row Python
        # work inside the layer loop is what small drafts pay for): where its new K and V go
        # ([kv_heads, n, head_dim] each) and what it attends to (K, V [1, kv_heads, keys, head_dim]).
        sizes = [row.n for row in rows]
        targets, keys, values, masks = [], [], [], []
        for row in rows:
            targets.append(row.kv[:, :, :, row.write_at:row.write_at + row.n].unbind(0))
            seen = row.kv[:, :, None, :, :row.keys]  # [layers, 2, 1, kv_heads, keys, head_dim]
            keys.append(seen[:, 0].unbind(0))
            values.append(seen[:, 1].unbind(0))
            mask = row.mask
            if mask is None and row.n > 1:
                mask = _bottom_right_causal(row.n, row.keys, x.device)
            masks.append(mask)
        residual = x
        h = kernels.rms_norm(x, self.layers[0][0], eps)
        for index, (_, qkv, qkv_b, o_proj, norm_post, gate_up, down) in enumerate(self.layers):
            projected = qkv(h)
            if qkv_b is not None:
                projected = projected + qkv_b
            qk, v = projected.split([q_size + kv_size, kv_size], -1)
            qk = self._rope(positions, qk, q_size)  # [T, heads + kv_heads, head_dim]
            q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
            q = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
            k = k.transpose(0, 1)  # [kv_heads, T, head_dim]
            v = v.view(total, self.num_kv_heads, self.head_dim).transpose(0, 1)
            # Every row writes before any row reads: rows of a token tree share one buffer.
            if len(rows) == 1:
                targets[0][index][0].copy_(k)
                targets[0][index][1].copy_(v)
            else:
                for target, row_k, row_v in zip(targets, k.split(sizes, 1), v.split(sizes, 1)):
                    target[index][0].copy_(row_k)
                    target[index][1].copy_(row_v)
            outputs = [
                _attend(query, row_keys[index], row_values[index], mask, gqa)
                for query, row_keys, row_values, mask in zip(q.split(sizes, 2), keys, values, masks)
            ]  # each [1, heads, n, head_dim]
            attention = outputs[0] if len(outputs) == 1 else torch.cat(outputs, 2)
            attended = o_proj(attention[0].transpose(0, 1).reshape(total, q_size))
            h, residual = kernels.add_rms_norm(attended, residual, norm_post, eps)
            mlp = down(kernels.silu_and_mul(gate_up(h)))
            if index + 1 < len(self.layers):
                h, residual = kernels.add_rms_norm(mlp, residual, self.layers[index + 1][0], eps)
        if last is None:
            return None, None
        x = residual + mlp
        hidden = kernels.rms_norm(x[last], self.norm, eps)  # the lm_head only where logits are wanted
        return self._lm_head(hidden).float(), hidden

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of ``tokens`` [N] (int64, < V) after final hidden states ``hidden`` [N, hidden]:
        [N] float32, without the full [N, V] product."""
        return (hidden.float() * self.lm_head[tokens].float()).sum(-1)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            gqa: bool) -> torch.Tensor:
    """Attention of one row: query [1, heads, n, head_dim] over keys / values [1, kv_heads, keys,
    head_dim] (mask [n, keys] bool or None: all visible). SDPA also for one-token decode rows:
    with torch 2.13 on CPU it beats three explicit products at every length measured (4 heads,
    head_dim 64, keys 20 / 100 / 300 / 1000: 6.5 / 8.8 / 24 / 78 µs against 17 / 21 / 38 / 101)."""
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)


def _bottom_right_causal(n: int, keys: int, device) -> torch.Tensor:
    """[n, keys] bool: new token j (at key keys - n + j) sees every key up to itself."""
    return torch.arange(keys, device=device)[None, :] <= torch.arange(keys - n, keys, device=device)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)
