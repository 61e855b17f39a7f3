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

Matrix products go through a ``make_linear`` factory (default ``F.linear``): a draft forward at
batch 1 is a chain of matrix-vector products whose weights the target's step has just evicted
from the cache, so it runs at memory speed, and a blocked, prepacked weight layout streams
about twice as fast as a plain row-major one. The vLLM adapter passes oneDNN's prepacked
products (``vllm_specplugin.fast_linear``); outside vLLM the default is torch's.
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

    def __init__(self, model, make_linear: LinearFactory | None = None):
        make_linear = make_linear or torch_linear
        self.linear_backend = getattr(make_linear, "name", getattr(make_linear, "__name__", "custom"))
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

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

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
        cos = self.rope_cos[positions][:, None]  # [T, 1, head_dim]
        sin = self.rope_sin[positions][:, None]
        q_size = self.num_heads * self.head_dim
        qk_heads = self.num_heads + self.num_kv_heads
        kv_size = self.num_kv_heads * self.head_dim
        gqa = self.num_kv_heads != self.num_heads
        # Per row, views of its buffer for every layer, made once per forward (per-row Python
        # work inside the layer loop is what small drafts pay for): where its new K/V go
        # ([2, kv_heads, n, head_dim]) and what it attends to (K, V [1, kv_heads, keys, head_dim]).
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
        for index, (norm_in, qkv, qkv_b, o_proj, norm_post, gate_up, down) in enumerate(self.layers):
            h = self._rms_norm(x, norm_in)
            projected = qkv(h)
            if qkv_b is not None:
                projected = projected + qkv_b
            qk, v = projected.split([q_size + kv_size, kv_size], -1)
            qk = qk.view(total, qk_heads, self.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin  # RoPE on the query and key heads at once
            q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
            q = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
            new_kv = torch.stack([k, v.view(total, self.num_kv_heads, self.head_dim)]).transpose(1, 2)
            # Every row writes before any row reads: rows of a token tree share one buffer.
            for target, source in zip(targets, new_kv.split(sizes, 2)):
                target[index].copy_(source)
            outputs = [
                _attend(query, row_keys[index], row_values[index], mask, gqa)
                for query, row_keys, row_values, mask in zip(q.split(sizes, 2), keys, values, masks)
            ]  # each [1, heads, n, head_dim]
            attention = outputs[0] if len(outputs) == 1 else torch.cat(outputs, 2)
            x = x + o_proj(attention[0].transpose(0, 1).reshape(total, q_size))
            h = self._rms_norm(x, norm_post)
            gate, up = gate_up(h).chunk(2, -1)
            x = x + down(F.silu(gate) * up)
        if last is None:
            return None, None
        hidden = self._rms_norm(x[last], self.norm)  # the lm_head only where logits are wanted
        return self._lm_head(hidden).float(), hidden

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of ``tokens`` [N] (int64, < V) after final hidden states ``hidden`` [N, hidden]:
        [N] float32, without the full [N, V] product."""
        return (hidden.float() * self.lm_head[tokens].float()).sum(-1)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            gqa: bool) -> torch.Tensor:
    """Attention of one row: query [1, heads, n, head_dim] over keys / values [1, kv_heads, keys,
    head_dim] (mask [n, keys] bool or None: all visible). A decode step (one query, no mask) is
    three small products: SDPA's CPU kernel costs about 3x as much in set-up at that size."""
    if query.shape[2] > 1 or mask is not None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)
    heads, kv_heads, head_dim = query.shape[1], keys.shape[1], query.shape[3]
    grouped = query.view(1, kv_heads, heads // kv_heads, head_dim)  # query head h reads kv head h // group
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * head_dim**-0.5  # [1, kv_heads, group, keys]
    return torch.matmul(scores.softmax(-1), values).view(1, heads, 1, head_dim)


def _bottom_right_causal(n: int, keys: int, device) -> torch.Tensor:
    """[n, keys] bool: new token j (at key keys - n + j) sees every key up to itself."""
    return torch.arange(keys, device=device)[None, :] <= torch.arange(keys - n, keys, device=device)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)
