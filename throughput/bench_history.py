"""Saved benchmark runs (pytest-benchmark JSON): compare the last two, or show the history.

``python -m vllm_specplugin.throughput.bench_history compare`` gates on the within-run speedup over plain
decoding (``extra_info.speedup_vs_plain``), never on absolute seconds: a configuration whose
speedup fell by more than ``--tolerance`` (relative, default 0.15 for noisy machines) against
the previous run fails. ``show`` prints every run's speedups as a table and plots them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from vllm_specplugin.paths import runs_dir

STORAGE = runs_dir("benchmarks")  # ./runs/benchmarks: where `make bench` saves


def load_runs(storage: str = STORAGE) -> list[dict]:
    """Saved runs, oldest first (pytest-benchmark numbers its autosaves)."""
    paths = sorted(glob.glob(os.path.join(storage, "*", "*.json")), key=os.path.basename)
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        run["path"] = path
        runs.append(run)
    return runs


def speedups(run: dict) -> dict[str, float]:
    return {
        b["name"]: b["extra_info"]["speedup_vs_plain"]
        for b in run.get("benchmarks", [])
        if b.get("extra_info", {}).get("speedup_vs_plain") is not None
    }


def compare(previous: dict, current: dict, tolerance: float) -> tuple[str, list[str]]:
    before, after = speedups(previous), speedups(current)
    lines = [f"{'benchmark':70s} {'before':>7s} {'after':>7s} {'change':>7s}"]
    regressions = []
    for name in sorted(set(before) & set(after)):
        change = after[name] / before[name] - 1
        flag = ""
        if after[name] < before[name] * (1 - tolerance):
            flag = "  REGRESSION"
            regressions.append(name)
        lines.append(f"{name:70s} {before[name]:7.2f} {after[name]:7.2f} {change:+7.1%}{flag}")
    return "\n".join(lines), regressions


def plot_history(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for run in runs for name in speedups(run)})
    fig, ax = plt.subplots(figsize=(10, 5))
    for name in names:
        points = [(i, speedups(run)[name]) for i, run in enumerate(runs) if name in speedups(run)]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("saved run")
    ax.set_ylabel("speedup over plain decoding (same run)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["compare", "show"])
    parser.add_argument("--storage", default=STORAGE, help="pytest-benchmark storage directory")
    parser.add_argument("--tolerance", type=float, default=0.15, help="allowed relative drop in speedup")
    args = parser.parse_args(argv)
    runs = [run for run in load_runs(args.storage) if speedups(run)]
    if args.command == "compare":
        if len(runs) < 2:
            print(f"need two saved runs with speedups in {args.storage}, found {len(runs)}: nothing to compare")
            return 0
        table, regressions = compare(runs[-2], runs[-1], args.tolerance)
        print(f"{os.path.basename(runs[-2]['path'])} -> {os.path.basename(runs[-1]['path'])}\n{table}")
        if regressions:
            print(f"\n{len(regressions)} speedup(s) fell by more than {args.tolerance:.0%}", file=sys.stderr)
            return 1
        return 0
    if not runs:
        print(f"no saved runs with speedups in {args.storage}")
        return 0
    names = sorted({name for run in runs for name in speedups(run)})
    header = f"{'benchmark':70s} " + " ".join(f"{i:>6d}" for i in range(len(runs)))
    print("runs: " + ", ".join(f"{i}={os.path.basename(r['path'])}" for i, r in enumerate(runs)))
    print(header)
    for name in names:
        cells = " ".join(f"{speedups(r)[name]:6.2f}" if name in speedups(r) else f"{'-':>6s}" for r in runs)
        print(f"{name:70s} {cells}")
    path = os.path.join(args.storage, "history.png")
    plot_history(runs, path)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
