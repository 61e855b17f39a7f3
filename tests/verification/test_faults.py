"""The injected faults, without an engine: each wrapper changes exactly what its docstring says.

The statistical tier (tests/statistical) shows that each one, injected into a real engine, is
caught; these tests pin down the mechanism so that a fault cannot silently become a no-op.
"""

from __future__ import annotations

import pytest
import torch

from vllm_specplugin import faults


def test_requested_fault_names(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    assert faults.requested_fault() is None
    for name in faults.FAULTS:
        monkeypatch.setenv(faults.ENV_VAR, name)
        assert faults.requested_fault() == name
    monkeypatch.setenv(faults.ENV_VAR, "no_such_fault")
    with pytest.raises(ValueError, match="no_such_fault"):
        faults.requested_fault()


def test_accept_all_drafts_makes_every_draft_the_argmax():
    seen = {}

    def original(draft_token_ids, num_draft_tokens, max_spec_len, cu, draft_probs, target_logits, *rest):
        seen["argmax"] = target_logits.argmax(-1)
        seen["logits"] = target_logits
        return "out"

    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 5.0, 1.0], [2.0, 2.5, 9.0]])
    drafts = torch.tensor([2, 0, 1], dtype=torch.int32)
    wrapped = faults._accept_all_drafts(original)
    assert wrapped(drafts, [3], 3, torch.tensor([3]), None, logits, "bonus", "meta") == "out"
    assert seen["argmax"].tolist() == drafts.tolist()
    assert torch.equal(logits, torch.tensor([[3.0, 1.0, 0.0], [0.0, 5.0, 1.0], [2.0, 2.5, 9.0]]))  # not in place
    # the other logits are untouched
    changed = seen["logits"] != logits
    assert changed.sum() == 3


def test_handoff_q_temperature_squares_q_and_keeps_empty_rows():
    class Proposer:
        def take_last_draft_probs(self):
            return torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0]]])

    wrapped = faults._handoff_q_temperature(Proposer.take_last_draft_probs)
    out = wrapped(Proposer())
    expected = torch.tensor([0.25, 0.09, 0.04, 0.0]) / 0.38
    assert torch.allclose(out[0, 0], expected)
    assert torch.equal(out[0, 1], torch.zeros(4))
    assert faults._handoff_q_temperature(lambda self: None)(Proposer()) is None


def test_handoff_fault_installs_on_the_adapter_class_only_once(monkeypatch):
    from vllm_specplugin.adapters import MultiDraftProposer

    original = MultiDraftProposer.take_last_draft_probs
    try:
        faults.install("handoff_q_temperature")
        patched = MultiDraftProposer.take_last_draft_probs
        assert patched is not original and getattr(patched, faults._MARK)
        faults.install("handoff_q_temperature")  # idempotent: never stacked
        assert MultiDraftProposer.take_last_draft_probs is patched
    finally:
        MultiDraftProposer.take_last_draft_probs = original
