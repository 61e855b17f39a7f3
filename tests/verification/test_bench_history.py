"""The benchmark gate compares within-run speedups, not seconds."""

from __future__ import annotations

import json

from vllm_specplugin.throughput.bench_history import compare, load_runs, main


def saved_run(path, speedups: dict[str, float], seconds: float):
    benchmarks = [
        {"name": name, "stats": {"min": seconds}, "extra_info": {"speedup_vs_plain": value}}
        for name, value in speedups.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmarks": benchmarks}))


def test_gate_flags_a_speedup_drop_beyond_tolerance(tmp_path):
    saved_run(tmp_path / "Linux" / "0001_a.json", {"x": 1.2, "y": 0.9}, seconds=1.0)
    saved_run(tmp_path / "Linux" / "0002_b.json", {"x": 1.0, "y": 0.88}, seconds=9.0)  # 9x slower machine
    runs = load_runs(str(tmp_path))
    table, regressions = compare(runs[0], runs[1], tolerance=0.15)
    assert regressions == ["x"] and "REGRESSION" in table
    assert main(["compare", "--storage", str(tmp_path)]) == 1
    assert main(["compare", "--storage", str(tmp_path), "--tolerance", "0.2"]) == 0


def test_show_renders_table_and_plot(tmp_path, capsys):
    saved_run(tmp_path / "Linux" / "0001_a.json", {"x": 1.2}, seconds=1.0)
    saved_run(tmp_path / "Linux" / "0002_b.json", {"x": 1.3}, seconds=1.0)
    assert main(["show", "--storage", str(tmp_path)]) == 0
    assert "1.30" in capsys.readouterr().out
    assert (tmp_path / "history.png").stat().st_size > 1000
