"""A phased workload's result is the whole run's: sums of tokens, time and counters."""

from __future__ import annotations

import pytest

from vllm_specplugin.throughput.bench import WorkloadResult, combine_phases, format_table


def test_combine_phases_sums_the_phases():
    quiet = WorkloadResult("c", 1, 0.0, 256, 2.0, 6, drafts=40, draft_tokens=240, accepted_tokens=216,
                           accepted_per_position=[40, 38, 36, 35, 34, 33], draft_time_s=0.5, step_time_s=1.8,
                           propose_calls=40, plugin={"specplugin:x_total": 1.0})
    burst = WorkloadResult("c", 48, 0.0, 3072, 6.0, 6, drafts=10, draft_tokens=60, accepted_tokens=30,
                           accepted_per_position=[10, 8, 6, 3, 2, 1], draft_time_s=0.25, step_time_s=5.5,
                           propose_calls=90, plugin={"specplugin:x_total": 2.0, "specplugin:y_total": 5.0})
    whole = combine_phases([quiet, burst, quiet])
    assert whole.phases == [1, 48, 1] and whole.batch == 48 and whole.batch_label == "1→48→1"
    assert whole.tokens_per_s == pytest.approx((256 * 2 + 3072) / 10.0)
    assert whole.alpha == pytest.approx((216 * 2 + 30) / (240 * 2 + 60))
    assert whole.accepted_per_position == [90, 84, 78, 73, 70, 67]
    assert whole.propose_calls == 170 and whole.draft_time_s == pytest.approx(1.25)
    assert whole.plugin == {"specplugin:x_total": 4.0, "specplugin:y_total": 5.0}
    # One plain step does not exist for phases of different concurrency: r is not given.
    assert whole.verify_cost_ratio(500.0) is None
    assert "| c | 1→48→1 | 0 |" in format_table([whole], {})


def test_combine_phases_keeps_an_unknown_draft_time_unknown():
    plugin = WorkloadResult("c", 1, 0.0, 64, 1.0, 4, draft_time_s=0.2, step_time_s=0.9, propose_calls=10)
    builtin = WorkloadResult("c", 16, 0.0, 64, 1.0, 4)  # vLLM's built-ins report no draft time
    assert combine_phases([plugin, builtin]).draft_time_s is None
