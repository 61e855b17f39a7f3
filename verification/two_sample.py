"""Two-sample exactness check: a speculative deployment against a plain one, no reference model.

``specplugin-verify two-sample`` samples the same prompts N times from a speculative sampler and N
times from a plain one, with the configuration actually served (dtype, tensor parallelism, ...),
and tests the two against each other with the chain-rule homogeneity test
(``stats.two_sample.two_sample_chain_test``): at every prefix node of the pooled tree of
continuations, a 2 x bins chi-square on the next tokens (bins from the pooled counts, expected
cells >= 5, a remainder bin), summed over the nodes of a prompt (chain rule). One hypothesis per
(sampling config, prompt), Holm over all of them at ``alpha``; node p-values are Holm-adjusted over
every node of the report to locate a deviation.

The samplers: two OpenAI-compatible endpoints (``endpoint_driver``; ``--spec-url`` and
``--plain-url``) or two engines the harness starts (``verification.engine_settings.engine_driver``:
the plugin's speculative config vs none). Every request carries a fixed seed (the OpenAI ``seed``
field, as ``drivers.request_seed`` lays them out); the plain side's seeds follow the speculative
side's, so the two samples are independent streams and a rerun reproduces both.

Power BEFORE the run (:func:`plan`): the df of a prompt's chain test is at most
``max_nodes * (max_bins - 1)`` (``stats.two_sample.two_sample_df_bound``), so the power of the
decision is bounded below before anything is sampled: against a binned TV >= ``delta`` between the
two laws at the first token of one prompt (N samples on each side: effective size N / 2), at
Holm's first-step level ``alpha / (cases * prompts)``. Below ``min_power`` the run is refused
(:class:`Underpowered`, with the N that would do), or, with ``allow_underpowered``, done with a
loud warning that the report keeps. After the run each prompt also reports the power at the
observed df and at its largest node of position 2, the first token a speculative engine drafts
(token 1 comes from the target's prefill in both samplers, so a speculative fault shows from
token 2 on).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from vllm_specplugin.stats.multitest import holm
from vllm_specplugin.stats.power import chain_power
from vllm_specplugin.stats.two_sample import (two_sample_chain_test, two_sample_df_bound, two_sample_power_for_tv,
                                              two_sample_size_for_tv)
from vllm_specplugin.verification.reports import VerdictReport
from vllm_specplugin.verification.drivers import EngineRun, GenerationTask, SamplingConfig, TaskResult, request_seed

Driver = Callable[[list[GenerationTask]], EngineRun]

DEFAULT_PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "for i in range(")


class Underpowered(ValueError):
    """The planned run cannot detect the stated effect with the required power."""


class EndpointError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class PowerPlan:
    """Computed before anything is sampled (module docstring)."""

    n: int  # samples per prompt on each side
    hypotheses: int  # cases x prompts (Holm family)
    level: float  # alpha / hypotheses: Holm's first step
    df_bound: int  # max_nodes * (max_bins - 1), per prompt
    delta: float
    power: float  # against a binned TV >= delta at the first token of one prompt
    min_power: float
    n_needed: int  # smallest N per side reaching min_power
    underpowered: bool

    def describe(self) -> str:
        return (f"power {self.power:.4f} against a binned TV >= {self.delta:g} at the first token of one prompt "
                f"(N = {self.n} per side, df <= {self.df_bound}, level {self.level:.3g} = alpha / "
                f"{self.hypotheses}); required {self.min_power:g}, reached from N = {self.n_needed} per side")


def plan(samplings: Sequence[SamplingConfig], n_prompts: int, *, alpha: float = 0.01, delta: float = 0.1,
         max_nodes: int = 6, max_bins: int = 6, min_power: float = 0.9) -> PowerPlan:
    """The power of the decision, before the run (the smallest N of the configs decides)."""
    if not samplings or n_prompts < 1:
        raise ValueError("need at least one sampling config and one prompt")
    if not 0.0 < alpha < 1.0 or not 0.0 < delta <= 1.0 or not 0.0 <= min_power < 1.0:
        raise ValueError("alpha must be in (0, 1), delta in (0, 1], min_power in [0, 1)")
    hypotheses = len(samplings) * n_prompts
    level = alpha / hypotheses
    df = two_sample_df_bound(max_nodes, max_bins)
    n = min(s.n for s in samplings)
    power = two_sample_power_for_tv(n, n, delta, df, level)
    needed = two_sample_size_for_tv(delta, df, level, min_power) if min_power > level else 1
    return PowerPlan(n, hypotheses, level, df, delta, power, min_power, needed, power < min_power)


@dataclasses.dataclass(frozen=True)
class PromptResult:
    prompt_index: int
    statistic: float
    df: int
    pvalue: float
    pvalue_holm: float  # over every (case, prompt) of the report
    rejected: bool
    n_spec: int
    n_plain: int
    n_nodes: int
    n_chi2_nodes: int
    truncated: bool
    power_observed_df: float  # TV delta at the first token, at the observed df, level alpha / hypotheses
    power_position2: float  # TV delta at the largest node of position 2 (first drafted token), observed df
    worst_node: dict  # the node with the smallest p-value: position, prefix, n_spec, n_plain, pvalue, tv
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TwoSampleCase:
    name: str
    sampling: dict
    prompts: tuple[PromptResult, ...]
    acceptance_rate: float | None  # speculative side, from vLLM's counters, when readable
    spec_generate_s: float
    plain_generate_s: float

    @property
    def rejected(self) -> bool:
        return any(p.rejected for p in self.prompts)


@dataclasses.dataclass(frozen=True)
class TwoSampleReport(VerdictReport):
    mode: str  # "endpoints" or "engines (<driver>)"
    spec: str  # what the speculative side was
    plain: str
    model: str
    settings: dict
    prompts: tuple
    alpha: float
    delta: float
    method: str
    max_nodes: int
    max_bins: int
    seed: int
    plan: PowerPlan
    cases: tuple[TwoSampleCase, ...]
    spec_startup_s: float
    plain_startup_s: float
    wall_s: float
    warnings: tuple[str, ...] = ()

    def _rows(self) -> list[list[str]]:
        rows = []
        for case in self.cases:
            acc = "-" if case.acceptance_rate is None else f"{case.acceptance_rate:.3f}"
            for p in case.prompts:
                worst = p.worst_node
                where = (f"pos {worst['position'] + 1} TV {worst['tv']:.3f}" if worst else "-")
                rows.append([case.name, str(p.prompt_index), str(p.n_spec), str(p.n_plain), str(p.n_chi2_nodes),
                             f"{p.statistic:.1f}", str(p.df), f"{p.pvalue:.2e}", f"{p.pvalue_holm:.2e}",
                             "REJECT" if p.rejected else "ok", f"{p.power_observed_df:.4f}",
                             f"{p.power_position2:.4f}", where, acc])
        return rows

    HEADER = ["case", "prompt", "N spec", "N plain", "chi2 nodes", "stat", "df", "p", "p Holm", "decided",
              "power@delta", "pos2 power", "worst node", "accept"]

    def _footer(self) -> list[str]:
        lines = [
            f"mode: {self.mode}; model: {self.model}; engine: {json.dumps(self.settings)}",
            f"speculative side: {self.spec}",
            f"plain side: {self.plain}",
            f"alpha {self.alpha:g}, Holm over {self.plan.hypotheses} (case, prompt) hypotheses; {self.method} "
            f"chi-square per node (2 x bins, pooled bins, expected cells >= 5, at most {self.max_bins} bins), "
            f"summed over at most {self.max_nodes} nodes per prompt (chain rule); seeds from {self.seed}.",
            f"planned before the run: {self.plan.describe()}.",
            f"power@delta: the same alternative at the observed df; pos2 power: a binned TV of {self.delta:g} at "
            "the prompt's largest node of position 2 (the first drafted token), observed df.",
        ]
        lines += [f"WARNING: {w}" for w in self.warnings]
        for case in self.cases:
            for p in case.prompts:
                lines += [f"note ({case.name}, prompt {p.prompt_index}): {n}" for n in p.notes]
        lines += [f"start-up: speculative {self.spec_startup_s:.1f} s, plain {self.plain_startup_s:.1f} s; "
                  f"wall time {self.wall_s:.1f} s", f"VERDICT: {self.verdict}"]
        return lines

    def format_table(self) -> str:
        rows = [self.HEADER] + self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER))]
        text = [" ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        text.insert(1, "-" * len(text[0]))
        return "\n".join(text + [""] + self._footer())

    def to_markdown(self) -> str:
        lines = [f"# Two-sample exactness check: {self.verdict}", "",
                 "| " + " | ".join(self.HEADER) + " |", "|" + "---|" * len(self.HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in self._rows()]
        return "\n".join(lines + [""] + [f"- {line}" for line in self._footer()]) + "\n"


def case_name(sampling: SamplingConfig) -> str:
    return f"T={sampling.temperature:g} top_k={sampling.top_k or 'off'} top_p={sampling.top_p:g}"


def _rectangular(samples: list[list[int]], m: int, notes: list[str], side: str) -> np.ndarray:
    lengths = {len(s) for s in samples}
    if lengths != {m}:
        common = min(lengths) if lengths else 0
        notes.append(f"{side}: samples of lengths {sorted(lengths)} (asked for {m}, ignore_eos); compared the "
                     f"first {common} tokens")
        samples = [s[:common] for s in samples]
        m = common
    return np.asarray(samples, dtype=np.int64).reshape(len(samples), m)


def _acceptance(metrics: dict) -> float | None:
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    if not drafted:
        return None
    return float(metrics.get("vllm:spec_decode_num_accepted_tokens", 0)) / drafted


def validate_samplings(samplings: Sequence[SamplingConfig]) -> None:
    for s in samplings:
        if s.temperature <= 0:
            raise ValueError("two-sample mode needs temperature > 0: at T = 0 both samplers are deterministic "
                             "(compare their outputs directly, or use the reference mode's argmax check)")
        if s.n < 1 or s.max_tokens < 1:
            raise ValueError("samples and tokens must be >= 1")
        if s.seed is None:
            raise ValueError("two-sample mode seeds every request (reproducible runs): give a seed")


def run_two_sample(spec_driver: Driver, plain_driver: Driver, samplings: Sequence[SamplingConfig],
                   prompts: Sequence, *, alpha: float = 0.01, delta: float = 0.1, min_power: float = 0.9,
                   allow_underpowered: bool = False, max_nodes: int = 6, max_bins: int = 6,
                   method: str = "pearson", min_node_samples: int = 10, mode: str = "engines",
                   spec: str = "", plain: str = "", model: str = "", settings: dict | None = None,
                   log=print) -> TwoSampleReport:
    """Plan the power, sample both sides (seeded), test each (case, prompt), Holm over them.

    ``prompts``: token-id lists (engine drivers) or strings (endpoints). Each ``SamplingConfig``'s
    ``seed`` is the speculative side's base; the plain side's starts after it (disjoint streams).
    Raises :class:`Underpowered` before sampling when the planned power is below ``min_power``,
    unless ``allow_underpowered`` (then warns loudly and records it)."""
    validate_samplings(samplings)
    if not prompts:
        raise ValueError("need at least one prompt")
    power_plan = plan(samplings, len(prompts), alpha=alpha, delta=delta, max_nodes=max_nodes, max_bins=max_bins,
                      min_power=min_power)
    notes_global = []
    log(f"planned power: {power_plan.describe()}")
    if power_plan.underpowered:
        message = (f"UNDERPOWERED: {power_plan.describe()}. Raise --samples to >= {power_plan.n_needed}, or "
                   f"use fewer prompts or a larger --delta.")
        if not allow_underpowered:
            raise Underpowered(message)
        warnings.warn(message, stacklevel=2)
        log("!" * 100 + f"\n{message}\nA PASS of this run says little: it cannot detect the stated effect.\n"
            + "!" * 100)
        notes_global.append(message)
    t0 = time.perf_counter()

    def tasks(side_offset: int) -> list[GenerationTask]:
        return [GenerationTask([p if isinstance(p, str) else list(p) for p in prompts],
                               dataclasses.replace(s, seed=s.seed + side_offset * len(prompts) * s.n))
                for s in samplings]

    log("sampling the speculative side ...")
    spec_run = spec_driver(tasks(0))
    log("sampling the plain side ...")
    plain_run = plain_driver(tasks(1))
    raw = []  # (case index, prompt index, result, notes)
    for ci, (sampling, st, pt) in enumerate(zip(samplings, spec_run.tasks, plain_run.tasks)):
        for pi in range(len(prompts)):
            notes: list[str] = []
            a = _rectangular(st.outputs[pi], sampling.max_tokens, notes, "speculative")
            b = _rectangular(pt.outputs[pi], sampling.max_tokens, notes, "plain")
            m = min(a.shape[1], b.shape[1])
            a, b = a[:, :m], b[:, :m]
            if m == 0 or len(a) == 0 or len(b) == 0:
                notes.append("no sampled token to compare: rejected (no data is no evidence)")
                raw.append((ci, pi, None, notes))
                continue
            raw.append((ci, pi, two_sample_chain_test(a, b, method, max_nodes=max_nodes, max_bins=max_bins,
                                                      min_node_samples=min_node_samples), notes))
    pvalues = [0.0 if r is None else r.pvalue for _, _, r, _ in raw]
    adjusted = holm(pvalues)
    node_ps = [nd.pvalue for _, _, r, _ in raw if r is not None for nd in r.nodes if nd.testable]
    node_holm = iter(holm(node_ps)) if node_ps else iter(())
    cases = []
    for ci, sampling in enumerate(samplings):
        results = []
        for (cj, pi, r, notes), p_adj in zip(raw, adjusted):
            if cj != ci:
                continue
            if r is None:
                results.append(PromptResult(pi, float("nan"), 0, 0.0, 0.0, True, 0, 0, 0, 0, False, float("nan"),
                                            float("nan"), {}, tuple(notes)))
                continue
            worst, worst_holm = None, 1.0
            for nd in r.nodes:
                if nd.testable:
                    h = float(next(node_holm))
                    if worst is None or nd.pvalue < worst.pvalue:
                        worst, worst_holm = nd, h
            worst_node = {} if worst is None else {
                "position": worst.position, "prefix": list(worst.prefix), "n_spec": worst.n_a,
                "n_plain": worst.n_b, "pvalue": worst.pvalue, "pvalue_holm_all_nodes": worst_holm, "tv": worst.tv}
            second = max((nd for nd in r.nodes if nd.position == 1 and nd.testable), key=lambda nd: nd.n_a + nd.n_b,
                         default=None)
            level = alpha / power_plan.hypotheses
            pow_df = two_sample_power_for_tv(r.n_a, r.n_b, delta, r.df, level) if r.df else float("nan")
            pow2 = (float(chain_power(second.n_a * second.n_b / (second.n_a + second.n_b) * (2 * delta) ** 2,
                                      r.df, level)) if second is not None else float("nan"))
            if r.df == 0:
                notes.append("no node had two bins: nothing was compared (counts as a pass of nothing; see power)")
            results.append(PromptResult(pi, r.statistic, r.df, r.pvalue, float(p_adj), bool(p_adj < alpha), r.n_a,
                                        r.n_b, r.n_nodes, r.n_chi2_nodes, r.truncated, pow_df, pow2, worst_node,
                                        tuple(notes)))
        cases.append(TwoSampleCase(case_name(sampling), sampling.as_dict(), tuple(results),
                                   _acceptance(spec_run.tasks[ci].spec_decode_metrics),
                                   spec_run.tasks[ci].generate_s, plain_run.tasks[ci].generate_s))
    return TwoSampleReport(
        mode=mode, spec=spec, plain=plain, model=model, settings=settings or {},
        prompts=tuple(p if isinstance(p, str) else tuple(p) for p in prompts), alpha=alpha, delta=delta,
        method=method, max_nodes=max_nodes, max_bins=max_bins, seed=int(samplings[0].seed), plan=power_plan,
        cases=tuple(cases), spec_startup_s=spec_run.startup_s, plain_startup_s=plain_run.startup_s,
        wall_s=time.perf_counter() - t0, warnings=tuple(notes_global))


# ------------------------------------------------------------------------------------------------
# An OpenAI-compatible endpoint as a sampler
# ------------------------------------------------------------------------------------------------


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _post(url: str, body: dict, api_key: str | None, timeout_s: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as error:
        raise EndpointError(f"{url} answered {error.code}: {error.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as error:
        raise EndpointError(f"{url} unreachable: {error.reason}") from None


def _spec_counters(base: str) -> dict:
    """vLLM's speculative counters from /metrics ({} when the server exports none)."""
    from vllm_specplugin.server import metric_total, parse_prometheus

    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            samples = parse_prometheus(r.read().decode(), prefix="vllm:spec_decode")
    except (urllib.error.URLError, OSError):
        return {}
    return {short: metric_total(samples, short + "_total") for short in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}


def endpoint_driver(url: str, model: str, *, api_key: str | None = None, max_n_per_request: int = 100,
                    timeout_s: float = 600) -> Driver:
    """``driver(tasks) -> EngineRun`` sampling from a running OpenAI-compatible vLLM server
    (``/v1/completions`` with ``n``, a per-request ``seed``, ``ignore_eos`` and ``return_token_ids``)."""
    base = _base(url)
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL must start with http:// or https://, got {url!r}")

    def driver(tasks: list[GenerationTask]) -> EngineRun:
        results = []
        for task in tasks:
            sp = task.sampling
            before, t1, outputs = _spec_counters(base), time.perf_counter(), []
            for prompt_index, prompt in enumerate(task.prompts):
                samples: list[list[int]] = []
                while len(samples) < sp.n:
                    n = min(max_n_per_request, sp.n - len(samples))
                    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": sp.max_tokens,
                            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k or -1,
                            "seed": request_seed(sp.seed, prompt_index, len(samples), sp.n),
                            "ignore_eos": True, "return_token_ids": True}
                    data = _post(base + "/v1/completions", body, api_key, timeout_s)
                    choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
                    if len(choices) != n or any(c.get("token_ids") is None for c in choices):
                        raise EndpointError(f"{base}: expected {n} choices with token_ids (vLLM's "
                                            f"return_token_ids), got {str(data)[:300]}")
                    samples += [list(c["token_ids"]) for c in choices]
                outputs.append(samples)
            after = _spec_counters(base)
            results.append(TaskResult(outputs=outputs, generate_s=time.perf_counter() - t1,
                                      spec_decode_metrics={k: after[k] - before.get(k, 0) for k in after}))
        return EngineRun(startup_s=0.0, tasks=results)

    driver.__name__ = f"endpoint {base}"
    return driver


# ------------------------------------------------------------------------------------------------
# Command line: specplugin-verify two-sample ...
# ------------------------------------------------------------------------------------------------


def build_parser():
    import argparse

    from vllm_specplugin.verification.engine_settings import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="specplugin-verify two-sample",
        description="Two-sample exactness check without a reference model: sample the same prompts from a "
                    "speculative and a plain sampler (two running OpenAI-compatible servers, or two engines "
                    "started here with your engine flags) and test them against each other (chain-rule "
                    "homogeneity chi-square, power planned before the run, Holm over prompts). Exits 1 on "
                    "FAIL, 2 on a usage error or when the planned run is underpowered.",
    )
    parser.add_argument("--model", required=True,
                        help="endpoints: the served model name; engines: the target checkpoint")
    parser.add_argument("--spec-url", help="base URL of the speculative server, e.g. http://host:8000")
    parser.add_argument("--plain-url", help="base URL of the plain (no speculation) server")
    parser.add_argument("--plain-model", help="endpoints: the plain server's model name (default --model)")
    parser.add_argument("--api-key", default=None, help="endpoints: bearer token, if the servers need one")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="engines: JSON, as for vllm serve (the plain engine gets none)")
    parser.add_argument("--additional-config", type=json.loads, default=None,
                        help="engines: JSON for the speculative engine, e.g. '{\"specplugin\": {\"drafts\": [...]}}'")
    parser.add_argument("--driver", choices=["offline", "http"], default="offline",
                        help="engines: offline (LLM.generate in a fresh process) or http (vLLM's server on 127.0.0.1)")
    add_engine_arguments(parser, default_dtype="auto")
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="one case per value (> 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--samples", type=int, default=3000, help="continuations per prompt and side (N)")
    parser.add_argument("--tokens", type=int, default=3, help="tokens per continuation (m >= 2: token 1 is the "
                                                               "prefill's in both samplers)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", default=None, help="a text prompt (repeatable)")
    prompt.add_argument("--prompt-ids", type=json.loads, default=None, help="JSON list of token-id lists")
    parser.add_argument("--alpha", type=float, default=0.01, help="family-wise level (Holm)")
    parser.add_argument("--delta", type=float, default=0.1, help="effect size: binned TV for the planned power")
    parser.add_argument("--min-power", type=float, default=0.9, help="refuse to run below this planned power")
    parser.add_argument("--allow-underpowered", action="store_true",
                        help="run anyway below --min-power (loud warning, kept in the report)")
    parser.add_argument("--max-nodes", type=int, default=6, help="chi-square nodes per prompt (bounds the df)")
    parser.add_argument("--max-bins", type=int, default=6, help="bins per node (bounds the df)")
    parser.add_argument("--method", choices=["pearson", "g"], default="pearson")
    parser.add_argument("--seed", type=int, default=0, help="base of the per-request seeds")
    parser.add_argument("--json", dest="json_path", help="write the report as JSON here")
    parser.add_argument("--markdown", dest="markdown_path", help="write the report as Markdown here")
    return parser


def parse_args(argv: list[str]):
    """Parse and validate; exits 2 with a clear message on a bad combination."""
    parser = build_parser()
    args = parser.parse_args(argv)
    urls = [args.spec_url, args.plain_url]
    if any(urls) and not all(urls):
        parser.error("give both --spec-url and --plain-url (or neither, to start two engines)")
    endpoints = all(urls)
    if endpoints and (args.speculative_config is not None or args.additional_config is not None):
        parser.error("--speculative-config / --additional-config configure engines started here; with "
                     "--spec-url/--plain-url the servers are already configured")
    if not endpoints and not args.speculative_config:
        parser.error("engines: --speculative-config is required (the speculative engine's config; the plain "
                     "engine gets none)")
    if not endpoints and (args.plain_model or args.api_key):
        parser.error("--plain-model and --api-key are for --spec-url/--plain-url")
    if any(t <= 0 for t in args.temperature):
        parser.error("--temperature must be > 0 in two-sample mode (T = 0 is deterministic: nothing to sample)")
    if args.samples < 1 or args.tokens < 1:
        parser.error("--samples and --tokens must be >= 1")
    if args.top_k < 0 or not 0.0 < args.top_p <= 1.0:
        parser.error("--top-k must be >= 0 and --top-p in (0, 1]")
    if not 0.0 < args.alpha < 1.0 or not 0.0 < args.delta <= 1.0 or not 0.0 <= args.min_power < 1.0:
        parser.error("--alpha must be in (0, 1), --delta in (0, 1], --min-power in [0, 1)")
    if args.max_nodes < 1 or args.max_bins < 2:
        parser.error("--max-nodes must be >= 1 and --max-bins >= 2")
    if args.prompt_ids is not None and (not isinstance(args.prompt_ids, list) or not args.prompt_ids or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in args.prompt_ids)):
        parser.error("--prompt-ids must be a non-empty JSON list of non-empty lists of token ids")
    return args


def main(argv: list[str]) -> None:
    from vllm_specplugin.verification.engine_settings import engine_driver, settings_from_args

    args = parse_args(argv)
    endpoints = bool(args.spec_url)
    settings = settings_from_args(args)
    samplings = [SamplingConfig(temperature=t, top_k=args.top_k, top_p=args.top_p, max_tokens=args.tokens,
                                n=args.samples, seed=args.seed) for t in args.temperature]
    if args.prompt_ids is not None:
        prompts = args.prompt_ids
    elif endpoints:
        prompts = args.prompt or list(DEFAULT_PROMPTS)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        prompts = [tokenizer(p)["input_ids"] for p in (args.prompt or DEFAULT_PROMPTS)]
    if endpoints:
        spec = endpoint_driver(args.spec_url, args.model, api_key=args.api_key)
        plain = endpoint_driver(args.plain_url, args.plain_model or args.model, api_key=args.api_key)
        labels = dict(mode="endpoints", spec=args.spec_url, plain=args.plain_url, settings={})
    else:
        spec = engine_driver(args.model, settings, speculative_config=args.speculative_config,
                             additional_config=args.additional_config, driver=args.driver)
        plain = engine_driver(args.model, settings, driver=args.driver)
        labels = dict(mode=f"engines ({args.driver})", settings=dataclasses.asdict(settings),
                      spec=f"speculative_config {json.dumps(args.speculative_config)}, additional_config "
                           f"{json.dumps(args.additional_config or {})}",
                      plain="no speculative config")
    try:
        report = run_two_sample(spec, plain, samplings, prompts, alpha=args.alpha, delta=args.delta,
                                min_power=args.min_power, allow_underpowered=args.allow_underpowered,
                                max_nodes=args.max_nodes, max_bins=args.max_bins, method=args.method,
                                model=args.model, **labels)
    except Underpowered as error:
        print(f"specplugin-verify two-sample: refused: {error}", file=sys.stderr)
        sys.exit(2)
    print(report.format_table())
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(report.to_json())
        print(f"report written to {args.json_path}")
    if args.markdown_path:
        with open(args.markdown_path, "w") as f:
            f.write(report.to_markdown())
        print(f"report written to {args.markdown_path}")
    sys.exit(0 if report.passed else 1)

