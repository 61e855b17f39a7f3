"""Fast checks of the tensor-parallel guards (vllm_specplugin/tensor_parallel.py, adapters._check_parallelism)
and of the runner shim's carried q (runner_shim._carried_q / _hand_over). The engine tests are
tests/e2e/test_tensor_parallel.py and tests/e2e/test_seeded_reproducibility.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_specplugin import runner_shim, tensor_parallel
from vllm_specplugin.adapters import _check_parallelism
from vllm_specplugin.config import SpecPluginConfigError
from vllm_specplugin.proposers.gamma import GammaPolicy


def engine(tp: int = 1, pp: int = 1):
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))


def test_measured_cost_is_refused_under_tensor_parallelism():
    with pytest.raises(SpecPluginConfigError, match="adaptive_gamma.cost_ratio.*tensor-parallel-size 2"):
        _check_parallelism(engine(tp=2), GammaPolicy(mode="cost_model"))
    _check_parallelism(engine(tp=2), GammaPolicy(mode="cost_model", cost_ratio=0.1))  # configured c: same on every rank
    _check_parallelism(engine(tp=2), GammaPolicy(mode="threshold"))
    _check_parallelism(engine(tp=1), GammaPolicy(mode="cost_model"))
    _check_parallelism(SimpleNamespace(), None)  # no parallel config at all: one rank


def test_pipeline_parallelism_is_refused():
    with pytest.raises(SpecPluginConfigError, match="pipeline_parallel_size"):
        _check_parallelism(engine(pp=2), None)


def test_draft_digest_sees_a_one_ulp_difference_in_q():
    state = SimpleNamespace(columns=None)
    q = torch.softmax(torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(0)), -1)
    drafts = [[5, 7, 9], [1]]
    base = tensor_parallel.draft_digest(state, drafts, q, ["a", "b"], {})
    assert base == tensor_parallel.draft_digest(state, drafts, q.clone(), ["a", "b"], {})
    nudged = q.clone()
    nudged[1, 0, 1] = torch.nextafter(nudged[1, 0, 1], torch.tensor(1.0))  # the drafted token's q, one ulp
    assert tensor_parallel.draft_digest(state, drafts, nudged, ["a", "b"], {}) != base
    assert tensor_parallel.draft_digest(state, [[5, 7, 8], [1]], q, ["a", "b"], {}) != base
    assert tensor_parallel.draft_digest(state, drafts, None, ["a", "b"], {}) != base


def view(req_ids, live):
    return runner_shim.BatchView(list(req_ids), [], [], frozenset(live))


def test_q_of_a_request_that_misses_a_step_is_carried_until_it_is_back():
    runner = SimpleNamespace()
    q1 = torch.rand(3, 2, 8)
    # Step 1: a, b, c drafted (c drafted nothing).
    runner_shim._hand_over(runner, q1, view("abc", "abc"), [[1, 2], [3], []], runner_shim._carried_q(runner, view("abc", "abc")))
    assert runner._draft_prob_req_ids == ["a", "b", "c"]
    # Step 2: b is skipped by the scheduler (still live, its drafts still scheduled); c too, but it had none.
    carried = runner_shim._carried_q(runner, view("a", "abc"))
    assert set(carried) == {"b"} and torch.equal(carried["b"], q1[1])
    q1.zero_()  # the drafter reuses its buffer: the carried row is a copy
    q2 = torch.rand(1, 2, 8)
    runner_shim._hand_over(runner, q2, view("a", "abc"), [[4, 5]], carried)
    assert runner._draft_prob_req_ids == ["a", "b"] and not torch.equal(runner._draft_probs[1], q1[1])
    # Step 3: b still away and a drew nothing: the carried row alone is handed over.
    carried = runner_shim._carried_q(runner, view("a", "abc"))
    runner_shim._hand_over(runner, None, view("a", "abc"), [[]], carried)
    assert runner._draft_prob_req_ids == ["b"]
    # Step 4: b is back (its drafts were verified at this step's sampling): nothing carried any more.
    assert runner_shim._carried_q(runner, view("ab", "abc")) == {}
    # A request that finished while away is dropped.
    runner._specplugin_carried_q = {"z": torch.zeros(2, 8)}
    assert runner_shim._carried_q(runner, view("a", "a")) == {}


def test_a_request_without_q_is_verified_one_hot_alone():
    q = torch.softmax(torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)), -1)
    runner = SimpleNamespace(_draft_probs=q, _draft_prob_req_ids=["a", "b"], _specplugin_shim_enabled=True,
                             input_batch=SimpleNamespace(req_ids=["a", "c", "b"]))
    metadata = SimpleNamespace(num_draft_tokens=[2, 2, 1], draft_token_ids=torch.tensor([1, 2, 6, 7, 3]))
    lookup = runner_shim._one_hot_only_where_q_is_missing(lambda self, md: "vLLM's own")
    rows = lookup(runner, metadata)
    assert rows.shape == (5, 8)
    assert torch.equal(rows[:2], q[0, :2]) and torch.equal(rows[4:], q[1, :1])
    assert torch.equal(rows[2:4], torch.nn.functional.one_hot(torch.tensor([6, 7]), 8).float())
    runner.input_batch.req_ids = ["a", "b"]  # nothing missing: vLLM's lookup as it is
    assert lookup(runner, SimpleNamespace(num_draft_tokens=[2, 1], draft_token_ids=torch.tensor([1, 2, 3]))) == "vLLM's own"


def test_vllm_placeholder_drafts_get_a_zero_q_and_leave_the_others_their_q():
    """-1 drafts (vLLM's scheduler pads a one-token prompt admitted beside decoding requests to 1 + k
    tokens): a zero q row each (rejected without reading q; recovered from max(p - 0, 0) = p), while
    the other requests keep their q. Handing the step to vLLM instead verified EVERY request as
    one-hot, which moved the seeded outputs of the others (helper-17, issue 14 item 2)."""
    q = torch.softmax(torch.randn(1, 3, 8), -1)
    runner = SimpleNamespace(_draft_probs=q, _draft_prob_req_ids=["a"], _specplugin_shim_enabled=True,
                             _specplugin_placeholders_rejected=True,  # the kernel rejects -1 (sampler_repair)
                             input_batch=SimpleNamespace(req_ids=["a", "c"]))
    lookup = runner_shim._one_hot_only_where_q_is_missing(lambda self, md: "vLLM's own")
    metadata = SimpleNamespace(num_draft_tokens=[1, 3], draft_token_ids=torch.tensor([1, -1, -1, -1]))
    rows = lookup(runner, metadata)
    assert rows.shape == (4, 8)
    assert torch.equal(rows[:1], q[0, :1])
    assert torch.equal(rows[1:], torch.zeros(3, 8))
    # A valid draft followed by -1 (structured output's padding): one-hot, then zero.
    metadata = SimpleNamespace(num_draft_tokens=[1, 2], draft_token_ids=torch.tensor([1, 5, -1]))
    rows = lookup(runner, metadata)
    assert torch.equal(rows[1], torch.nn.functional.one_hot(torch.tensor(5), 8).float())
    assert torch.equal(rows[2], torch.zeros(8))
    # vLLM-CPU's kernel unrepaired (it would accept -1 at p/q of the previous row's last entry):
    # the step is left to vLLM's own path, as before.
    runner._specplugin_placeholders_rejected = False
    assert lookup(runner, metadata) == "vLLM's own"
