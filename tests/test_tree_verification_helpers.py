"""Tree verification in vLLM (vllm_specplugin/tree_verification.py): its pure helpers, the cache
layout probe against vLLM's own CPU cache writer, the chain-only request rules, the config key and
the tree proposer's tree mode. Fast tier: no engine."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from vllm_specplugin import tree_verification as tv
from vllm_specplugin.config import SpecPluginConfig, SpecPluginConfigError
from vllm_specplugin.proposers.base import DraftRequest
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.proposers.tree import TreeProposer, tree_accepted_path
from vllm_specplugin.proposers.tree_verify import tree_attention_mask
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

torch.set_num_threads(1)

PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # root; two children; 1 has two children; 2 one; 3 one


def _vllm_writer(dtype, block: int, dim: int, isa: str | None = None):
    """(impl, layer) stand-ins carrying what vLLM's CPU cache writer reads; ``isa`` None: the one
    vLLM picks on this CPU for ``dtype`` and ``block``."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    impl = types.SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    layer = types.SimpleNamespace(isa=isa or _get_attn_isa(dtype, block, dim, "auto"), _k_scale_float=1.0,
                                  _v_scale_float=1.0)
    return impl, layer


# The CPU attention ISAs whose cache layouts the reader knows: (isa, dtype, layout). "amx" is what
# vLLM picks for bf16 caches (block % 32 == 0) on CPUs with AMX tiles; elsewhere its kernel is absent.
ISA_CASES = [
    pytest.param("vec", torch.float32, "k_dxb", id="vec-fp32"),
    pytest.param("vec", torch.bfloat16, "k_dxb", id="vec-bf16"),
    pytest.param("vec16", torch.float32, "k_dxb", id="vec16-fp32"),
    pytest.param("amx", torch.bfloat16, "amx_vnni", id="amx-bf16",
                 marks=pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="no AMX tiles on this CPU")),
]


@pytest.mark.parametrize("isa,dtype,layout", [*ISA_CASES, pytest.param(None, torch.float32, None, id="chosen-fp32"),
                                              pytest.param(None, torch.bfloat16, None, id="chosen-bf16")])
def test_paged_reader_reads_what_vllms_writer_wrote(isa, dtype, layout):
    """Tokens written with vLLM's do_kv_cache_update into scattered blocks read back exactly, for
    each ISA's layout and for the ISA vLLM picks on this CPU."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    block, dim, heads = 32, 64, 2
    impl, layer = _vllm_writer(dtype, block, dim, isa)
    cache = torch.zeros(6, heads, block, 2 * dim, dtype=dtype)
    table = torch.tensor([4, 1, 3], dtype=torch.int32)  # the request's blocks, not in order
    n = 2 * block + 5
    key = torch.randn(n, heads, dim).to(dtype)
    value = torch.randn(n, heads, dim).to(dtype)
    slots = torch.tensor([int(table[i // block]) * block + i % block for i in range(n)], dtype=torch.int64)
    CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key, value, cache, slots)
    probed = tv.probe_layout(impl, layer, cache)
    assert probed in tv.CPU_BACKEND.layouts and probed == (layout or probed), (layer.isa, probed)
    for other in set(tv.CPU_BACKEND.layouts) - {probed}:  # the probe tells the layouts apart
        k, v = tv.read_paged_kv(cache, table, n, other)
        assert not (torch.equal(k, key) and torch.equal(v, value)), other
    layout = probed
    k, v = tv.read_paged_kv(cache, table, n, layout)
    assert torch.equal(k, key) and torch.equal(v, value)
    k, v = tv.read_paged_kv(cache, table, 7, layout)  # a prefix inside the first block
    assert torch.equal(k, key[:7]) and torch.equal(v, value[:7])


def test_probe_refuses_a_layout_it_cannot_read():
    impl, layer = _vllm_writer(torch.float32, 32, 64)
    cache = torch.zeros(2, 2, 32, 128)
    assert tv.probe_layout(impl, layer, cache, fault="probe_layout") is None


@pytest.mark.parametrize("layout", tv.BLOCK_NATIVE_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_attention_read_from_cache_blocks_equals_each_tree_alone(layout, dtype):
    """tree_attention_blocks (the CPU layouts read from the gathered blocks with one copy each for K
    and V) equals tree_attention of each tree over its own prefix: trees of different sizes and prefix
    lengths in one call (one prefix a whole number of blocks, one shorter than a block), GQA, NaN in
    every slot past a prefix (never written: it must not leak), bf16 cache blocks."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block = 4, 2, 16, 8
    trees = [([-1, 0, 0, 1], 19), ([-1, 0, 1, 2, 2, 0, 5], 16), (list(PARENTS), 3)]  # (parents, prefix length)
    count = max(-(-prefix // block) for _, prefix in trees)
    width = max(len(parents) for parents, _ in trees)
    lengths = torch.tensor([prefix for _, prefix in trees])
    slabs = torch.full((len(trees) * count, kv_heads, 2, block * dim), float("nan"))
    masks = torch.zeros(len(trees), width, width, dtype=torch.bool)
    masks[:, :, 0] = True  # padding rows attend to the root
    query = torch.randn(len(trees), width, heads, dim, generator=generator)
    key = torch.randn(len(trees), width, kv_heads, dim, generator=generator)
    value = torch.randn(len(trees), width, kv_heads, dim, generator=generator)
    prefixes = []
    for e, (parents, prefix) in enumerate(trees):
        masks[e, :len(parents), :len(parents)] = tree_attention_mask(parents)
        prefix_k = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype).float()
        prefix_v = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype).float()
        prefixes.append((prefix_k, prefix_v))
        for position in range(prefix):
            slab = slabs[e * count + position // block]
            b = position % block
            for h in range(kv_heads):
                k_region = slab[h, 0].view(dim, block) if layout == "k_dxb" else slab[h, 0].view(block, dim).t()
                k_region[:, b] = prefix_k[position, h]
                slab[h, 1].view(block, dim)[b] = prefix_v[position, h]
    blocks = slabs.view(len(trees) * count, kv_heads, block, 2 * dim).to(dtype)
    out = tv.tree_attention_blocks(query, key, value, blocks, layout,
                                   tv.block_attention_masks(lengths, masks, count, block, kv_heads, "cpu"), dim ** -0.5)
    assert out.shape == query.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    for e, ((parents, _), (prefix_k, prefix_v)) in enumerate(zip(trees, prefixes)):
        n = len(parents)
        expected = tv.tree_attention(query[e, :n], key[e, :n], value[e, :n], prefix_k, prefix_v,
                                     tree_attention_mask(parents), dim ** -0.5)
        assert torch.allclose(out[e, :n], expected, atol=1e-5), (layout, e)
    with pytest.raises(ValueError, match="reads layouts"):
        tv.tree_attention_blocks(query, key, value, blocks, "amx_vnni", None, 1.0)


def test_tree_attention_equals_causal_attention_along_each_path():
    """Row i of the tree attention = plain causal attention over [prefix, root .. node i]."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, prefix = 4, 2, 32, 9
    n = len(PARENTS)
    query = torch.randn(n, heads, dim, generator=generator)
    key = torch.randn(n, kv_heads, dim, generator=generator)
    value = torch.randn(n, kv_heads, dim, generator=generator)
    prefix_k = torch.randn(prefix, kv_heads, dim, generator=generator)
    prefix_v = torch.randn(prefix, kv_heads, dim, generator=generator)
    scale = dim ** -0.5
    out = tv.tree_attention(query, key, value, prefix_k, prefix_v, tree_attention_mask(PARENTS), scale)
    assert out.shape == (n, heads, dim) and out.dtype == torch.float32
    for node in range(n):
        path = []
        while node >= 0 and node not in path:
            path.append(node)
            node = PARENTS[node]
        path = path[::-1]
        last = path[-1]
        k = torch.cat([prefix_k, key[path]]).repeat_interleave(2, dim=1)
        v = torch.cat([prefix_v, value[path]]).repeat_interleave(2, dim=1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[last : last + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        ).transpose(0, 1)[0]
        assert torch.allclose(out[last], expected, atol=1e-5)
    # Without the ancestor mask (causal over BFS rows) a node also sees its parent's siblings.
    causal = tv.tree_attention(query, key, value, prefix_k, prefix_v, torch.ones(n, n, dtype=torch.bool).tril(), scale)
    assert not torch.allclose(causal[3], out[3], atol=1e-3)


def test_walk_accepts_a_second_child_and_the_fault_cannot():
    """Greedy: the target's argmax after the root is node 2's token (the root's second child)."""
    vocab = 8
    tokens = [-1, 5, 6, 1, 2, 3, 4]
    argmax = [6, 0, 3, 0, 0, 7, 0]  # after root: 6 (node 2); after node 2: 3 (node 5); then 7 (a leaf)
    target = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).double()
    accepted, emitted = tv.walk_tree(target, PARENTS, tokens, greedy=True, generator=None)
    assert accepted == [2, 5] and emitted == [6, 3, 7]
    assert tv.non_first_children(PARENTS, accepted) == 1
    assert tv.compaction_moves(accepted) == [(2, 1), (5, 2)]
    accepted, emitted = tv.walk_tree(target, PARENTS, tokens, greedy=True, generator=None, fault="first_child_only")
    assert accepted == [] and emitted == [6]
    # A path through first children: nothing to move.
    target = torch.nn.functional.one_hot(torch.tensor([5, 1, 0, 4, 0, 0, 2]), vocab).double()
    accepted, emitted = tv.walk_tree(target, PARENTS, tokens, greedy=True, generator=None)
    assert accepted == [1, 3, 6] and emitted == [5, 1, 4, 2]
    assert tv.compaction_moves(accepted) == [(3, 2), (6, 3)] and tv.non_first_children(PARENTS, accepted) == 0


def _walk_law(target, draft, tokens, fault, rule="one_hot", samples=4000):
    """Empirical law of the first emitted token of ``tv.walk_tree`` (T > 0)."""
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(target.shape[1])
    for _ in range(samples):
        _, emitted = tv.walk_tree(target, PARENTS, tokens, greedy=False, generator=generator, fault=fault,
                                  draft_probs=draft, rule=rule)
        counts[emitted[0]] += 1
    return counts / samples


@pytest.mark.parametrize("fault", tv.WALK_FAULTS)
def test_walk_faults_reach_the_walk_and_change_its_law(fault):
    """The walk faults act in the engine's walk (T > 0). On a fixed top-k tree the one-hot walk's
    first emitted token has the target's law (exact by enumeration, and sampled) and the faults
    move it far; q_not_updated acts on the without-replacement walk (whose exactness is over the
    draws of the children, tests/test_proposers_tree.py): its law on a fixed tree changes too. The
    sampled walk follows the enumerated law in every case."""
    from vllm_specplugin.proposers.tree_verify import emission_distribution

    vocab = 8
    tokens = [-1, 5, 6, 1, 2, 3, 4]
    rng = np.random.default_rng(0)
    target = torch.from_numpy(rng.dirichlet(np.ones(vocab), size=len(PARENTS)))
    draft = torch.from_numpy(rng.dirichlet(np.ones(vocab), size=len(PARENTS)))
    for j, kids in enumerate([[1, 2], [3, 4], [5], [6]]):  # the children are the draft's top tokens
        for rank, kid in enumerate(kids):
            draft[j, tokens[kid]] = 2.0 - 0.5 * rank
        draft[j] /= draft[j].sum()
    # At the root: the draft favours the first child's token, the target the second's.
    target[0] = 0.05
    target[0, 5], target[0, 6] = 0.2, 0.5
    draft[0] = 0.1 / 6
    draft[0, 5], draft[0, 6] = 0.5, 0.4

    rule = "without_replacement" if fault == "q_not_updated" else "one_hot"

    def first_token_law(f):
        law = np.zeros(vocab)
        for seq, weight in emission_distribution(target, draft, PARENTS, tokens, rule, fault=f).items():
            law[seq[0]] += weight
        return law

    honest = first_token_law(None)
    if rule == "one_hot":
        np.testing.assert_allclose(honest, target[0].numpy(), atol=1e-12)
    assert np.abs(_walk_law(target, draft, tokens, None, rule) - honest).max() < 0.03
    faulty = first_token_law(fault)
    assert 0.5 * np.abs(faulty - honest).sum() > 0.05
    assert np.abs(_walk_law(target, draft, tokens, fault, rule) - faulty).max() < 0.03
    if fault != "residual_not_updated":
        with pytest.raises(ValueError, match="draft rows"):
            tv.walk_tree(target, PARENTS, tokens, greedy=False, generator=None, fault=fault, rule=rule)


def test_drafted_rows_come_from_the_scheduled_tree():
    from vllm_specplugin.proposers.tree import TokenTree

    probs = torch.rand(len(PARENTS), 8)
    tree = TokenTree([-1, 5, 6, 1, 2, 3, 4], list(PARENTS), [0, 1, 1, 2, 2, 2, 3], probs)
    for kids in ([1, 2], [3, 4]):  # siblings carry their parent's row
        probs[kids[1]] = probs[kids[0]]
    proposer = types.SimpleNamespace(last_trees={"a": tree})
    runner = types.SimpleNamespace(drafter=types.SimpleNamespace(proposer=types.SimpleNamespace(inner=proposer)))
    entry = tv.TreeEntry(0, "a", 0, [-1, 0, 0, 1], [-1, 5, 6, 1], tree_attention_mask([-1, 0, 0, 1]))
    rows = tv.drafted_rows(runner, entry)
    assert rows.shape == (4, 8) and rows.dtype == torch.float64
    assert torch.equal(rows[0], probs[1].double()) and torch.equal(rows[1], probs[3].double())
    for bad in (tv.TreeEntry(0, "a", 0, [-1, 0, 0, 1], [-1, 5, 6, 9], entry.mask),
                tv.TreeEntry(0, "b", 0, [-1, 0, 0, 1], [-1, 5, 6, 1], entry.mask)):
        with pytest.raises(RuntimeError, match="not the scheduled one"):
            tv.drafted_rows(runner, bad)


def test_first_child_subtree():
    assert tv.first_child_subtree(PARENTS) == [0, 1, 3, 6]


def test_chain_only_reasons():
    from vllm import SamplingParams as VllmSamplingParams

    def state(**kwargs):
        return types.SimpleNamespace(sampling_params=VllmSamplingParams(**kwargs))

    assert tv.chain_only_reason(state(temperature=0.0)) is None
    assert tv.chain_only_reason(state(temperature=0.8, top_k=20, top_p=0.9, seed=3)) is None
    assert tv.chain_only_reason(state(repetition_penalty=1.2)) == "penalties"
    assert tv.chain_only_reason(state(presence_penalty=0.5)) == "penalties"
    assert tv.chain_only_reason(state(min_tokens=4)) == "min_tokens"
    assert tv.chain_only_reason(state(logprobs=2)) == "logprobs"
    assert tv.chain_only_reason(state(min_p=0.1)) is not None
    assert tv.chain_only_reason(types.SimpleNamespace(sampling_params=None)) is not None


def test_fault_names_are_checked(monkeypatch):
    monkeypatch.setenv(tv.FAULT_ENV, "nope")
    with pytest.raises(ValueError, match="SPECPLUGIN_TREE_FAULT"):
        tv.requested_fault()
    monkeypatch.setenv(tv.FAULT_ENV, "no_kv_compaction")
    assert tv.requested_fault() == "no_kv_compaction"
    for fault in ("residual_not_updated", "iid_on_topk"):  # proposers/tree_verify.py's, in the engine walk
        monkeypatch.setenv(tv.FAULT_ENV, fault)
        assert tv.requested_fault() == fault


def test_config_verify_key():
    assert SpecPluginConfig.from_dict({}).tree_verify == "chain"
    assert SpecPluginConfig.from_dict({"tree_drafting": {"node_budget": 8}}).tree_verify == "chain"
    config = SpecPluginConfig.from_dict({"tree_drafting": {"verify": "tree", "branching": 2}})
    assert config.tree_verify == "tree" and config.tree_drafting == {"verify": "tree", "branching": 2}
    with pytest.raises(SpecPluginConfigError, match="tree_drafting.verify"):
        SpecPluginConfig.from_dict({"tree_drafting": {"verify": "graph"}})
    with pytest.raises(SpecPluginConfigError, match="tree_drafting.verify"):
        SpecPluginConfig.from_dict({"tree_drafting": {"verify": "tree"}, "adaptive_gamma": {}})
    assert SpecPluginConfig.from_dict({"tree_drafting": {"max_depth": 4}}).tree_drafting == {"max_depth": 4}
    with pytest.raises(SpecPluginConfigError, match="tree_drafting.max_depth"):
        SpecPluginConfig.from_dict({"tree_drafting": {"max_depth": 0}})


def test_tree_accepted_path():
    tokens = [5, 6, 1, 2, 3, 4]  # nodes 1..6 of PARENTS
    assert tree_accepted_path(tokens, PARENTS, [6, 3, 9]) == [2, 5]
    assert tree_accepted_path(tokens, PARENTS, [5, 2, 9]) == [1, 4]
    assert tree_accepted_path(tokens, PARENTS, [7]) == []


@pytest.fixture(scope="module")
def distill() -> DraftRuntime:
    return DraftRuntime(os.path.join(REPO_ROOT, "models", "demo", "draft-distill"), target_vocab_size=4096)


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0, top_k=20)])
def test_tree_mode_submits_the_whole_tree_only_when_allowed(distill, params):
    context = np.random.default_rng(1).integers(3, 4096, size=12).tolist()
    proposer = TreeProposer(EnsembleProposer([distill]), node_budget=8, branching=2, verify="tree")
    tree_draft, chain_draft = proposer.propose([
        DraftRequest("t", context, 6, params, tree_ok=True),  # gamma 6 caps the budget of 8
        DraftRequest("c", context, 6, params, tree_ok=False),
    ])
    tree = proposer.last_trees["t"]
    assert tree_draft.parents == tree.parents and tree_draft.token_ids == tree.tokens[1:]
    assert len(tree_draft.token_ids) == 6 and tree_draft.probs.shape == (6, 4096)
    assert max(tree.depths) <= 3  # default depth ceil(6 / 2): budget shared between width and depth
    assert any(len(tree.children(node)) > 1 for node in range(tree.num_nodes))  # a real tree
    assert torch.equal(tree_draft.probs.argmax(-1), torch.tensor(tree_draft.token_ids))
    assert chain_draft.parents is None
    assert chain_draft.token_ids == proposer.last_trees["c"].path(proposer.last_trees["c"].best_node())
    # The next step's context tells which path was accepted: node tokens along the tree.
    path = tree.ancestry(tree.num_nodes - 1)[1:]
    emitted = [tree.tokens[n] for n in path] + [7]
    proposer.propose([DraftRequest("t", context + emitted, 6, params, tree_ok=True)])
    metrics = proposer.metrics
    assert metrics.accepted_tokens == len(path)


@pytest.mark.parametrize("isa,dtype,layout", [ISA_CASES[0], ISA_CASES[-1]])
def test_tree_rows_recomputed_from_the_paged_cache_and_compacted(isa, dtype, layout):
    """The attention impl's tree pass on a cache written by vLLM's writer: each tree row equals
    attention over [prefix, its path]; rows of other requests are left alone; the compaction then
    puts the accepted path's K/V in the slots after the root."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 32, 32
    impl, layer = _vllm_writer(dtype, block, dim, isa)
    impl.scale = dim ** -0.5
    prefix, n, start = 40, len(PARENTS), 2  # another request owns token rows 0..1 (batch row 0)
    table = torch.tensor([[0, 0], [5, 2]], dtype=torch.int32)

    def slot(position):
        return int(table[1, position // block]) * block + position % block

    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output row is rounded to bf16
    cache = torch.zeros(6, kv_heads, block, 2 * dim, dtype=dtype)
    prefix_k = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype)
    prefix_v = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype)
    CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, prefix_k, prefix_v, cache,
                                               torch.tensor([slot(p) for p in range(prefix)]))
    total = start + n
    query = torch.randn(total, heads, dim, generator=generator).to(dtype)
    key = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    value = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    slots = torch.tensor([0, 1] + [slot(prefix + i) for i in range(n)])  # tree rows: sequential slots
    CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key[start:], value[start:], cache, slots[start:])
    metadata = types.SimpleNamespace(seq_lens=torch.tensor([5, prefix + n], dtype=torch.int32), block_table=table,
                                     slot_mapping=slots)
    entry = tv.TreeEntry(1, "r", start, list(PARENTS), [-1, 5, 6, 1, 2, 3, 4], tree_attention_mask(PARENTS))

    # What vLLM's kernel wrote for the tree rows before the recompute: causal attention in row order.
    causal = _causal_rows(query[start:], key[start:], value[start:], prefix_k, prefix_v, impl.scale).to(dtype)

    def run(fault=None):
        step = tv.TreeStep([entry], layout, fault)
        output = torch.zeros(total, heads, dim, dtype=dtype)
        output[start:] = causal
        tv._recompute_tree_rows(impl, step, layer, query, key, value, cache, metadata, output)
        return step, output

    step, output = run()
    assert not output[:start].any()
    # The root row, the leading chain (here the root alone: PARENTS branches at once), is the
    # kernel's causal row untouched; every later row is recomputed.
    assert tv.leading_chain(PARENTS) == 2 and torch.equal(output[start:start + 2], causal[:2])
    expected = tv.tree_attention(query[start:], key[start:], value[start:], prefix_k, prefix_v,
                                 tree_attention_mask(PARENTS), impl.scale)
    assert torch.allclose(output[start:].float(), expected, atol=tolerance / 10)
    for node in range(n):  # and that is causal attention along the node's path
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        rows = [start + p for p in path[::-1]]
        k = torch.cat([prefix_k, key[rows]]).float().repeat_interleave(2, dim=1)
        v = torch.cat([prefix_v, value[rows]]).float().repeat_interleave(2, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            query[start + node: start + node + 1].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            scale=impl.scale).transpose(0, 1)[0]
        assert torch.allclose(output[start + node].float(), ref, atol=tolerance)
    _, masked_off = run("no_ancestor_mask")
    assert not torch.allclose(masked_off[start + 3].float(), output[start + 3].float(), atol=tolerance)

    tv._compact(step, 0, [2, 5])  # accepted: node 2 (depth 1), node 5 (depth 2)
    k, v = tv.read_paged_kv(cache, table[1], prefix + 3, layout)
    assert torch.equal(k[prefix + 1], key[start + 2]) and torch.equal(v[prefix + 1], value[start + 2])
    assert torch.equal(k[prefix + 2], key[start + 5]) and torch.equal(v[prefix + 2], value[start + 5])
    assert torch.equal(k[prefix], key[start]) and torch.equal(k[:prefix], prefix_k)  # root and prefix kept


@pytest.mark.parametrize("general_path", [False, True], ids=["blocks-read-in-place", "general-gather"])
@pytest.mark.parametrize("isa,dtype,layout", [ISA_CASES[0], ISA_CASES[1]])
def test_trees_of_a_batch_recomputed_together_equal_each_tree_alone(isa, dtype, layout, general_path, monkeypatch):
    """Several tree requests of different sizes and prefix lengths, a plain decode row between
    them, attended in one padded call (and in chunks of one entry): each tree row equals
    :func:`tree_attention` of its own tree over its own prefix; the plain row is left alone; NaN
    in cache blocks past a prefix (other requests' or never written) does not leak in; the saved
    K/V and slots are each entry's."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    # general_path: the gather into token order that AMX's and CUDA's layouts take, run here on the CPU's.
    monkeypatch.setattr(tv, "BLOCK_NATIVE_OFF", general_path)
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    impl, layer = _vllm_writer(dtype, block, dim, isa)
    impl.scale = dim ** -0.5
    shapes = [([-1, 0, 0, 1], 37), ([-1, 0, 1, 2, 2, 0, 5], 5), (list(PARENTS), 70)]  # (parents, prefix length)
    cache = torch.full((16, kv_heads, block, 2 * dim), float("nan")).to(dtype)
    tables = [[1, 2, 3], [4, 0, 0], [5, 6, 7, 8, 9]]  # a row's blocks past its prefix: NaN
    table = torch.zeros(4, 5, dtype=torch.int32)
    for row, blocks in zip((0, 2, 3), tables):
        table[row, :len(blocks)] = torch.tensor(blocks)
    entries, rows_of, prefixes, start = [], [], [], 0
    slots, seq_lens = [], [0] * 4
    for index, ((parents, prefix), row) in enumerate(zip(shapes, (0, 2, 3))):
        if row == 2:  # a plain decode row (batch row 1) before this one
            slots.append(15 * block)
            seq_lens[1] = 9
            start += 1
        n = len(parents)

        def slot(position, row=row):
            return int(table[row, position // block]) * block + position % block

        prefix_k = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype)
        prefix_v = torch.randn(prefix, kv_heads, dim, generator=generator).to(dtype)
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, prefix_k, prefix_v, cache,
                                                   torch.tensor([slot(p) for p in range(prefix)]))
        prefixes.append((prefix_k, prefix_v))
        entries.append(tv.TreeEntry(row, f"r{index}", start, list(parents), [-1] + [7] * (n - 1),
                                    tree_attention_mask(parents)))
        rows_of.append(list(range(start, start + n)))
        slots += [slot(prefix + i) for i in range(n)]
        seq_lens[row] = prefix + n
        start += n
    total = start
    query = torch.randn(total, heads, dim, generator=generator).to(dtype)
    key = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    value = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
    slots = torch.tensor(slots)
    for entry, rows in zip(entries, rows_of):
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key[rows], value[rows], cache, slots[rows])
    metadata = types.SimpleNamespace(seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
                                     slot_mapping=slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    plain_row = rows_of[1][0] - 1
    # What vLLM's kernel wrote for the tree rows: causal attention in row order over each prefix.
    causal = {entry.req_id: _causal_rows(query[rows], key[rows], value[rows], *prefix, impl.scale).to(dtype)
              for entry, rows, prefix in zip(entries, rows_of, prefixes)}
    for chunk_bytes in (tv.TREE_ATTENTION_CHUNK_BYTES, 1):  # all at once; one entry per call
        monkeypatch.setattr(tv, "TREE_ATTENTION_CHUNK_BYTES", chunk_bytes)
        step = tv.TreeStep(entries, layout, None)
        output = torch.zeros(total, heads, dim, dtype=dtype)
        for entry, rows in zip(entries, rows_of):
            output[rows] = causal[entry.req_id]
        for _ in range(2):  # two layers: the step's layout is computed once
            tv._recompute_tree_rows(impl, step, layer, query, key, value, cache, metadata, output)
        assert not output[plain_row].any()
        assert torch.isfinite(output.float()).all()
        for entry, rows, (prefix_k, prefix_v), saved_k, saved_slots in zip(
                entries, rows_of, prefixes, step.saved[1].keys, step.saved[1].slots):
            expected = tv.tree_attention(query[rows], key[rows], value[rows], prefix_k, prefix_v, entry.mask, impl.scale)
            # bf16: the output row is rounded to bf16 (relative 2^-8)
            rtol = 1e-5 if dtype == torch.float32 else 2 ** -8
            assert torch.allclose(output[rows].float(), expected, atol=tolerance / 10, rtol=rtol), entry.req_id
            assert torch.equal(saved_k, key[rows]) and torch.equal(saved_slots, slots[rows])
            lead = tv.leading_chain(entry.parents)  # the rows the kernel got right are left as it wrote them
            assert torch.equal(output[rows[:lead]], causal[entry.req_id][:lead]), entry.req_id
        assert len(step.saved) == 2
        assert [tv.leading_chain(entry.parents) for entry in entries] == [2, 4, 2]


def _causal_rows(query, key, value, prefix_k, prefix_v, scale):
    """Causal attention of rows in order over [prefix, the rows]: what vLLM's kernel computes for them."""
    n = query.shape[0]
    return tv.tree_attention(query, key, value, prefix_k, prefix_v, torch.ones(n, n, dtype=torch.bool).tril(), scale)


def test_leading_chain():
    assert tv.leading_chain([-1]) == 1
    assert tv.leading_chain([-1, 0, 1, 2]) == 4  # a chain: every row is the kernel's
    assert tv.leading_chain([-1, 0, 1, 1, 3]) == 3  # row 3 is row 2's sibling: it and all after it
    assert tv.leading_chain([-1, 0, 0]) == 2


def _fake_runner(tree_state=True):
    """A stand-in for vLLM's model runner with what the wrappers read: request "b" at batch row 0
    (a plain decode row), request "a" at row 1 with a tree of PARENTS drafted for it."""
    tokens = [5, 6, 1, 2, 3, 4]
    metrics = types.SimpleNamespace(tree_verify_steps=0, tree_nodes=0, tree_accepted_tokens=0,
                                    tree_non_first_child_accepted=0, tree_chain_fallbacks=0)
    return types.SimpleNamespace(
        drafter=types.SimpleNamespace(tree_plans={"a": (tokens, list(PARENTS))}, metrics=metrics),
        input_batch=types.SimpleNamespace(req_id_to_index={"b": 0, "a": 1}, temperature_cpu=np.zeros(2),
                                          generators={}),
        query_start_loc=types.SimpleNamespace(np=np.array([0, 1, 1 + len(PARENTS)])),
        positions=torch.zeros(16, dtype=torch.int64),
        _specplugin_tree_state=tv._RunnerState(layout="k_dxb", fault=None) if tree_state else None,
    )


def test_prepare_inputs_wrapper_sets_tree_positions_and_the_sample_wrapper_walks():
    runner = _fake_runner()

    def prepare(self, scheduler_output, num_scheduled_tokens):  # vLLM: sequential positions
        self.positions[:8] = torch.tensor([20] + [30 + i for i in range(7)])
        return "inputs"

    scheduled = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 1, 2, 3, 4]})
    assert tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 7])) == "inputs"
    assert runner.positions[:8].tolist() == [20, 30, 31, 31, 32, 32, 32, 33]  # n0 = 30, + depth
    step = tv._CURRENT
    assert [e.req_id for e in step.entries] == ["a"] and step.entries[0].query_start == 1

    # Logits: row 0 for "b" (no drafts), rows 1..7 for "a"; the target's argmax after the root is
    # node 2's token 6, after node 2 node 5's token 3, after node 5 token 9.
    logits = torch.zeros(8, 16)
    for row, token in [(0, 11), (1, 6), (3, 3), (6, 9)]:
        logits[row, token] = 5.0
    sampled = torch.full((2, 7), 7, dtype=torch.int32)  # what vLLM's chain sampler wrote
    metadata = types.SimpleNamespace(num_draft_tokens=[0, 6])
    out = tv._tree_sample(lambda self, lg, md: types.SimpleNamespace(sampled_token_ids=sampled))(runner, logits, metadata)
    assert out.sampled_token_ids[1].tolist() == [6, 3, 9, -1, -1, -1, -1]
    assert out.sampled_token_ids[0].tolist() == [7] * 7  # other rows untouched
    assert tv._CURRENT is None
    stats = runner.drafter.metrics
    assert (stats.tree_verify_steps, stats.tree_accepted_tokens, stats.tree_non_first_child_accepted) == (1, 2, 1)


def test_wrappers_change_nothing_without_tree_state_or_for_chains_and_mismatches():
    def prepare(self, scheduler_output, num_scheduled_tokens):
        self.positions[:8] = torch.arange(30, 38)

    runner = _fake_runner(tree_state=False)
    scheduled = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 1, 2, 3, 4]})
    tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 7]))
    assert runner.positions[:8].tolist() == list(range(30, 38)) and tv._CURRENT is None
    runner = _fake_runner()
    for drafts, counts in (([5, 6, 1, 9], [1, 5]),  # not the drafted tokens
                           ([5], [1, 2]),  # a one-node prefix is a chain
                           ([5, 6, 1], [1, 9])):  # not a decode row of root + drafts
        scheduled = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": drafts})
        tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array(counts))
        assert runner.positions[:8].tolist() == list(range(30, 38)) and tv._CURRENT is None
    # A BFS prefix of the tree is a tree: drafts [5, 6, 1] are nodes 1..3 (3's parent is 1).
    scheduled = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 1]})
    tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 4]))
    assert tv._CURRENT.entries[0].parents == [-1, 0, 0, 1]
    assert runner.positions[1:5].tolist() == [31, 32, 32, 33]
    tv._CURRENT = None


def test_a_chain_shaped_merged_tree_is_walked_by_the_merged_rule():
    """A merged tree (several drafters, tree_drafting.merge) is a tree entry even when its drafts
    form a chain: whether they do depends on the drafted tokens (a model's draw equal to the n-gram's
    token shares its node), so verifying chain-shaped ones with vLLM's one-hot chain sampler and the
    rest with the merged rule is inexact (measured in tests/statistical: 0.023 off the target's law
    at token 2). A model's own chain-shaped tree stays with vLLM's sampler (the same walk), and so
    does a merged one whose proposals are all one-hot."""
    from vllm_specplugin.proposers.merged_tree import DrafterProposal, merge_proposals

    def prepare(self, scheduler_output, num_scheduled_tokens):
        self.positions[:8] = torch.arange(30, 38)

    q = torch.full((16,), 1 / 16)
    merged = merge_proposals([DrafterProposal.chain([5]), DrafterProposal.chain([5], q[None])])
    assert merged.parents == [-1, 0]  # one node, both drafters' slots on it
    runner = _fake_runner()
    runner.drafter.tree_plans = {"a": ([5], [-1, 0])}
    runner.drafter.metrics.__dict__.update(tree_merged_steps=0, tree_zero_cost_accepted=0, tree_model_accepted=0)
    runner.drafter.proposer = types.SimpleNamespace(last_trees={"a": merged},
                                                    accepted_drafter_kinds=lambda rid, drafters: (len(drafters), 0))
    runner._specplugin_tree_paths = {}
    scheduled = types.SimpleNamespace(scheduled_spec_decode_tokens={"a": [5]})
    tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 2]))
    assert tv._CURRENT is not None and tv._CURRENT.entries[0].parents == [-1, 0]
    logits = torch.zeros(3, 16)
    logits[1, 5] = logits[2, 9] = 5.0  # greedy: the target takes 5, then 9
    sampled = torch.full((2, 2), 7, dtype=torch.int32)
    tv._tree_sample(lambda self, lg, md: types.SimpleNamespace(sampled_token_ids=sampled))(
        runner, logits, types.SimpleNamespace(num_draft_tokens=[0, 1]))
    assert sampled[1].tolist() == [5, 9]
    assert runner.drafter.metrics.tree_merged_steps == 1 and runner.drafter.metrics.tree_zero_cost_accepted == 1
    runner.drafter.proposer.last_trees = {}  # not a merged tree: a chain is vLLM's
    tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 2]))
    assert tv._CURRENT is None
    # One-hot proposals only (n-gram and suffix, or a greedy request's model draft): the shape is a
    # function of the context and vLLM's one-hot chain sampler is the merged rule: vLLM's too.
    runner.drafter.proposer.last_trees = {"a": merge_proposals([DrafterProposal.chain([5]), DrafterProposal.chain([5])])}
    tv._tree_prepare_inputs(prepare)(runner, scheduled, np.array([1, 2]))
    assert tv._CURRENT is None


# ---------------------------------------------------------------------------------------------
# The CUDA path (FlashAttention / Triton / FlexAttention cache layout): no GPU here, so its layout
# helpers and backend selection are tested on CPU tensors; vLLM's CUDA writer
# (reshape_and_cache_flash) is not available on CPU and is stood in for by the indexing it does.
# ---------------------------------------------------------------------------------------------


def _flash_writer(impl, layer, key, value, kv_cache, slot_mapping):
    """What vLLM 0.32's CUDA backends' do_kv_cache_update writes (reshape_and_cache_flash into
    ``kv_cache.transpose(1, 2).split(D, dim=-1)``: slot s -> block s // B, offset s % B)."""
    dim = key.shape[-1]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)  # [num_blocks, B, H, D] views
    block = kv_cache.shape[2]
    key_cache[slot_mapping // block, slot_mapping % block] = key
    value_cache[slot_mapping // block, slot_mapping % block] = value


def _installed_source(module: str) -> str:
    import importlib.util

    with open(importlib.util.find_spec(module).origin) as f:
        return f.read()


def test_the_flash_writer_stand_in_is_what_vllms_cuda_backends_do():
    for spec in tv.CUDA_BACKENDS:
        assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in _installed_source(spec.module), spec
        assert "[num_blocks, num_kv_heads, block_size, 2 * head_size]" in _installed_source(spec.module) or (
            spec.name == "FLASH_ATTN" and "(B, H, N, 2*D)" in _installed_source(spec.module)), spec


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_layout_reads_what_the_flash_writer_wrote_and_the_probe_tells_layouts_apart(dtype):
    block, dim, heads = 16, 64, 4
    cache = torch.zeros(6, heads, block, 2 * dim, dtype=dtype)
    table = torch.tensor([5, 0, 2], dtype=torch.int32)  # scattered blocks
    n = 2 * block + 3
    key, value = torch.randn(n, heads, dim).to(dtype), torch.randn(n, heads, dim).to(dtype)
    slots = torch.tensor([int(table[i // block]) * block + i % block for i in range(n)])
    _flash_writer(None, None, key, value, cache, slots)
    k, v = tv.read_paged_kv(cache, table, n, "kv_interleaved")
    assert k.shape == (n, heads, dim) and torch.equal(k, key) and torch.equal(v, value)
    k, v = tv.read_paged_kv(cache, table, 5, "kv_interleaved")
    assert torch.equal(k, key[:5]) and torch.equal(v, value[:5])
    for layout in ("k_dxb", "k_bxd"):  # the CPU layouts do not read it back
        k, v = tv.read_paged_kv(cache, table, n, layout)
        assert not (torch.equal(k, key) and torch.equal(v, value)), layout
    flash = tv.CUDA_BACKENDS[0]
    assert tv.probe_layout(None, None, cache, backend=flash, writer=_flash_writer) == "kv_interleaved"
    assert tv.probe_layout(None, None, cache, fault="probe_layout", backend=flash, writer=_flash_writer) is None
    # CPU layouts against the CUDA writer: refused, as tree mode would be at start-up.
    assert tv.probe_layout(None, None, cache, backend=tv.CPU_BACKEND, writer=_flash_writer) is None


def test_tree_rows_over_the_cuda_layout_equal_attention_along_each_path():
    """The recompute's inputs from a CUDA-layout cache: prefix K/V read back, tree attention over
    [prefix | tree] equals plain causal attention over prefix + the path, for every node."""
    block, dim, heads, n0 = 16, 32, 2, 21
    cache = torch.zeros(4, heads, block, 2 * dim)
    table = torch.tensor([3, 1])
    prefix_k, prefix_v = torch.randn(n0, heads, dim), torch.randn(n0, heads, dim)
    _flash_writer(None, None, prefix_k, prefix_v, cache,
                  torch.tensor([int(table[i // block]) * block + i % block for i in range(n0)]))
    read_k, read_v = tv.read_paged_kv(cache, table, n0, "kv_interleaved")
    nodes = len(PARENTS)
    query, key, value = (torch.randn(nodes, heads, dim) for _ in range(3))
    out = tv.tree_attention(query, key, value, read_k, read_v, tree_attention_mask(PARENTS), dim ** -0.5)
    for node in range(nodes):
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        path = path[::-1]
        keys = torch.cat([prefix_k, key[path]]).transpose(0, 1)
        values = torch.cat([prefix_v, value[path]]).transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[node][:, None], keys, values, scale=dim ** -0.5)[:, 0]
        torch.testing.assert_close(out[node], expected, atol=1e-5, rtol=1e-5)


def test_backend_selection_by_platform():
    assert tv.platform_backends("cpu") == (tv.CPU_BACKEND,)
    assert [s.name for s in tv.platform_backends("cuda")] == ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
    assert tv.platform_backends("rocm") == () and tv.platform_backends("tpu") == ()
    assert tv.CPU_BACKEND.tested and not any(s.tested for s in tv.CUDA_BACKENDS)
    assert tv.current_platform_name() == "cpu"
    with pytest.raises(tv.TreeVerificationUnavailable, match="no tree attention path for platform 'rocm'"):
        tv.register_backend(platform="rocm")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for spec in tv.ALL_BACKENDS:
        assert getattr(AttentionBackendEnum, spec.name).value == f"{spec.module}.{spec.backend_class}"
        source = _installed_source(spec.module)
        assert f"class {spec.backend_class}(" in source and f"class {spec.impl_class}(" in source
        assert "def do_kv_cache_update(" in source


def test_cuda_tree_subclasses_build_on_cpu_and_resolve_by_name():
    """vLLM 0.32's CUDA backend modules import on this CPU build: the tree subclasses are built
    and resolvable the way vLLM's registry resolves a backend path (import + getattr)."""
    import importlib

    for spec in tv.ALL_BACKENDS:
        backend, impl = tv.backend_classes(spec)
        base_backend, base_impl = tv._vllm_classes(spec)
        assert issubclass(backend, base_backend) and issubclass(impl, base_impl)
        assert backend.get_impl_cls() is impl and backend.get_name() == base_backend.get_name() == spec.name
        module_path, _, name = tv.backend_path(spec).rpartition(".")
        assert getattr(importlib.import_module(module_path), name) is backend
        assert tv.vllm_cache_writer(spec) is base_impl.do_kv_cache_update
    assert tv.CPU_BACKEND.tree_impl_name == "TreeCPUAttentionImpl"


def test_importing_tree_verification_imports_no_cuda_backend():
    import subprocess
    import sys

    code = ("import sys; import vllm_specplugin.tree_verification as tv; tv.backend_classes(); "
            "print(sorted(s.module for s in tv.CUDA_BACKENDS if s.module in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
