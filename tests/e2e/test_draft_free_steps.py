"""Steps without drafts take vLLM's plain sampler (vllm_specplugin/draft_free_steps.py).

Adaptive γ with ``max_batch: 4`` drafts nothing while more than 4 requests run: the first task
(8 prompts) has only draft-free steps, the second (2 prompts) drafted ones. The draft-free
steps' greedy tokens must be those of a plain engine (no speculative config) on the same batch,
token for token: a wrong logits row or a lost token shows here. The distribution at T > 0 is
checked by the statistical tier (``honest_draft_free_steps``).
"""

from __future__ import annotations

import pytest

from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

# make test-extended (2.5 min): make test covers draft-free steps in the statistical suite
# (honest_draft_free_steps: T = 0 every token the argmax, T = 1 chain-rule test).
pytestmark = [pytest.mark.engine, pytest.mark.extended]

GREEDY = SamplingConfig(temperature=0.0, max_tokens=24, n=1, seed=None)
MANY = [[(11 * i + 5 * j) % 500 + 3 for j in range(12 + i)] for i in range(8)]  # 8 rows > max_batch
FEW = MANY[:2]
PROPOSER = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
            "num_speculative_tokens": 3}


def run(model: str, draft: str | None, mode: str = "plain", log_path: str | None = None):
    tasks = [GenerationTask(MANY, GREEDY), GenerationTask(FEW, GREEDY)]
    if draft is None:
        return run_offline(model, tasks)
    config = {"drafts": [draft], "adaptive_gamma": {"max_batch": 4}, "draft_free_sampler": mode}
    return run_offline(model, tasks, speculative_config=PROPOSER, additional_config={"specplugin": config},
                       log_path=log_path)


def test_draft_free_steps_sample_like_plain_decoding(peaked_target, peaked_draft, tmp_path):
    log = tmp_path / "engine.log"
    spec = run(peaked_target, peaked_draft, log_path=str(log))
    plain = run(peaked_target, None)
    many, few = spec.tasks
    # Draft-free but for the odd step while rows are admitted (fewer than 5 rows drafting then).
    assert many.spec_decode_metrics.get("vllm:spec_decode_num_draft_tokens", 0) <= 2 * 3, many.spec_decode_metrics
    assert few.spec_decode_metrics.get("vllm:spec_decode_num_draft_tokens", 0) > 0, few.spec_decode_metrics  # drafted
    assert "steps without drafts use vLLM's plain sampler" in log.read_text()
    assert [len(s) for p in many.outputs for s in p] == [GREEDY.max_tokens] * len(MANY)
    assert many.outputs == plain.tasks[0].outputs
    assert [len(s) for p in few.outputs for s in p] == [GREEDY.max_tokens] * len(FEW)
