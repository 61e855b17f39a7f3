"""proposers/medusa_heads.py: Medusa heads as the plugin's drafter draw each token from its head's
distribution (the trainer's forward, models/heads.py, which tests/test_heads.py ties to vLLM's
Medusa), processed with the request's sampling, and serve TreeProposer's trees (the distribution at
depth j is head j's, whatever tokens are above it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm_specplugin.models import heads as H  # noqa: E402
from vllm_specplugin.models.random_llama import make_random_llama  # noqa: E402
from vllm_specplugin.proposers.base import DraftRequest  # noqa: E402
from vllm_specplugin.proposers.eagle_head import HeadCheckpointError  # noqa: E402
from vllm_specplugin.proposers.medusa_heads import MedusaHeadsProposer  # noqa: E402
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusahead")
    target_dir = make_random_llama(root / "target", logit_scale=15.0, seed=0)
    target = H.load_target(target_dir)
    torch.manual_seed(2)
    heads = H.MedusaHeads(target.config.hidden_size, 3, 1, target.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn_like(p))  # the zero init would make every head the target's guess
    H.save_heads(heads, root / "medusa", target.config.to_dict(), {})
    return target, root / "medusa"


def _states(target, context):
    f, _ = H.target_hidden_and_logp(target, torch.tensor([context]))
    return f[0]


@torch.no_grad()
def test_each_draft_is_its_heads_processed_distribution(pair):
    target, path = pair
    heads = H.MedusaHeads(target.config.hidden_size, 3, 1, target.lm_head.weight)
    from safetensors.torch import load_file

    weights = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    for j, block in enumerate(heads.blocks):
        block[0].weight.copy_(weights[f"blocks.{j}.layers.0.weight"])
        block[0].bias.copy_(weights[f"blocks.{j}.layers.0.bias"])
    heads.lm_head.copy_(weights["lm_head.weight"])
    proposer = MedusaHeadsProposer(path)
    context = list(range(3, 15))
    f = _states(target, context)
    want = torch.stack(heads(f[len(context) - 2]))  # [3, V] logits of heads 0..2
    for rid, params in (("greedy", SamplingParams(0.0)), ("topk", SamplingParams(0.8, 20, 0.9))):
        draft, = proposer.propose([DraftRequest(rid, context, 5, params, torch.Generator().manual_seed(1),
                                                hidden_states=f[:len(context) - 1], hidden_start=0)])
        assert len(draft.token_ids) == 3  # capped by the heads
        torch.testing.assert_close(draft.probs, processed_probs(want, params), atol=2e-5, rtol=1e-4)
        if params.greedy:
            assert draft.token_ids == want.argmax(-1).tolist()
    # Only the newest verified position's state drafts.
    stale, = proposer.propose([DraftRequest("stale", context, 3, SamplingParams(0.0),
                                            hidden_states=f[:len(context) - 2], hidden_start=0)])
    assert stale.token_ids == [] and proposer.metrics.fallback_requests == 1


@torch.no_grad()
def test_medusa_trees_from_the_heads(pair):
    from vllm_specplugin.proposers.tree import TreeProposer

    target, path = pair
    proposer = MedusaHeadsProposer(path)
    tree = TreeProposer(proposer, node_budget=6, branching=2, verify="tree")
    context = list(range(5, 17))
    f = _states(target, context)
    request = DraftRequest("r", context, 6, SamplingParams(1.0), torch.Generator().manual_seed(3), tree_ok=True,
                           hidden_states=f[:len(context) - 1], hidden_start=0)
    draft, = tree.propose([request])
    assert draft.parents is not None and len(draft.parents) == len(draft.token_ids) + 1 <= 7
    depths = [0]
    for parent in draft.parents[1:]:
        depths.append(depths[parent] + 1)
    assert max(depths) <= 3 and draft.parents.count(0) >= 2
    dists = proposer.branch_distributions_of([("r", context, [[1], [2, 3]])])[0]
    heads = proposer._distributions("r")
    torch.testing.assert_close(dists, heads[[1, 2]])


def test_bad_checkpoint_is_named(pair, tmp_path):
    _, path = pair
    with pytest.raises(HeadCheckpointError, match="missing"):
        MedusaHeadsProposer(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(HeadCheckpointError, match="not a Medusa checkpoint"):
        MedusaHeadsProposer(tmp_path)


@torch.no_grad()
def test_medusa_heads_in_the_drafter_choice_draft_from_the_newest_state(pair):
    """suffix_drafting with medusa_heads: after steps the suffix drafted, the first step the heads
    are chosen drafts at once, from the newest verified state the choice hands them, what a heads
    drafter that saw only that request drafts (red when the choice drops the request's states)."""
    from vllm_specplugin.proposers.choice import MODEL, SUFFIX, ChoicePolicy, DrafterChoice
    from vllm_specplugin.proposers.suffix import SuffixDrafter, SuffixSettings

    target, path = pair
    heads = MedusaHeadsProposer(path)
    suffix_first = ChoicePolicy(model_prior=0.0, suffix_prior=1.0, draft_cost=0.0, verify_cost=0.0, measure_costs=False)
    choice = DrafterChoice(heads, SuffixDrafter(heads.vocab_size, SuffixSettings(corpus_requests=0)), suffix_first)
    seq = list(range(3, 15)) + list(range(3, 11)) + [20, 21]
    f = _states(target, seq)
    greedy = SamplingParams(0.0)
    chosen = set()
    for end, start in ((12, 0), (15, 11), (18, 14), (20, 17)):  # the second copy: the suffix drafts
        choice.propose([DraftRequest("r", seq[:end], 3, greedy, hidden_states=f[start:end - 1], hidden_start=start)])
        chosen.add(choice.last_choices["r"].drafter)
    assert SUFFIX in chosen and MODEL not in chosen
    choice._states["r"].model_accepted = 3.0  # the heads' measured acceptance: now the best option
    draft, = choice.propose([DraftRequest("r", seq, 3, greedy, hidden_states=f[19:21], hidden_start=19)])
    assert choice.last_choices["r"].drafter == MODEL and len(draft.token_ids) == 3
    want, = MedusaHeadsProposer(path).propose([DraftRequest("r", seq, 3, greedy, hidden_states=f[20:21], hidden_start=20)])
    assert draft.token_ids == want.token_ids
    torch.testing.assert_close(draft.probs, want.probs)


@torch.no_grad()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_drafted_together_in_one_pass_as_each_alone(pair, dtype):
    """A step's requests share one pass over the heads: their states stacked, one LM head product
    for every request and head (the weights read once per step); each request's distributions are
    what it gets drafted alone, in the heads' dtype on the kernels the plugin would choose (vLLM's
    oneDNN products where they run here), and within that dtype's rounding of the float32 heads."""
    from vllm_specplugin.draft_kernels import draft_kernels

    target, path = pair
    kernels = draft_kernels("auto", "cpu", dtype)
    fast = MedusaHeadsProposer(path, kernels=kernels, dtype=dtype)
    reference = MedusaHeadsProposer(path)  # float32, torch's products
    calls = []
    lm = fast._lm
    fast._lm = lambda x: calls.append(tuple(x.shape)) or lm(x)
    contexts = [list(range(3, 15)), list(range(20, 29)), list(range(40, 60))]
    gammas, params = [3, 2, 1], [SamplingParams(0.0), SamplingParams(0.8, 20, 0.9), SamplingParams(1.0)]

    def requests(tag):
        return [DraftRequest(f"{tag}{i}", c, g, p, torch.Generator().manual_seed(i),
                             hidden_states=_states(target, c)[:len(c) - 1], hidden_start=0)
                for i, (c, g, p) in enumerate(zip(contexts, gammas, params))]

    together = fast.propose(requests("t"))
    assert calls == [(3 * 3, target.config.hidden_size)]  # 3 requests x the deepest request's 3 heads, one product
    tolerance = {"float32": dict(atol=2e-5, rtol=1e-4), "bfloat16": dict(atol=3e-2, rtol=0.0)}[dtype]
    for i, request in enumerate(requests("a")):
        alone, = fast.propose([request])
        assert together[i].token_ids == alone.token_ids
        torch.testing.assert_close(together[i].probs, alone.probs, atol=1e-5, rtol=1e-4)
        want, = reference.propose([request])
        torch.testing.assert_close(alone.probs, want.probs, **tolerance)


@torch.no_grad()
def test_a_tree_shallower_than_the_heads_reads_the_lm_head_once_per_step(pair):
    """A tree whose depth room() caps below the number of heads computes the heads it may read in
    the root's pass: growing it asks for no second LM head product (a default of every head in the
    tree's lookups once recomputed each request's heads from scratch)."""
    from vllm_specplugin.proposers.tree import TreeProposer

    target, path = pair
    proposer = MedusaHeadsProposer(path)  # 3 heads
    calls = []
    lm = proposer._lm
    proposer._lm = lambda x: calls.append(tuple(x.shape)) or lm(x)
    tree = TreeProposer(proposer, node_budget=6, branching=2, verify="tree")
    context = list(range(5, 17))
    f = _states(target, context)
    request = DraftRequest("r", context, 2, SamplingParams(1.0), torch.Generator().manual_seed(3), tree_ok=True,
                           hidden_states=f[:len(context) - 1], hidden_start=0)  # γ 2: depth 2 of 3 heads
    draft, = tree.propose([request])
    assert len(draft.token_ids) >= 2  # a tree was grown
    assert calls == [(2, target.config.hidden_size)]  # one product, the 2 heads the tree may read
