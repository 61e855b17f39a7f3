"""Lossless tree verification inside vLLM 0.32 on CPU: ``tree_drafting: {"verify": "tree"}``.

vLLM 0.32 verifies chains only (its tree attention was removed upstream). This module holds all
the vLLM coupling that lets the plugin's :class:`~vllm_specplugin.proposers.tree.TreeProposer`
have a whole token tree verified in one target forward, exactly (the design, with the vLLM
internals each step relies on and the acceptance rule: ``docs/tree-verification.md``):

1. **Drafts = tree nodes.** The proposer returns the tree's nodes parents first (BFS) as the
   request's draft tokens; the adapter keeps each request's parents (``tree_plans``). vLLM's
   scheduler only ever cuts drafts to a prefix, and a BFS prefix of a tree is a tree.
2. **Positions** (``_prepare_inputs`` wrapper): after vLLM computed positions and the slot mapping
   from them (sequential slots, which are kept), the tree rows' positions become n0 + depth.
3. **Attention** (:class:`TreeCPUAttentionImpl`, registered for ``CPU_ATTN`` through vLLM's
   backend registry): vLLM's kernel runs for every row, then the tree rows of tree requests are
   recomputed with SDPA over [the cached prefix, read from the paged cache | the in-flight tree
   K/V] under the mask [ones(n0) | ancestor-or-self].
4. **Sampling** (``_sample`` wrapper): the tree is walked with
   :func:`~vllm_specplugin.proposers.tree_verify.verify_tree_nodes` on vLLM's processed target
   distributions (``apply_sampling_constraints``; greedy: the argmax) with the rule the drafted
   tree carries (``TokenTree.rule``: recursive rejection sampling, against the draft rows the
   children were drawn from, for the T > 0 trees whose children are drawn without replacement;
   the one-hot rule for top-k trees and at T = 0) and the request's own generator; the request's
   output row becomes the accepted path + one token, as the rejection sampler writes it.
5. **KV compaction**: the accepted node at depth d is rewritten into the slot of row d with the
   backend's own cache writer (``do_kv_cache_update``), before the next forward (async
   scheduling is off for custom_class).
6. **Start-up check and layout probe** (``initialize_kv_cache`` wrapper): refuses tree mode with
   :class:`TreeVerificationUnavailable` when the model or engine uses something this path does
   not handle, or when known values written with vLLM's writer do not read back.
7. **Platforms** (:data:`CPU_BACKEND`, :data:`CUDA_BACKENDS`): the same subclass, recompute,
   compaction and probe over vLLM's CPU backend or, on CUDA, its FlashAttention, Triton and
   FlexAttention backends (one cache layout, token rows [K | V]). The CUDA path is UNTESTED on a
   GPU: its layout helpers and backend selection are unit-tested on CPU tensors only, its CUDA
   modules are imported only in a CUDA worker, and full CUDA graphs (which would replay vLLM's
   kernel without the recompute) are refused.

Requests needing chain-only features (penalties, bad words, min_tokens, structured output,
logprobs, logit bias, min_p, allowed tokens, thinking budget) are drafted and verified as a chain.

``SPECPLUGIN_TREE_FAULT`` (tests only) injects one of :data:`TREE_FAULTS`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from vllm_specplugin.config import SpecPluginConfig
from vllm_specplugin.logging_utils import get_logger, log_once
from vllm_specplugin.proposers.merged_tree import MERGED_FAULTS, MergedTree, verify_merged_tree
from vllm_specplugin.proposers.tree_verify import (
    FAULTS as WALK_RULE_FAULTS,
    AcceptanceRule,
    draft_probs_from_tree,
    tree_attention_mask,
    tree_children,
    tree_depths,
    verify_tree_nodes,
)

logger = get_logger()

FAULT_ENV = "SPECPLUGIN_TREE_FAULT"
# Deliberate faults, for proving the engine tests catch them:
#   probe_layout: the cache reader assumes a layout vLLM's writer does not use (the probe must refuse);
#   no_ancestor_mask: tree rows attend causally to every earlier node (siblings included);
#   no_tree_positions: tree rows keep sequential positions instead of n0 + depth;
#   no_kv_compaction: the accepted path's K/V stay in the slots of its BFS rows;
#   first_child_only: the walk tries only the first child of each node (a chain);
#   residual_not_updated, iid_on_topk, q_not_updated: the walk's acceptance rule is wrong, as
#     proposers/tree_verify.py's FAULTS of those names (the target residual is not updated after a
#     rejected sibling; the i.i.d. rule min(1, p/q), max(p - q, 0) on the top-k tree, with q the
#     draft distribution the tree's children were chosen from; without replacement, q not
#     renormalised without the rejected siblings). The first two act on top-k trees: with them the
#     tree proposer drafts top-k children at T > 0 too (children = "topk"), which the one-hot walk
#     verifies; q_not_updated acts on the default T > 0 trees (children drawn without replacement).
#     All need T > 0 to act: a greedy walk verifies one-hot targets, where none changes anything.
#   merged_residual_not_updated, merged_wrong_q: a merged tree's walk (several drafters' proposals,
#     tree_drafting.merge) is wrong as proposers/merged_tree.py's MERGED_FAULTS: each drafter's
#     proposals at a node start again from the target row instead of the residual the earlier
#     drafter left; a one-hot drafter's token verified with the model draft's q at the same node.
WALK_FAULTS = ("residual_not_updated", "iid_on_topk", "q_not_updated")
TOPK_FAULTS = ("residual_not_updated", "iid_on_topk")
assert set(WALK_FAULTS) <= set(WALK_RULE_FAULTS)
TREE_FAULTS = ("probe_layout", "no_ancestor_mask", "no_tree_positions", "no_kv_compaction", "first_child_only",
               *WALK_FAULTS, *MERGED_FAULTS)

# Paged-cache layouts of vLLM 0.32's cache tensor [num_blocks, H_kv, B, 2D]. On CPU, one block and
# head is [K region | V region] of B * D elements each (vLLM views the cache as
# [num_blocks, H_kv, 2B, D] and chunks it): "k_dxb": K column-major [D, B], V row-major [B, D] (CPU
# "vec" ISA, checked for fp32 and bf16); "k_bxd": both row-major [B, D]; "amx_vnni" (the "amx" ISA
# vLLM picks for bf16 caches with B % 32 == 0 on CPUs with AMX, e.g. Sapphire Rapids): tiles packed
# for AMX's VNNI products, K as [B/16, D/2, 16, 2] (16-token tiles, pairs of dims) and V as
# [D/16, B/2, 16, 2] (16-dim tiles, pairs of tokens), mapped by writing with vLLM's writer. On CUDA (FlashAttention,
# Triton and FlexAttention backends alike), every token's row of 2D holds [K | V]:
# "kv_interleaved", ``key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)``, each
# [num_blocks, B, H_kv, D]. The probe picks the first of its backend's layouts that reads back what
# vLLM's writer wrote.
LAYOUTS = ("k_dxb", "k_bxd", "amx_vnni", "kv_interleaved")
_BOGUS_LAYOUT = "v_dxb"  # K and V both column-major: what the probe_layout fault reads with


@dataclasses.dataclass(frozen=True)
class TreeBackendSpec:
    """One vLLM attention backend the tree path subclasses: the registry name it is routed through,
    vLLM's module and classes (imported only when used, in a worker of that platform), the cache
    layouts its writer may use, and whether the path has run on that backend."""

    name: str  # AttentionBackendEnum member
    module: str
    backend_class: str
    impl_class: str
    layouts: tuple[str, ...]
    tested: bool

    @property
    def tree_backend_name(self) -> str:
        return f"Tree{self.backend_class}"

    @property
    def tree_impl_name(self) -> str:
        return "Tree" + self.impl_class.replace("BackendImpl", "Impl")  # TreeCPUAttentionImpl, TreeFlashAttentionImpl


_BACKENDS = "vllm.v1.attention.backends."
CPU_BACKEND = TreeBackendSpec("CPU_ATTN", _BACKENDS + "cpu_attn", "CPUAttentionBackend", "CPUAttentionBackendImpl",
                              ("k_dxb", "k_bxd", "amx_vnni"), tested=True)
# The CUDA path: the same torch recompute and compaction over vLLM's CUDA cache layout. UNTESTED on
# CUDA (written and unit-tested on CPU tensors with these layouts; no GPU was available).
CUDA_BACKENDS = (
    TreeBackendSpec("FLASH_ATTN", _BACKENDS + "flash_attn", "FlashAttentionBackend", "FlashAttentionImpl",
                    ("kv_interleaved",), tested=False),
    TreeBackendSpec("TRITON_ATTN", _BACKENDS + "triton_attn", "TritonAttentionBackend", "TritonAttentionImpl",
                    ("kv_interleaved",), tested=False),
    TreeBackendSpec("FLEX_ATTENTION", _BACKENDS + "flex_attention", "FlexAttentionBackend", "FlexAttentionImpl",
                    ("kv_interleaved",), tested=False),
)
ALL_BACKENDS = (CPU_BACKEND, *CUDA_BACKENDS)


def platform_backends(platform: str) -> tuple[TreeBackendSpec, ...]:
    """The backends tree verification routes on a platform ("cpu", "cuda"); none elsewhere."""
    return {"cpu": (CPU_BACKEND,), "cuda": CUDA_BACKENDS}.get(platform, ())


def current_platform_name() -> str:
    """"cpu", "cuda" or vLLM's device name of the platform this process runs on."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", "unknown"))


def backend_spec_of(impl) -> TreeBackendSpec | None:
    """The spec whose tree impl ``impl`` is (None: not a tree attention impl)."""
    for spec in ALL_BACKENDS:
        if type(impl).__name__ == spec.tree_impl_name and spec.name in _CLASSES and isinstance(
                impl, _CLASSES[spec.name][1]):
            return spec
    return None


class TreeVerificationUnavailable(RuntimeError):
    """Tree verification was asked for but cannot run exactly on this engine."""


def requested_fault() -> str | None:
    from vllm_specplugin.fault_switch import fault_variable

    fault = fault_variable(FAULT_ENV) or None
    if fault is not None and fault not in TREE_FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r}: expected one of {list(TREE_FAULTS)}")
    return fault


# ---------------------------------------------------------------------------------------------
# Pure helpers (torch only)
# ---------------------------------------------------------------------------------------------


def read_paged_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layout: str):
    """The first ``num_tokens`` tokens' K and V of one request from a paged cache.

    ``kv_cache`` [num_blocks, H_kv, B, 2D] (vLLM's cache tensor, CPU or CUDA); ``block_ids``
    [>= ceil(n / B)] the request's block table row; ``layout`` one of :data:`LAYOUTS`. Returns
    (K, V), each [num_tokens, H_kv, D] in the cache dtype, on the cache's device.
    """
    block = kv_cache.shape[2]
    needed = -(-num_tokens // block)
    # index_select, not kv_cache[ids]: advanced indexing of the cache took 8x as long on CPU (288 vs 34 us, 1 MB).
    blocks = kv_cache.index_select(0, block_ids[:needed].long().to(kv_cache.device))  # [n_blk, H, B, 2D], a copy
    return blocks_kv(blocks, num_tokens, layout)


def blocks_kv(blocks: torch.Tensor, num_tokens: int, layout: str):
    """The first ``num_tokens`` tokens' (K, V), each [num_tokens, H_kv, D], of cache blocks
    ``blocks`` [n_blk, H_kv, B, 2D] taken in order (:func:`read_paged_kv` without the gather)."""
    needed, heads, block, two_d = blocks.shape
    dim = two_d // 2
    if layout == "kv_interleaved":  # token rows [K | V] (CUDA backends)
        k, v = blocks.transpose(1, 2).split(dim, dim=-1)  # each [n_blk, B, H, D]
        return (k.reshape(needed * block, heads, dim)[:num_tokens],
                v.reshape(needed * block, heads, dim)[:num_tokens])
    regions = blocks.reshape(needed, heads, 2, block * dim)
    k_region, v_region = regions[:, :, 0], regions[:, :, 1]
    if layout == "amx_vnni":  # CPU "amx" ISA (bf16): VNNI-packed tiles of 16
        k = k_region.reshape(needed, heads, block // 16, dim // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
        v = v_region.reshape(needed, heads, dim // 16, block // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
        return (k.reshape(needed * block, heads, dim)[:num_tokens],
                v.reshape(needed * block, heads, dim)[:num_tokens])
    if layout in ("k_dxb", _BOGUS_LAYOUT):
        k = k_region.reshape(needed, heads, dim, block).permute(0, 3, 1, 2)
    elif layout == "k_bxd":
        k = k_region.reshape(needed, heads, block, dim).permute(0, 2, 1, 3)
    else:
        raise ValueError(f"unknown cache layout {layout!r}")
    if layout == _BOGUS_LAYOUT:
        v = v_region.reshape(needed, heads, dim, block).permute(0, 3, 1, 2)
    else:
        v = v_region.reshape(needed, heads, block, dim).permute(0, 2, 1, 3)
    return (k.reshape(needed * block, heads, dim)[:num_tokens],
            v.reshape(needed * block, heads, dim)[:num_tokens])


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_key: torch.Tensor,
                   prefix_value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a tree's rows: node i sees the whole prefix and its ancestors-or-self. One tree,
    unpadded: the reference the engine's :func:`tree_attention_batch` is tested against.

    ``query`` [N, H, D]; ``key``/``value`` [N, H_kv, D] (the tree's own, post-RoPE);
    ``prefix_key``/``prefix_value`` [n0, H_kv, D]; ``mask`` [N, N] bool (True: attend).
    Returns [N, H, D] float32 (GQA: H_kv divides H).
    """
    num_nodes, heads, _ = query.shape
    keys = torch.cat([prefix_key.float(), key.float()])
    values = torch.cat([prefix_value.float(), value.float()])
    group = heads // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    full_mask = torch.cat(
        [torch.ones(num_nodes, prefix_key.shape[0], dtype=torch.bool, device=mask.device), mask], dim=1
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=full_mask.to(query.device), scale=scale,
    )
    return out.transpose(0, 1)


def tree_attention_batch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_key: torch.Tensor,
                         prefix_value: torch.Tensor, prefix_lengths: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """:func:`tree_attention` for E trees at once, padded: one attention call, no loop.

    ``query`` [E, M, H, D] (M <= N: the rows to compute, any subset of each tree's nodes);
    ``key``/``value`` [E, N, H_kv, D] (every node of the tree); ``prefix_key``/``prefix_value``
    [E, L, H_kv, D], of which entry e's first ``prefix_lengths[e]`` rows are its prefix (the rest
    is padding, possibly garbage: zeroed before use, so a NaN there cannot leak); ``mask``
    [E, M, N] bool, query row against node (every row needs a True: padded rows attend to a real
    node). Returns [E, M, H, D] float32.
    """
    longest, padding, full_mask = tree_attention_masks(prefix_lengths, mask, prefix_key.device)
    return _tree_attention_masked(query, key, value, prefix_key[:, :longest], prefix_value[:, :longest],
                                  padding, full_mask, scale)


def tree_attention_masks(prefix_lengths: torch.Tensor, mask: torch.Tensor, device) -> tuple:
    """What :func:`tree_attention_batch` needs besides the tensors, the same for every layer of a
    step: (L, the longest prefix; padding [E, L, 1, 1] bool, True past an entry's prefix, or None
    when no entry has any; the attention mask [E, 1, M, L + N] bool)."""
    entries, rows, _ = mask.shape
    longest = int(prefix_lengths.max())
    valid = torch.arange(longest, device=device)[None, :] < prefix_lengths.to(device)[:, None]
    padding = None if bool(valid.all()) else ~valid[:, :, None, None]
    full_mask = torch.cat([valid[:, None, :].expand(entries, rows, longest), mask.to(device)], dim=2)
    return longest, padding, full_mask[:, None]


def _tree_attention_masked(query, key, value, prefix_key, prefix_value, padding, full_mask, scale) -> torch.Tensor:
    """:func:`tree_attention_batch` with the prefixes cut to L and the masks of
    :func:`tree_attention_masks`."""
    prefix_key, prefix_value = prefix_key.float(), prefix_value.float()
    if padding is not None:  # padding rows (entries of different lengths): zero them, NaN included
        prefix_key, prefix_value = prefix_key.masked_fill(padding, 0), prefix_value.masked_fill(padding, 0)
    keys = torch.cat([prefix_key, key.float()], dim=1)  # [E, L + N, H_kv, D]
    values = torch.cat([prefix_value, value.float()], dim=1)
    return _attend(query, keys.transpose(1, 2), values.transpose(1, 2), full_mask, scale)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, full_mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """The tree rows' attention call: ``query`` [E, M, H, D]; ``keys``/``values`` [E, H_kv, L + N, D]
    float32 (KV heads repeated for GQA here); ``full_mask`` [E, 1, M, L + N]. Returns [E, M, H, D]."""
    group = query.shape[2] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(1, 2), keys, values, attn_mask=full_mask.to(query.device), scale=scale)
    return out.transpose(1, 2)


# Layouts whose K and V the tree attention reads in place, block by block (:func:`tree_attention_blocks`).
BLOCK_NATIVE_LAYOUTS = ("k_dxb", "k_bxd")
# Tests and A/B measurements only: True sends those layouts through the gather into token order too.
BLOCK_NATIVE_OFF = False


def block_attention_masks(prefix_lengths: torch.Tensor, mask: torch.Tensor, blocks: int, block: int,
                          heads_kv: int, device) -> tuple:
    """What :func:`tree_attention_blocks` needs besides the tensors, the same for every layer of a
    step: :func:`tree_attention_masks`' (L, the longest prefix; the attention mask [E, 1, M, L + N]),
    with, in place of the padding mask, the flat row indices (into [E, H_kv, blocks * B + N] key rows)
    of the positions past each shorter entry's prefix, or None when every prefix is L long."""
    longest, padding, full_mask = tree_attention_masks(prefix_lengths, mask, device)
    rows = blocks * block + mask.shape[2]
    if padding is None:
        return longest, None, full_mask
    entry, position = padding[:, :, 0, 0].nonzero(as_tuple=True)  # past each entry's prefix
    heads = torch.arange(heads_kv, device=device)
    flat = (entry[:, None] * heads_kv + heads[None, :]) * rows + position[:, None]
    return longest, flat.reshape(-1), full_mask


def tree_attention_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: torch.Tensor,
                          layout: str, masks: tuple, scale: float) -> torch.Tensor:
    """:func:`tree_attention_batch` reading the prefixes from the gathered cache blocks with one
    strided copy each for K and V into the attention's own layout (the general path reorders each
    block into token order, then concatenates the tree's keys, then zeroes the padding: three
    passes).

    ``query`` [E, M, H, D]; ``key``/``value`` [E, N, H_kv, D] (every node of each tree);
    ``blocks`` [E * nb, H_kv, B, 2D]: entry e's nb cache blocks in order; ``layout`` in
    :data:`BLOCK_NATIVE_LAYOUTS`; ``masks`` from :func:`block_attention_masks`. Returns [E, M, H, D]
    float32, the same as :func:`tree_attention_batch` up to float rounding."""
    if layout not in BLOCK_NATIVE_LAYOUTS:
        raise ValueError(f"tree_attention_blocks reads layouts {BLOCK_NATIVE_LAYOUTS}, not {layout!r}")
    longest, past_rows, full_mask = masks
    entries, dim = query.shape[0], query.shape[3]
    nodes = key.shape[1]
    heads_kv, block = blocks.shape[1], blocks.shape[2]
    count = blocks.shape[0] // entries
    regions = blocks.view(entries, count, heads_kv, 2, block * dim)
    if layout == "k_dxb":  # K^T of each block: [E, nb, H_kv, D, B]
        prefix_k = regions[:, :, :, 0].view(entries, count, heads_kv, dim, block).permute(0, 2, 1, 4, 3)
    else:
        prefix_k = regions[:, :, :, 0].view(entries, count, heads_kv, block, dim).transpose(1, 2)
    prefix_v = regions[:, :, :, 1].view(entries, count, heads_kv, block, dim).transpose(1, 2)  # [E, H_kv, nb, B, D]
    # [E, H_kv, nb * B + N, D] float32: the prefix blocks in token order (converted in the same copy),
    # the tree's keys from position L on (over what follows the longest prefix in its blocks).
    keys = torch.empty(entries, heads_kv, count * block + nodes, dim, dtype=torch.float32, device=query.device)
    values = torch.empty_like(keys)
    keys[:, :, :count * block].view(entries, heads_kv, count, block, dim).copy_(prefix_k)
    values[:, :, :count * block].view(entries, heads_kv, count, block, dim).copy_(prefix_v)
    keys[:, :, longest:longest + nodes].copy_(key.transpose(1, 2))
    values[:, :, longest:longest + nodes].copy_(value.transpose(1, 2))
    if past_rows is not None:  # past a shorter prefix: other tokens, or never written (NaN would leak)
        keys.view(-1, dim).index_fill_(0, past_rows, 0.0)
        values.view(-1, dim).index_fill_(0, past_rows, 0.0)
    return _attend(query, keys[:, :, :longest + nodes], values[:, :, :longest + nodes], full_mask, scale)


def first_child_subtree(parents: Sequence[int]) -> list[int]:
    """Nodes reachable from the root through first children only (the first_child_only fault)."""
    children = tree_children(parents)
    keep, node = [0], 0
    while children[node]:
        node = children[node][0]
        keep.append(node)
    return keep


def walk_tree(target_probs: torch.Tensor, parents: Sequence[int], tokens: Sequence[int], *, greedy: bool,
              generator: torch.Generator | None, fault: str | None = None,
              draft_probs: torch.Tensor | None = None,
              rule: AcceptanceRule | str = AcceptanceRule.ONE_HOT) -> tuple[list[int], list[int]]:
    """One lossless walk: (accepted nodes root -> leaf, emitted tokens) with ``rule``.

    ``target_probs`` [N, V] float64: row j = the processed target distribution after node j
    (greedy: any distribution whose argmax is the target's choice, e.g. one-hot; greedy walks
    use the one-hot rule whatever ``rule`` says). ``draft_probs`` [N, V]: the draft rows the
    children were chosen from (row j: node j's children's), needed by the without-replacement
    rule and the ``iid_on_topk`` fault. ``fault`` in :data:`WALK_FAULTS` is passed on to
    :func:`verify_tree_nodes` (the rule's known wrong variants).
    """
    rule = AcceptanceRule(rule)
    if (rule is not AcceptanceRule.ONE_HOT or fault == "iid_on_topk") and draft_probs is None and not greedy:
        raise ValueError(f"the {rule.value} walk{' with fault ' + fault if fault else ''} needs the tree's draft rows")
    if fault == "first_child_only":
        keep = first_child_subtree(parents)
        index = {node: i for i, node in enumerate(keep)}
        sub_parents = [-1] + [index[parents[n]] for n in keep[1:]]
        accepted, emitted = verify_tree_nodes(
            target_probs[keep], None if draft_probs is None else draft_probs[keep], sub_parents,
            [tokens[n] for n in keep], rule, generator, greedy=greedy,
        )
        return [keep[a] for a in accepted], emitted
    return verify_tree_nodes(target_probs, draft_probs, parents, tokens, rule, generator, greedy=greedy,
                             fault=fault if fault in WALK_FAULTS else None)


def non_first_children(parents: Sequence[int], accepted: Sequence[int]) -> int:
    """How many accepted nodes are not their parent's first child (what a chain could not accept)."""
    children = tree_children(parents)
    return sum(1 for node in accepted if children[parents[node]][0] != node)


def compaction_moves(accepted: Sequence[int]) -> list[tuple[int, int]]:
    """(source node row, destination row) pairs that put the accepted node of depth d in row d."""
    return [(node, depth) for depth, node in enumerate(accepted, start=1) if node != depth]


# ---------------------------------------------------------------------------------------------
# One step's plan, shared by the runner wrappers and the attention impl (same process and thread)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TreeEntry:
    row: int  # batch row of the request
    req_id: str
    query_start: int  # first token row of the request in this step (the root)
    parents: list[int]  # [N], root included
    tokens: list[int]  # [N]: tokens[0] = -1 (the root is already in the context), then the nodes
    mask: torch.Tensor  # [N, N] bool, ancestor-or-self

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


@dataclasses.dataclass
class _SavedLayer:
    impl: object
    layer: object
    kv_cache: torch.Tensor
    keys: list[torch.Tensor]  # per entry [N, H_kv, D] post-RoPE
    values: list[torch.Tensor]
    slots: list[torch.Tensor]  # per entry [N] int64, the rows' slots


@dataclasses.dataclass
class TreeStep:
    entries: list[TreeEntry]
    layout: str
    fault: str | None
    saved: list[_SavedLayer] = dataclasses.field(default_factory=list)
    backend: TreeBackendSpec = CPU_BACKEND  # whose cache writer compacts
    layout_cache: _StepLayout | None = None  # the trees' rows and masks, from the first layer


_CURRENT: TreeStep | None = None


# ---------------------------------------------------------------------------------------------
# The attention backend
# ---------------------------------------------------------------------------------------------


def _vllm_classes(spec: TreeBackendSpec) -> tuple[type, type]:
    """vLLM's (backend, impl) classes of ``spec``, imported now (a CUDA module only on CUDA)."""
    import importlib

    module = importlib.import_module(spec.module)
    return getattr(module, spec.backend_class), getattr(module, spec.impl_class)


def _backend_classes(spec: TreeBackendSpec):
    from vllm.v1.attention.backend import AttentionType

    base_backend, base_impl = _vllm_classes(spec)

    class TreeAttentionImpl(base_impl):
        """vLLM's attention, then the tree rows of tree requests recomputed with an ancestor mask."""

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
            step = _CURRENT
            if (step is not None and attn_metadata is not None and key is not None
                    and self.attn_type == AttentionType.DECODER):
                _recompute_tree_rows(self, step, layer, query, key, value, kv_cache, attn_metadata, output)
            return result

    class TreeAttentionBackend(base_backend):
        @staticmethod
        def get_impl_cls():
            return TreeAttentionImpl

    TreeAttentionBackend.__name__ = spec.tree_backend_name
    TreeAttentionImpl.__name__ = spec.tree_impl_name
    for cls in (TreeAttentionBackend, TreeAttentionImpl):
        cls.__qualname__ = cls.__name__  # resolvable (and picklable) as module attributes, see __getattr__
    return TreeAttentionBackend, TreeAttentionImpl


_CLASSES: dict[str, tuple] = {}  # spec name -> (tree backend, tree impl)


def backend_classes(spec: TreeBackendSpec = CPU_BACKEND) -> tuple:
    """(TreeXBackend, TreeXImpl) for vLLM's backend ``spec`` (default CPU: TreeCPUAttentionBackend,
    TreeCPUAttentionImpl), built on first use: importing vLLM's attention while plugins load
    (early in every vLLM process) is avoided, and a CUDA backend is imported only when used."""
    if spec.name not in _CLASSES:
        _CLASSES[spec.name] = _backend_classes(spec)
    return _CLASSES[spec.name]


def __getattr__(name: str):
    # vLLM's registry resolves backend_path(spec) with import_module + getattr, which lands here.
    for spec in ALL_BACKENDS:
        if name == spec.tree_backend_name:
            return backend_classes(spec)[0]
        if name == spec.tree_impl_name:
            return backend_classes(spec)[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_path(spec: TreeBackendSpec) -> str:
    return f"{__name__}.{spec.tree_backend_name}"


BACKEND_PATH = backend_path(CPU_BACKEND)


# The gathered keys of one attention call are bounded by this (float32 bytes, K and V of the padded
# prefixes): trees of a large batch are attended in chunks of entries, not all at once.
TREE_ATTENTION_CHUNK_BYTES = 256 << 20


@dataclasses.dataclass
class _StepLayout:
    """Where a step's trees sit, computed at its first attention layer (the same for every layer)."""

    node_rows: torch.Tensor  # [E, N] int64: each node's token row (padding: the entry's root row)
    rows: torch.Tensor  # [sum of sizes] int64: the nodes' token rows, entry by entry
    sizes: list[int]  # [E] nodes per entry (root included)
    prefix_lengths: torch.Tensor  # [E] int64: n0, the root's position
    block_rows: torch.Tensor  # [E] int64: the entries' batch rows (their block table rows)
    query_rows: torch.Tensor  # [E, M] int64: the token rows recomputed (padding: the entry's root row)
    query_real: torch.Tensor  # [E, M] bool: a recomputed row, not padding
    mask: torch.Tensor  # [E, M, N] bool: the recomputed rows' ancestors-or-self; padding rows see the root
    # Per chunk of entries, from the first layer on (the same for every layer): (entries slice,
    # block ids [E_c * blocks] int64, blocks per entry, tree_attention_masks(...) of the chunk,
    # the chunk's real recomputed rows: their flat positions in [E_c * M], their token rows).
    chunks: list | None = None


def leading_chain(parents: Sequence[int]) -> int:
    """How many of a tree's first rows (root included) form a chain from the root: row i < k has
    parent i - 1, so its ancestors-or-self are exactly rows 0..i, which is what the engine's causal
    attention already gave that row. Those rows are not recomputed."""
    k = 1
    while k < len(parents) and parents[k] == k - 1:
        k += 1
    return k


def _step_layout(step: TreeStep, attn_metadata) -> _StepLayout:
    entries = step.entries
    sizes = [entry.num_nodes for entry in entries]
    width = max(sizes)
    offsets = torch.arange(width)
    starts = torch.tensor([entry.query_start for entry in entries], dtype=torch.int64)
    real = offsets[None, :] < torch.tensor(sizes)[:, None]
    node_rows = torch.where(real, starts[:, None] + offsets[None, :], starts[:, None])
    # Only the rows whose causal result is wrong are recomputed: from the first row off the leading
    # chain on (a confident draft's tree is mostly chain, its siblings last).
    leads = [leading_chain(entry.parents) for entry in entries]
    counts = [n - lead for n, lead in zip(sizes, leads)]
    height = max(counts)
    query_real = torch.arange(height)[None, :] < torch.tensor(counts)[:, None]
    first = torch.tensor(leads, dtype=torch.int64)
    query_rows = torch.where(query_real, starts[:, None] + first[:, None] + torch.arange(height)[None, :], starts[:, None])
    mask = torch.zeros(len(entries), height, width, dtype=torch.bool)
    mask[:, :, 0] = True  # padding rows attend to the root (overwritten for real rows)
    for index, entry in enumerate(entries):
        n, lead = entry.num_nodes, leads[index]
        full = torch.ones(n, n, dtype=torch.bool).tril() if step.fault == "no_ancestor_mask" else entry.mask
        mask[index, :n - lead, :n] = full[lead:]
    block_rows = torch.tensor([entry.row for entry in entries], dtype=torch.int64)
    seq_lens = torch.as_tensor(attn_metadata.seq_lens).to("cpu", torch.int64)
    prefix_lengths = seq_lens[block_rows] - torch.tensor(sizes)
    return _StepLayout(node_rows, node_rows[real], sizes, prefix_lengths, block_rows, query_rows, query_real, mask)


def _attention_chunks(plan: _StepLayout, attn_metadata, kv_cache: torch.Tensor, device, native: bool) -> list:
    """The step's attention calls (see :attr:`_StepLayout.chunks`): entries in chunks bounded by
    :data:`TREE_ATTENTION_CHUNK_BYTES`; none when no row is off a leading chain (every entry a
    chain: merged trees are walked by the merged rule even when chain-shaped), where the engine's
    causal rows are already right and only K/V are saved."""
    if plan.query_rows.shape[1] == 0:
        return []
    _, heads_kv, block, two_d = kv_cache.shape
    per_entry = 2 * 4 * heads_kv * (two_d // 2) * (int(plan.prefix_lengths.max()) + plan.mask.shape[2])
    size = max(1, TREE_ATTENTION_CHUNK_BYTES // max(1, per_entry))
    table_device = attn_metadata.block_table.device
    chunks = []
    for first in range(0, len(plan.sizes), size):
        part = slice(first, first + size)
        lengths = plan.prefix_lengths[part]
        blocks = max(1, -(-int(lengths.max()) // block))
        table = attn_metadata.block_table[plan.block_rows[part].to(table_device), :blocks]
        real = plan.query_real[part].reshape(-1)
        real_at = real.nonzero().flatten()
        masks = (block_attention_masks(lengths, plan.mask[part], blocks, block, heads_kv, device)
                 if native else tree_attention_masks(lengths, plan.mask[part], device))
        chunks.append((part, table.reshape(-1).long().to(kv_cache.device), blocks, masks,
                       real_at.to(device), plan.query_rows[part].reshape(-1)[real_at].to(device)))
    return chunks


def _recompute_tree_rows(impl, step: TreeStep, layer, query, key, value, kv_cache, attn_metadata, output) -> None:
    """Overwrite ``output`` [T, H, D] at every tree entry's rows with tree attention, and save the
    rows' K/V [N, H_kv, D] and slots [N] for the compaction after sampling.

    All trees of the step in one padded attention call (chunked by memory), their prefixes read
    from the paged cache in one gather: no loop over requests per layer."""
    if step.layout_cache is None:
        step.layout_cache = _step_layout(step, attn_metadata)
    plan = step.layout_cache
    device = query.device
    heads, heads_kv, dim = query.shape[1], key.shape[1], key.shape[2]
    # CPU layouts are read block by block where they lie (tree_attention_blocks); the others
    # (AMX's packed tiles, CUDA's interleaved rows) are gathered into token order first.
    native = step.layout in BLOCK_NATIVE_LAYOUTS and not BLOCK_NATIVE_OFF
    if plan.chunks is None:
        plan.chunks = _attention_chunks(plan, attn_metadata, kv_cache, device, native)
    # Gathers by index_select and a write by index_copy_: advanced indexing (tensor[rows]) cost
    # several times as much on CPU at these sizes. No chunk when no row is off a leading chain.
    for part, block_ids, blocks, masks, real_at, real_rows in plan.chunks:
        entries = block_ids.shape[0] // blocks
        rows, q_rows = plan.node_rows[part], plan.query_rows[part]
        queries = query.index_select(0, q_rows.reshape(-1).to(device)).view(entries, -1, heads, dim)
        keys = key.index_select(0, rows.reshape(-1).to(device)).view(entries, -1, heads_kv, dim)
        values = value.index_select(0, rows.reshape(-1).to(device)).view(entries, -1, heads_kv, dim)
        gathered = kv_cache.index_select(0, block_ids)  # [E * blocks, H_kv, B, 2D], a copy
        if native:
            out = tree_attention_blocks(queries, keys, values, gathered, step.layout, masks, impl.scale)
        else:
            longest, padding, full_mask = masks
            prefix_k, prefix_v = blocks_kv(gathered, block_ids.shape[0] * kv_cache.shape[2], step.layout)
            prefix_k = prefix_k.view(entries, -1, heads_kv, dim)[:, :longest]
            prefix_v = prefix_v.view(entries, -1, heads_kv, dim)[:, :longest]
            out = _tree_attention_masked(queries, keys, values, prefix_k, prefix_v, padding, full_mask, impl.scale)
        output.index_copy_(0, real_rows, out.reshape(-1, heads, dim).index_select(0, real_at).to(output.dtype))
    rows = plan.rows.to(device)
    keys, values = key.index_select(0, rows), value.index_select(0, rows)  # copies: saved past this layer
    slots = attn_metadata.slot_mapping.index_select(0, rows.to(attn_metadata.slot_mapping.device)).to(torch.int64)
    step.saved.append(_SavedLayer(impl, layer, kv_cache, list(keys.split(plan.sizes)), list(values.split(plan.sizes)),
                                  list(slots.split(plan.sizes))))


def register_backend(platform: str | None = None) -> None:
    """Route this platform's attention backends (:func:`platform_backends`: CPU_ATTN on CPU;
    FLASH_ATTN, TRITON_ATTN and FLEX_ATTENTION on CUDA) to their tree subclasses (in a worker,
    before the model is built); the selector's cache is cleared so that no earlier choice sticks."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    platform = platform or current_platform_name()
    specs = platform_backends(platform)
    if not specs:
        raise TreeVerificationUnavailable(
            f"specplugin: tree_drafting.verify = 'tree' refused: no tree attention path for platform {platform!r} "
            "(CPU, and untested CUDA). Use tree_drafting.verify = 'chain'.")
    routed = []
    for spec in specs:
        try:
            backend_classes(spec)
        except Exception as exc:  # noqa: BLE001 - one backend missing does not stop the others
            log_once("warning", f"specplugin: tree verification: vLLM's {spec.name} backend cannot be subclassed "
                                f"here ({exc!r}); layers on it will refuse tree mode")
            continue
        vllm_register_backend(getattr(AttentionBackendEnum, spec.name), backend_path(spec))
        routed.append(spec)
    if not routed:
        raise TreeVerificationUnavailable(f"no attention backend of platform {platform!r} can be subclassed")
    selector._cached_get_attn_backend.cache_clear()
    log_once("info", "specplugin: tree verification: " + ", ".join(
        f"{spec.name} routed to {spec.tree_backend_name}" for spec in routed))
    if not all(spec.tested for spec in routed):
        log_once("warning", "specplugin: tree verification on CUDA is UNTESTED (written and unit-tested on CPU "
                            "tensors only); the start-up layout probe still refuses it if vLLM's cache layout differs")


# ---------------------------------------------------------------------------------------------
# Which requests may be trees
# ---------------------------------------------------------------------------------------------


def chain_only_reason(req_state) -> str | None:
    """Why this request must be verified as a chain (None: it may be a tree)."""
    params = getattr(req_state, "sampling_params", None)
    if params is None:
        return "no sampling parameters"
    if (params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1):
        return "penalties"
    if params.bad_words or getattr(params, "_bad_words_token_ids", None):
        return "bad words"
    if params.min_tokens:
        return "min_tokens"
    if params.structured_outputs is not None:
        return "structured output"
    if (params.logprobs is not None or params.prompt_logprobs is not None
            or getattr(params, "logprob_token_ids", None)):
        return "logprobs"
    if params.logit_bias or params.allowed_token_ids or params.min_p:
        return "logit bias / allowed tokens / min_p"
    if getattr(params, "thinking_token_budget", None) is not None:
        return "thinking budget"
    return None


def tree_rows(runner, req_ids: Sequence[str]) -> tuple[bool, ...]:
    """Per batch row: may the request be drafted as a tree? Empty when tree verification is off."""
    state = getattr(runner, "_specplugin_tree_state", None)
    if state is None:
        return ()
    out = []
    for rid in req_ids:
        reason = chain_only_reason(runner.requests.get(rid))
        if reason is not None:
            metrics = getattr(getattr(runner, "drafter", None), "metrics", None)
            if metrics is not None:
                metrics.tree_chain_fallbacks += 1
            log_once("info", f"specplugin: tree verification: requests with {reason} are drafted and verified as a chain")
        out.append(reason is None)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Runner wrappers
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _RunnerState:
    layout: str
    fault: str | None
    backend: TreeBackendSpec = CPU_BACKEND


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specplugin.patches import wrap_once

    wrap_once(GPUModelRunner, "initialize_kv_cache", _checked_initialize_kv_cache)
    wrap_once(GPUModelRunner, "_prepare_inputs", _tree_prepare_inputs)
    wrap_once(GPUModelRunner, "_sample", _tree_sample)


def tree_requested(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "custom_class":
        return False
    config = SpecPluginConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
    return config.tree_verify == "tree"


def _checked_initialize_kv_cache(original):
    def initialize_kv_cache(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if getattr(self, "_specplugin_tree_state", None) is None and tree_requested(self.vllm_config):
            self._specplugin_tree_state = check_runner(self)
            logger.info("specplugin: tree verification ON (cache layout %s)", self._specplugin_tree_state.layout)
        return result

    return initialize_kv_cache


def _tree_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        global _CURRENT
        _CURRENT = None
        result = original(self, scheduler_output, num_scheduled_tokens)
        state = getattr(self, "_specplugin_tree_state", None)
        if state is not None and scheduler_output.scheduled_spec_decode_tokens:
            try:
                entries = _plan_entries(self, scheduler_output, num_scheduled_tokens)
            except Exception:
                # Nothing changed yet (positions are written below): vLLM verifies chains, exactly.
                logger.exception("specplugin: planning this step's tree verification failed; verifying as chains")
                entries = []
            if entries:
                if state.fault != "no_tree_positions":
                    for entry in entries:  # after the slot mapping was computed from sequential positions
                        start = entry.query_start
                        depths = torch.tensor(tree_depths(entry.parents), dtype=self.positions.dtype)
                        self.positions[start: start + entry.num_nodes] = self.positions[start] + depths.to(
                            self.positions.device)
                _CURRENT = TreeStep(entries, state.layout, state.fault, backend=state.backend)
        return result

    return _prepare_inputs


def _plan_entries(runner, scheduler_output, num_scheduled_tokens) -> list[TreeEntry]:
    """The tree requests of this step: those whose scheduled drafts are (a BFS prefix of) the tree
    the adapter drafted for them, scheduled as one decode row block (root + drafts)."""
    plans = getattr(runner.drafter, "tree_plans", None) or {}
    proposer = tree_proposer(runner)
    drafted = {} if proposer is None else proposer.last_trees
    entries = []
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        plan = plans.get(req_id)
        if plan is None or not drafts:
            continue
        tokens, parents = plan
        n = len(drafts)
        row = runner.input_batch.req_id_to_index.get(req_id)
        if row is None or list(drafts) != tokens[:n] or int(num_scheduled_tokens[row]) != n + 1:
            continue  # not the drafted tree (or not a plain decode row): vLLM verifies it as a chain
        parents = list(parents[: n + 1])
        tree = drafted.get(req_id)
        if all(parents[i] == i - 1 for i in range(1, n + 1)) and (
                not isinstance(tree, MergedTree) or tree.prefix(n + 1).one_hot):
            # A chain: vLLM's own verifier is the same walk. Not for a merged tree with a drawn
            # model proposal: its rule (that drafter's own q) must not depend on whether the drafts
            # happened to form a chain, which depends on the drawn tokens themselves (inexact:
            # tests/statistical). With one-hot proposals only (deterministic drafters, greedy
            # requests) the shape is fixed by the context, and vLLM's one-hot chain sampler is the
            # merged rule on a chain.
            continue
        entries.append(TreeEntry(row, req_id, int(runner.query_start_loc.np[row]), parents,
                                 [-1] + list(tokens[:n]), tree_attention_mask(parents)))
    return entries


def _tree_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        global _CURRENT
        step, _CURRENT = _CURRENT, None
        self._specplugin_tree_paths = {}  # request id -> verified tree rows (root first), for heads
        if step is None or spec_decode_metadata is None or logits is None:
            return original(self, logits, spec_decode_metadata)
        # The tree rows' logits [N, V], before vLLM's sampler (which may process logits in place).
        num_draft = spec_decode_metadata.num_draft_tokens
        ends = np.cumsum([d + 1 for d in num_draft])
        blocks = []
        for entry in step.entries:
            end = int(ends[entry.row])
            ok = num_draft[entry.row] + 1 == entry.num_nodes  # always, as planned; else one token only
            blocks.append(logits[end - entry.num_nodes: end].clone() if ok else None)
        output = original(self, logits, spec_decode_metadata)
        _verify_trees(self, step, blocks, output.sampled_token_ids)
        return output

    return _sample


def _target_probs(runner, row: int, block: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """([N, V] float64 target distributions of one tree request, greedy?) with vLLM's processing."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    if float(runner.input_batch.temperature_cpu[row]) == 0.0:  # vLLM stores 0.0 for greedy requests
        # Greedy: vLLM's greedy choice is the argmax of the logits (no processors: chain_only_reason).
        return torch.nn.functional.one_hot(block.argmax(-1), block.shape[-1]).double(), True
    metadata = runner.input_batch.sampling_metadata
    one = slice(row, row + 1)
    request_metadata = dataclasses.replace(
        metadata,
        temperature=metadata.temperature[one],
        top_k=None if metadata.top_k is None else metadata.top_k[one],
        top_p=None if metadata.top_p is None else metadata.top_p[one],
        all_greedy=False,
        all_random=True,
    )
    cu = torch.tensor([block.shape[0]], dtype=torch.int32, device=block.device)
    processed = apply_sampling_constraints(block.to(torch.float32).clone(), cu, request_metadata)
    return processed.double().softmax(-1).cpu(), False


def _verify_trees(runner, step: TreeStep, blocks: list[torch.Tensor], sampled: torch.Tensor) -> None:
    """Walk each tree, write its output row of ``sampled`` [num_reqs, max_spec_len + 1] (int32,
    -1 after the emitted tokens), compact its KV and count."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    state = runner._specplugin_tree_state
    metrics = getattr(getattr(runner, "drafter", None), "metrics", None)
    proposer = tree_proposer(runner)
    drafted = {} if proposer is None else proposer.last_trees
    for index, (entry, block) in enumerate(zip(step.entries, blocks)):
        merged_drafters = None
        try:
            if block is None:
                raise RuntimeError(f"the logits rows of request {entry.req_id} do not match its tree")
            target, greedy = _target_probs(runner, entry.row, block)
            generator = runner.input_batch.generators.get(entry.row)
            if isinstance(drafted.get(entry.req_id), MergedTree):
                tree = drafted_tree(runner, entry)  # several drafters' proposals: SpecInfer's rule across them
                walk = verify_merged_tree(tree.prefix(entry.num_nodes), target, generator, greedy=greedy,
                                          fault=step.fault if step.fault in MERGED_FAULTS else None)
                accepted, emitted, merged_drafters = walk.accepted, walk.emitted, walk.drafters
            else:
                # The drafted tree's rule and rows (greedy walks need neither: one-hot rule).
                tree = drafted_tree(runner, entry) if not greedy or step.fault == "iid_on_topk" else None
                rule = AcceptanceRule.ONE_HOT if tree is None else AcceptanceRule(tree.rule)
                draft = None
                if tree is not None and (rule is not AcceptanceRule.ONE_HOT or step.fault == "iid_on_topk"):
                    draft = draft_probs_from_tree(tree)[: entry.num_nodes]
                accepted, emitted = walk_tree(target, entry.parents, entry.tokens, greedy=greedy,
                                              generator=generator, fault=step.fault, draft_probs=draft, rule=rule)
        except Exception:
            # Keep only vLLM's first token: position 0 (after the root) is verified exactly by the
            # chain sampler too, and one emitted token needs no compaction.
            if metrics is not None:
                metrics.tree_walk_failures += 1
            logger.exception("specplugin: tree verification of request %s failed; emitting one token", entry.req_id)
            sampled[entry.row, 1:] = PLACEHOLDER_TOKEN_ID
            runner._specplugin_tree_paths[entry.req_id] = [0]
            continue
        _emit(runner, step, index, entry, accepted, emitted, sampled, metrics)
        if merged_drafters is not None:
            _count_merged(proposer, entry.req_id, merged_drafters, metrics)


def _emit(runner, step: TreeStep, index: int, entry: TreeEntry, accepted: list[int], emitted: list[int],
          sampled: torch.Tensor, metrics) -> None:
    """Write one walk's emitted tokens into its row of ``sampled``, compact its KV and count it."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    runner._specplugin_tree_paths[entry.req_id] = [0] + list(accepted)
    row = sampled[entry.row]
    row.fill_(PLACEHOLDER_TOKEN_ID)
    row[: len(emitted)] = torch.tensor(emitted, dtype=row.dtype, device=row.device)
    if step.fault != "no_kv_compaction":
        _compact(step, index, accepted)
    if metrics is not None:
        metrics.tree_verify_steps += 1
        metrics.tree_nodes += entry.num_nodes - 1
        metrics.tree_accepted_tokens += len(accepted)
        metrics.tree_non_first_child_accepted += non_first_children(entry.parents, accepted)


def _count_merged(proposer, req_id: str, drafters: Sequence[int], metrics) -> None:
    """Count a merged tree's accepted nodes by the kind of drafter whose proposal was accepted."""
    if metrics is None or not hasattr(proposer, "accepted_drafter_kinds"):
        return
    zero_cost, model = proposer.accepted_drafter_kinds(req_id, drafters)
    metrics.tree_merged_steps += 1
    metrics.tree_zero_cost_accepted += zero_cost
    metrics.tree_model_accepted += model


def tree_proposer(runner):
    """The drafter's TreeProposer (the object with ``last_trees``), or None."""
    proposer = getattr(getattr(runner, "drafter", None), "proposer", None)
    while proposer is not None and not hasattr(proposer, "last_trees"):
        proposer = getattr(proposer, "inner", None)  # a wrapper such as AdaptiveGamma
    return proposer


def drafted_tree(runner, entry: TreeEntry):
    """The tree the proposer drafted for this request (``last_trees``: a TokenTree, or a MergedTree
    of several drafters), which must be the one scheduled (the same nodes, parents first, possibly
    cut to a prefix by vLLM)."""
    proposer = tree_proposer(runner)
    tree = None if proposer is None else proposer.last_trees.get(entry.req_id)
    n = entry.num_nodes
    if tree is None or tree.parents[:n] != entry.parents or tree.tokens[1:n] != entry.tokens[1:]:
        raise RuntimeError(f"the drafted tree of request {entry.req_id} is not the scheduled one")
    return tree


def drafted_rows(runner, entry: TreeEntry) -> torch.Tensor:
    """[N, V] float64: the draft distribution each node's children were chosen from (row j for
    node j's children; leaves' rows zero), from :func:`drafted_tree`."""
    return draft_probs_from_tree(drafted_tree(runner, entry))[: entry.num_nodes]


def vllm_cache_writer(spec: TreeBackendSpec):
    """vLLM's own cache writer of ``spec``'s backend: ``do_kv_cache_update(impl, layer, key, value,
    kv_cache, slot_mapping)`` of its impl class (the tree impls inherit it unchanged)."""
    return _vllm_classes(spec)[1].do_kv_cache_update


def _compact(step: TreeStep, index: int, accepted: list[int]) -> None:
    """Rewrite the accepted nodes' K/V into the slots of rows 1..k with vLLM's own cache writer."""
    moves = compaction_moves(accepted)
    if not moves:
        return
    writer = vllm_cache_writer(step.backend)
    for saved in step.saved:
        device = saved.keys[index].device
        sources = torch.tensor([s for s, _ in moves], device=device)
        destinations = torch.tensor([d for _, d in moves], device=saved.slots[index].device)
        writer(saved.impl, saved.layer, saved.keys[index][sources].contiguous(),
               saved.values[index][sources].contiguous(), saved.kv_cache, saved.slots[index][destinations])


# ---------------------------------------------------------------------------------------------
# Start-up check and layout probe
# ---------------------------------------------------------------------------------------------


def probe_layout(impl, layer, kv_cache: torch.Tensor, fault: str | None = None,
                 backend: TreeBackendSpec = CPU_BACKEND, writer=None) -> str | None:
    """Write known K/V with the backend's own writer (``writer``, default :func:`vllm_cache_writer`)
    into a scratch cache shaped like ``kv_cache`` (2 blocks, same dtype and device) and read them
    back; the first of the backend's layouts that matches exactly, or None."""
    writer = writer or vllm_cache_writer(backend)
    _, heads, block, two_d = kv_cache.shape
    dim = two_d // 2
    scratch = torch.zeros(2, heads, block, two_d, dtype=kv_cache.dtype, device=kv_cache.device)
    num_tokens = block + 3  # spans both blocks, the second partly
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, heads, dim, generator=generator).to(kv_cache.dtype)
    value = torch.randn(num_tokens, heads, dim, generator=generator).to(kv_cache.dtype)
    key, value = key.to(kv_cache.device), value.to(kv_cache.device)
    slots = torch.arange(num_tokens, dtype=torch.int64, device=kv_cache.device)
    writer(impl, layer, key, value, scratch, slots)
    blocks = torch.tensor([0, 1])
    for layout in ([_BOGUS_LAYOUT] if fault == "probe_layout" else backend.layouts):
        k, v = read_paged_kv(scratch, blocks, num_tokens, layout)
        if torch.equal(k, key) and torch.equal(v, value):
            return layout
    return None


def check_runner(runner) -> _RunnerState:
    """Refuse tree verification (raise :class:`TreeVerificationUnavailable`) unless this engine can
    run it exactly; otherwise the runner's tree state (the probed cache layout)."""
    from vllm.model_executor.layers.attention import Attention

    fault = requested_fault()
    config = SpecPluginConfig.from_additional_config(runner.vllm_config.additional_config)
    problems = []
    if not config.runner_shim:
        problems.append("the runner shim is off (tree verification needs request ids)")
    if not hasattr(getattr(runner, "drafter", None), "tree_plans"):
        problems.append("the drafter is not the plugin's MultiDraftProposer")
    if getattr(runner, "use_async_scheduling", False):
        problems.append("async scheduling is on")
    if getattr(runner, "uses_mrope", False):
        problems.append("the model uses M-RoPE")
    parallel = runner.vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        problems.append("tensor or pipeline parallelism (untested)")
    if runner.vllm_config.kv_transfer_config is not None:
        problems.append("a KV connector is configured")
    if runner.cache_config.cache_dtype != "auto":
        problems.append(f"KV cache dtype {runner.cache_config.cache_dtype} (quantized caches are not read back)")
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        problems.append(f"{len(groups)} KV cache groups (one full-attention group supported)")
    layers = {name: module for name, module in runner.compilation_config.static_forward_context.items()
              if isinstance(module, Attention)}
    if not layers:
        problems.append("no attention layers found")
    platform = current_platform_name()
    if platform != "cpu":
        mode = getattr(runner.compilation_config, "cudagraph_mode", None)
        if mode is not None and mode.has_full_cudagraphs():
            # A captured full graph replays vLLM's attention kernel without the tree recompute.
            problems.append(f"CUDA graph mode {mode.name} captures attention (use enforce_eager or "
                            "compilation_config.cudagraph_mode = PIECEWISE / NONE)")
    layout, backend = None, None
    for name, layer in layers.items():
        impl = layer.impl
        spec = backend_spec_of(impl)
        if spec is None or spec not in platform_backends(platform):
            problems.append(f"layer {name} uses {type(impl).__name__}, not a tree attention of this platform "
                            f"({', '.join(s.tree_impl_name for s in platform_backends(platform)) or 'none'})")
            break
        if backend not in (None, spec):
            problems.append(f"layers use two attention backends ({backend.name}, {spec.name})")
            break
        backend = spec
        unsupported = [what for what, bad in (
            ("sliding window", getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1))),
            ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
            ("logit soft cap", bool(getattr(impl, "logits_soft_cap", None))),
            ("attention sinks", getattr(impl, "sinks", None) is not None),
            ("KV sharing", getattr(impl, "kv_sharing_target_layer_name", None) is not None),
        ) if bad]
        if unsupported:
            problems.append(f"layer {name} uses {', '.join(unsupported)}")
            break
        kv_cache = layer.kv_cache
        kv_cache = kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
            problems.append(f"layer {name}: KV cache is not a [num_blocks, H_kv, B, 2D] tensor")
            break
        if layout is None:
            layout = probe_layout(impl, layer, kv_cache, fault, backend=spec)
            if layout is None:
                problems.append(
                    f"the KV cache layout probe failed (ISA {getattr(layer, 'isa', '?')}, dtype {kv_cache.dtype}): "
                    "values written with vLLM's cache writer do not read back in any known layout"
                )
                break
    if fault in TOPK_FAULTS and not problems:
        proposer = tree_proposer(runner)
        if proposer is not None:
            proposer.children = "topk"  # the fault acts on top-k trees (see WALK_FAULTS)
    if problems:
        raise TreeVerificationUnavailable(
            "specplugin: tree_drafting.verify = 'tree' refused: " + "; ".join(problems)
            + ". Use tree_drafting.verify = 'chain' (the default) on this engine."
        )
    return _RunnerState(layout=layout, fault=fault, backend=backend)
