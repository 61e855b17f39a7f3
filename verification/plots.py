"""PNG plots of a check report: node p-values against the uniform, and TV per case."""

from __future__ import annotations

import numpy as np


def plot_report(report, node_pvalues: dict[str, list[float]], path: str) -> str:
    """Left: QQ plot of per-node p-values (a straight diagonal under exactness).
    Right: -log10 Holm p per case with the rejection line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (qq, bars) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pvalues in node_pvalues.items():
        p = np.sort(np.asarray(pvalues))
        if len(p) == 0:
            continue
        expected = (np.arange(1, len(p) + 1) - 0.5) / len(p)
        qq.plot(expected, p, marker=".", linestyle="none", label=f"{name} ({len(p)} nodes)")
    qq.plot([0, 1], [0, 1], color="grey", linewidth=1)
    qq.set_xlabel("uniform quantile")
    qq.set_ylabel("node p-value")
    qq.set_title("Per-node p-values (diagonal = exact)")
    qq.legend(fontsize=7)
    names = [c.name for c in report.cases]
    heights = [-np.log10(max(c.pvalue_holm, 1e-300)) for c in report.cases]
    colors = ["tab:red" if c.rejected else "tab:green" for c in report.cases]
    bars.barh(names, heights, color=colors)
    bars.axvline(-np.log10(report.alpha), color="black", linestyle="--", label=f"alpha = {report.alpha:g}")
    bars.set_xlabel("-log10 Holm p (right of the line = rejected)")
    bars.set_title(f"Verdict: {report.verdict}")
    bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
