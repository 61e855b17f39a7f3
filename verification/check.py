"""The exactness check: sample from vLLM, test every visited prefix against the exact target.

For each sampling config (temperature, top-k, top-p) and prompt, the engine samples N
continuations of m tokens (at T = 0: one continuation per prompt, as vLLM requires, over many
prompts). The chain-rule test (``stats.chain_test``) checks at EVERY prefix node of the sampled
tree that each sampled token is possible under the exact processed target distribution from
``verification.reference`` (at T = 0: that it is the argmax, up to a float32 near-tie), and
compares the next-token counts of every node with >= ``MIN_NODE_SAMPLES`` samples with it (Pearson
chi-square summed over nodes and prompts). Cases are combined with Holm's correction at level
alpha (or decided at a suite's Bonferroni share, ``family_size``). A case that checked no token
fails.

Power. ``CaseReport.power_at_delta`` is the power of the decision actually made (combined df,
the case's level) against a binned TV of delta at the first token of each prompt. Before a run,
``plan_power`` computes it from exact simulated runs (the df depends on the sampled tree), or the
power against a known faulty sampler's exact law (``speculative_law``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from vllm_specplugin import stats
from vllm_specplugin.fault_switch import switch_env
from vllm_specplugin.verification.reports import VerdictReport
from vllm_specplugin.verification.drivers import EngineRun, GenerationTask, SamplingConfig, run_http, run_offline
from vllm_specplugin.verification.algorithm import SAMPLING_EPS, speculative_token_law
from vllm_specplugin.verification.reference import (GREEDY_TIE_TOLERANCE, BatchLaw, Prefix,
                                                    ProcessedConditionals, TargetReference,
                                                    sample_tree, target_law)


@dataclasses.dataclass(frozen=True)
class CaseReport:
    """One sampling config: all its prompts' chain tests combined.

    ``power_at_delta`` is the power of the decision this case gets: the combined chain statistic
    (df = ``df``, summed over nodes and prompts) at level ``case_alpha``, against a binned TV of
    delta at the first token of every prompt (noncentrality ``n_prompts * N * (2 delta)**2``,
    ``stats.chain_power_for_tv``); NaN when no chi-square was computed (T = 0: the support check
    is the test, and any non-argmax token fails it).
    """

    name: str
    sampling: dict
    n_prompts: int
    samples_per_prompt: int
    tokens_per_sample: int
    statistic: float
    df: int
    pvalue: float
    pvalue_holm: float  # Holm-adjusted over the report, or min(1, p * family_size) with a family_size
    n_nodes: int  # prefix nodes visited: every node's sampled tokens were checked for support
    n_chi2_nodes: int  # nodes with >= min_node_samples samples, in the chi-square sum
    tokens_checked: int  # sampled tokens checked for support (0: the case fails)
    impossible_count: int
    worst_node: dict  # node with the smallest Holm p: position, prefix, n, pvalue_holm, tv (plug-in)
    node_pvalues: tuple[float, ...]  # raw p-value of every testable node (uniform under H0)
    power_at_delta: float
    case_alpha: float  # the level at which this case is decided
    acceptance_rate: float | None  # accepted / drafted tokens, from vLLM's counters
    generate_s: float
    rejected: bool
    near_tie_nodes: int = 0  # T = 0: visited nodes with several tokens within the tie tolerance
    near_tie_accepted: int = 0  # T = 0: sampled tokens accepted only thanks to the tolerance
    notes: tuple[str, ...] = ()
    # Power against the same binned TV at every testable node of position 2 (the first token a
    # speculative engine drafts; token 1 is vLLM's plain prefill sample): NaN at T = 0.
    power_at_delta_speculative: float = float("nan")
    plugin_counters: dict | None = None  # the plugin's worker counters accrued by this case, if read


@dataclasses.dataclass(frozen=True)
class CheckReport(VerdictReport):
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
    family_size: int = 0  # hypotheses in the family alpha is spent over (0: this report's cases)
    engine_options: dict | None = None  # more vllm.LLM arguments of the engine (e.g. enforce_eager)

    def format_table(self) -> str:
        head = (
            f"{'case':30s} {'P':>3s} {'N':>5s} {'m':>2s} {'nodes':>5s} {'chi2':>4s} {'tokens':>6s} "
            f"{'stat':>8s} {'df':>4s} {'p':>9s} {'decided':>9s} {'TV@worst':>8s} "
            f"{f'power@{self.delta:g}':>9s} {'pos2 pow':>8s} {'accept':>6s}"
        )
        lines = [head, "-" * len(head)]
        for c in self.cases:
            tv = c.worst_node.get("tv", float("nan"))
            acc = "-" if c.acceptance_rate is None else f"{c.acceptance_rate:.3f}"
            decided = "REJECT" if c.rejected else "ok"
            lines.append(
                f"{c.name:30s} {c.n_prompts:3d} {c.samples_per_prompt:5d} {c.tokens_per_sample:2d} {c.n_nodes:5d} "
                f"{c.n_chi2_nodes:4d} {c.tokens_checked:6d} {c.statistic:8.1f} {c.df:4d} {c.pvalue:9.2e} "
                f"{decided:>9s} {tv:8.3f} {c.power_at_delta:9.4f} {c.power_at_delta_speculative:8.4f} {acc:>6s}"
            )
        spec = json.dumps(self.speculative_config) if self.speculative_config else "none (plain decoding)"
        family = self.family_size or len(self.cases)
        rule = (f"Holm over this report's {len(self.cases)} cases" if not self.family_size
                else f"each case at alpha/{family} = {self.alpha / family:.2g} (Bonferroni share of a "
                     f"{family}-hypothesis suite)")
        lines += [
            "",
            f"model: {self.model}",
            f"speculative config: {spec}",
            f"injected fault: {self.injected_fault or 'none'}; driver: {self.driver}",
            f"alpha {self.alpha:g} family-wise, {rule}; {self.method} chi-square summed over the nodes "
            f"with >= {MIN_NODE_SAMPLES} samples; every sampled token checked for support "
            f"(a token the target gives probability 0, or a non-argmax token at T = 0, fails the case).",
            f"power@{self.delta:g}: power of the decision made (combined df, level alpha/{family}) against "
            f"a binned TV of {self.delta:g} at the first token of every prompt.",
            "TV@worst: plug-in binned TV at the node with the smallest Holm p (selected, biased upward; "
            "not an estimate of a fault's size, no interval).",
        ]
        for c in self.cases:
            lines += [f"note ({c.name}): {note}" for note in c.notes]
        lines += [
            f"engine start-up {self.startup_s:.1f} s, wall time {self.wall_s:.1f} s",
            f"VERDICT: {self.verdict}",
        ]
        return "\n".join(lines)


MIN_NODE_SAMPLES = 10  # chain_test's default: nodes below it are checked for support only
MIN_EXPECTED = 5.0  # gof_test's default: expected count per bin


def case_name(sampling: SamplingConfig) -> str:
    return f"T={sampling.temperature:g} top_k={sampling.top_k or 'off'} top_p={sampling.top_p:g}"


def random_prompts(vocab_size: int, count: int, length: int | tuple[int, int] = 6,
                   seed: int = 0) -> list[list[int]]:
    """Prompts of random tokens (ids >= 3 skip the special tokens), for random-weight models.

    ``length``: one length for all, or ``(shortest, longest)`` for lengths drawn uniformly.
    """
    rng = np.random.default_rng(seed)
    if isinstance(length, int):
        return rng.integers(3, vocab_size, size=(count, length)).tolist()
    lengths = rng.integers(length[0], length[1] + 1, size=count)
    return [rng.integers(3, vocab_size, size=int(n)).tolist() for n in lengths]


def _decision_power(df: int, sizes: Sequence[int], delta: float, alpha: float) -> float:
    if df < 1:
        return float("nan")  # support check only (greedy): no chi-square
    return float(stats.chain_power_for_tv(sizes, delta, df, alpha))


def _rectangular(samples, notes: list[str], prompt_index: int) -> np.ndarray:
    lengths = {len(s) for s in samples}
    if len(lengths) > 1:  # ignore_eos is set, so this is unexpected: test the common part
        notes.append(f"prompt {prompt_index}: samples of lengths {sorted(lengths)}; tested the first "
                     f"{min(lengths)} tokens")
        samples = [s[: min(lengths)] for s in samples]
    return np.asarray(samples, dtype=np.int64).reshape(len(samples), min(lengths) if lengths else 0)


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
    tie_tolerance: float = GREEDY_TIE_TOLERANCE,
    plugin_counters: dict | None = None,
) -> CaseReport:
    """Test one sampling config's outputs; ``alpha`` is the level this case is decided at (used for
    its power; the decision itself is made by ``run_check``)."""
    results, sizes, notes = [], [], []
    near_tie_nodes = near_tie_accepted = 0
    greedy = sampling.temperature < SAMPLING_EPS
    for prompt_index, (prompt, samples) in enumerate(zip(prompts, outputs)):
        samples = _rectangular(samples, notes, prompt_index)
        if samples.size == 0:
            notes.append(f"prompt {prompt_index}: no sampled token")
            continue
        conditional = ProcessedConditionals(
            reference.prefix_logits(prompt, samples), sampling.temperature, sampling.top_k, sampling.top_p,
            tie_tolerance=tie_tolerance,
        )
        result = stats.chain_test(samples, conditional, method=method, min_node_samples=MIN_NODE_SAMPLES,
                                  support_only=greedy, tv_ci=False, seed=prompt_index)
        results.append(dataclasses.replace(
            result, nodes=tuple(dataclasses.replace(n, prompt_index=prompt_index) for n in result.nodes)
        ))
        sizes.append(len(samples))
        if greedy:
            for row in samples.tolist():
                for depth, token in enumerate(row):
                    prefix = tuple(row[:depth])
                    if conditional(prefix)[token] <= 0:
                        break  # an impossible token: the case fails; nothing below it is queried
                    tied, accepted_by_tolerance = conditional.near_tie(prefix, token)
                    near_tie_nodes += tied
                    near_tie_accepted += accepted_by_tolerance
    if not results:
        notes.append("no sampled token to check: the case fails (a check that visits no data cannot pass)")
        return CaseReport(
            name=case_name(sampling), sampling=sampling.as_dict(), n_prompts=len(prompts),
            samples_per_prompt=sampling.n, tokens_per_sample=sampling.max_tokens, statistic=float("nan"),
            df=0, pvalue=0.0, pvalue_holm=0.0, n_nodes=0, n_chi2_nodes=0, tokens_checked=0,
            impossible_count=0, worst_node={}, node_pvalues=(), power_at_delta=float("nan"),
            case_alpha=alpha, acceptance_rate=acceptance_rate, generate_s=generate_s, rejected=True,
            notes=tuple(notes), plugin_counters=plugin_counters,
        )
    combined = stats.combine_chain_results(results)
    evidence = [n for n in combined.nodes if n.testable or n.impossible_count]
    worst = min(evidence, key=lambda n: n.pvalue_holm, default=None)
    worst_node = {} if worst is None else {
        "prompt_index": worst.prompt_index, "position": worst.position, "prefix": list(worst.prefix),
        "n": worst.n, "pvalue_holm": worst.pvalue_holm, "tv": worst.tv,
        "impossible_count": worst.impossible_count,
    }
    if greedy and near_tie_nodes:
        notes.append(f"{near_tie_nodes} node(s) had a near-tie (logit gap <= {tie_tolerance:g}); "
                     f"{near_tie_accepted} token(s) accepted only thanks to the tolerance")
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
        n_nodes=combined.n_nodes,
        n_chi2_nodes=combined.n_chi2_nodes,
        tokens_checked=int(combined.n_tokens),
        impossible_count=int(combined.impossible_count),
        worst_node=worst_node,
        node_pvalues=tuple(float(n.pvalue) for n in combined.nodes if n.testable),
        power_at_delta=_decision_power(combined.df, sizes, delta, alpha),
        case_alpha=alpha,
        acceptance_rate=acceptance_rate,
        generate_s=generate_s,
        rejected=False,
        near_tie_nodes=near_tie_nodes,
        near_tie_accepted=near_tie_accepted,
        notes=tuple(notes),
        power_at_delta_speculative=_decision_power(combined.df, [speculative_position_samples(combined.nodes)],
                                                   delta, alpha) if combined.df >= 1 else float("nan"),
        plugin_counters=plugin_counters,
    )


def speculative_position_samples(nodes) -> int:
    """Samples at the testable nodes of position 2 (prefix length 1): where a TV deviation at the
    first speculated token is seen by the chi-square sum."""
    return int(sum(nd.n for nd in nodes if nd.position == 1 and not nd.support_only and nd.testable))


# ------------------------------------------------------------------------------------------------
# Power of the decision, computed from exact draws (no engine): to size N before a run, and to
# show that an injected fault is caught with power >= 0.99 at its known effect.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PowerPlan:
    """Power of one case's decision (level ``alpha``), from ``reps`` exact simulated runs.

    ``power`` is the smallest over the runs of the noncentral chi-square power at that run's
    combined df and noncentrality (or of the probability of sampling an impossible token, if
    larger). ``alternative`` says what deviation the noncentrality comes from.
    """

    power: float
    df: tuple[int, ...]
    noncentrality: tuple[float, ...]
    impossible_probability: tuple[float, ...]
    alpha: float
    n: int
    tokens: int
    reps: int
    alternative: str
    # delta plans: the same TV at position 2 (the first speculated token) instead of position 1
    power_speculative: float = float("nan")


def _binned_w2(law: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, float]:
    """(Cohen's w^2 over the bins of ``probs`` at sample size n, mass of ``law`` on impossible tokens)."""
    binning = stats.probability_bins(probs, n, MIN_EXPECTED)
    possible = binning.bin_of >= 0
    impossible_mass = float(law[~possible].sum())
    if binning.n_bins < 2 or impossible_mass >= 1.0:
        return 0.0, impossible_mass
    binned = np.bincount(binning.bin_of[possible], weights=law[possible], minlength=binning.n_bins)
    binned = binned / binned.sum()
    return float(np.sum((binned - binning.bin_probs) ** 2 / binning.bin_probs)), impossible_mass


def _simulate(laws, sampling, rng, faulty: bool):
    """One exact simulated run: (combined df, noncentrality of the law vs the target, P(impossible),
    samples at the testable nodes of position 2).

    ``laws``: per prompt, (the target's batch law, the sampled law)."""
    df, noncentrality, log_no_impossible, second = 0, 0.0, 0.0, 0
    for target, law in laws:
        samples = sample_tree(law, sampling.n, sampling.max_tokens, rng)
        result = stats.chain_test(samples, lambda s: target([tuple(s)])[0], min_node_samples=MIN_NODE_SAMPLES,
                                  tv_ci=False)
        df += result.df
        second += speculative_position_samples(result.nodes)
        if not faulty:
            continue
        nodes = list(result.nodes)
        p_rows = target([nd.prefix for nd in nodes])
        f_rows = law([nd.prefix for nd in nodes])
        for nd, p, f in zip(nodes, p_rows, f_rows):
            w2, impossible_mass = _binned_w2(f, p, nd.n)
            if not nd.support_only:
                noncentrality += nd.n * w2
            if impossible_mass > 0:
                log_no_impossible += nd.n * np.log1p(-min(impossible_mass, 1.0 - 1e-16))
    return df, noncentrality, 0.0 - np.expm1(log_no_impossible), second


def plan_power(reference: TargetReference, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
               alpha: float, delta: float | None = None, law_for_prompt=None, reps: int = 3,
               seed: int = 0) -> PowerPlan:
    """Power of the decision a case will get, before running the engine.

    The df of the combined test depends on the sampled tree, so runs are simulated exactly
    (``sample_tree``) with this N, m and prompts. Two alternatives:

    * ``delta``: the target itself is sampled (the tree and df under H0); the alternative is a
      binned TV of ``delta`` at the first token of every prompt (noncentrality
      ``len(prompts) * N * (2 delta)**2``), as ``CaseReport.power_at_delta`` reports after a run;
    * ``law_for_prompt(prompt, target_law) -> BatchLaw``: a known faulty sampler (e.g.
      ``speculative_law`` with a fault); runs are drawn from it, and the noncentrality is the sum
      over the chi-square nodes of ``n * w^2`` (w over the node's bins) between its law and the
      target's; impossible tokens count too.
    """
    if (delta is None) == (law_for_prompt is None):
        raise ValueError("give exactly one of delta and law_for_prompt")
    if sampling.temperature < SAMPLING_EPS:
        raise ValueError("T = 0 has no chi-square: its check is the support check")
    rng = np.random.default_rng(seed)
    laws = []
    for prompt in prompts:
        target = target_law(reference, prompt, sampling.temperature, sampling.top_k, sampling.top_p)
        laws.append((target, target if law_for_prompt is None else law_for_prompt(prompt, target)))
    dfs, lams, imps, powers, speculative = [], [], [], [], []
    for _ in range(reps):
        df, lam, imp, second = _simulate(laws, sampling, rng, law_for_prompt is not None)
        if delta is not None:
            lam = len(prompts) * sampling.n * (2.0 * delta) ** 2
            # The same TV at position 2 instead, where speculation acts (token 1 is the prefill's).
            lam2 = second * (2.0 * delta) ** 2
            speculative.append(float(stats.chain_power(lam2, df, alpha)) if df >= 1 and lam2 > 0 else 0.0)
        chi2 = float(stats.chain_power(lam, df, alpha)) if df >= 1 else 0.0
        dfs.append(df)
        lams.append(float(lam))
        imps.append(float(imp))
        powers.append(max(chi2, imp))
    alternative = (f"binned TV {delta:g} at the first token of each prompt" if delta is not None
                   else "the given sampler's exact law at every chi-square node")
    return PowerPlan(min(powers), tuple(dfs), tuple(lams), tuple(imps), alpha, sampling.n,
                     sampling.max_tokens, reps, alternative,
                     power_speculative=min(speculative) if speculative else float("nan"))


def speculative_law(draft_for_prompt, *, mode: str = "probabilistic", fault: str | None = None,
                    fault_arg=None, token_law=None):
    """``law_for_prompt`` for :func:`plan_power`: what a speculative sampler emits.

    The first token comes from the target (vLLM samples it at prefill, before any draft); every
    later token has the law ``speculative_token_law(p, q)`` at its context, whether it is a later
    drafted position of the same step or the first of a new one (for these position-independent
    rules, as long as a step drafts at least ``m - 1`` tokens). ``draft_for_prompt(prompt) ->
    BatchLaw`` is the draft's sampling distribution q; ``fault_arg`` is passed on, or called as
    ``fault_arg(prompt, prefixes, p, q)`` for a per-context argument (the verification q of
    ``"wrong_q"``, the verification target of ``"ignore_temperature"``). ``token_law(p, q) -> law``
    (rows ``[n, V]``, float64) replaces ``speculative_token_law`` for a rule it does not model
    (e.g. vLLM's ``synthetic`` acceptance).
    """

    def law_for_prompt(prompt, target: BatchLaw) -> BatchLaw:
        draft = draft_for_prompt(prompt)
        cache: dict[Prefix, np.ndarray] = {}

        def law(prefixes: list[Prefix]) -> np.ndarray:
            missing = [s for s in dict.fromkeys(prefixes) if s not in cache]
            if missing:
                p = target(missing)
                out = p.copy()
                later = [i for i, s in enumerate(missing) if len(s) > 0]
                if later:
                    sub = [missing[i] for i in later]
                    q = draft(sub)
                    if token_law is not None:
                        out[later] = token_law(p[later], q)
                    else:
                        arg = fault_arg(prompt, sub, p[later], q) if callable(fault_arg) else fault_arg
                        out[later] = speculative_token_law(p[later], q, mode=mode, fault=fault, fault_arg=arg)
                cache.update(zip(missing, out))
            return np.stack([cache[s] for s in prefixes])

        return law

    return law_for_prompt


def _acceptance(metrics: dict) -> float | None:
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    if not drafted:
        return None
    return float(metrics.get("vllm:spec_decode_num_accepted_tokens", 0)) / drafted


def decide(cases: Sequence[CaseReport], alpha: float, family_size: int | None = None) -> tuple[CaseReport, ...]:
    """Set each case's ``pvalue_holm`` and ``rejected`` (see :func:`run_check`). A case that checked
    no token is rejected: no data is no evidence of exactness."""
    if family_size is None:
        adjusted = stats.holm([c.pvalue for c in cases])
        return tuple(
            dataclasses.replace(c, pvalue_holm=float(p), rejected=bool(p < alpha or c.tokens_checked == 0))
            for c, p in zip(cases, adjusted)
        )
    return tuple(
        dataclasses.replace(c, pvalue_holm=min(1.0, c.pvalue * family_size),
                            rejected=bool(c.pvalue < alpha / family_size or c.tokens_checked == 0))
        for c in cases
    )


# A driver samples every task (one engine or model load for all of them): tasks -> EngineRun.
Driver = Callable[[list[GenerationTask]], EngineRun]
ENGINE_DRIVERS = {"offline": run_offline, "http": run_http}


def run_check(
    model: str,
    samplings: Sequence[SamplingConfig],
    prompts: Sequence[Sequence[int]],
    *,
    greedy_prompts: Sequence[Sequence[int]] | None = None,
    speculative_config: dict | None = None,
    additional_config: dict | None = None,
    injected_fault: str | None = None,
    alpha: float = 0.01,
    family_size: int | None = None,
    delta: float = 0.1,
    method: str = "pearson",
    reference: TargetReference | None = None,
    max_model_len: int = 512,
    engine_options: dict | None = None,
    driver: str | Driver = "offline",
    driver_name: str | None = None,
    progress: bool = True,
) -> CheckReport:
    """Sample every config with one driver, then test each against the exact reference.

    ``greedy_prompts``: the prompts of the T = 0 cases (default ``prompts``). vLLM samples one
    continuation per prompt at T = 0, so those cases need many prompts rather than many samples.
    ``driver``: "offline" (``LLM.generate`` in a fresh process) or "http" (the real
    OpenAI-compatible server on 127.0.0.1), both with ``speculative_config``,
    ``additional_config``, ``max_model_len`` and ``injected_fault``
    (``SPECPLUGIN_INJECT_FAULT``), the offline driver also with ``engine_options`` (more
    ``vllm.LLM`` arguments, e.g. ``{"enforce_eager": True}``); or any callable ``driver(tasks) -> EngineRun`` (e.g. the
    transformers driver, ``verification.hf_driver.run_hf_check``), which then owns those settings
    (they are only recorded in the report), reported as ``driver_name``.

    Decisions. ``alpha`` is family-wise. Without ``family_size`` the family is this report's
    cases: Holm over them, and each case's power is computed at ``alpha / len(cases)`` (the level
    at which one deviating case is rejected for sure). With ``family_size`` (a suite spread over
    several reports, as in tests/statistical) each case is rejected iff ``p < alpha /
    family_size`` (Holm's first step; power at that level): the suite's Holm procedure over all
    its p-values rejects every case rejected here, and may reject more (after k rejections its
    threshold is ``alpha / (family_size - k)``), so the suite runs it at the end.
    A case whose check visited no token is rejected.
    """
    if isinstance(driver, str):
        if driver not in ENGINE_DRIVERS:
            raise ValueError(f"driver must be one of {sorted(ENGINE_DRIVERS)} or a callable, got {driver!r}")
        driver_name, engine = driver, ENGINE_DRIVERS[driver]
        if engine_options and driver != "offline":
            raise ValueError(f"engine_options are for the offline driver (got driver {driver!r}); "
                             "give the http server its arguments through a driver of your own")
        options = {"engine_options": engine_options} if engine_options else {}
        # An injected fault is a deliberate request: its engine gets the testing switch too.
        extra_env = {"SPECPLUGIN_INJECT_FAULT": injected_fault, **switch_env()} if injected_fault else None

        def driver(tasks: list[GenerationTask]) -> EngineRun:
            return engine(model, tasks, speculative_config=speculative_config, additional_config=additional_config,
                          max_model_len=max_model_len, extra_env=extra_env, **options)
    driver_name = driver_name or getattr(driver, "__name__", "custom")
    if family_size is not None and family_size < len(samplings):
        raise ValueError(f"family_size {family_size} is smaller than the {len(samplings)} cases of this report")
    case_alpha = alpha / (family_size or len(samplings))
    greedy_prompts = prompts if greedy_prompts is None else greedy_prompts
    prompts_of = [greedy_prompts if s.temperature < SAMPLING_EPS else prompts for s in samplings]
    t0 = time.perf_counter()
    with tqdm(total=len(samplings) + 1, desc="exactness check", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"sampling ({driver_name})")
        run = driver([GenerationTask([list(p) for p in ps], s) for ps, s in zip(prompts_of, samplings)])
        bar.update(1)
        reference = reference or TargetReference(model)
        cases = []
        for sampling, ps, task in zip(samplings, prompts_of, run.tasks):
            bar.set_postfix_str(case_name(sampling))
            cases.append(analyse(
                reference, ps, task.outputs, sampling, alpha=case_alpha, delta=delta, method=method,
                acceptance_rate=_acceptance(task.spec_decode_metrics), generate_s=task.generate_s,
                plugin_counters=task.plugin_metrics or None,
            ))
            bar.update(1)
    cases = decide(cases, alpha, family_size)
    return CheckReport(
        model=model, speculative_config=speculative_config, additional_config=additional_config,
        injected_fault=injected_fault, driver=driver_name, alpha=alpha, delta=delta, method=method, cases=cases,
        startup_s=run.startup_s, wall_s=time.perf_counter() - t0, family_size=family_size or 0,
        engine_options=engine_options,
    )
