"""The interleaved A/B's bookkeeping (throughput/interleaved.py): rotation and paired ratios."""

from __future__ import annotations

import pytest

from vllm_specplugin.throughput.bench import WorkloadResult
from vllm_specplugin.throughput import interleaved
from vllm_specplugin.throughput.interleaved import PRESETS, main, paired_ratios, rotation, summed, workload_prompts


def test_rotation_visits_every_server_once_and_moves_the_first():
    orders = [rotation(4, r) for r in range(4)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    assert [order[0] for order in orders] == [0, 1, 2, 3]  # each server leads one round in four
    assert rotation(3, 5) == rotation(3, 2)


def test_paired_ratios_divide_within_a_round():
    """A machine that runs twice as slow in round 2 moves both sides of each ratio: the paired
    ratio stays 1.5, where the ratio of best rounds across servers would not."""
    rounds = [{"plain": 100.0, "a": 150.0, "b": 120.0}, {"plain": 50.0, "a": 75.0, "b": 60.0},
              {"plain": 80.0, "a": 120.0}]
    paired = paired_ratios(rounds, ["plain", "b"])
    assert paired["a"].ratios["plain"] == pytest.approx([1.5, 1.5, 1.5])
    assert paired["a"].ratios["b"] == pytest.approx([1.25, 1.25])  # round 3 has no b: not paired
    assert paired["a"].median("plain") == pytest.approx(1.5)
    assert paired["b"].spread("plain") == pytest.approx((1.2, 1.2))
    assert paired["a"].tokens_per_s == [150.0, 75.0, 120.0]


def test_paired_ratios_refuse_nothing_to_compare():
    with pytest.raises(ValueError, match="no round"):
        paired_ratios([], ["plain"])
    with pytest.raises(ValueError, match="no round"):
        paired_ratios([{}, {}], ["plain"])
    with pytest.raises(ValueError, match="baseline 'plain' has no round"):
        paired_ratios([{"a": 1.0}], ["plain"])


def test_summed_adds_counters_over_rounds():
    rounds = [WorkloadResult("x", 1, 1.0, 40, 0.5, 6, drafts=10, draft_tokens=60, accepted_tokens=30,
                             draft_time_s=0.1, step_time_s=0.4, propose_calls=10),
              WorkloadResult("x", 1, 1.0, 40, 0.3, 6, drafts=8, draft_tokens=48, accepted_tokens=24,
                             draft_time_s=0.1, step_time_s=0.3, propose_calls=8)]
    total = summed(rounds)
    assert (total.output_tokens, total.wall_s, total.drafts) == (80, pytest.approx(0.8), 18)
    assert total.alpha == pytest.approx(0.5) and total.mean_accepted_length == pytest.approx(4.0)
    assert total.draft_time_s == pytest.approx(0.2) and total.propose_calls == 18
    plain = summed([WorkloadResult("plain", 1, 1.0, 40, 0.5, 0)])
    assert plain.draft_time_s is None and plain.alpha is None


def test_presets_start_with_plain_and_name_their_reference():
    for preset in PRESETS.values():
        names = [c.name for c in preset.configs]
        assert names[0] == "plain" and preset.reference in names and len(set(names)) == len(names)
        assert all(name in names and reference in names for name, reference in preset.pairs)


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        main(["--concurrency", "0"])
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--warmup-rounds", "-1"])
    assert "--warmup-rounds must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reference", "no such configuration"])
    assert "no such configuration" in capsys.readouterr().err


def test_help_names_the_presets(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Presets:" in out and all(name in out for name in PRESETS)


def test_workload_prompts():
    texts, temperatures = workload_prompts("mixed-T1", 8)
    assert len(texts) == 8 and sorted(set(temperatures)) == [1.0, 1.3]
    texts, temperatures = workload_prompts("heldout-T0", 3)
    assert len(texts) == 3 and temperatures == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown workload"):
        workload_prompts("mixed-T2", 4)
    with pytest.raises(ValueError, match="only 48"):
        workload_prompts("heldout-T1", 49)


def test_report_compares_a_pair_with_its_own_reference():
    from vllm_specplugin.throughput.bench import ServedConfig
    from vllm_specplugin.throughput.interleaved import Preset, format_report

    names = ["plain", "chain 8", "chain 16", "tree 16"]
    preset = Preset("t", "heldout-T1", tuple(ServedConfig(n) for n in names), "chain 8", "about",
                    pairs=(("tree 16", "chain 16"),))
    rounds = [{"plain": 50.0, "chain 8": 100.0, "chain 16": 80.0, "tree 16": 88.0}] * 3
    paired = paired_ratios(rounds, ["plain", "chain 8", "chain 16"])
    totals = {n: summed([WorkloadResult(n, 1, 1.0, 48, 0.5, 0)]) for n in names}
    rows = {line.split(" | ")[0][2:]: line for line in format_report("x", preset, paired, totals, "chain 8", "h").splitlines()
            if line.startswith("| ") and not line.startswith("| configuration")}
    assert "1.100x (1.10-1.10) x chain 16" in rows["tree 16"]  # 88 / 80, not 88 / 100
    assert "0.800x (0.80-0.80) |" in rows["chain 16"]  # against the default reference


def test_a_server_that_would_exhaust_memory_is_refused_before_it_starts(monkeypatch):
    """Every server of a preset stays resident: one more where less than a server's memory is
    available is refused with what to do (the kernel would otherwise kill a running one)."""
    assert interleaved.available_memory_gib() > 0  # /proc/meminfo read (Linux)
    monkeypatch.setattr(interleaved, "available_memory_gib", lambda: interleaved.SERVER_MEMORY_GIB + 1)
    interleaved.check_memory_for_another_server(3, 9)
    monkeypatch.setattr(interleaved, "available_memory_gib", lambda: interleaved.SERVER_MEMORY_GIB - 0.5)
    with pytest.raises(SystemExit, match="after 8 of 9 servers.*--only"):
        interleaved.check_memory_for_another_server(8, 9)


def test_a_server_seed_is_added_once_to_each_servers_arguments():
    config = interleaved.ServedConfig("x", server_args=("--no-async-scheduling", "--seed", "3"))
    seeded = interleaved.with_server_seed(config, 7)
    assert seeded.server_args == ("--no-async-scheduling", "--seed", "7")
    assert interleaved.with_server_seed(interleaved.ServedConfig("plain"), 0).server_args == ("--seed", "0")


def test_only_selects_an_exact_name_alone_and_substrings_widely():
    preset = PRESETS["tree"]
    exact = [c.name for c in interleaved.selected(preset, "tree 16", "chain 8")]
    assert exact == ["plain", "chain 8", "chain 16", "tree 16"]  # its pair's chain, not the tiny draft's tree
    wide = [c.name for c in interleaved.selected(preset, "tiny", "chain 8")]
    assert wide == ["plain", "chain 8"] + [c.name for c in preset.configs if "tiny" in c.name]
