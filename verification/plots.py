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


def plot_lossy_sweep(report, path: str) -> str:
    """The lossy sweep's trade-off (``verification.lossy``): per class, tokens per verification step
    against the per-node TV to the target (left, 95% CI; hollow markers: predicted by the rule) and
    against the log-likelihood gap to the exact class (right, 95% CI). Red labels: LOSSY."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tv_ax, ll_ax) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"exact": "tab:green", "lenient": "tab:blue", "typical": "tab:orange"}
    for mode, color in colors.items():
        rows = sorted((r for r in report.rows if r.mode == mode), key=lambda r: r.tokens_per_step)
        if not rows:
            continue
        x = np.array([r.tokens_per_step for r in rows])
        tv = np.array([r.tv.tv for r in rows])
        tv_err = np.array([[r.tv.tv - r.tv.low for r in rows], [r.tv.high - r.tv.tv for r in rows]])
        tv_ax.errorbar(x, tv, yerr=np.clip(tv_err, 0, None), marker="o", color=color, capsize=3, label=mode)
        tv_ax.plot(x, [r.tv.predicted_tokens for r in rows], marker="o", fillstyle="none", linestyle=":",
                   color=color)
        gap = np.array([r.loglik_gap for r in rows])
        gap_err = np.array([[r.loglik_gap - r.loglik_gap_low for r in rows],
                            [r.loglik_gap_high - r.loglik_gap for r in rows]])
        ll_ax.errorbar(x, gap, yerr=gap_err, marker="o", color=color, capsize=3, label=mode)
        for r, xi, ti, gi in zip(rows, x, tv, gap):
            name = r.setting.replace("lenient", "l").replace("typical", "t")
            for ax, y in ((tv_ax, ti), (ll_ax, gi)):
                ax.annotate(name, (xi, y), fontsize=6, xytext=(3, 3), textcoords="offset points",
                            color="tab:red" if r.lossy else "black")
    tv_ax.set_xlabel("tokens per verification step")
    tv_ax.set_ylabel("per-node TV to the target")
    tv_ax.set_title("Distribution distance (filled: measured, 95% CI; hollow: rule's exact TV over tokens)",
                    fontsize=8)
    ll_ax.axhline(0.0, color="grey", linewidth=1)
    ll_ax.set_xlabel("tokens per verification step")
    ll_ax.set_ylabel("target log-likelihood per token, minus exact's")
    ll_ax.set_title("Sequence level (held-out prompts, 95% CI)", fontsize=8)
    for ax in (tv_ax, ll_ax):
        ax.legend(fontsize=7)
    s = report.sampling
    fig.suptitle(f"Lossy acceptance trade-off: T={s['temperature']:g}, top_k={s['top_k'] or 'off'}, "
                 f"top_p={s['top_p']:g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
