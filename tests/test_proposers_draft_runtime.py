"""The engine-agnostic draft runtime: vocabulary check, incremental KV cost, rollback, memory."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.draft_runtime import DraftModelError, DraftRuntime
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.verification.algorithm import process_logits
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DRAFT = os.path.join(REPO_ROOT, "models", "demo", "draft-tiny")
VOCAB = 4096
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runtime():
    return DraftRuntime(DRAFT, target_vocab_size=VOCAB)


def context(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


def test_vocabulary_mismatch_names_both_models(random_target):
    with pytest.raises(DraftModelError, match=r"vocabulary size 512, but models/demo/target has 4096"):
        DraftRuntime(random_target, target_vocab_size=4096, target_name="models/demo/target")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(DraftModelError, match="no config.json"):
        DraftRuntime(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("damage", ["truncated weights", "no weights"])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage):
    """A checkpoint whose weights are cut short or missing: a DraftModelError naming the draft."""
    import shutil

    path = tmp_path / "draft"
    shutil.copytree(DRAFT, path)
    weights = path / "model.safetensors"
    if damage == "no weights":
        weights.unlink()
    else:
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    with pytest.raises(DraftModelError, match=rf"draft model '{path}' could not be loaded .*not truncated"):
        DraftRuntime(str(path), target_vocab_size=VOCAB)


@pytest.mark.parametrize("context_length", [100, 800])
def test_step_cost_grows_with_new_tokens_not_context(runtime, context_length):
    """After the first step, a step forwards the new tokens plus gamma - 1 drafts, whatever the context."""
    gamma, rid = 3, f"cost-{context_length}"
    ctx = context(context_length)
    before = runtime.tokens_forwarded
    first = runtime.draft(rid, ctx, gamma, GREEDY)
    assert runtime.tokens_forwarded - before == context_length + gamma - 1
    # The target accepted two drafts and added one token of its own.
    ctx = ctx + first.token_ids[:2] + [7]
    before = runtime.tokens_forwarded
    runtime.draft(rid, ctx, gamma, GREEDY)
    assert runtime.tokens_forwarded - before == 1 + gamma - 1
    runtime.free(rid)


def test_rollback_matches_a_fresh_cache(runtime):
    """Drafts after a rejection equal those drafted from scratch on the same context."""
    ctx = context(60, seed=1)
    first = runtime.draft("rollback", ctx, 4, GREEDY)
    ctx = ctx + first.token_ids[:1] + [11]  # one accepted, then a correction
    incremental = runtime.draft("rollback", ctx, 4, GREEDY)
    fresh = DraftRuntime(DRAFT, target_vocab_size=VOCAB).draft("fresh", ctx, 4, GREEDY)
    assert incremental.token_ids == fresh.token_ids
    torch.testing.assert_close(incremental.probs, fresh.probs)
    runtime.free("rollback")


def test_q_is_the_distribution_drawn_from(runtime):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    generator = torch.Generator().manual_seed(0)
    draft = runtime.draft("q", context(40, seed=2), 5, params, generator)
    assert draft.probs.shape == (5, VOCAB)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(5))
    for token, row in zip(draft.token_ids, draft.probs):
        assert row[token] > 0
        assert int((row > 0).sum()) <= 20
    greedy = runtime.draft("q", context(40, seed=2), 3, GREEDY)
    assert all(float(row.max()) == 1.0 for row in greedy.probs)
    runtime.free("q")


def test_processing_matches_the_reference(runtime):
    """Draft-side processing is the harness's float64 reference (vLLM's conventions)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    for params in [SamplingParams(0.7, 50, 0.9), SamplingParams(1.3, 0, 0.8), SamplingParams(1.0, 5, 1.0)]:
        expected = process_logits(logits.double().numpy(), params.temperature, params.top_k, params.top_p)
        got = processed_probs(logits, params).double().numpy()
        assert set(np.nonzero(got)[0]) == set(np.nonzero(expected)[0])
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_context_beyond_draft_length_falls_back_once(runtime, caplog):
    too_long = context(runtime.max_length, seed=4)
    with caplog.at_level(logging.WARNING, logger="vllm_specplugin.proposers.draft_runtime"):
        assert runtime.draft("long", too_long, 3, GREEDY).token_ids == []
        assert runtime.draft("long", too_long + [5], 3, GREEDY).token_ids == []
    messages = [r.getMessage() for r in caplog.records if "maximum length" in r.getMessage()]
    assert len(messages) == 1 and "plain decoding continues" in messages[0]
    near = context(runtime.max_length - 2, seed=5)
    assert len(runtime.draft("near", near, 5, GREEDY).token_ids) == 2  # clipped, not dropped
    runtime.free("long"), runtime.free("near")


def test_no_leak_over_1000_requests_and_budget_holds():
    small = DraftRuntime(DRAFT, target_vocab_size=VOCAB, memory_budget_mb=0.5)
    for i in range(1000):
        small.draft(f"r{i}", context(8, seed=i), 2, GREEDY)
        if i % 2:
            small.free(f"r{i}")
        assert small.cache_bytes <= small.memory_budget_bytes or small.num_cached_requests == 1
    assert small.evictions > 0
    for i in range(1000):
        small.free(f"r{i}")
    assert small.num_cached_requests == 0 and small.cache_bytes == 0


def test_byte_counts_are_the_sums_over_the_caches():
    """cache_bytes and resident_bytes are running totals (a sum over every tracked request after
    each batch made drafting quadratic in the requests an engine holds): they must equal the sums
    they replace after every operation: buffers growing, rollbacks, evictions, frees, resident
    bytes set and cleared, prefix sharing."""
    rt = DraftRuntime(DRAFT, target_vocab_size=VOCAB, memory_budget_mb=0.25, prefix_sharing=True,
                      prefix_block_size=4, kv_chunk_tokens=16)
    gen = np.random.default_rng(0)
    shared = context(12, seed=99)
    for i in range(300):
        rid = f"r{gen.integers(40)}"
        tail = context(int(gen.integers(1, 60)), seed=i)
        rt.draft(rid, shared + tail if gen.random() < 0.5 else tail, 3, GREEDY)
        rt.set_resident_bytes(rid, int(gen.choice([0, 1000, 5000])))
        if gen.random() < 0.2:
            rt.free(rid)
        assert rt.cache_bytes == sum(c.nbytes for c in rt._caches.values()), i
        assert rt.resident_bytes == sum(rt._resident.values()), i
    assert rt.evictions > 0 and rt.prefix_cache.num_blocks > 0
    for i in range(40):
        rt.free(f"r{i}")
    assert rt.cache_bytes == 0 and rt.resident_bytes == 0


@pytest.mark.parametrize("name", ["draft-small", "draft-distill", "target"])
def test_lean_llama_forward_equals_transformers(name):
    """The lean forward path gives transformers' logits, batched, ragged and incremental."""
    path = os.path.join(REPO_ROOT, "models", "demo", name)
    lean = DraftRuntime(path, target_vocab_size=VOCAB)
    plain = DraftRuntime(path, target_vocab_size=VOCAB, lean_forward=False)
    assert lean.lean is not None and plain.lean is None
    contexts = [context(37, seed=10), context(5, seed=11), context(60, seed=12)]
    batches = [rt.open_batch(["a", "b", "c"], contexts) for rt in (lean, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=1e-4, rtol=1e-4)
    for token in (3, 99):
        torch.testing.assert_close(
            batches[0].extend([token] * 3), batches[1].extend([token] * 3), atol=1e-4, rtol=1e-4
        )


def test_lean_forward_with_grouped_query_attention(tmp_path):
    """Grouped-query attention (2 KV heads for 4 query heads), prefill and one-token decode steps
    (the decode step's own attention path): transformers' logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    lean = DraftRuntime(str(tmp_path), target_vocab_size=VOCAB)
    plain = DraftRuntime(str(tmp_path), target_vocab_size=VOCAB, lean_forward=False)
    assert lean.lean is not None and lean.lean.num_kv_heads == 2
    batches = [rt.open_batch(["a", "b"], [context(20, seed=15), context(7, seed=16)]) for rt in (lean, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=1e-4, rtol=1e-4)
    for token in (3, 99, 7):
        torch.testing.assert_close(batches[0].extend([token] * 2), batches[1].extend([token] * 2), atol=1e-4, rtol=1e-4)


def test_lean_rope_table_grows_for_long_contexts(monkeypatch):
    """A draft whose positions outrun the precomputed RoPE table extends it (long-context models
    start with a short table), and its logits still equal transformers'."""
    from vllm_specplugin.proposers import lean_llama

    monkeypatch.setattr(lean_llama, "ROPE_TABLE_POSITIONS", 16)
    path = os.path.join(REPO_ROOT, "models", "demo", "draft-small")
    lean = DraftRuntime(path, target_vocab_size=VOCAB)
    plain = DraftRuntime(path, target_vocab_size=VOCAB, lean_forward=False)
    assert lean.lean.rope_cos.shape[0] == 16
    ctx = context(40, seed=13)
    logits = [rt.open_batch(["a"], [ctx]).logits for rt in (lean, plain)]
    assert lean.lean.rope_cos.shape[0] >= 40
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_lean_forward_takes_its_kernels():
    """Every matrix product of the lean forward goes through ``kernels.linear``, and each other
    kernel is called (the vLLM adapter passes vLLM's CPU kernels there): counting kernels see them."""
    import dataclasses

    from vllm_specplugin.proposers.lean_llama import TORCH_KERNELS

    made, calls = [], {}

    def counting(name, kernel):
        def wrapped(*args):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args)
        return wrapped

    def linear(weight):
        made.append(tuple(weight.shape))
        return counting("linear", TORCH_KERNELS.linear(weight))

    def make_rope(cos, sin):
        return counting("rope", TORCH_KERNELS.make_rope(cos, sin))

    kernels = dataclasses.replace(
        TORCH_KERNELS, name="counting", linear=linear, make_rope=make_rope,
        rms_norm=counting("rms_norm", TORCH_KERNELS.rms_norm),
        add_rms_norm=counting("add_rms_norm", TORCH_KERNELS.add_rms_norm),
        silu_and_mul=counting("silu_and_mul", TORCH_KERNELS.silu_and_mul),
    )
    path = os.path.join(REPO_ROOT, "models", "demo", "draft-small")
    # the lean forward itself (the one-row fast path, on by default, has its own tests: test_lean_decode.py)
    rt = DraftRuntime(path, target_vocab_size=VOCAB, kernels=kernels, fast_path=False)
    layers = rt.model.config.num_hidden_layers
    assert len(made) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the lm_head
    reference = DraftRuntime(path, target_vocab_size=VOCAB).open_batch(["a"], [context(9, seed=14)]).logits
    torch.testing.assert_close(rt.open_batch(["a"], [context(9, seed=14)]).logits, reference)
    assert calls == {"linear": 4 * layers + 1, "rope": layers, "rms_norm": 2, "add_rms_norm": 2 * layers - 1,
                     "silu_and_mul": layers}


def test_lean_forward_is_not_used_where_it_does_not_apply(random_target):
    from transformers import AutoConfig

    from vllm_specplugin.proposers.lean_llama import LeanLlama

    runtime_ = DraftRuntime(random_target)
    assert LeanLlama.supports(runtime_.model)
    config = AutoConfig.from_pretrained(random_target)
    config.attention_bias = True
    runtime_.model.config = config
    assert not LeanLlama.supports(runtime_.model)


# -- KV buffers: written in place, grown in chunks --------------------------------------------


@torch.no_grad()
def full_forward_logits(rt: DraftRuntime, tokens: list[int]) -> torch.Tensor:
    """Next-token logits from a cache-free transformers forward of the whole context [V]."""
    return rt.model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_kv_buffers_are_written_in_place_and_grow_in_chunks():
    """A step writes the new tokens into the request's buffer and a rollback moves its length:
    the buffer is the same tensor step after step until it is full, then grows by half,
    rounded up to the chunk. The budget counts capacity."""
    rt = DraftRuntime(DRAFT, target_vocab_size=VOCAB)
    config = rt.model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32
    ctx = context(100, seed=20)
    rt.draft("kv", ctx, 3, GREEDY)
    buffer = rt._caches["kv"].kv
    assert buffer.shape[3] == rt.kv_chunk_tokens == 256
    assert rt.cache_bytes == 256 * per_token
    for step in range(30):
        draft = rt.draft("kv", ctx, 3, GREEDY)
        ctx = ctx + draft.token_ids[: step % 3] + [5]  # 0-2 accepted: rollbacks of 2-0 tokens
        assert rt._caches["kv"].kv.data_ptr() == buffer.data_ptr()
    assert len(ctx) < 256
    ctx = ctx + context(150, seed=21)
    rt.draft("kv", ctx, 3, GREEDY)
    assert rt._caches["kv"].kv.shape[3] == 512  # max(needed, 1.5 * 256) rounded up to the chunk
    assert rt.cache_bytes == 512 * per_token
    fresh = DraftRuntime(DRAFT, target_vocab_size=VOCAB).draft("kv", ctx, 3, GREEDY)
    assert rt.draft("kv", ctx, 3, GREEDY).token_ids == fresh.token_ids


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_rows_extend_on_their_own(lean):
    """extend(rows=...) forwards only the rows given, and each row's cache keeps what it forwarded."""
    rt = DraftRuntime(os.path.join(REPO_ROOT, "models", "demo", "draft-small"), target_vocab_size=VOCAB,
                      lean_forward=lean)
    contexts = [context(30, seed=22), context(12, seed=23), context(50, seed=24)]
    batch = rt.open_batch(["a", "b", "c"], contexts)
    before = rt.tokens_forwarded
    logits = batch.extend([17, 23], rows=[0, 2])
    assert logits.shape == (2, VOCAB) and batch.rows == [0, 2] and rt.tokens_forwarded - before == 2
    torch.testing.assert_close(logits[0], full_forward_logits(rt, contexts[0] + [17]), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], full_forward_logits(rt, contexts[2] + [23]), atol=2e-4, rtol=1e-4)
    logits = batch.extend([5], rows=[2])
    torch.testing.assert_close(logits[0], full_forward_logits(rt, contexts[2] + [23, 5]), atol=2e-4, rtol=1e-4)
    batch.close()
    before = rt.tokens_forwarded
    nexts = [contexts[0] + [17, 1], contexts[1] + [1], contexts[2] + [23, 5, 1]]
    again = rt.open_batch(["a", "b", "c"], nexts)
    assert rt.tokens_forwarded - before == 3
    for row, ctx in enumerate(nexts):
        torch.testing.assert_close(again.logits[row], full_forward_logits(rt, ctx), atol=2e-4, rtol=1e-4)
    again.close()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_branches_use_scratch_entries_and_leave_the_cache_alone(lean):
    """Token-tree rows share their request's buffer (scratch entries, masked per row), also when
    extended; afterwards the cache holds exactly the context."""
    rt = DraftRuntime(os.path.join(REPO_ROOT, "models", "demo", "draft-small"), target_vocab_size=VOCAB,
                      lean_forward=lean)
    ctx = context(40, seed=25)
    paths = [[5], [9, 11], [5, 6, 7]]
    batch = rt.open_batch(["t"], [ctx])
    batch.close()
    from vllm_specplugin.proposers.draft_runtime import DraftBatch

    branches = DraftBatch.branches(rt, "t", ctx, paths)
    for row, path in enumerate(paths):
        torch.testing.assert_close(branches.logits[row], full_forward_logits(rt, ctx + path), atol=2e-4, rtol=1e-4)
    extended = branches.extend([1, 2], rows=[2, 0])
    torch.testing.assert_close(extended[0], full_forward_logits(rt, ctx + paths[2] + [1]), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(extended[1], full_forward_logits(rt, ctx + paths[0] + [2]), atol=2e-4, rtol=1e-4)
    branches.close()
    before = rt.tokens_forwarded
    after = rt.open_batch(["t"], [ctx + [3]])
    assert rt.tokens_forwarded - before == 1
    torch.testing.assert_close(after.logits[0], full_forward_logits(rt, ctx + [3]), atol=2e-4, rtol=1e-4)
    after.close()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_tree_grown_wave_by_wave_forwards_each_node_once(lean):
    """The waves of one tree's growth (a call per level, as TreeProposer's builders ask): each
    path forwards only its new token, attending to its ancestors' scratch entries from earlier
    calls, with the logits of the whole context + path; once the context changes, nothing of the
    old tree is reused."""
    from vllm_specplugin.proposers.draft_runtime import DraftBatch

    rt = DraftRuntime(os.path.join(REPO_ROOT, "models", "demo", "draft-small"), target_vocab_size=VOCAB,
                      lean_forward=lean)
    ctx = context(40, seed=26)
    rt.open_batch(["t"], [ctx]).close()
    waves = [[[5], [9]], [[5, 6], [5, 8], [9, 11]], [[5, 6, 7]], [[5, 8, 2], [9, 11, 4]]]
    for wave in waves:
        before = rt.tokens_forwarded
        branches = DraftBatch.branches(rt, "t", ctx, wave)
        assert rt.tokens_forwarded - before == len(wave)  # one token per node
        for row, path in enumerate(wave):
            torch.testing.assert_close(branches.logits[row], full_forward_logits(rt, ctx + path), atol=2e-4, rtol=1e-4)
        branches.close()
    # A path asked again forwards its last token again (its logits are not kept), nothing more.
    before = rt.tokens_forwarded
    DraftBatch.branches(rt, "t", ctx, [[5, 6, 7]]).close()
    assert rt.tokens_forwarded - before == 1
    # Another context of the same length (its last token replaced): the old tree is stale.
    other = ctx[:-1] + [7 if ctx[-1] != 7 else 8]
    before = rt.tokens_forwarded
    branches = DraftBatch.branches(rt, "t", other, [[5, 6]])
    assert rt.tokens_forwarded - before == 1 + 2
    torch.testing.assert_close(branches.logits[0], full_forward_logits(rt, other + [5, 6]), atol=2e-4, rtol=1e-4)
    branches.close()
    # The context moves on (a committed token): the old tree's entries are stale, paths start over.
    rt.open_batch(["t"], [ctx + [5]]).close()
    new_ctx = ctx + [5, 3]
    before = rt.tokens_forwarded
    branches = DraftBatch.branches(rt, "t", new_ctx, [[5, 6]])
    assert rt.tokens_forwarded - before == 1 + 2  # the new context token, then the whole path
    torch.testing.assert_close(branches.logits[0], full_forward_logits(rt, new_ctx + [5, 6]), atol=2e-4, rtol=1e-4)
    branches.close()


def test_a_request_is_in_a_batch_once(runtime):
    with pytest.raises(ValueError, match="only once"):
        runtime.open_batch(["x", "x"], [[1, 2], [1, 2]])


def test_solo_prefill_threshold_is_a_parameter(tmp_path):
    """Rows with more new tokens than the threshold are prefilled first, so a prompt shared by
    two rows of one batch is forwarded once; above the threshold both rows forward it."""
    prompt = context(40, seed=26)
    forwarded, hits = {}, {}
    for threshold in (16, 1000):
        rt = DraftRuntime(DRAFT, target_vocab_size=VOCAB, prefix_sharing=True, solo_prefill_threshold=threshold)
        rt.open_batch(["a", "b"], [prompt, prompt + [7]]).close()
        forwarded[threshold], hits[threshold] = rt.tokens_forwarded, rt.prefix_cache.hit_tokens
    # Default: "a" prefills 39 alone (2 whole blocks shared), "b" starts from 32 shared tokens.
    assert (forwarded[16], hits[16]) == (39 + 1 + 9, 32)
    assert (forwarded[1000], hits[1000]) == (40 + 41, 0)
    with pytest.raises(ValueError, match="solo_prefill_threshold"):
        DraftRuntime(DRAFT, solo_prefill_threshold=-1)


# -- lean forward coverage: GQA, Qwen2 (qkv bias), llama3 RoPE ------------------------------


def _tiny_checkpoint(path, kind: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
        with torch.no_grad():  # random biases, so that leaving them out shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
    elif kind == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    elif kind == "linear-rope":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                         "factor": 4.0}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "llama3-rope", "linear-rope"])
def test_lean_forward_covers_more_llama_family_drafts(tmp_path, kind):
    path = _tiny_checkpoint(tmp_path / kind, kind)
    lean = DraftRuntime(path, target_vocab_size=VOCAB)
    plain = DraftRuntime(path, target_vocab_size=VOCAB, lean_forward=False)
    assert lean.lean is not None and plain.lean is None
    contexts = [context(37, seed=27), context(5, seed=28), context(90, seed=29)]  # past 64: llama3's bands
    batches = [rt.open_batch(["a", "b", "c"], contexts) for rt in (lean, plain)]
    torch.testing.assert_close(batches[0].logits, batches[1].logits, atol=1e-4, rtol=1e-4)
    for token in (3, 99):
        torch.testing.assert_close(
            batches[0].extend([token] * 3), batches[1].extend([token] * 3), atol=1e-4, rtol=1e-4
        )
    torch.testing.assert_close(batches[0].logits[2], full_forward_logits(plain, contexts[2] + [3, 99]),
                               atol=1e-4, rtol=1e-4)


# -- vocabulary: a draft whose vocabulary is a prefix of the target's --------------------------


@pytest.fixture(scope="module")
def prefix_draft(tmp_path_factory) -> str:
    """A 1-layer random Llama over the first 500 ids of random_target's 512-id word vocabulary
    (same tokens for ids < 500)."""
    from vllm_specplugin.models.random_llama import make_random_llama

    return str(make_random_llama(tmp_path_factory.mktemp("models") / "draft500", vocab_size=500, num_layers=1,
                                 seed=3))


def test_prefix_vocabulary_is_padded_with_zeros(random_target, prefix_draft):
    from vllm_specplugin.proposers.base import DraftRequest
    from vllm_specplugin.proposers.ensemble import EnsembleProposer

    rt = DraftRuntime(prefix_draft, target_vocab_size=512, target_name="random target", target_path=random_target)
    assert (rt.vocab_size, rt.draft_vocab_size) == (512, 500)
    params = SamplingParams(temperature=2.0)  # flat: padded ids would be drawn if they had mass
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(30)
    drawn = set()
    for i in range(40):
        ctx = rng.integers(3, 512, size=20).tolist()  # target ids the draft lacks included
        draft = rt.draft(f"p{i}", ctx, 4, params, generator)
        assert draft.probs.shape == (4, 512)
        assert bool((draft.probs[:, 500:] == 0).all()) and bool((draft.probs[:, :500] > 0).all())
        drawn.update(draft.token_ids)
    assert max(drawn) < 500 and len(drawn) > 100
    proposer = EnsembleProposer([rt])
    out = proposer.propose([DraftRequest("e", rng.integers(3, 512, size=30).tolist(), 3, params, generator)])[0]
    assert out.probs.shape == (3, 512) and bool((out.probs[:, 500:] == 0).all()) and max(out.token_ids) < 500


def test_target_path_defaults_to_a_target_name_that_is_a_directory(random_target, prefix_draft):
    """vLLM's adapter passes the target's model path as target_name."""
    assert DraftRuntime(prefix_draft, target_vocab_size=512, target_name=random_target).vocab_size == 512


def test_draft_larger_than_the_target_is_refused(random_target):
    with pytest.raises(DraftModelError, match=r"vocabulary size 512, but small-target has 500: a draft may not"):
        DraftRuntime(random_target, target_vocab_size=500, target_name="small-target")


def test_disagreeing_tokenizers_are_refused(tmp_path, random_target, prefix_draft):
    import json
    import shutil

    other = tmp_path / "draft500-other"
    shutil.copytree(prefix_draft, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["w10"], vocab["w11"] = vocab["w11"], vocab["w10"]  # ids 13 and 14 swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DraftModelError, match=r"vocabulary size 500, but tgt has 512, and the draft's vocabulary "
                                              r"is not a prefix of the target's \(id 13 is 'w11' for the draft"):
        DraftRuntime(str(other), target_vocab_size=512, target_name="tgt", target_path=random_target)


def test_missing_tokenizer_files_require_equal_sizes(tmp_path, random_target, prefix_draft):
    import shutil

    bare = tmp_path / "draft500-bare"
    shutil.copytree(prefix_draft, bare)
    for name in os.listdir(bare):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(bare / name)
    with pytest.raises(DraftModelError, match=r"needs both tokenizers to compare, and none could be read for the draft"):
        DraftRuntime(str(bare), target_vocab_size=512, target_name="tgt", target_path=random_target)
    with pytest.raises(DraftModelError, match=r"none could be read for the target \(no-such-model\)"):
        DraftRuntime(prefix_draft, target_vocab_size=512, target_name="no-such-model")
