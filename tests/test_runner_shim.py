"""The runner shim's mapping, on a fake runner around vLLM's own code.

The runner is a stand-in with the attributes the shim and vLLM's custom_class path read
(``input_batch`` with ``req_ids``, the numpy ``temperature_cpu`` / ``top_k_cpu`` / ``top_p_cpu``,
``generators``, ``num_tokens_no_spec``, ``token_ids_cpu``; ``requests``; the configs; the
drafter). The methods are vLLM 0.32's: the shim wraps the real
``GPUModelRunner.propose_draft_token_ids`` and the next step's reader is the real
``GPUModelRunner._get_spec_decode_draft_probs``. The drafter is a real MultiDraftProposer on the
demo drafts; q is checked against the draft models' distributions computed here independently.
"""

from __future__ import annotations

import inspect
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplugin import runner_shim
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DEMO = os.path.join(REPO_ROOT, "models", "demo")
DRAFTS = ["draft-tiny", "draft-small"]
K = 3
VOCAB = 4096
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8


def vllm_config(runner_shim_on: bool = True):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K, method="custom_class"),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN, get_vocab_size=lambda: VOCAB, model=os.path.join(DEMO, "target")),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        device_config=SimpleNamespace(device="cpu"),
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, d) for d in DRAFTS],
                                          "runner_shim": runner_shim_on}},
    )


class FakeInputBatch:
    """vLLM's InputBatch as the shim and the custom_class path read it (gpu_input_batch.py)."""

    def __init__(self):
        self.req_ids: list[str] = []
        self.temperature_cpu = np.zeros(MAX_NUM_SEQS, dtype=np.float32)
        self.top_k_cpu = np.zeros(MAX_NUM_SEQS, dtype=np.int32)
        self.top_p_cpu = np.zeros(MAX_NUM_SEQS, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self.num_tokens_no_spec = np.zeros(MAX_NUM_SEQS, dtype=np.int32)
        self.token_ids_cpu = np.zeros((MAX_NUM_SEQS, MAX_MODEL_LEN), dtype=np.int32)

    def add(self, req_id: str, context: list[int], temperature=0.0, top_k=0, top_p=1.0, seed=None) -> int:
        """As InputBatch.add_request: greedy is temperature 0.0, top-k off is the vocabulary size."""
        row = len(self.req_ids)
        self.req_ids.append(req_id)
        self.temperature_cpu[row] = temperature
        self.top_k_cpu[row] = top_k if 0 < top_k < VOCAB else VOCAB
        self.top_p_cpu[row] = top_p
        if seed is not None:
            self.generators[row] = torch.Generator().manual_seed(seed)
        self.set_context(row, context)
        return row

    def set_context(self, row: int, context: list[int]) -> None:
        self.token_ids_cpu[row, : len(context)] = context
        self.num_tokens_no_spec[row] = len(context)

    def remove_and_condense(self, req_id: str) -> None:
        """As remove_request + condense: the last row moves into the hole, with its settings."""
        hole, last = self.req_ids.index(req_id), len(self.req_ids) - 1
        self.generators.pop(hole, None)
        if hole != last:
            self.req_ids[hole] = self.req_ids[last]
            for array in (self.temperature_cpu, self.top_k_cpu, self.top_p_cpu, self.num_tokens_no_spec):
                array[hole] = array[last]
            self.token_ids_cpu[hole] = self.token_ids_cpu[last]
            generator = self.generators.pop(last, None)
            if generator is not None:
                self.generators[hole] = generator
        self.req_ids.pop()


class FakeRunner:
    def __init__(self, drafter, config):
        self.drafter = drafter
        self.vllm_config = config
        self.speculative_config = config.speculative_config
        self.input_batch = FakeInputBatch()
        self.requests: dict[str, object] = {}
        self._draft_probs = None
        self._draft_prob_req_ids = None

    def add(self, req_id, context, **settings):
        self.requests[req_id] = object()
        return self.input_batch.add(req_id, context, **settings)

    def finish(self, req_id):
        del self.requests[req_id]
        self.input_batch.remove_and_condense(req_id)


def _vllm(name):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return inspect.unwrap(getattr(GPUModelRunner, name))


def shimmed_propose(runner, sampled_token_ids):
    """One step's drafting as vLLM runs it, through the shim: vLLM's propose_draft_token_ids
    (custom_class branch) wrapped by runner_shim."""
    propose = runner_shim._shimmed_propose_draft_token_ids(_vllm("propose_draft_token_ids"))
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=0, num_spec_tokens_to_schedule=K)
    return propose(runner, scheduler_output, sampled_token_ids, None, None, None, None, None, None, None)


def vllm_reads_q(runner, num_draft_tokens):
    """The next step's sampler input: vLLM's _get_spec_decode_draft_probs, [total drafts, V]."""
    return _vllm("_get_spec_decode_draft_probs")(runner, SimpleNamespace(num_draft_tokens=num_draft_tokens))


@pytest.fixture(scope="module")
def drafter():
    from vllm_specplugin.adapters import MultiDraftProposer

    drafter = MultiDraftProposer(vllm_config())
    yield drafter
    drafter.publisher.close()


@pytest.fixture(scope="module")
def draft_models():
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, d), dtype=torch.float32).eval() for d in DRAFTS]


@torch.no_grad()
def reference_q(draft_models, context, drafted, params):
    """Per drafted position: the request's processing of the uniform mixture of the drafts'
    next-token distributions after context + the tokens drafted before it (no KV cache)."""
    ids = torch.tensor([list(context) + list(drafted)])
    mixture = sum(m(input_ids=ids).logits[0].float().softmax(-1) for m in draft_models) / len(draft_models)
    first = len(context) - 1
    return torch.stack([processed_probs(mixture[first + j].log(), params) for j in range(len(drafted))])


def contexts(n, seed, length=24):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, length).tolist() for _ in range(n)]


def test_batch_view_maps_rows_to_ids_settings_and_seeds(drafter):
    runner = FakeRunner(drafter, vllm_config())
    a, b, c, d = contexts(4, 0)
    runner.add("a", a)  # greedy
    runner.add("b", b, temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    runner.add("c", c, temperature=1.0)
    runner.add("d", d, temperature=0.5, top_p=0.5, seed=7)
    view = runner_shim.batch_view(runner)
    assert view.req_ids == ["a", "b", "c", "d"]
    assert view.params[0].greedy and view.params[0].temperature == 0.0
    assert view.params[1] == SamplingParams(temperature=pytest.approx(0.8), top_k=50, top_p=pytest.approx(0.9))
    assert view.params[2] == SamplingParams(temperature=1.0, top_k=VOCAB, top_p=1.0)  # top-k off: V
    assert view.params[3] == SamplingParams(temperature=0.5, top_k=VOCAB, top_p=0.5)
    assert view.seeds == [None, 1234, None, 7]
    assert view.live_request_ids == frozenset("abcd")
    # vLLM condenses the batch when "b" finishes: "d" moves to row 1 with its settings and generator.
    runner.finish("b")
    view = runner_shim.batch_view(runner)
    assert view.req_ids == ["a", "d", "c"]
    assert view.seeds == [None, 7, None]
    assert view.params[1] == SamplingParams(temperature=0.5, top_k=VOCAB, top_p=0.5)
    assert view.live_request_ids == frozenset("acd")


def test_shim_hands_vllm_q_row_by_row(drafter, draft_models):
    """A batch mixing γ and sampling settings: greedy, T > 0 with top-k/top-p (seeded), T = 1,
    a row not decoding, and a row near max_model_len (a shorter draft)."""
    runner = FakeRunner(drafter, vllm_config())
    ctx = contexts(5, 1)
    settings = [
        dict(),  # greedy
        dict(temperature=0.8, top_k=50, top_p=0.9, seed=11),
        dict(temperature=1.0),
        dict(temperature=0.7),  # not decoding this step
        dict(temperature=0.9, top_p=0.95),  # 2 tokens below max_model_len: room for one draft
    ]
    ctx[4] = np.random.default_rng(5).integers(3, VOCAB, MAX_MODEL_LEN - 2).tolist()
    for i, (context, s) in enumerate(zip(ctx, settings)):
        runner.add(f"req-{i}", context, **s)
    sampled = [[c[-1]] for c in ctx]
    sampled[3] = []
    drafts = shimmed_propose(runner, sampled)

    assert [len(d) for d in drafts] == [K, K, K, 0, 1]
    assert runner._draft_prob_req_ids == runner.input_batch.req_ids
    q = runner._draft_probs
    assert q.shape == (5, K, VOCAB) and q.dtype == torch.float32 and q.device == torch.device("cpu")
    view = runner_shim.batch_view(runner)
    for row, draft in enumerate(drafts):
        n = len(draft)
        assert float(q[row, n:].abs().sum()) == 0, f"row {row}: q past its draft must be zero"
        if n == 0:
            continue
        picked = q[row, torch.arange(n), torch.tensor(draft)]
        assert bool((picked > 0).all()), f"row {row}: a drafted token with q = 0"
        assert torch.allclose(q[row, :n].sum(-1), torch.ones(n), atol=1e-5)
        if view.params[row].greedy:
            assert torch.equal(q[row, :n], torch.nn.functional.one_hot(torch.tensor(draft), VOCAB).float())
        expected = reference_q(draft_models, ctx[row], draft, view.params[row])
        assert torch.allclose(q[row, :n], expected, atol=2e-5), f"row {row}: q is not what the token was drawn from"
    assert int((q[1, :K] > 0).sum(-1).max()) <= 50  # row 1's top-k

    # Next step: vLLM reads q by request id for the rows it verifies, only their draft lengths,
    # even after the batch is condensed ("req-0" finished: "req-4" moves to row 0).
    expected_rows = {f"req-{i}": q[i, : len(d)].clone() for i, d in enumerate(drafts)}
    runner.finish("req-0")
    assert runner.input_batch.req_ids == ["req-4", "req-1", "req-2", "req-3"]
    num_draft = [len(drafts[4]), len(drafts[1]), len(drafts[2]), 0]
    read = vllm_reads_q(runner, num_draft)
    assert read.shape == (sum(num_draft), VOCAB)
    assert torch.equal(read, torch.cat([expected_rows[r] for r in ["req-4", "req-1", "req-2"]]))
    # The scheduler may verify fewer drafts than proposed: vLLM then reads a shorter prefix.
    assert torch.equal(vllm_reads_q(runner, [1, 2, 0, 0]), torch.cat([expected_rows["req-4"], expected_rows["req-1"][:2]]))


def test_the_q_buffer_is_reused_only_after_vllm_consumed_it(drafter):
    """Step t's q is read at step t+1's sampling (a copy) before step t+1 drafts into the same
    buffer; a row whose draft got shorter has no stale q past it."""
    runner = FakeRunner(drafter, vllm_config())
    first, second = contexts(2, 2)
    runner.add("x", first, temperature=1.0)
    runner.add("y", second, temperature=0.6, top_k=30)
    drafts = shimmed_propose(runner, [[first[-1]], [second[-1]]])
    q_t = runner._draft_probs
    kept = q_t.clone()
    # Step t+1: the sampler reads step t's q, then sample_tokens clears it and drafts again.
    read = vllm_reads_q(runner, [len(d) for d in drafts])
    runner._draft_probs = runner._draft_prob_req_ids = None
    runner.input_batch.set_context(0, first + drafts[0] + [7])
    longer = np.random.default_rng(3).integers(3, VOCAB, MAX_MODEL_LEN - 2).tolist()
    runner.input_batch.set_context(1, longer)  # row 1's next draft has room for one token
    drafts_next = shimmed_propose(runner, [drafts[0] + [7], [longer[-1]]])
    q_next = runner._draft_probs
    assert q_next.data_ptr() == q_t.data_ptr()  # one buffer, reused
    assert torch.equal(read, torch.cat([kept[0, : len(drafts[0])], kept[1, : len(drafts[1])]]))  # intact
    assert [len(d) for d in drafts_next] == [K, 1]
    assert float(q_next[1, 1:].abs().sum()) == 0 and float(kept[1, 1:].abs().sum()) > 0


def test_seeded_rows_draft_reproducibly(drafter):
    runner = FakeRunner(drafter, vllm_config())
    (context,) = contexts(1, 4)
    for name, seed in [("s1", 99), ("s2", 99), ("s3", 100), ("s4", 101), ("u1", None), ("u2", None)]:
        runner.add(name, context, temperature=1.5, seed=seed)
    drafts = shimmed_propose(runner, [[context[-1]]] * 6)
    assert drafts[0] == drafts[1]  # the same seed draws the same draft
    assert drafts[2] != drafts[0] or drafts[3] != drafts[0]
    # A fresh drafter given the same seed draws the same draft again.
    from vllm_specplugin.adapters import MultiDraftProposer

    other = MultiDraftProposer(vllm_config())
    try:
        again = FakeRunner(other, vllm_config())
        again.add("s1-again", context, temperature=1.5, seed=99)
        assert shimmed_propose(again, [[context[-1]]]) == [drafts[0]]
    finally:
        other.publisher.close()


def test_shim_off_hands_no_view_and_no_q(drafter):
    runner = FakeRunner(drafter, vllm_config(runner_shim_on=False))
    a, b = contexts(2, 6)
    runner.add("a", a, temperature=1.0)
    runner.add("b", b)
    drafts = shimmed_propose(runner, [[a[-1]], [b[-1]]])
    assert [len(d) for d in drafts] == [K, K]
    assert runner._draft_probs is None and runner._draft_prob_req_ids is None
    assert drafter.proposer.tracked_request_ids() <= {"row-0", "row-1"}
    drafter._forget_rows_beyond(0)  # leave the shared drafter as the other tests expect it


def test_q_that_cannot_be_handed_over_drops_the_drafts(drafter, monkeypatch, caplog):
    """Drafts sampled at T > 0 are exact only against their q: without it, no drafts."""
    runner = FakeRunner(drafter, vllm_config())
    a, b = contexts(2, 7)
    runner.add("a", a, temperature=1.0)
    runner.add("b", b)
    take = drafter.take_last_draft_probs
    monkeypatch.setattr(drafter, "take_last_draft_probs", lambda: take()[:, :1])  # too short for K drafts
    with caplog.at_level(logging.ERROR, logger="vllm.specplugin"):
        for _ in range(runner_shim.MAX_CONSECUTIVE_HANDOVER_FAILURES):
            drafts = shimmed_propose(runner, [[a[-1]], [b[-1]]])
            assert drafts == [[], []]
            assert runner._draft_probs is None and runner._draft_prob_req_ids is None
        assert sum("cannot be handed to vLLM" in r.getMessage() for r in caplog.records) == 3
        # A persistent fault switches the shim off: greedy drafts, verified one-hot (exact).
        assert runner._specplugin_shim_enabled is False
        assert any("switching the runner shim OFF" in r.getMessage() for r in caplog.records)
        drafts = shimmed_propose(runner, [[a[-1]], [b[-1]]])
    assert [len(d) for d in drafts] == [K, K] and runner._draft_probs is None
    drafter._forget_rows_beyond(0)


def test_a_batch_the_shim_cannot_read_falls_back_to_greedy_drafting(drafter, caplog):
    runner = FakeRunner(drafter, vllm_config())
    a, b = contexts(2, 8)
    runner.add("a", a, temperature=1.0)
    runner.add("b", b)
    del runner.input_batch.top_p_cpu  # as if vLLM renamed it
    with caplog.at_level(logging.ERROR, logger="vllm.specplugin"):
        drafts = shimmed_propose(runner, [[a[-1]], [b[-1]]])
    assert [len(d) for d in drafts] == [K, K] and runner._draft_probs is None
    assert runner._specplugin_shim_enabled is False
    assert any("cannot read the input batch" in r.getMessage() for r in caplog.records)
    drafter._forget_rows_beyond(0)
