"""The exactness check: sample from vLLM, test every visited prefix against the exact target.

For each sampling config (temperature, top-k, top-p) and prompt, the engine samples N
continuations of m tokens. The chain-rule test (``stats.chain_test``) compares, at every prefix
node of the sampled tree, the next-token counts with the exact processed target distribution
from ``verification.reference``. Cases are combined with Holm's correction at level alpha.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats
from tqdm import tqdm

from vllm_specplugin import stats
from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_http, run_offline
from vllm_specplugin.verification.reference import ProcessedConditionals, TargetReference


@dataclasses.dataclass(frozen=True)
class CaseReport:
    """One sampling config: all its prompts' chain tests combined."""

    name: str
    sampling: dict
    n_prompts: int
    samples_per_prompt: int
    tokens_per_sample: int
    statistic: float
    df: int
    pvalue: float
    pvalue_holm: float
    n_nodes: int
    impossible_count: int
    worst_node: dict  # position, prefix, n, pvalue_holm, tv, tv_ci
    node_pvalues: tuple[float, ...]  # raw p-value of every testable node (uniform under H0)
    power_at_delta: float  # min over prompts: first-token power to detect binned TV >= delta
    power_at_observed: float  # power at the effect size the statistic implies (lambda = X2 - df)
    acceptance_rate: float | None  # accepted / drafted tokens, from vLLM's counters
    generate_s: float
    rejected: bool


@dataclasses.dataclass(frozen=True)
class CheckReport:
    model: str
    speculative_config: dict | None
    additional_config: dict | None
    injected_fault: str | None
    driver: str
    alpha: float
    delta: float
    method: str
    cases: tuple[CaseReport, ...]
    startup_s: float
    wall_s: float

    @property
    def passed(self) -> bool:
        return not any(case.rejected for case in self.cases)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["verdict"] = self.verdict
        return json.dumps(data, indent=2, default=float)

    def format_table(self) -> str:
        head = (
            f"{'case':34s} {'N':>6s} {'m':>2s} {'nodes':>5s} {'stat':>9s} {'df':>5s} {'p':>9s} "
            f"{'p_holm':>9s} {'worst TV [95% CI]':>22s} {f'power@{self.delta:g}':>10s} {'accept':>6s}"
        )
        lines = [head, "-" * len(head)]
        for c in self.cases:
            w = c.worst_node
            tv = f"{w.get('tv', float('nan')):.3f} [{w.get('tv_ci_low', float('nan')):.3f},{w.get('tv_ci_high', float('nan')):.3f}]"
            acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.3f}"
            lines.append(
                f"{c.name:34s} {c.samples_per_prompt:6d} {c.tokens_per_sample:2d} {c.n_nodes:5d} "
                f"{c.statistic:9.1f} {c.df:5d} {c.pvalue:9.2e} {c.pvalue_holm:9.2e} {tv:>22s} "
                f"{c.power_at_delta:10.3f} {acc:>6s}"
            )
        spec = json.dumps(self.speculative_config) if self.speculative_config else "none (plain decoding)"
        lines += [
            "",
            f"model: {self.model}",
            f"speculative config: {spec}",
            f"injected fault: {self.injected_fault or 'none'}; driver: {self.driver}",
            f"alpha {self.alpha} per suite (Holm over {len(self.cases)} cases), {self.method} chi-square, "
            f"power@{self.delta:g}: first-token power to detect a binned TV >= {self.delta:g}",
            f"engine start-up {self.startup_s:.1f} s, wall time {self.wall_s:.1f} s",
            f"VERDICT: {self.verdict}",
        ]
        return "\n".join(lines)


def case_name(sampling: SamplingConfig) -> str:
    return f"T={sampling.temperature:g} top_k={sampling.top_k or 'off'} top_p={sampling.top_p:g}"


def random_prompts(vocab_size: int, count: int, length: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts of random tokens (ids >= 3 skip the special tokens), for random-weight models."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab_size, size=(count, length)).tolist()


def _first_token_power(probs: np.ndarray, n: int, delta: float, alpha: float) -> float:
    binning = stats.probability_bins(probs, n)
    df = binning.n_bins - 1
    if df < 1:
        return float("nan")  # greedy: a single bin, deviations show as impossible tokens
    return float(stats.power_for_tv(n, delta, df, alpha))


def _power_at_observed(statistic: float, df: int, alpha: float) -> float:
    if df < 1:
        return float("nan")
    critical = scipy_stats.chi2.isf(alpha, df)
    noncentrality = max(statistic - df, 0.0)
    if noncentrality == 0.0:
        return alpha
    return float(scipy_stats.ncx2.sf(critical, df, noncentrality))


def analyse(
    reference: TargetReference,
    prompts: Sequence[Sequence[int]],
    outputs: list[list[list[int]]],
    sampling: SamplingConfig,
    *,
    alpha: float,
    delta: float,
    method: str,
    acceptance_rate: float | None,
    generate_s: float,
) -> CaseReport:
    results, powers = [], []
    for prompt_index, (prompt, samples) in enumerate(zip(prompts, outputs)):
        samples = np.asarray(samples, dtype=np.int64)
        conditional = ProcessedConditionals(
            reference.prefix_logits(prompt, samples), sampling.temperature, sampling.top_k, sampling.top_p
        )
        result = stats.chain_test(samples, conditional, method=method, seed=prompt_index)
        results.append(dataclasses.replace(
            result, nodes=tuple(dataclasses.replace(n, prompt_index=prompt_index) for n in result.nodes)
        ))
        powers.append(_first_token_power(conditional(()), len(samples), delta, alpha))
    combined = stats.combine_chain_results(results)
    testable = [n for n in combined.nodes if n.testable or n.impossible_count]
    worst = min(testable, key=lambda n: n.pvalue_holm, default=None)
    worst_node = {} if worst is None else {
        "prompt_index": worst.prompt_index, "position": worst.position, "prefix": list(worst.prefix),
        "n": worst.n, "pvalue_holm": worst.pvalue_holm, "tv": worst.tv,
        "tv_ci_low": worst.tv_ci_low, "tv_ci_high": worst.tv_ci_high,
        "impossible_count": worst.impossible_count,
    }
    finite_powers = [p for p in powers if np.isfinite(p)]
    return CaseReport(
        name=case_name(sampling),
        sampling=sampling.as_dict(),
        n_prompts=len(prompts),
        samples_per_prompt=sampling.n,
        tokens_per_sample=sampling.max_tokens,
        statistic=float(combined.statistic),
        df=int(combined.df),
        pvalue=float(combined.pvalue),
        pvalue_holm=float(combined.pvalue),  # set at suite level
        n_nodes=len(testable),
        impossible_count=int(combined.impossible_count),
        worst_node=worst_node,
        node_pvalues=tuple(float(n.pvalue) for n in combined.nodes if n.testable),
        power_at_delta=min(finite_powers) if finite_powers else float("nan"),
        power_at_observed=_power_at_observed(combined.statistic, combined.df, alpha),
        acceptance_rate=acceptance_rate,
        generate_s=generate_s,
        rejected=False,
    )


def _acceptance(metrics: dict) -> float | None:
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    if not drafted:
        return None
    return float(metrics.get("vllm:spec_decode_num_accepted_tokens", 0)) / drafted


def run_check(
    model: str,
    samplings: Sequence[SamplingConfig],
    prompts: Sequence[Sequence[int]],
    *,
    speculative_config: dict | None = None,
    additional_config: dict | None = None,
    injected_fault: str | None = None,
    alpha: float = 0.01,
    delta: float = 0.1,
    method: str = "pearson",
    reference: TargetReference | None = None,
    max_model_len: int = 512,
    driver: str = "offline",
    progress: bool = True,
) -> CheckReport:
    """Sample every config from one engine, then test each against the exact reference.

    ``driver``: "offline" (``LLM.generate`` in a fresh process) or "http" (the real
    OpenAI-compatible server on 127.0.0.1).
    """
    drivers = {"offline": run_offline, "http": run_http}
    if driver not in drivers:
        raise ValueError(f"driver must be one of {sorted(drivers)}, got {driver!r}")
    t0 = time.perf_counter()
    extra_env = {"SPECPLUGIN_INJECT_FAULT": injected_fault} if injected_fault else None
    with tqdm(total=len(samplings) + 1, desc="exactness check", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"sampling from vLLM ({driver})")
        run = drivers[driver](
            model,
            [GenerationTask([list(p) for p in prompts], s) for s in samplings],
            speculative_config=speculative_config,
            additional_config=additional_config,
            max_model_len=max_model_len,
            extra_env=extra_env,
        )
        bar.update(1)
        reference = reference or TargetReference(model)
        cases = []
        for sampling, task in zip(samplings, run.tasks):
            bar.set_postfix_str(case_name(sampling))
            cases.append(analyse(
                reference, prompts, task.outputs, sampling, alpha=alpha, delta=delta, method=method,
                acceptance_rate=_acceptance(task.spec_decode_metrics), generate_s=task.generate_s,
            ))
            bar.update(1)
    adjusted = stats.holm([c.pvalue for c in cases])
    cases = tuple(
        dataclasses.replace(c, pvalue_holm=float(p), rejected=bool(p < alpha))
        for c, p in zip(cases, adjusted)
    )
    return CheckReport(
        model=model, speculative_config=speculative_config, additional_config=additional_config,
        injected_fault=injected_fault, driver=driver, alpha=alpha, delta=delta, method=method, cases=cases,
        startup_s=run.startup_s, wall_s=time.perf_counter() - t0,
    )
