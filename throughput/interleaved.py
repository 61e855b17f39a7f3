"""Interleaved A/B of served configurations: every server up at once, rounds taken in turn.

``python -m vllm_specplugin.throughput.interleaved --preset routing``

The benchmarks in ``tests/benchmarks`` serve one configuration after another and keep each one's
fastest round. On this shared 2-core machine the speed drifts by 10-20 % over minutes, so two
configurations served ten minutes apart differ by that much with nothing changed (the same
configuration read 1.37x and 1.59x plain in two runs of 7 Dec). Here all the preset's servers run
side by side and round r sends the same workload to each in turn, the order rotated every round. A
server waits out the others' turns stopped (SIGSTOP to its process group, SIGCONT before its own): an
idle vLLM server still polls (its worker about 5 % of a core here), and five of them slowed every
configuration by about a quarter. Each configuration's speed in a round is divided by the reference's
(plain decoding, and ``--reference``) in the same round. The median of those paired ratios over the
rounds, with their range, is the figure: a drift slower than a round moves both sides of a ratio.

Output: a Markdown table and a JSON file under ``runs/bench/`` (``interleaved-<preset>-<time>``), with
per configuration the median paired ratio against plain and against the reference, their range,
the best round's tokens/s, and α, τ (tokens per verification step), c and r from its counters
summed over every round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import time
from dataclasses import dataclass, field

from vllm_specplugin.throughput.bench import (MODELS, PLAIN_ASYNC_OFF, PLUGIN_PROPOSER, ServedConfig, WorkloadResult,
                                              WorkloadRun, builtin_draft_model_config, choice_floor_config,
                                              combine_phases, dynamic_tree_config, plugin_config, run_workload)
from vllm_specplugin.throughput.workloads import heldout_prompts, mixed_requests

MIX = os.path.join(MODELS, "demo-mix")
MB = os.path.join(MODELS, "demo-mb")
EAGLE_LONG = os.path.join(MB, "eagle-long")
MB_DRAFT, TINY_DRAFT = "demo-mb/draft", "demo/draft-distill"
RESUME_SETTLE_S = 1.0  # after SIGCONT, before the round: the server's loops pick up again
CODE, PROSE = "demo-mix/draft-code", "demo-mix/draft-prose"


@dataclass(frozen=True)
class Preset:
    """Servers to compare on one workload: ``configs`` (plain first), the ``workload`` (see
    :func:`workload_prompts`) and the default reference."""

    target: str
    workload: str
    configs: tuple[ServedConfig, ...]
    reference: str
    about: str
    # (configuration, its own reference) pairs compared instead of with ``reference`` (e.g. a tree
    # with the chain of as many drafts)
    pairs: tuple[tuple[str, str], ...] = ()

    def reference_of(self, name: str, default: str) -> str:
        return dict(self.pairs).get(name, default)


WORKLOADS = ("mixed-T0", "mixed-T1", "heldout-T0", "heldout-T1")


def workload_prompts(workload: str, count: int) -> tuple[list[str], list[float]]:
    """(prompt texts, one temperature each): ``mixed-T0`` / ``mixed-T1``: the mixed stream of
    :func:`~vllm_specplugin.throughput.workloads.mixed_requests` at setting 0 (T = 0, creative 1.0) or
    1 (T = 1, creative 1.3); ``heldout-T0`` / ``heldout-T1``: the held-out code prompts at T = 0 / 1
    (at most 48)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {WORKLOADS}")
    kind, temperature = workload.split("-T")
    if kind == "mixed":
        requests = mixed_requests(count, setting=int(temperature))
        return [p.text for p in requests], [p.temperature for p in requests]
    return heldout_prompts(count), [float(temperature)] * count


def _eagle(name: str, k: int, options: dict | None) -> ServedConfig:
    """vLLM's own ``eagle`` (``options`` None) or the plugin's EAGLE head drafter over models/demo-mb/eagle-long."""
    if options is None:
        return ServedConfig(name, {"method": "eagle", "model": EAGLE_LONG, "num_speculative_tokens": k})
    return ServedConfig(name, {"method": "custom_class", "model": PLUGIN_PROPOSER, "num_speculative_tokens": k},
                        {"specplugin": {"eagle_head": EAGLE_LONG, **options}})


def _load_preset(workload: str) -> Preset:
    """Issue 31's load goal (≥ 0.97x plain at concurrency 48) on the mixed workload: the drafter
    choice (suffix or draft-prose at γ 4, k 6), its floor (the same server priced out of drafting:
    the speculative path alone) and plain decoding both with vLLM's default async scheduling and
    without it, as vLLM 0.32 serves every custom_class proposer."""
    return Preset(
        os.path.join(MIX, "target"), workload,
        (ServedConfig("plain"),
         PLAIN_ASYNC_OFF,
         choice_floor_config(PROSE, 6),
         plugin_config("choice: suffix + draft-prose γ 4, k 6", [PROSE], 6, suffix_drafting={"model_gamma": 4}),
         plugin_config("plugin draft-code γ 6, bfloat16", [CODE], 6, draft_dtype="bfloat16")),
        "plain",
        f"issue 31's load goal on the mixed workload ({workload}; run with --concurrency 48 --requests 96): the "
        "drafter choice, its floor (priced out of drafting), plain with and without async scheduling, and "
        "draft-code's bfloat16 chain",
    )


def _tree_preset(workload: str, label: str) -> Preset:
    """Issue 31's tree cells at one temperature: each dynamic tree against the chain of as many drafts."""
    return Preset(
        os.path.join(MB, "target"), workload,
        (ServedConfig("plain"),
         *[config for n in (8, 16) for config in (plugin_config(f"chain {n}", [MB_DRAFT], n), dynamic_tree_config(f"tree {n}", [MB_DRAFT], n))],
         *[config for n in (8, 16) for config in (plugin_config(f"chain {n}, tiny draft", [TINY_DRAFT], n),
                                                  dynamic_tree_config(f"tree {n}, tiny draft", [TINY_DRAFT], n))]),
        "chain 8",
        "issue 31's tree goals: dynamic trees of 8 and 16 nodes verified whole against chains of as many drafts "
        "(the memory-bound pair; and the tiny draft demo/draft-distill, where drafts are uncertain), held-out "
        f"code prompts at {label}, batch 1 (--concurrency 16: the batch-16 cells; at most 7 servers fit 24 GiB: "
        "run it in halves with --only)",
        pairs=(("tree 16", "chain 16"), ("tree 8, tiny draft", "chain 8, tiny draft"),
               ("tree 16, tiny draft", "chain 16, tiny draft")),
    )


PRESETS = {
    "routing": Preset(
        os.path.join(MIX, "target"), "mixed-T1",
        (ServedConfig("plain"),
         builtin_draft_model_config(CODE, 6),
         plugin_config("plugin draft-code γ 6", [CODE], 6),
         plugin_config("plugin draft-code γ 6, bfloat16", [CODE], 6, draft_dtype="bfloat16"),
         plugin_config("plugin draft-code | draft-prose routed by prompt γ 6", [CODE, PROSE], 6, draft_routing="prompt"),
         plugin_config("plugin draft-code | draft-prose routed by prompt γ 6, bfloat16", [CODE, PROSE], 6,
                       draft_routing="prompt", draft_dtype="bfloat16")),
        "plugin draft-code γ 6",
        "issue 31's mixed workload at T = 1 (creative 1.3), batch 1: the best single drafter of the baseline "
        "(draft-code's chain of 6), vLLM's draft_model with it, and the code / prose drafts routed by prompt",
    ),
    "routing-T0": Preset(
        os.path.join(MIX, "target"), "mixed-T0",
        (ServedConfig("plain"),
         plugin_config("plugin draft-prose γ 4", [PROSE], 4),
         plugin_config("plugin draft-code | draft-prose routed by prompt γ 4", [CODE, PROSE], 4, draft_routing="prompt")),
        "plugin draft-prose γ 4",
        "the mixed workload at T = 0 (creative 1.0), batch 1: the best model-draft chain of the baseline "
        "(draft-prose γ 4) against the code / prose drafts routed by prompt",
    ),
    "eagle-tree": Preset(
        os.path.join(MB, "target"), "heldout-T0",
        (ServedConfig("plain"),
         _eagle("vllm eagle[eagle-long] k=8", 8, None),
         _eagle("plugin eagle[eagle-long] k=8 bfloat16", 8, {"draft_dtype": "bfloat16"}),
         _eagle("plugin eagle[eagle-long] dynamic tree 8 bfloat16", 8,
                {"draft_dtype": "bfloat16", "tree_drafting": {"node_budget": 8, "verify": "tree", "shape": "dynamic"}})),
        "vllm eagle[eagle-long] k=8",
        "issue 33's tree goal: the memory-bound target's long EAGLE-1 head (models/demo-mb/eagle-long) served "
        "by vLLM's eagle (k = 8) and by the plugin (a sampled chain of 8, a dynamic tree of 8 verified whole, "
        "bfloat16), held-out code prompts at T = 0, batch 1",
    ),
    "load-T0": _load_preset("mixed-T0"),
    "load-T1": _load_preset("mixed-T1"),
    "tree": _tree_preset("heldout-T1", "T = 1"),
    "tree-T0": _tree_preset("heldout-T0", "T = 0"),
}


def pause(server, paused: bool) -> None:
    """Stop (``paused``) or continue every process of ``server``'s group (its API server, engine core
    and worker): a stopped server takes no CPU while another one runs its round. If this process is
    killed while a server is stopped, the server's parent-death SIGINT waits until it is continued:
    ``pkill -CONT -f "vllm_specplugin.cli serve"`` ends it."""
    if server.process is None or server.process.poll() is not None:
        return  # never started, or gone
    os.killpg(os.getpgid(server.process.pid), signal.SIGSTOP if paused else signal.SIGCONT)


# Each CPU server stays resident while the others run (about 1.9 GiB for its worker and 0.6 GiB for
# its API server on the demo targets, 7 Dec): a ninth server on a 24 GiB machine left 0.4 GiB.
SERVER_MEMORY_GIB = 2.6


def available_memory_gib() -> float | None:
    """MemAvailable of /proc/meminfo in GiB; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def check_memory_for_another_server(started: int, total: int) -> None:
    """Refuse, before it starts, a server that would leave the machine without memory (the kernel
    would kill a running one mid-round), saying how to serve fewer at once."""
    available = available_memory_gib()
    if available is not None and available < SERVER_MEMORY_GIB:
        raise SystemExit(f"{available:.1f} GiB of memory available after {started} of {total} servers, a server needs "
                         f"about {SERVER_MEMORY_GIB} GiB: serve fewer at once with --only (e.g. one pair per run)")


def selected(preset: Preset, only: str, reference: str) -> list[ServedConfig]:
    """The configurations of ``preset`` that ``only`` (comma-separated) names: a configuration's
    exact name selects it alone ("tree 16", not also "tree 16, tiny draft"); anything else selects
    every name containing it. Plain, ``reference`` and each kept one's own reference always stay."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    names = {c.name for c in preset.configs}
    kept = {c.name for i, c in enumerate(preset.configs) if i == 0 or c.name == reference
            or any(w == c.name if w in names else w in c.name for w in wanted)}
    kept |= {preset.reference_of(name, reference) for name in kept}
    return [c for c in preset.configs if c.name in kept]


def with_server_seed(config: ServedConfig, seed: int) -> ServedConfig:
    """``config`` served with vLLM's ``--seed seed`` (any ``--seed`` it had replaced)."""
    args = list(config.server_args)
    if "--seed" in args:
        del args[args.index("--seed"):args.index("--seed") + 2]
    return dataclasses.replace(config, server_args=(*args, "--seed", str(seed)))


def rotation(count: int, round_index: int) -> list[int]:
    """The order in which round ``round_index`` visits ``count`` servers: rotated by one each round,
    so that no configuration always runs first (after the client's idle pause) or last."""
    shift = round_index % count if count else 0
    return list(range(shift, count)) + list(range(shift))


@dataclass
class Paired:
    """One configuration's rounds: tokens/s per round, and its paired ratios (this round's speed over
    the baseline's speed in the same round)."""

    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=dict)  # baseline name -> per-round ratio

    def median(self, baseline: str) -> float:
        return statistics.median(self.ratios[baseline])

    def spread(self, baseline: str) -> tuple[float, float]:
        return min(self.ratios[baseline]), max(self.ratios[baseline])


def paired_ratios(rounds: list[dict[str, float]], baselines: list[str]) -> dict[str, Paired]:
    """``rounds``: per round {config: tokens/s}. Returns per config its :class:`Paired`, with ratios
    against each of ``baselines`` (all rounds where both ran). Raises ValueError when a baseline never
    ran, or no round holds any result (nothing to compare is not a result)."""
    if not rounds or not any(rounds):
        raise ValueError("no round has a result")
    names = list(dict.fromkeys(name for speeds in rounds for name in speeds))
    for baseline in baselines:
        if baseline not in names:
            raise ValueError(f"baseline {baseline!r} has no round; configurations: {names}")
    out = {name: Paired(name) for name in names}
    for speeds in rounds:
        for name, speed in speeds.items():
            out[name].tokens_per_s.append(speed)
            for baseline in baselines:
                if baseline in speeds:
                    out[name].ratios.setdefault(baseline, []).append(speed / speeds[baseline])
    return out


def summed(results: list[WorkloadResult]) -> WorkloadResult:
    """One configuration's rounds as one result (counters and times summed: bench's
    :func:`combine_phases`, less its phases, which would leave r unmeasured): α, τ, c and r over all rounds."""
    return dataclasses.replace(combine_phases(results), phases=[])


def format_report(preset_name: str, preset: Preset, paired: dict[str, Paired], totals: dict[str, WorkloadResult],
                  reference: str, header: str) -> str:
    plain = preset.configs[0].name
    lines = [f"# Interleaved A/B: {preset_name}", "", header, "",
             f"| configuration | x plain, median (range) | x its reference (default {reference}), median (range) "
             "| best round tok/s | τ | α | c | r |",
             "|---|---|---|---|---|---|---|---|"]
    plain_speed = statistics.median(paired[plain].tokens_per_s)
    for config in preset.configs:
        p = paired.get(config.name)
        if p is None:
            continue
        total = totals[config.name]
        own = preset.reference_of(config.name, reference)
        low, high = p.spread(plain)
        rlow, rhigh = p.spread(own)
        c = total.cost_ratio
        r = total.verify_cost_ratio(plain_speed)
        lines.append(
            f"| {config.name} | {p.median(plain):.2f}x ({low:.2f}-{high:.2f}) | {p.median(own):.3f}x "
            f"({rlow:.2f}-{rhigh:.2f}){'' if own == reference else f' x {own}'} | {max(p.tokens_per_s):.1f} | {total.mean_accepted_length:.2f} | "
            f"{'-' if total.alpha is None else f'{total.alpha:.3f}'} | {'-' if c is None else f'{c:.3f}'} | "
            f"{'-' if r is None else f'{r:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.throughput.interleaved",
        description=__doc__.split("\n\n")[0] + " Each round visits the servers in a rotated order; each speed is "
        "divided by plain decoding's and the reference's in the same round.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Presets:\n" + "\n".join(f"  {name}: {p.about}" for name, p in PRESETS.items()),
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="routing")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per configuration (default 5)")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per round (default 16; the mixed workload: four of each "
                        "category; held-out prompts: at most 48)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight at once (default 1: one at a time; 16: a pool of 16 clients)")
    parser.add_argument("--warmup-rounds", type=int, default=0,
                        help="untimed rounds of the workload on each server before the timed ones (default 0): "
                        "a fresh server's first burst runs before it has measured its costs under load")
    parser.add_argument("--server-seed", type=int,
                        help="vLLM's --seed for every server (default vLLM's own): the random stream an unseeded "
                        "request's sampling draws from, the same for every server at start")
    parser.add_argument("--reference", help="the configuration every other is also compared with (default: the preset's)")
    parser.add_argument("--only", help="comma-separated names or substrings: serve only the configurations named "
                        "exactly, or whose name contains one that names none exactly (plain, the reference and each "
                        "one's own reference always)")
    parser.add_argument("--out", default=os.path.join("runs", "bench"), help="directory for the .md and .json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests, --max-tokens and --concurrency must be >= 1")
    if args.warmup_rounds < 0:
        parser.error("--warmup-rounds must be >= 0")
    preset = PRESETS[args.preset]
    reference = args.reference or preset.reference
    configs = list(preset.configs)
    if reference not in [c.name for c in configs]:
        parser.error(f"--reference {reference!r} is not a configuration of {args.preset}: {[c.name for c in configs]}")
    if args.only:
        configs = selected(preset, args.only, reference)
    if args.server_seed is not None:
        configs = [with_server_seed(c, args.server_seed) for c in configs]
    if not os.path.isdir(preset.target):
        parser.error(f"{preset.target} is not built (make models)")

    from tqdm import tqdm

    try:
        texts, temperatures = workload_prompts(preset.workload, args.requests)
    except ValueError as error:
        parser.error(str(error))
    servers = []
    rounds: list[dict[str, float]] = []
    results: dict[str, list[WorkloadResult]] = {c.name: [] for c in configs}
    started = time.strftime("%Y%m%d-%H%M%S")
    try:
        for config in tqdm(configs, desc="starting servers", unit="server"):
            check_memory_for_another_server(len(servers), len(configs))
            server = config.server(preset.target)
            server.__enter__()
            servers.append(server)
            run_workload(server, config, texts[:2], batch=1, temperature=temperatures[:2], max_tokens=8)  # warm-up
            for _ in range(args.warmup_rounds):
                run_workload(server, config, texts, batch=args.concurrency, temperature=temperatures,
                             max_tokens=args.max_tokens)
            pause(server, True)
        with tqdm(total=args.rounds * len(configs), desc="rounds", unit="run") as bar:
            for index in range(args.rounds):
                speeds: dict[str, float] = {}
                for k in rotation(len(configs), index):
                    pause(servers[k], False)
                    time.sleep(RESUME_SETTLE_S)
                    run = WorkloadRun(servers[k], configs[k], [(texts, args.concurrency)], temperature=temperatures,
                                      max_tokens=args.max_tokens, workload=preset.workload)
                    run.begin()
                    run.generate()
                    result = run.finish()
                    results[configs[k].name].append(result)
                    speeds[configs[k].name] = result.tokens_per_s
                    pause(servers[k], True)
                    bar.update()
                rounds.append(speeds)
    finally:
        for server in reversed(servers):
            pause(server, False)  # a stopped process cannot act on the SIGINT of a graceful stop
            server.__exit__(None, None, None)
    served = [c.name for c in configs]
    references = list(dict.fromkeys([configs[0].name, reference] + [r for n, r in preset.pairs if n in served]))
    paired = paired_ratios(rounds, references)
    totals = {name: summed(rs) for name, rs in results.items() if rs}
    header = (f"{preset.about}. Target {os.path.relpath(preset.target)}; {args.requests} requests of workload "
              f"{preset.workload} x {args.max_tokens} tokens per round, "
              f"{'one at a time' if args.concurrency == 1 else f'{args.concurrency} at a time'}, "
              f"{'' if args.server_seed is None else f'servers started with --seed {args.server_seed}, '}"
              f"{'' if not args.warmup_rounds else f'{args.warmup_rounds} untimed round(s) on each server first, '}"
              f"{args.rounds} rounds, servers side by side, order rotated each round; started {started}. "
              f"Ratios are paired within a round; τ, α, c, r over every round.")
    report = format_report(args.preset, dataclasses.replace(preset, configs=tuple(configs)), paired, totals, reference,
                           header)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"interleaved-{args.preset}-{started}")
    with open(stem + ".md", "w") as f:
        f.write(report)
    with open(stem + ".json", "w") as f:
        json.dump({"preset": args.preset, "reference": reference, "rounds": rounds, "args": vars(args),
                   "results": {name: [r.as_dict() for r in rs] for name, rs in results.items()}}, f, indent=1)
    print(report)
    print(f"saved {stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
