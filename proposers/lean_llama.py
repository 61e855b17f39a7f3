"""A lean forward pass for Llama-architecture drafts.

Small drafts are cheap in arithmetic but not in Python: transformers spends about 1.5 ms of
framework overhead per forward of a 2-layer model on CPU, more than the matrix products. This is
the same computation as ``LlamaForCausalLM`` (checked against it in
``tests/test_proposers_draft_runtime.py``) in a few dozen tensor operations, on the model's own
weights. Checkpoints it does not cover (other architectures, RoPE scaling, biases) use
transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LeanLlama:
    """``forward(input_ids, positions, past, mask) -> (logits, layers)`` on a LlamaForCausalLM's weights."""

    @staticmethod
    def supports(model) -> bool:
        config = model.config
        rope = getattr(config, "rope_parameters", None) or {}
        return (
            type(model).__name__ == "LlamaForCausalLM"
            and not getattr(config, "attention_bias", False)
            and not getattr(config, "mlp_bias", False)
            and getattr(config, "hidden_act", "silu") == "silu"
            and rope.get("rope_type", "default") == "default"
            and getattr(config, "pretraining_tp", 1) == 1
        )

    def __init__(self, model):
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = [
            (
                layer.input_layernorm.weight,
                torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]),
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                layer.mlp.down_proj.weight,
            )
            for layer in inner.layers
        ]
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scaling = float(inner.rotary_emb.attention_scaling)
        self.dtype = self.embed.dtype

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past, mask: torch.Tensor):
        """``past``: per layer (K, V) [B, kv_heads, past, head_dim] or None; ``mask``: [B, 1, n, past + n] bool."""
        batch, n = input_ids.shape
        x = F.embedding(input_ids, self.embed)
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, n, head_dim / 2]
        angles = torch.cat([freqs, freqs], -1)
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)[:, None]
        sin = (angles.sin() * self.rope_scaling).to(self.dtype)[:, None]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        new_layers = []
        for index, (norm_in, qkv_w, o_w, norm_post, gate_up_w, down_w) in enumerate(self.layers):
            h = self._rms_norm(x, norm_in)
            q, k, v = F.linear(h, qkv_w).split([q_size, kv_size, kv_size], -1)
            q = q.view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if past is not None:
                k = torch.cat([past[index][0], k], 2)
                v = torch.cat([past[index][1], v], 2)
            new_layers.append((k, v))
            attention = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
            )
            x = x + F.linear(attention.transpose(1, 2).reshape(batch, n, q_size), o_w)
            h = self._rms_norm(x, norm_post)
            gate, up = F.linear(h, gate_up_w).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        logits = F.linear(self._rms_norm(x, self.norm), self.lm_head)
        return logits, new_layers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)
