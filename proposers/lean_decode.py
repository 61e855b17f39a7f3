"""A one-row fast path for the drafts' lean forward (``proposers/lean_llama.py``).

At batch 1 a draft forward is 17 memory-bound matrix products (4 per layer and the lm_head) and,
between them, a few dozen small operations, each worth more in dispatch (Python, torch's
dispatcher, a fresh output tensor, view bookkeeping) than in arithmetic. Measured on the
memory-bound demo draft (4 layers x 256, vLLM's CPU kernels, one thread, weights evicted before
each forward as a target step does), the products take 0.67 of the 1.3 ms of a one-token float32
forward; the rest is that dispatch, itself slowed by the cold caches.

:class:`LeanDecode` runs the same computation, with the same kernels and in the same order, for
the common case of a single row (a request's catch-up and its one-token extends, whose new tokens
attend to everything before them, and the wave of one request's token tree, masked), with the
per-forward Python work cut down:

- every intermediate is written into buffers allocated once per new-token count (products,
  RMSNorm and SiLU-and-mul through their ``out`` forms where the kernels have one: see
  :func:`linear_into`); only the returned logits and hidden state are fresh tensors, so callers
  may keep them;
- the views of each buffer (query, key/value slices, the K/V slot, the lm_head input) are made
  once per buffer set, not per layer and forward;
- the new K and V are written into the request's KV buffer with one copy per layer (both at
  once, from the projection's output), not two;
- the catch-up's causal mask is a view of a cached lower-triangular matrix, not built per
  forward;
- the final residual add and norm run on the last token only, in one fused kernel call.

Anything else (several rows, more than :data:`MAX_FAST_TOKENS` new tokens, as in a prefill) goes
to the wrapped :class:`LeanLlama` as it is.
The logits equal the wrapped forward's up to float rounding (bit for bit for the one-token
forward in float32, with torch's kernels and with vLLM's; ``tests/test_lean_decode.py``).
Measured against it, thread CPU time, one thread, median of 9 interleaved repeats on a loaded
machine: a one-token forward 14% (float32) / 20% (bfloat16) cheaper with the weights evicted,
26% with them cached; a 5-token catch-up 17-24%. ``torch.compile`` of the whole one-token forward
(inductor, vLLM's products as opaque ops, the KV write outside the graph since inductor copies the
whole buffer for a slice write at a dynamic position) compiled in 10-35 s and was no faster than
this eager path.

Kernel contract: besides :class:`LeanKernels`, the fast path uses, when present,

- ``linear(weight).into(x, out)``: the product written into ``out`` (attribute of the callable
  a :data:`LinearFactory` returns); otherwise ``out.copy_(linear(x))``;
- :class:`OutKernels` ``rms_norm_into(out, x, weight, eps)`` and ``silu_and_mul_into(out,
  gate_up)``; the default :data:`TORCH_OUT_KERNELS` computes as torch's :class:`LeanKernels` do.

This module does not import vLLM; ``vllm_specplugin/draft_kernels.py`` provides vLLM's forms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_specplugin.proposers.lean_llama import LeanLlama, RowAttention, _torch_rms_norm

MASK_START = 256  # side of the cached causal-mask matrix at first; doubles on demand
# Most new tokens a fast-path forward takes: catch-ups after a verification step are gamma + 1 at
# most; longer forwards (prefills) go to the wrapped forward, so buffer sets stay few and small.
MAX_FAST_TOKENS = 16


def _torch_rms_norm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    out.copy_(_torch_rms_norm(x, weight, eps))


def _torch_silu_and_mul_into(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    half = gate_up.shape[-1] // 2
    torch.mul(F.silu(gate_up[:, :half]), gate_up[:, half:], out=out)


@dataclass(frozen=True)
class OutKernels:
    """The ``out`` forms the fast path writes through (tensors in the model dtype):
    ``rms_norm_into(out, x, weight, eps)`` and ``silu_and_mul_into(out [T, ffn], gate_up [T, 2 * ffn])``."""

    name: str
    rms_norm_into: Callable
    silu_and_mul_into: Callable


TORCH_OUT_KERNELS = OutKernels("torch", _torch_rms_norm_into, _torch_silu_and_mul_into)


def linear_into(linear: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``(x, out) -> None``: the product of ``linear`` written into ``out``; the kernel's own
    ``into`` form where it has one, else a copy of its result."""
    into = getattr(linear, "into", None)
    if into is not None:
        return into

    def copy_into(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(linear(x))

    return copy_into


class _Buffers:
    """Everything one forward of ``n`` new tokens writes besides the KV buffer, and its views."""

    def __init__(self, lean: LeanLlama, n: int, ffn: int):
        dtype, device = lean.dtype, lean.embed.device
        hidden, heads, kv_heads, dim = lean.hidden_size, lean.num_heads, lean.num_kv_heads, lean.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim

        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

        self.residual = empty(n, hidden)
        self.h = empty(n, hidden)
        self.qkv = empty(n, q_size + 2 * kv_size)
        self.o = empty(n, hidden)
        self.gate_up = empty(n, 2 * ffn)
        self.act = empty(n, ffn)
        self.down = empty(n, hidden)
        self.qk = self.qkv[:, :q_size + kv_size]
        self.q = self.qkv[:, :q_size].view(n, heads, dim).transpose(0, 1)[None]  # [1, heads, n, dim]
        # the new K and V of every token: [2, kv_heads, n, dim], the layout of a KV slot
        self.new_kv = self.qkv[:, q_size:].view(n, 2, kv_heads, dim).permute(1, 2, 0, 3)
        # attention's output [1, heads, n, dim] read as the o_proj input [n, heads * dim]:
        # a view for one token, a copy (into this buffer) for more
        self.attended = empty(n, q_size)


class LeanDecode:
    """``forward_rows`` of :class:`LeanLlama` with a fast path for one unmasked row.

    ``lean``: the forward to wrap (its weights and kernels are used as they are, nothing is
    copied or prepacked again); ``out_kernels``: the ``out`` forms matching ``lean.kernels``
    (default torch's).
    """

    def __init__(self, lean: LeanLlama, out_kernels: OutKernels | None = None):
        self.lean = lean
        self.out_kernels = out_kernels or TORCH_OUT_KERNELS
        self.kernels = lean.kernels
        self.layers = [
            (norm_in, linear_into(qkv), qkv_b, linear_into(o_proj), norm_post, linear_into(gate_up),
             linear_into(down))
            for norm_in, qkv, qkv_b, o_proj, norm_post, gate_up, down in lean.layers
        ]
        # the FFN width: one probe product on a zero row (the lean forward keeps no weight shapes)
        probe = torch.zeros(1, lean.hidden_size, dtype=lean.dtype, device=lean.embed.device)
        self._ffn = int(lean.layers[0][5](probe).shape[1]) // 2
        self._buffers: dict[int, _Buffers] = {}
        self._causal = torch.ones(0, 0, dtype=torch.bool, device=lean.embed.device)
        self.attend = F.scaled_dot_product_attention  # (q, k, v, attn_mask=, enable_gqa=)
        self._rope_probe = (None, False)
        self.fast_forwards = 0  # forwards that took the fast path (tests, cost accounting)

    # the wrapped forward's attributes (dtype, hidden_size, token_logits, ...) read through
    def __getattr__(self, name):
        return getattr(self.lean, name)

    def _buffers_for(self, n: int) -> _Buffers:
        buffers = self._buffers.get(n)
        if buffers is None:
            buffers = self._buffers[n] = _Buffers(self.lean, n, self._ffn)
        return buffers

    def _rope_in_place(self) -> bool:
        """Whether the kernels' RoPE rotates the projection's output where it lies (vLLM's) or
        returns the rotated heads (torch's): asked once per RoPE table, on a probe row."""
        rope = self.lean._rope
        if self._rope_probe[0] is not rope:
            probe = self._buffers_for(1)
            positions = torch.zeros(1, dtype=torch.long, device=probe.qkv.device)
            probe.qkv.zero_()
            self._rope_probe = (rope, rope(positions, probe.qk, self.lean.num_heads * self.lean.head_dim).data_ptr()
                                == probe.qkv.data_ptr())
        return self._rope_probe[1]

    def _causal_mask(self, n: int, keys: int) -> torch.Tensor:
        """[n, keys] bool: new token j (key keys - n + j) sees every key up to itself; a view."""
        if self._causal.shape[0] < keys:
            size = max(keys, min(max(2 * self._causal.shape[0], MASK_START), self.lean._max_positions))
            self._causal = torch.ones(size, size, dtype=torch.bool, device=self._causal.device).tril()
        return self._causal[keys - n:keys, :keys]

    @torch.no_grad()
    def forward_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowAttention],
        last: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """As :meth:`LeanLlama.forward_rows`; one row takes the fast path (with its mask, if any:
        the paths of one request's token-tree wave, merged into one row by the draft runtime)."""
        if len(rows) != 1 or rows[0].n > MAX_FAST_TOKENS:
            return self.lean.forward_rows(input_ids, positions, rows, last)
        return self._forward_row(input_ids, positions, rows[0], last)

    def _forward_row(self, input_ids, positions, row: RowAttention, last):
        lean, kernels, out_kernels = self.lean, self.kernels, self.out_kernels
        n, at, keys = row.n, row.write_at, row.keys
        if lean.rope_cos.shape[0] < lean._max_positions:  # a long-context draft: is the table long enough?
            needed = int(positions.max()) + 1
            if needed > lean.rope_cos.shape[0]:
                lean._rope_table(max(needed, 2 * lean.rope_cos.shape[0]))
        self.fast_forwards += 1
        b = self._buffers_for(n)
        eps, q_size, gqa = lean.eps, lean.num_heads * lean.head_dim, lean.num_kv_heads != lean.num_heads
        rope, attend, rope_in_place = lean._rope, self.attend, self._rope_in_place()
        kv = row.kv
        # per layer, in three calls: where its new K/V go ([2, kv_heads, n, dim]) and what it
        # attends to (K, V [1, kv_heads, keys, dim])
        slots = kv[:, :, :, at:at + n].unbind(0)
        seen = kv[:, :, None, :, :keys]
        seen_keys, seen_values = seen[:, 0].unbind(0), seen[:, 1].unbind(0)
        mask = row.mask if row.mask is not None else (None if n == 1 else self._causal_mask(n, keys))
        residual = torch.index_select(lean.embed, 0, input_ids, out=b.residual)
        h = b.h
        out_kernels.rms_norm_into(h, residual, self.layers[0][0], eps)
        layers = self.layers
        for index, (_, qkv, qkv_b, o_proj, norm_post, gate_up, down) in enumerate(layers):
            qkv(h, b.qkv)
            if qkv_b is not None:
                b.qkv.add_(qkv_b)
            qk = rope(positions, b.qk, q_size)
            if not rope_in_place:  # torch's rope returns the rotated heads
                b.qk.view_as(qk).copy_(qk)
            slots[index].copy_(b.new_kv)
            attention = attend(b.q, seen_keys[index], seen_values[index], attn_mask=mask,
                               enable_gqa=gqa)  # [1, heads, n, dim]
            if n == 1:
                attended = attention.view(1, q_size)
            else:
                attended = b.attended
                attended.view(n, lean.num_heads, lean.head_dim).copy_(attention[0].transpose(0, 1))
            o_proj(attended, b.o)
            h, residual = kernels.add_rms_norm(b.o, residual, norm_post, eps)
            gate_up(h, b.gate_up)
            out_kernels.silu_and_mul_into(b.act, b.gate_up)
            down(b.act, b.down)
            if index + 1 < len(layers):
                h, residual = kernels.add_rms_norm(b.down, residual, layers[index + 1][0], eps)
        if last is None:
            return None, None
        # the final residual add and norm of the wanted token only (fresh tensors: callers keep them)
        final = residual.index_select(0, last)
        hidden, _ = kernels.add_rms_norm(b.down.index_select(0, last), final, lean.norm, eps)
        return lean._lm_head(hidden).float(), hidden
