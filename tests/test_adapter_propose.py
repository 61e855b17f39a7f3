"""MultiDraftProposer's vLLM-facing propose(), driven the way vLLM 0.32's runner calls it.

The engine is replaced by the arguments it passes (rows, token ids, the shim's BatchView); the
proposer, its drafts and the adapter's bookkeeping are the real ones.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.verification.drivers import REPO_ROOT
from vllm_specplugin.runner_shim import BatchView

DEMO = os.path.join(REPO_ROOT, "models", "demo")
K = 3


def vllm_config(**plugin):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: 4096, model="models/demo/target"),
        device_config=SimpleNamespace(device="cpu"),
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-tiny")], **plugin}},
    )


@pytest.fixture(scope="module")
def adapter():
    from vllm_specplugin.adapters import MultiDraftProposer

    return MultiDraftProposer(vllm_config())


def batch(rows: int, length: int = 20):
    tokens = np.zeros((rows, 512), dtype=np.int64)
    tokens[:, :length] = np.random.default_rng(0).integers(3, 4096, (rows, length))
    return [[5]] * rows, np.full(rows, length), tokens


def test_shim_view_gives_ids_params_and_q(adapter):
    sampled, num_tokens, tokens = batch(3)
    sampled[1] = []  # row 1 is not decoding this step
    params = [SamplingParams(1.0, 50, 0.9), SamplingParams(0.0), SamplingParams(0.0)]
    adapter.set_batch_view(BatchView(["a", "b", "c"], params, [7, None, None], frozenset({"a", "b", "c"})))
    drafts = adapter.propose(sampled, num_tokens, tokens)
    assert [len(d) for d in drafts] == [K, 0, K]
    probs = adapter.take_last_draft_probs()
    assert probs.shape == (3, K, 4096)
    assert float(probs[0].sum(-1).min()) == pytest.approx(1.0)
    assert int((probs[0] > 0).sum(-1).max()) <= 50  # row 0's q carries its top-k
    assert torch.equal(probs[2], torch.nn.functional.one_hot(torch.tensor(drafts[2]), 4096).float())
    assert float(probs[1].abs().sum()) == 0
    # Requests that left the runner are forgotten at the next step.
    adapter.set_batch_view(BatchView(["c"], [SamplingParams(0.0)], [None], frozenset({"c"})))
    adapter.propose([[5]], num_tokens[:1], tokens[2:3])
    assert adapter.proposer.tracked_request_ids() == {"c"}


def test_without_the_shim_drafts_are_greedy_per_row(adapter, caplog):
    sampled, num_tokens, tokens = batch(2)
    with caplog.at_level(logging.WARNING):
        first = adapter.propose(sampled, num_tokens, tokens)
    assert adapter.take_last_draft_probs() is None
    assert first == adapter.propose(sampled, num_tokens, tokens)  # greedy: deterministic
    assert adapter._warned_no_shim


def test_a_drafting_error_falls_back_to_no_drafts(adapter, monkeypatch, caplog):
    def broken(requests):
        raise RuntimeError("simulated draft failure")

    monkeypatch.setattr(adapter.proposer, "propose", broken)
    sampled, num_tokens, tokens = batch(2)
    with caplog.at_level(logging.ERROR):
        assert adapter.propose(sampled, num_tokens, tokens) == [[], []]
    assert adapter.draft_failures == 1
    assert any("decodes without drafts" in r.getMessage() for r in caplog.records)


def test_room_near_max_model_len(adapter):
    sampled, num_tokens, tokens = batch(1, length=509)
    adapter.set_batch_view(BatchView(["n"], [SamplingParams(0.0)], [None], frozenset({"n"})))
    (draft,) = adapter.propose(sampled, num_tokens, tokens)
    assert len(draft) == 2  # max_model_len 512: 509 tokens leave room for 2 drafts (and the bonus)
