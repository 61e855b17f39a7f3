"""proposers/eagle_head.py: the EAGLE-1 and EAGLE-3 heads as the plugin's drafter drafts what the trainer's
reference forward (models/eagle.py, itself tied to vLLM's llama_eagle in tests/test_eagle.py) drafts,
with the request's processed q, whatever way the target's hidden states arrive (all at once, one
verified step at a time, positions recomputed, states missing)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm_specplugin.models import eagle as E  # noqa: E402
from vllm_specplugin.models import heads as H  # noqa: E402
from vllm_specplugin.models.random_llama import make_random_llama  # noqa: E402
from vllm_specplugin.proposers.base import DraftRequest  # noqa: E402
from vllm_specplugin.proposers.eagle_head import EagleHeadProposer, HeadCheckpointError  # noqa: E402
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs  # noqa: E402


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def pair(request, tmp_path_factory):
    """A random 4-layer target and an untrained (randomised) head saved as vLLM loads it: EAGLE-1, or
    EAGLE-3 reading the target's layers 0, 1 and 3."""
    root = tmp_path_factory.mktemp(request.param)
    target_dir = make_random_llama(root / "target", logit_scale=15.0, seed=0, num_layers=4)
    target = H.load_target(target_dir)
    cfg = target.config.to_dict()
    torch.manual_seed(1)
    if request.param == "eagle3":
        head = E.Eagle3Head(cfg, target.model.embed_tokens.weight, target.lm_head.weight, (0, 1, 3),
                            target.model.norm.weight)
    else:
        head = E.EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the identity start would hide attention / MLP bugs
    E.save_eagle(head, root / "eagle", cfg, {"method": request.param})
    head = E.load_eagle(root / "eagle", target)  # bf16 round trip: the weights the proposer reads
    return target, head, root / "eagle"


def _features(pair, tokens: list[int]) -> torch.Tensor:
    """What the runner hands the head for ``tokens`` [1, n, F]: the target's final normed hidden
    states (EAGLE-1), or its residual stream after the head's aux layers, concatenated (EAGLE-3)."""
    target, head, _ = pair
    return head.target_inputs(target, torch.tensor([tokens]))[0]


def _proposer(pair):
    target, _, path = pair
    proposer = EagleHeadProposer(path)
    proposer.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return proposer


def _reference(target, head, context: list[int], drafted: list[int]):
    """The trainer's teacher-forced chain from the start at the context's last verified position,
    fed the drafted tokens: logits [len(drafted), V] of draft steps 1..len(drafted)."""
    x = torch.tensor([context + drafted])
    f, _ = head.target_inputs(target, x)
    steps = len(drafted)
    start = len(context) - 2
    return torch.stack([logits[0, start] for logits in head.chain(x, f, steps)])


def _request(rid, context, gamma, params, hidden, start, generator=None):
    return DraftRequest(rid, context, gamma, params, generator, hidden_states=hidden, hidden_start=start)


@torch.no_grad()
def test_chain_matches_the_reference_head_greedy_and_sampled(pair):
    target, head, _ = pair
    proposer = _proposer(pair)
    context = torch.randint(0, target.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))[0].tolist()
    f = _features(pair, context)
    for rid, params in (("greedy", SamplingParams(0.0)), ("t1", SamplingParams(1.0)), ("topk", SamplingParams(0.8, 5, 0.9))):
        generator = torch.Generator().manual_seed(7)
        # The target has seen positions 0..18 (19 = the newest token has no state yet).
        draft, = proposer.propose([_request(rid, context, 4, params, f[0, :19], 0, generator)])
        assert len(draft.token_ids) == 4
        logits = _reference(target, head, context, draft.token_ids)
        want = processed_probs(logits, params)
        torch.testing.assert_close(draft.probs, want, atol=2e-5, rtol=1e-4)
        if params.greedy:
            assert draft.token_ids == logits.argmax(-1).tolist()


@torch.no_grad()
def test_states_arriving_step_by_step_give_the_states_at_once_result(pair):
    target, head, _ = pair
    seq = torch.randint(0, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))[0].tolist()
    f = _features(pair, seq)
    f = f[0]
    once, steps = _proposer(pair), _proposer(pair)
    greedy = SamplingParams(0.0)
    t1 = SamplingParams(1.0)  # q's every entry shows a wrong state (a greedy one-hot hides most)
    whole, = once.propose([_request("r", seq[:25], 3, t1, f[:24], 0, torch.Generator().manual_seed(5))])
    # Prefill of 12 prompt tokens (states 0..11), then verified steps of 1, 3 and 2 positions with
    # a rejected draft's state never handed over; and one step recomputing positions 20..21.
    steps.propose([_request("r", seq[:13], 3, greedy, f[:12], 0)])
    steps.propose([_request("r", seq[:14], 3, greedy, f[12:13], 12)])
    steps.propose([_request("r", seq[:17], 3, greedy, f[13:16], 13)])
    steps.propose([_request("r", seq[:22], 3, greedy, torch.cat([f[16:20], f[20:21] + 1.0]), 16)])  # row 20 recomputed next
    last, = steps.propose([_request("r", seq[:25], 3, t1, f[20:24], 20, torch.Generator().manual_seed(5))])
    assert last.token_ids == whole.token_ids
    torch.testing.assert_close(last.probs, whole.probs)
    # The outcome of the previous draft is scored from the tokens that arrived.
    assert steps.metrics.verify_steps == 4 and once.metrics.verify_steps == 0


@torch.no_grad()
def test_no_draft_without_the_state_of_the_last_verified_position(pair):
    target, _, _ = pair
    proposer = _proposer(pair)
    seq = list(range(1, 12))
    f = _features(pair, seq)
    draft, = proposer.propose([_request("r", seq, 3, SamplingParams(0.0), f[0, :8], 0)])  # 8, 9 missing
    assert draft.token_ids == [] and proposer.metrics.fallback_requests == 1
    draft, = proposer.propose([_request("r", seq, 3, SamplingParams(0.0), None, 0)])
    assert draft.token_ids == []
    proposer.free("r")
    assert proposer.tracked_request_ids() == set()


def test_bad_checkpoints_and_targets_are_named(pair, tmp_path):
    target, _, path = pair
    with pytest.raises(HeadCheckpointError, match="config.json is missing"):
        EagleHeadProposer(tmp_path)
    proposer = EagleHeadProposer(path)
    with pytest.raises(HeadCheckpointError, match="trained for this target"):
        proposer.attach_target(target.model.embed_tokens.weight[:, :8], target.lm_head.weight)
    with pytest.raises(RuntimeError, match="attach_target"):
        proposer.propose([_request("r", [1, 2, 3], 2, SamplingParams(0.0), None, 0)])


@torch.no_grad()
def test_tree_nodes_are_the_heads_chain_along_each_path(pair):
    """The interface TreeProposer grows trees with: the distribution after the context and any path
    of drafted tokens is the head's chain fed that path (tree attention over the real entries and
    the node's own ancestors only: siblings and cousins computed in the same pass are not seen)."""
    target, head, _ = pair
    proposer = _proposer(pair)
    context = torch.randint(0, target.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(6))[0].tolist()
    f = _features(pair, context)
    request = _request("r", context, 4, SamplingParams(1.0), f[0, :15], 0)
    proposer.prepare([request])
    assert proposer.room("r", len(context), 4) == 4 and proposer.room("r", len(context) + 1, 4) == 0
    root = proposer.root_distributions(["r"], [context])[0]
    torch.testing.assert_close(root, _reference(target, head, context, [0])[0].softmax(-1), atol=2e-5, rtol=1e-4)
    paths = [[5], [9], [5, 7], [9, 7], [5, 11], [5, 7, 2], [9, 7, 3]]
    # Asked level by level as TreeProposer does, and the deepest level once more all at once.
    for level in (paths[:2], paths[2:5], paths[5:]):
        got = proposer.branch_distributions_of([("r", context, level)])[0]
        for path, row in zip(level, got):
            want = _reference(target, head, context, path + [0])[len(path)].softmax(-1)
            torch.testing.assert_close(row, want, atol=2e-5, rtol=1e-4)
    fresh = _proposer(pair)
    fresh.prepare([request])
    got = fresh.branch_distributions_of([("r", context, [paths[-1]])])[0][0]  # parents computed first
    torch.testing.assert_close(got, _reference(target, head, context, paths[-1] + [0])[3].softmax(-1), atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_tree_proposer_over_the_head_drafts_trees(pair):
    from vllm_specplugin.proposers.tree import TreeProposer

    target, _, _ = pair
    proposer = _proposer(pair)
    tree = TreeProposer(proposer, node_budget=6, branching=2, verify="tree")
    context = torch.randint(0, target.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(8))[0].tolist()
    f = _features(pair, context)
    request = DraftRequest("r", context, 6, SamplingParams(1.0), torch.Generator().manual_seed(2),
                           tree_ok=True, hidden_states=f[0, :15], hidden_start=0)
    draft, = tree.propose([request])
    assert draft.parents is not None and len(draft.token_ids) == 6 and len(draft.parents) == 7
    assert sorted(draft.parents).count(0) >= 2  # siblings at the root
    assert torch.allclose(draft.probs.sum(-1), torch.ones(6), atol=1e-4)


@torch.no_grad()
def test_a_bfloat16_head_drafts_the_float32_heads_distributions(pair):
    """draft_dtype bfloat16: the head, its KV cache and the shared embedding / LM head in bfloat16
    (half the bytes a draft step reads), q still float32 and normalised, and close to the float32
    head's (bfloat16 rounding only)."""
    target, _, path = pair
    context = torch.randint(0, target.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))[0].tolist()
    f = _features(pair, context)
    rows = []
    for dtype in ("float32", "bfloat16"):
        proposer = EagleHeadProposer(path, dtype=dtype)
        proposer.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
        draft, = proposer.propose([_request("a", context, 1, SamplingParams(1.0), f[0, :19], 0,
                                            torch.Generator().manual_seed(7))])
        cache = proposer._caches["a"]
        assert proposer.lm_head.dtype == cache.keys.dtype == getattr(torch, dtype)
        assert draft.probs.dtype == torch.float32
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(1))
        rows.append(draft.probs[0])
    assert 0.5 * (rows[0] - rows[1]).abs().sum() < 0.05
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        EagleHeadProposer(path, dtype="int8")


@torch.no_grad()
def test_the_head_is_one_drafter_of_a_merged_tree(pair):
    """tree_drafting.merge with eagle_head (what vllm_specplugin/adapters.py builds): the suffix
    drafter's chain over the request's repeating context and the head's dynamic tree are merged
    into one tree, the head drafting with the budget the chain left."""
    from vllm_specplugin.proposers.choice import ChoicePolicy
    from vllm_specplugin.proposers.merged_proposer import MergedTreeProposer
    from vllm_specplugin.proposers.merged_tree import MergedTree
    from vllm_specplugin.proposers.suffix import SuffixDrafter, SuffixSettings
    from vllm_specplugin.proposers.tree import TokenTree, TreeProposer

    target, _, _ = pair
    head = _proposer(pair)
    tree = TreeProposer(head, node_budget=8, verify="tree", shape="dynamic")
    suffix = SuffixDrafter(head.vocab_size, SuffixSettings(corpus_requests=0))
    merged = MergedTreeProposer(tree, [("suffix", suffix)], 0.5, ChoicePolicy(draft_cost=0.0, verify_cost=0.0))
    context = [5, 6, 7, 8, 9] * 3 + [5, 6]  # "5 6" seen before: the suffix continues 7 8 9 5
    f = _features(pair, context)
    request = DraftRequest("r", context, 8, SamplingParams(1.0), torch.Generator().manual_seed(2),
                           tree_ok=True, hidden_states=f[0, :len(context) - 1], hidden_start=0)
    draft, = merged.propose([request])
    merged_tree = merged.last_trees["r"]
    assert isinstance(merged_tree, MergedTree) and merged.last_drafters["r"] == ["suffix", "model"]
    assert draft.parents == merged_tree.parents and len(draft.token_ids) <= 8
    suffix_nodes = [j for j in range(1, merged_tree.num_nodes) if 0 in merged_tree.proposed_by[j]]
    assert [merged_tree.tokens[j] for j in suffix_nodes] == [7, 8, 9, 5]
    head_tree = tree.last_trees["r"]
    assert isinstance(head_tree, TokenTree) and 1 <= head_tree.num_nodes - 1 <= 4


@torch.no_grad()
def test_the_head_in_the_drafter_choice_keeps_every_state_while_the_suffix_drafts(pair):
    """suffix_drafting with eagle_head (what vllm_specplugin/adapters.py builds): at steps where the
    choice drafts with the suffix or drafts nothing, the head still takes the verified positions'
    states, so when it is chosen its draft is the draft of a head that saw every state (made red by
    handing the head only the requests it drafts for)."""
    from vllm_specplugin.proposers.choice import SUFFIX, ChoicePolicy, DrafterChoice
    from vllm_specplugin.proposers.suffix import SuffixDrafter, SuffixSettings

    target, _, _ = pair
    head, fresh = _proposer(pair), _proposer(pair)
    # Model drafts priced out (accepted 0 of them): the suffix chain where the context repeats, else nothing.
    policy = ChoicePolicy(model_prior=0.0, suffix_prior=1.0, draft_cost=0.0, verify_cost=0.0, measure_costs=False)
    choice = DrafterChoice(head, SuffixDrafter(head.vocab_size, SuffixSettings(corpus_requests=0)), policy)
    seq = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))[0].tolist()
    seq = seq + seq[:8] + [3, 1, 4]  # the second copy of the prefix: the suffix continues it
    f = _features(pair, seq)
    f = f[0]
    greedy = SamplingParams(0.0)
    chosen = []
    for end, start in ((12, 0), (15, 11), (18, 14), (20, 17), (23, 19)):  # prefill, then verified steps
        draft, = choice.propose([_request("r", seq[:end], 3, greedy, f[start:end - 1], start)])
        chosen.append(choice.last_choices["r"].drafter)
    assert SUFFIX in chosen and "model" not in chosen
    assert head._caches["r"].positions == list(range(22))
    t1 = SamplingParams(1.0)
    mine, = head.propose([_request("r", seq, 3, t1, f[22:22], 22, torch.Generator().manual_seed(5))])
    want, = fresh.propose([_request("r", seq, 3, t1, f[:22], 0, torch.Generator().manual_seed(5))])
    assert mine.token_ids == want.token_ids
    torch.testing.assert_close(mine.probs, want.probs)
