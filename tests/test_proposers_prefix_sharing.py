"""Prefix sharing: draft KV of a common prompt is forwarded once, drafts stay the same, memory is bounded."""

from __future__ import annotations

import os

import numpy as np
import torch

from vllm_specplugin.proposers.base import DraftRequest
from vllm_specplugin.proposers.draft_runtime import DraftRuntime
from vllm_specplugin.proposers.ensemble import EnsembleProposer
from vllm_specplugin.proposers.prefix_cache import PrefixCache
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-small")
SYSTEM_PROMPT = np.random.default_rng(0).integers(3, 4096, 208).tolist()


def workload(n_requests: int = 32, steps: int = 4):
    rng = np.random.default_rng(1)
    return {f"r{i}": SYSTEM_PROMPT + rng.integers(3, 4096, 20).tolist() for i in range(n_requests)}, steps


def serve(sharing: bool):
    rt = DraftRuntime(DRAFT, target_vocab_size=4096, prefix_sharing=sharing)
    proposer = EnsembleProposer([rt])
    contexts, steps = workload()
    drafts_seen = []
    for _ in range(steps):
        requests = [DraftRequest(rid, ctx, 3) for rid, ctx in contexts.items()]
        drafts = proposer.propose(requests)
        drafts_seen.append([d.token_ids for d in drafts])
        for request, draft in zip(requests, drafts):
            contexts[request.request_id] = list(request.context) + draft.token_ids[:1] + [5]
    return rt, drafts_seen


def test_shared_system_prompt_is_forwarded_once():
    plain, plain_drafts = serve(sharing=False)
    shared, shared_drafts = serve(sharing=True)
    saved = 1 - shared.tokens_forwarded / plain.tokens_forwarded
    print(f"draft tokens forwarded: {plain.tokens_forwarded} without sharing, {shared.tokens_forwarded} with "
          f"({saved:.0%} fewer)")
    # 31 of the 32 requests reuse the 13 whole blocks (208 tokens) of the system prompt.
    assert plain.tokens_forwarded - shared.tokens_forwarded == 31 * 208
    assert shared.prefix_cache.hit_tokens == 31 * 208
    assert plain_drafts == shared_drafts


def test_short_prompts_are_shared_too():
    """Prompts under the solo-prefill threshold are offered once their batch closes."""
    rt = DraftRuntime(DRAFT, target_vocab_size=4096, prefix_sharing=True, prefix_block_size=4)
    proposer = EnsembleProposer([rt])
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    proposer.propose([DraftRequest("first", prompt, 2)])
    before = rt.tokens_forwarded
    proposer.propose([DraftRequest("second", prompt, 2)])
    assert rt.tokens_forwarded - before == 1 + 1  # the last prompt token (8 from the tree), one draft step
    assert rt.prefix_cache.hit_tokens == 8


def test_shared_kv_equals_own_prefill():
    rt = DraftRuntime(DRAFT, target_vocab_size=4096, prefix_sharing=True)
    a = rt.open_batch(["a"], [SYSTEM_PROMPT + [7, 8, 9]])
    a.close()
    b = rt.open_batch(["b"], [SYSTEM_PROMPT + [10, 11]])
    fresh = DraftRuntime(DRAFT, target_vocab_size=4096).open_batch(["b"], [SYSTEM_PROMPT + [10, 11]])
    torch.testing.assert_close(b.logits, fresh.logits, atol=1e-4, rtol=1e-4)
    b.close()


def check_blocks_in_use(rt: DraftRuntime) -> int:
    """Every block a live request holds is still in the tree, with one reference per holder.
    Returns how many blocks are in use (so a caller can tell the check visited something)."""
    in_tree = {id(n) for n in rt.prefix_cache._nodes()}
    holders: dict[int, int] = {}
    nodes = {}
    for cache in rt._caches.values():
        for node in cache.shared_chain:
            holders[id(node)] = holders.get(id(node), 0) + 1
            nodes[id(node)] = node
    evicted = set(holders) - in_tree
    assert not evicted, f"{len(evicted)} blocks in use were evicted"
    assert all(nodes[i].refcount == count for i, count in holders.items())
    return len(holders)


def test_eviction_spares_blocks_in_use_and_budget_holds():
    rt = DraftRuntime(DRAFT, target_vocab_size=4096, prefix_sharing=True, memory_budget_mb=0.6)
    rng = np.random.default_rng(2)
    most_in_use = 0
    for i in range(40):
        batch = rt.open_batch([f"q{i}"], [rng.integers(3, 4096, 100).tolist()])
        batch.close()
        if i % 3:
            rt.free(f"q{i}")
        assert rt.total_bytes <= rt.memory_budget_bytes or rt.num_cached_requests == 1
        most_in_use = max(most_in_use, check_blocks_in_use(rt))
    assert rt.prefix_cache.evicted_blocks > 0
    assert most_in_use > 0 and check_blocks_in_use(rt) > 0  # the check saw live shared blocks
    for rid in list(rt.request_ids):
        rt.free(rid)
    remaining = list(rt.prefix_cache._nodes())
    assert remaining and all(n.refcount == 0 for n in remaining)


def test_radix_tree_matches_whole_blocks_only():
    tree = PrefixCache(block_size=4)
    kv = [(torch.randn(2, 10, 8), torch.randn(2, 10, 8))]
    chain = tree.insert(list(range(10)), kv)
    assert len(chain) == 2 and tree.num_blocks == 2  # 10 tokens: two whole blocks
    assert len(tree.match(list(range(9)))) == 2
    assert len(tree.match([0, 1, 2, 3, 9, 9, 9, 9])) == 1
    assert tree.match([1, 2, 3, 4]) == []
    loaded = tree.load(tree.match(list(range(8))))
    torch.testing.assert_close(loaded[0][0], kv[0][0][:, :8])
    tree.acquire(chain[:1])
    assert tree.evict(10**9) == chain[1].nbytes  # the referenced first block stays
    assert tree.num_blocks == 1
