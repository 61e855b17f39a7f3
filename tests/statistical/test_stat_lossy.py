"""The lossy sweep, short (issue 15 A item 2): one engine serves three request classes (exact,
lenient l = 0.2, typical eps = 0.25) on the demo pair; the exact class passes the chain-rule test,
both lossy classes are reported LOSSY and flagged, with a measured TV above the exact class's and a
predicted TV > 0.02; lenient accepts more tokens per step and typical (Medusa's rule) fewer than
exact on this pair; the table and the PNG are written. The full sweep is ``python -m vllm_specplugin.verification lossy-sweep``."""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.lossy_acceptance import Acceptance
from vllm_specplugin.verification import lossy
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

# make test-extended (3.5 min): make test keeps the lossy rules' unit tests (test_lossy_acceptance.py)
# and fault (e), a lossy threshold, caught in the statistical suite.
pytestmark = [pytest.mark.statistical, pytest.mark.extended]

DEMO = os.path.join(REPO_ROOT, "models", "demo")


def test_short_sweep_flags_the_lossy_classes_and_passes_the_exact_one(tmp_path):
    from transformers import AutoTokenizer

    from vllm_specplugin.throughput.workloads import heldout_prompts

    target, draft = os.path.join(DEMO, "target"), os.path.join(DEMO, "draft-distill")
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = [tokenizer(t)["input_ids"] for t in heldout_prompts(10)]
    settings = [Acceptance(), Acceptance("lenient", lenience=0.2), Acceptance("typical", epsilon=0.25, delta=0.5)]
    report = lossy.sweep(
        target, settings,
        speculative_config={"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                            "num_speculative_tokens": 3},
        additional_config={"specplugin": {"drafts": [draft]}}, stat_prompts=ids[:2], loglik_prompts=ids[2:],
        samples=1000, tokens=3, loglik_samples=2, loglik_tokens=16, draft=draft, progress=False)
    print(report.format_table())
    exact, lenient, typical = report.rows
    assert exact.verdict == "PASS", exact
    for row in (lenient, typical):
        assert row.verdict.startswith("LOSSY: flagged"), row.verdict
        assert row.tv.predicted_tokens > 0.02 and row.tv.tv > exact.tv.tv, (row.setting, row.tv, exact.tv)
    assert lenient.tv.low > exact.tv.high and lenient.tokens_per_step > exact.tokens_per_step
    # Medusa's rule rejects the unlikely drafts that the exact rule accepts with probability p/q: on
    # this pair at T = 1 it accepts LESS than exact (measured 1.99 against 2.42 tokens per step).
    assert typical.tokens_per_step < exact.tokens_per_step
    assert exact.tv.predicted_tokens < 1e-9 and exact.loglik_gap == 0.0
    (tmp_path / "sweep.json").write_text(report.to_json())
    from vllm_specplugin.verification.plots import plot_lossy_sweep

    assert os.path.getsize(plot_lossy_sweep(report, str(tmp_path / "sweep.png"))) > 10_000
