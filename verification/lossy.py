"""What a lossy acceptance setting costs: ``python -m vllm_specplugin.verification lossy-sweep``.

One engine serves every setting of the sweep side by side, each as its own request class
(``SamplingParams.extra_args``, as ``vllm_xargs`` over HTTP), so the classes share the engine, the
draft and the machine's load. Per setting it reports, from the same run:

- **the chain-rule test's verdict** (``verification.check.analyse``, Holm over the sweep at
  ``alpha``): the exact class must PASS; a lossy class is reported ``LOSSY``, as "flagged" when the
  test rejects it and "not flagged at this N" otherwise, never as passing;
- **per-node TV to the target**: at every prefix node of depth >= 1 with >= ``min_node_samples``
  samples, the TV between the node's next-token counts and the exact processed target over the
  target's probability bins (``stats.probability_bins``), averaged over nodes weighted by their
  samples; debiased and with a 95% interval from a parametric bootstrap of every node's counts (basic
  bootstrap: the plug-in TV is biased upward, see ``stats.tv``; the interval is 2 TV - quantiles,
  which removes that bias to first order; the exact class shows what is left of it). Beside it the
  TV the rule *predicts* at the same nodes (``lossy_acceptance.token_law`` with the draft's q,
  binned the same way, and over tokens), when the draft checkpoint is known;
- **the target's mean log-likelihood per generated token** (the unprocessed target, T = 1,
  teacher-forced in float32) on held-out prompts, and its gap to the exact class's (which samples
  the target's own distribution: plain sampling's, verified by the chain test in the same run), with
  a 95% Welch interval over sequences;
- **speed**: accepted draft tokens per draft and tokens per verification step (vLLM's counters,
  per class), and tokens/s of the log-likelihood task relative to the exact class (one round; the
  machine's load is printed beside it).

Every non-root node of an m-token sample is a drafted position when m <= k + 1 (the first token
comes from the prefill, the bonus position is k + 1 tokens later), so its law is exactly the rule's
``token_law``; keep ``--tokens`` <= k + 1 for the predicted column to apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from vllm_specplugin import stats
from vllm_specplugin.lossy_acceptance import REQUEST_KEYS, Acceptance, token_law
from vllm_specplugin.verification.check import analyse, decide
from vllm_specplugin.paths import demo_model, require_demo_models
from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline
from vllm_specplugin.verification.reference import ProcessedConditionals, TargetReference

DEMO = demo_model("demo")
MIN_EXPECTED = 5.0
_FIELD_KEY = {field: key for key, field in REQUEST_KEYS.items()}


def extra_args(setting: Acceptance) -> dict:
    """The ``vllm_xargs`` / ``extra_args`` of a request in this class."""
    out = {_FIELD_KEY["mode"]: setting.mode}
    if setting.mode == "lenient":
        out[_FIELD_KEY["lenience"]] = setting.lenience
    elif setting.mode == "typical":
        out.update({_FIELD_KEY["epsilon"]: setting.epsilon, _FIELD_KEY["delta"]: setting.delta})
    return out


def default_settings() -> list[Acceptance]:
    """exact; lenient l = 0.8 ... 0.2; typical with Medusa's delta = sqrt(epsilon)."""
    return ([Acceptance()] + [Acceptance("lenient", lenience=l) for l in (0.8, 0.6, 0.4, 0.2)]
            + [Acceptance("typical", epsilon=e, delta=round(math.sqrt(e), 4)) for e in (0.01, 0.03, 0.09, 0.25)])


def parse_setting(text: str) -> Acceptance:
    """``exact`` | ``lenient:L`` | ``typical:EPS`` (delta = sqrt(eps)) | ``typical:EPS:DELTA``."""
    mode, *values = text.split(":")
    try:
        numbers = [float(v) for v in values]
        if mode == "exact" and not numbers:
            return Acceptance()
        if mode == "lenient" and len(numbers) == 1:
            return Acceptance("lenient", lenience=numbers[0])
        if mode == "typical" and len(numbers) in (1, 2):
            return Acceptance("typical", epsilon=numbers[0],
                              delta=numbers[1] if len(numbers) == 2 else round(math.sqrt(numbers[0]), 4))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    raise argparse.ArgumentTypeError(f"{text!r}: expected exact, lenient:L, typical:EPS or typical:EPS:DELTA")


@dataclasses.dataclass(frozen=True)
class LossySamplingConfig(SamplingConfig):
    extra_args: dict | None = None


# -- the measurements ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeTv:
    """n-weighted mean binned TV over the nodes, debiased, with a basic-bootstrap 95% interval."""

    tv: float
    low: float
    high: float
    plug_in: float
    nodes: int
    samples: int
    predicted_binned: float = float("nan")  # the rule's exact law at the same nodes, same bins
    predicted_tokens: float = float("nan")  # the same over tokens (what the user gets)


def node_tv(reference: TargetReference, prompts, outputs, sampling: SamplingConfig, *, min_node_samples: int = 100,
            setting: Acceptance | None = None, draft: TargetReference | None = None, n_boot: int = 1000,
            seed: int = 0) -> NodeTv:
    cells, weights, predicted_binned, predicted_tokens = [], [], [], []
    for prompt, samples in zip(prompts, outputs):
        samples = np.asarray(samples, dtype=np.int64)
        if samples.ndim != 2 or samples.shape[1] < 2:
            continue
        conditional = ProcessedConditionals(reference.prefix_logits(prompt, samples), sampling.temperature,
                                            sampling.top_k, sampling.top_p)
        draft_logits = draft.prefix_logits(prompt, samples) if draft is not None else None
        for depth in range(1, samples.shape[1]):
            prefixes, counts = np.unique(samples[:, : depth + 1], axis=0, return_counts=True)
            by_node: dict[tuple, np.ndarray] = {}
            for row, count in zip(prefixes, counts):
                node = tuple(row[:depth].tolist())
                by_node.setdefault(node, np.zeros(reference.vocab_size))[row[depth]] += count
            for node, token_counts in by_node.items():
                n = int(token_counts.sum())
                if n < min_node_samples:
                    continue
                p = conditional(node)
                binning = stats.probability_bins(p, n, MIN_EXPECTED)
                binned, impossible = binning.bin_counts(token_counts.astype(np.int64))
                cells.append((np.append(binned, impossible).astype(np.float64), np.append(binning.bin_probs, 0.0)))
                weights.append(n)
                if draft_logits is not None and setting is not None:
                    from vllm_specplugin.verification.algorithm import process_logits

                    q = process_logits(draft_logits[node].astype(np.float64), sampling.temperature, sampling.top_k,
                                       sampling.top_p)
                    law = token_law(torch.tensor(p), torch.tensor(q), setting).numpy()
                    possible = binning.bin_of >= 0
                    law_bins = np.bincount(binning.bin_of[possible], weights=law[possible], minlength=binning.n_bins)
                    predicted_binned.append(0.5 * (np.abs(law_bins - binning.bin_probs).sum() + law[~possible].sum()))
                    predicted_tokens.append(stats.tv_distance(law, p))
    if not cells:
        nan = float("nan")
        return NodeTv(nan, nan, nan, nan, 0, 0)
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    rng = np.random.default_rng(seed)
    plug_in = sum(wi * 0.5 * np.abs(obs / obs.sum() - ref).sum() for wi, (obs, ref) in zip(w, cells))
    boot = np.zeros(n_boot)
    for wi, (obs, ref) in zip(w, cells):
        n = int(obs.sum())
        boot += wi * 0.5 * np.abs(rng.multinomial(n, obs / n, size=n_boot) / n - ref).sum(axis=1)
    low_q, high_q = np.quantile(boot, [0.025, 0.975])
    mean = lambda values: float(np.dot(w, values)) if values else float("nan")  # noqa: E731
    return NodeTv(tv=max(0.0, 2 * plug_in - float(boot.mean())), low=max(0.0, 2 * plug_in - high_q),
                  high=max(0.0, 2 * plug_in - low_q), plug_in=float(plug_in), nodes=len(cells), samples=sum(weights),
                  predicted_binned=mean(predicted_binned), predicted_tokens=mean(predicted_tokens))


class _CachedReference:
    """A TargetReference whose prefix_logits are computed once per (prompt, samples): the chain test
    and the TV both need them."""

    def __init__(self, reference: TargetReference):
        self.reference = reference
        self._cache: dict = {}

    def __getattr__(self, name):
        return getattr(self.reference, name)

    def prefix_logits(self, prompt, samples):
        samples = np.asarray(samples, dtype=np.int64)
        key = (tuple(prompt), samples.shape, samples.tobytes())
        if key not in self._cache:
            # Only the distinct prefixes of depth < m are needed (not every distinct m-token sample):
            # one forward per distinct (m-1)-token prefix, its last column a placeholder.
            distinct = np.unique(samples[:, :-1], axis=0)
            padded = np.concatenate([distinct, np.zeros((len(distinct), 1), dtype=np.int64)], axis=1)
            self._cache[key] = self.reference.prefix_logits(prompt, padded)
        return self._cache[key]


def sequence_logliks(reference: TargetReference, prompts, outputs) -> np.ndarray:
    """Per generated sequence, the target's mean log-probability (T = 1, unprocessed) of its tokens."""
    out = []
    model = reference.model
    for prompt, samples in zip(prompts, outputs):
        samples = [s for s in samples if s]
        if not samples:
            continue
        by_length: dict[int, list[list[int]]] = {}
        for s in samples:
            by_length.setdefault(len(s), []).append(s)
        for length, group in by_length.items():
            inputs = torch.tensor([list(prompt) + s for s in group], dtype=torch.long)
            with torch.no_grad():
                logits = model(input_ids=inputs).logits[:, len(prompt) - 1: -1, :].double()
            logp = logits.log_softmax(-1).gather(-1, inputs[:, len(prompt):, None]).squeeze(-1)
            out += logp.mean(-1).tolist()
    return np.asarray(out)


def welch_interval(a: np.ndarray, b: np.ndarray, z: float = 1.959964) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its normal-approximation 95% interval (Welch's standard error)."""
    gap = float(a.mean() - b.mean())
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return gap, gap - z * se, gap + z * se


# -- the sweep --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepRow:
    setting: str
    mode: str
    parameter: float  # lenience, or typical's epsilon; 1.0 for exact
    lossy: bool
    verdict: str
    chain_pvalue: float
    chain_pvalue_holm: float
    chain_df: int
    power_at_delta: float
    tv: NodeTv
    loglik: float
    loglik_gap: float
    loglik_gap_low: float
    loglik_gap_high: float
    sequences: int
    acceptance: float  # accepted / drafted tokens
    tokens_per_step: float  # 1 + accepted / drafts (tokens per verification step)
    tokens_per_s: float
    speed_ratio: float  # tokens/s over the exact class's, same engine, one round


@dataclasses.dataclass(frozen=True)
class SweepReport:
    model: str
    speculative_config: dict
    additional_config: dict
    sampling: dict
    stat_prompts: int
    samples: int
    tokens: int
    loglik_prompts: int
    loglik_samples: int
    loglik_tokens: int
    alpha: float
    delta: float
    load: str
    rows: tuple[SweepRow, ...]
    startup_s: float
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=float)

    def format_table(self) -> str:
        head = (f"{'setting':30s} {'verdict':34s} {'TV (95% CI)':>22s} {'pred':>6s} {'pred tok':>8s} {'nodes':>5s} "
                f"{'loglik gap (95% CI)':>27s} {'accept':>6s} {'tok/step':>8s} {'speed':>6s}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r.setting:30s} {r.verdict:34s} {r.tv.tv:6.4f} [{r.tv.low:6.4f},{r.tv.high:6.4f}] "
                f"{r.tv.predicted_binned:6.4f} {r.tv.predicted_tokens:8.4f} {r.tv.nodes:5d} "
                f"{r.loglik_gap:+8.4f} [{r.loglik_gap_low:+8.4f},{r.loglik_gap_high:+8.4f}] {r.acceptance:6.3f} "
                f"{r.tokens_per_step:8.3f} {r.speed_ratio:5.2f}x")
        s = self.sampling
        lines += [
            "",
            f"model {self.model}; speculative config {json.dumps(self.speculative_config)}; plugin config "
            f"{json.dumps(self.additional_config)}",
            f"sampling T={s['temperature']:g} top_k={s['top_k'] or 'off'} top_p={s['top_p']:g}; chain test and TV: "
            f"{self.stat_prompts} held-out prompts x N={self.samples} x {self.tokens} tokens per class; log-likelihood: "
            f"{self.loglik_prompts} other held-out prompts x {self.loglik_samples} x {self.loglik_tokens} tokens",
            f"verdict: chain-rule chi-square, Holm over the {len(self.rows)} classes at alpha {self.alpha:g}; a lossy "
            "class is never reported as passing ('not flagged' = the test lacked the power to see it at this N)",
            "TV: binned (target's probability bins), mean over nodes of depth >= 1 weighted by samples, debiased, "
            "basic-bootstrap 95% CI; pred: the rule's exact law at the same nodes (binned / over tokens)",
            "loglik gap: target's mean log-probability per generated token (T=1) minus the exact class's, "
            "95% Welch CI over sequences; accept: accepted/drafted; tok/step: 1 + accepted/drafts",
            f"speed: tokens/s of the log-likelihood task over the exact class's (same engine, one round); load: {self.load}",
            f"engine start-up {self.startup_s:.1f} s, wall {self.wall_s:.1f} s",
        ]
        return "\n".join(lines)


def _verdict(setting: Acceptance, case) -> str:
    if not setting.lossy:
        return "FAIL (exact class rejected)" if case.rejected else "PASS"
    if case.rejected:
        return f"LOSSY: flagged (p_Holm={case.pvalue_holm:.1e})"
    return f"LOSSY: not flagged at this N (p={case.pvalue:.2g})"


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"
    except OSError:
        return "unknown"


def sweep(model: str, settings: Sequence[Acceptance], *, speculative_config: dict, additional_config: dict | None,
          stat_prompts: Sequence[Sequence[int]], loglik_prompts: Sequence[Sequence[int]], temperature: float = 1.0,
          top_k: int = 0, top_p: float = 1.0, samples: int = 2000, tokens: int = 3, loglik_samples: int = 4,
          loglik_tokens: int = 32, alpha: float = 0.01, delta: float = 0.1, draft: str | None = None,
          min_node_samples: int = 100, seed: int = 0, max_model_len: int = 512, progress: bool = True) -> SweepReport:
    settings = list(settings)
    if not any(not s.lossy for s in settings):
        raise ValueError("the sweep needs an exact class (the reference for the log-likelihood gap and speed)")
    t0 = time.perf_counter()
    tasks = []
    for setting in settings:
        args = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, extra_args=extra_args(setting))
        tasks.append(GenerationTask([list(p) for p in stat_prompts],
                                    LossySamplingConfig(max_tokens=tokens, n=samples, **args)))
        tasks.append(GenerationTask([list(p) for p in loglik_prompts],
                                    LossySamplingConfig(max_tokens=loglik_tokens, n=loglik_samples, **args)))
    with tqdm(total=2 * len(settings) + 1, desc="lossy sweep", disable=not progress) as bar:
        bar.set_postfix_str(f"sampling {len(settings)} classes in one engine")
        # engine_job gives each request its task's extra_args (the specplugin_* keys of vllm_xargs).
        run = run_offline(model, tasks, speculative_config=speculative_config, additional_config=additional_config,
                          max_model_len=max_model_len, timeout_s=3600)
        load = _load()
        bar.update(1)
        reference = _CachedReference(TargetReference(model))
        draft_reference = _CachedReference(TargetReference(draft)) if draft else None
        cases, measured = [], []
        for index, setting in enumerate(settings):
            bar.set_postfix_str(setting.label)
            for cached in (reference, draft_reference):
                if cached is not None:
                    cached._cache.clear()  # one class's samples at a time
            stat, ll = run.tasks[2 * index], run.tasks[2 * index + 1]
            sampling = tasks[2 * index].sampling
            counters = stat.spec_decode_metrics
            cases.append(analyse(reference, stat_prompts, stat.outputs, sampling, alpha=alpha / len(settings),
                                 delta=delta, method="pearson", acceptance_rate=None, generate_s=stat.generate_s))
            bar.update(1)
            tv = node_tv(reference, stat_prompts, stat.outputs, sampling, min_node_samples=min_node_samples,
                         setting=setting, draft=draft_reference, seed=seed + index)
            drafts = sum(m.get("vllm:spec_decode_num_drafts", 0) for m in (counters, ll.spec_decode_metrics))
            drafted = sum(m.get("vllm:spec_decode_num_draft_tokens", 0) for m in (counters, ll.spec_decode_metrics))
            accepted = sum(m.get("vllm:spec_decode_num_accepted_tokens", 0) for m in (counters, ll.spec_decode_metrics))
            generated = sum(len(s) for per_prompt in ll.outputs for s in per_prompt)
            measured.append(dict(tv=tv, logliks=sequence_logliks(reference, loglik_prompts, ll.outputs),
                                 acceptance=accepted / drafted if drafted else float("nan"),
                                 tokens_per_step=1 + accepted / drafts if drafts else float("nan"),
                                 tokens_per_s=generated / ll.generate_s))
            bar.update(1)
    cases = decide(cases, alpha)
    base = next(m for s, m in zip(settings, measured) if not s.lossy)
    rows = []
    for setting, case, m in zip(settings, cases, measured):
        gap, low, high = welch_interval(m["logliks"], base["logliks"])
        rows.append(SweepRow(
            setting=setting.label, mode=setting.mode,
            parameter=setting.lenience if setting.mode == "lenient" else setting.epsilon if setting.mode == "typical" else 1.0,
            lossy=setting.lossy, verdict=_verdict(setting, case), chain_pvalue=case.pvalue,
            chain_pvalue_holm=case.pvalue_holm, chain_df=case.df, power_at_delta=case.power_at_delta, tv=m["tv"],
            loglik=float(m["logliks"].mean()), loglik_gap=gap, loglik_gap_low=low, loglik_gap_high=high,
            sequences=len(m["logliks"]), acceptance=m["acceptance"], tokens_per_step=m["tokens_per_step"],
            tokens_per_s=m["tokens_per_s"], speed_ratio=m["tokens_per_s"] / base["tokens_per_s"]))
    return SweepReport(
        model=model, speculative_config=speculative_config, additional_config=additional_config or {},
        sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p), stat_prompts=len(stat_prompts),
        samples=samples, tokens=tokens, loglik_prompts=len(loglik_prompts), loglik_samples=loglik_samples,
        loglik_tokens=loglik_tokens, alpha=alpha, delta=delta, load=load, rows=tuple(rows),
        startup_s=run.startup_s, wall_s=time.perf_counter() - t0)


# -- CLI ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.verification lossy-sweep",
        description="Sweep the opt-in lossy acceptance modes: per setting the chain-rule verdict, per-node TV to "
                    "the target (with a 95%% CI), the target's log-likelihood of the generated text against the "
                    "exact class's, and the speedup, all from one engine run; prints a table and plots the "
                    "trade-off (PNG).",
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(DEMO, "target"), help="target checkpoint (default: demo target)")
    parser.add_argument("--draft", default=os.path.join(DEMO, "draft-distill"),
                        help="draft checkpoint, served by the plugin's MultiDraftProposer unless --speculative-config "
                             "is given; also used for the predicted TV column ('' to skip)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON; default: MultiDraftProposer with --draft, num_speculative_tokens --k")
    parser.add_argument("--additional-config", type=json.loads, default=None, help="JSON; default: the --draft")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the default speculative config")
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=None,
                        help="exact | lenient:L | typical:EPS (delta = sqrt(EPS)) | typical:EPS:DELTA; default: "
                             "exact, lenient 0.8/0.6/0.4/0.2, typical 0.01/0.03/0.09/0.25")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--stat-prompts", type=int, default=4, help="held-out prompts for the chain test and TV")
    parser.add_argument("--samples", type=int, default=2000, help="continuations per stat prompt and class (N)")
    parser.add_argument("--tokens", type=int, default=3, help="tokens per stat continuation (<= k + 1)")
    parser.add_argument("--loglik-prompts", type=int, default=40, help="other held-out prompts for the log-likelihood")
    parser.add_argument("--loglik-samples", type=int, default=4)
    parser.add_argument("--loglik-tokens", type=int, default=32)
    parser.add_argument("--min-node-samples", type=int, default=100, help="nodes in the TV average need this many")
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--plot", dest="plot_path", help="write the trade-off PNG here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    require_demo_models(args.model, args.draft)
    from transformers import AutoTokenizer

    from vllm_specplugin.throughput.workloads import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = heldout_prompts(args.stat_prompts + args.loglik_prompts)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    spec = args.speculative_config or {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                                       "num_speculative_tokens": args.k}
    additional = args.additional_config
    if additional is None:
        additional = {"specplugin": {"drafts": [args.draft]}} if spec.get("method") == "custom_class" else {}
    if args.tokens > spec.get("num_speculative_tokens", args.k) + 1:
        print("note: --tokens > k + 1: some nodes are bonus positions; the predicted TV column does not apply")
    report = sweep(args.model, args.settings or default_settings(), speculative_config=spec,
                   additional_config=additional, stat_prompts=ids[: args.stat_prompts],
                   loglik_prompts=ids[args.stat_prompts:], temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, samples=args.samples, tokens=args.tokens, loglik_samples=args.loglik_samples,
                   loglik_tokens=args.loglik_tokens, alpha=args.alpha, draft=args.draft or None,
                   min_node_samples=args.min_node_samples, seed=args.seed)
    from vllm_specplugin.verification.cli import publish
    from vllm_specplugin.verification.plots import plot_lossy_sweep

    publish(report, args.json_path, args.plot_path, lambda path: plot_lossy_sweep(report, path))
    exact_ok = all(not r.verdict.startswith("FAIL") for r in report.rows)
    sys.exit(0 if exact_ok else 1)


if __name__ == "__main__":
    main()
