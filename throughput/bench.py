"""Throughput measurement against the real HTTP server: workloads, counters, the cost model.

Every figure comes with its cost model: α (accepted / drafted draft tokens, vLLM's counters), γ
(draft tokens per step), c (draft time per draft token over target time per step, measured by
the plugin's proposer; unknown for vLLM's built-ins), the Leviathan et al. speedup bound
E[tokens/step] / (1 + cγ) for those α, γ and c, and r, the measured target cost of a
verification step over a plain step (the bound assumes r = 1).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from vllm_specplugin.paths import models_dir
from vllm_specplugin.server import VllmServer, metric_total

MODELS = models_dir()  # the checkout's models/, or $SPECPLUGIN_MODELS_DIR (vllm_specplugin/paths.py)
DEMO = os.path.join(MODELS, "demo")  # the small family: a 4.46 M target (compute-bound on CPU)
DEMO_MB = os.path.join(MODELS, "demo-mb")  # the memory-bound family: a 31.5 M target grown from it


def model_path(name: str) -> str:
    """A demo checkpoint: "draft-distill" is in the small family; "demo-mb/draft" names its family."""
    return os.path.join(MODELS, name) if "/" in name else os.path.join(DEMO, name)
PLUGIN_PROPOSER = "vllm_specplugin.adapters.MultiDraftProposer"


@dataclass(frozen=True)
class ServedConfig:
    """One way of serving the target: plain, a vLLM built-in method, or a plugin proposer."""

    name: str
    speculative_config: dict | None = None
    additional_config: dict | None = None
    server_args: tuple[str, ...] = ()  # more `vllm serve` arguments, e.g. ("--no-async-scheduling",)

    @property
    def gamma(self) -> int:
        return int((self.speculative_config or {}).get("num_speculative_tokens", 0))

    @property
    def is_plugin(self) -> bool:
        return (self.speculative_config or {}).get("model") == PLUGIN_PROPOSER

    def server(self, target: str) -> VllmServer:
        return VllmServer(target, speculative_config=self.speculative_config, additional_config=self.additional_config,
                          extra_args=list(self.server_args))


def plugin_config(name: str, drafts: list[str], gamma: int = 3, **plugin_options) -> ServedConfig:
    return ServedConfig(
        name,
        {"method": "custom_class", "model": PLUGIN_PROPOSER, "num_speculative_tokens": gamma},
        {"specplugin": {"drafts": [model_path(d) for d in drafts], **plugin_options}},
    )


def dynamic_tree_config(name: str, drafts: list[str], nodes: int, **plugin_options) -> ServedConfig:
    """The plugin's dynamic tree of ``nodes`` nodes verified whole (``num_speculative_tokens`` = nodes)."""
    return plugin_config(name, drafts, nodes, **plugin_options,
                         tree_drafting={"node_budget": nodes, "verify": "tree", "shape": "dynamic"})


def builtin_draft_model_config(draft: str, gamma: int = 3) -> ServedConfig:
    """vLLM's own draft_model method (probabilistic drafts; exact on CPU with the plugin's repair)."""
    return ServedConfig(
        f"vllm draft_model[{draft}]",
        {"method": "draft_model", "model": model_path(draft), "num_speculative_tokens": gamma,
         "draft_sample_method": "probabilistic"},
    )


# vLLM 0.32 turns async scheduling off for every custom_class server (vllm/config/vllm.py): plain
# decoding served that way is what the plugin's floor is held to.
PLAIN_ASYNC_OFF = ServedConfig("plain, async scheduling off (as vLLM serves custom_class)",
                               server_args=("--no-async-scheduling",))


def choice_floor_config(draft: str, gamma: int) -> ServedConfig:
    """The drafter choice priced out of drafting (every option, no probes, fixed prices): the cost of
    serving through the speculative path at all, the floor the choice is held to under load."""
    return plugin_config(f"choice that never drafts (floor), k {gamma}", [draft], gamma,
                         suffix_drafting={"model_gamma": 4, "draft_cost": 9.9, "verify_cost": 9.9,
                                          "measure_costs": False})


@dataclass
class WorkloadResult:
    config: str
    batch: int
    temperature: float | str  # a workload's one temperature, or its requests' ("0/1": temperature_label)
    output_tokens: int
    wall_s: float
    gamma: int
    drafts: float = 0.0  # vLLM: verification steps with drafts
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)
    draft_time_s: float | None = None  # plugin proposers only
    step_time_s: float | None = None
    propose_calls: float | None = None
    plugin: dict = field(default_factory=dict)  # every specplugin counter's change over the workload
    phases: list[int] = field(default_factory=list)  # concurrency of each phase (run_phases); batch is the largest
    workload: str = ""  # the workload's name (a category of throughput/workloads.py), "" when unnamed

    @property
    def key(self) -> tuple[str, int, float | str]:
        """What a plain-decoding baseline must share: workload, batch and temperature."""
        return (self.workload, self.batch, self.temperature)

    @property
    def batch_label(self) -> str:
        return "→".join(map(str, self.phases)) if self.phases else str(self.batch)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def alpha(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step: accepted drafts + the target's own (1.0 when plain)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def draft_time_fraction(self) -> float | None:
        if self.draft_time_s is None or not self.step_time_s:
            return None
        return self.draft_time_s / self.step_time_s

    @property
    def cost_ratio(self) -> float | None:
        """c: draft time per draft token / target time per step (step time less drafting)."""
        if self.draft_time_s is None or not self.propose_calls or not self.step_time_s or not self.gamma:
            return None
        steps = self.propose_calls
        target_per_step = (self.step_time_s - self.draft_time_s) / steps
        return (self.draft_time_s / steps / self.gamma) / target_per_step if target_per_step > 0 else None

    def verify_cost_ratio(self, plain_tokens_per_s: float | None) -> float | None:
        """r: this configuration's target time per step (drafting excluded) over a plain decoding
        step at the same batch. The Leviathan model assumes r = 1 (verifying γ + 1 tokens costs
        one step); on a compute-bound CPU it does not."""
        if not plain_tokens_per_s or self.draft_time_fraction is None or not self.drafts or self.phases:
            return None  # (phases of different concurrency have no one plain step to compare with)
        step = self.batch * self.mean_accepted_length / self.tokens_per_s
        return step * (1 - self.draft_time_fraction) / (self.batch / plain_tokens_per_s)

    def leviathan_bound(self) -> float | None:
        from vllm_specplugin.stats.speedup import expected_speedup

        if self.alpha is None or self.cost_ratio is None:
            return None
        return float(expected_speedup(min(self.alpha, 0.999), self.gamma, self.cost_ratio))

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            tokens_per_s=self.tokens_per_s, alpha=self.alpha, mean_accepted_length=self.mean_accepted_length,
            draft_time_fraction=self.draft_time_fraction, cost_ratio=self.cost_ratio,
            leviathan_bound=self.leviathan_bound(),
        )
        return out


Temperature = float | list[float]


def temperature_label(temperature: Temperature) -> float | str:
    """A workload's temperature for tables and baselines: the value when every request has it,
    else the distinct values joined ("0/1": a mixed workload whose requests keep their own)."""
    if isinstance(temperature, (int, float)):
        return float(temperature)
    values = sorted(set(float(t) for t in temperature))
    return values[0] if len(values) == 1 else "/".join(f"{t:g}" for t in values)


@dataclass
class _Counters:
    """Counters read before (or after) the timed part of a workload."""

    vllm: dict
    plugin: dict


def _read_counters(server: VllmServer, config: ServedConfig, *, settle: bool) -> _Counters:
    """vLLM's counters (served at once) and the plugin's, which workers flush every 0.5 s: read
    settled (``settle``: waits until two reads agree) only outside the timed generation."""
    plugin = server.settled_metrics("specplugin:") if (config.is_plugin and settle) else {}
    return _Counters(server.metrics(), plugin)


def _send(server: VllmServer, prompts: list, *, batch: int, temperature: Temperature, max_tokens: int) -> int:
    """The generation phase: every prompt, ``batch`` at a time (a pool of that many concurrent
    clients), each with its own temperature when ``temperature`` is a list. Returns the output
    tokens."""
    from openai import OpenAI

    temperatures = [float(temperature)] * len(prompts) if isinstance(temperature, (int, float)) else list(temperature)
    if len(temperatures) != len(prompts):
        raise ValueError(f"{len(temperatures)} temperatures for {len(prompts)} prompts")
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=900)

    def complete(item) -> int:
        prompt, t = item
        completion = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=t,
            extra_body={"ignore_eos": True},
        )
        return completion.usage.completion_tokens

    with ThreadPoolExecutor(batch) as pool:
        return sum(pool.map(complete, zip(prompts, temperatures)))


def _result(config: ServedConfig, batch: int, temperature: Temperature, output_tokens: int, wall: float,
            before: _Counters, after: _Counters) -> WorkloadResult:
    def delta(name: str, a=after.vllm, b=before.vllm) -> float:
        return metric_total(a, name) - metric_total(b, name)

    result = WorkloadResult(
        config.name, batch, temperature_label(temperature), output_tokens, wall, config.gamma,
        drafts=delta("vllm:spec_decode_num_drafts_total"),
        draft_tokens=delta("vllm:spec_decode_num_draft_tokens_total"),
        accepted_tokens=delta("vllm:spec_decode_num_accepted_tokens_total"),
        accepted_per_position=[
            after.vllm.get(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels}}}', 0)
            - before.vllm.get(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels}}}', 0)
            for labels in _position_labels(after.vllm)
        ],
    )
    if config.is_plugin and after.plugin:
        result.draft_time_s = delta("specplugin:draft_time_seconds_total", after.plugin, before.plugin)
        result.step_time_s = delta("specplugin:step_time_seconds_total", after.plugin, before.plugin)
        result.propose_calls = delta("specplugin:propose_calls_total", after.plugin, before.plugin)
        result.plugin = {
            key: after.plugin[key] - before.plugin.get(key, 0) for key in after.plugin
            if key.endswith("_total") or "_total{" in key
        }
    return result


class WorkloadRun:
    """One round of a workload in three parts, so that a timer can hold the generation alone:
    :meth:`begin` (settled counters), :meth:`generate` (the requests: the timed part, whose wall
    time is the tokens/s figure's) and :meth:`finish` (settled counters, the result). ``phases``:
    [(prompts, concurrency), ...] run one after another (vLLM's counters, served at once, are read
    between phases; the plugin's only at the ends), or one phase of ``prompts`` at ``batch``."""

    def __init__(self, server: VllmServer, config: ServedConfig, phases: list[tuple[list, int]], *,
                 temperature: Temperature | list[Temperature], max_tokens: int, workload: str = ""):
        if not phases:
            raise ValueError("a workload needs at least one phase")
        self.server, self.config, self.phases, self.max_tokens = server, config, phases, max_tokens
        self.workload = workload
        # one temperature for all, or one Temperature per phase
        self.temperatures = ([temperature] * len(phases) if isinstance(temperature, (int, float))
                             else list(temperature) if len(phases) > 1 else [temperature])
        if len(self.temperatures) != len(phases):
            raise ValueError(f"{len(self.temperatures)} temperatures for {len(phases)} phases")
        self._start: _Counters | None = None
        self._parts: list[tuple[int, float, _Counters, _Counters]] = []
        self.result: WorkloadResult | None = None

    def begin(self) -> None:
        self._start = _read_counters(self.server, self.config, settle=True)

    def generate(self) -> None:
        if self._start is None:
            raise RuntimeError("begin() first")
        before = self._start
        for (prompts, batch), temperature in zip(self.phases, self.temperatures):
            started = time.perf_counter()
            tokens = _send(self.server, prompts, batch=batch, temperature=temperature, max_tokens=self.max_tokens)
            wall = time.perf_counter() - started
            after = _read_counters(self.server, self.config, settle=False)
            self._parts.append((tokens, wall, before, after))
            before = after

    def finish(self) -> WorkloadResult:
        if self.result is not None:
            return self.result
        end = _read_counters(self.server, self.config, settle=True)
        parts = []
        for index, ((prompts, batch), temperature, (tokens, wall, before, after)) in enumerate(
                zip(self.phases, self.temperatures, self._parts)):
            # the plugin's counters: the whole run's, on the first phase (combine_phases sums them)
            before = _Counters(before.vllm, self._start.plugin if index == 0 else {})
            after = _Counters(after.vllm, end.plugin if index == 0 else {})
            parts.append(_result(self.config, batch, temperature, tokens, wall, before, after))
        if len(parts) > 1:
            for part in parts[1:]:  # no plugin counters of their own: zero, not missing
                part.draft_time_s = 0.0 if parts[0].draft_time_s is not None else None
                part.step_time_s = 0.0 if parts[0].step_time_s is not None else None
                part.propose_calls = 0.0 if parts[0].propose_calls is not None else None
        self.result = parts[0] if len(parts) == 1 else combine_phases(parts)
        self.result.workload = self.workload
        return self.result


def run_workload(
    server: VllmServer,
    config: ServedConfig,
    prompts: list[str] | list[list[int]],
    *,
    batch: int,
    temperature: Temperature,
    max_tokens: int,
) -> WorkloadResult:
    """Send every prompt, ``batch`` at a time (a pool of that many concurrent clients);
    ``temperature``: one for all, or one per prompt (a mixed workload's requests keep their own)."""
    run = WorkloadRun(server, config, [(prompts, batch)], temperature=temperature, max_tokens=max_tokens)
    run.begin()
    run.generate()
    return run.finish()


def run_phases(
    server: VllmServer,
    config: ServedConfig,
    phases: list[tuple[list, int]],
    *,
    temperature: Temperature | list[Temperature],
    max_tokens: int,
) -> WorkloadResult:
    """Phases of (prompts, concurrency) one after another, as one workload: traffic whose load
    changes (a quiet phase at concurrency 1, a burst, quiet again), where the γ that pays changes
    with it. Tokens, time and every counter are summed over the phases. ``temperature``: one for
    all, or one per phase (each a value or a list per prompt)."""
    run = WorkloadRun(server, config, phases, temperature=temperature, max_tokens=max_tokens)
    run.begin()
    run.generate()
    return run.finish()


def combine_phases(parts: list[WorkloadResult]) -> WorkloadResult:
    """One result for phases run one after another: tokens, time and counters summed (so its
    tokens/s is the whole run's), ``batch`` the largest concurrency, ``phases`` each one's."""

    def total(name: str):
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else sum(values)

    first = parts[0]
    longest = max(len(p.accepted_per_position) for p in parts)
    temperatures = {p.temperature for p in parts}
    return WorkloadResult(
        first.config, max(p.batch for p in parts),
        first.temperature if len(temperatures) == 1 else "/".join(sorted(map(str, temperatures))),
        total("output_tokens"), total("wall_s"),
        first.gamma, drafts=total("drafts"), draft_tokens=total("draft_tokens"),
        accepted_tokens=total("accepted_tokens"),
        accepted_per_position=[sum(p.accepted_per_position[i] for p in parts if i < len(p.accepted_per_position))
                               for i in range(longest)],
        draft_time_s=total("draft_time_s"), step_time_s=total("step_time_s"), propose_calls=total("propose_calls"),
        plugin={key: sum(p.plugin.get(key, 0) for p in parts) for key in {k for p in parts for k in p.plugin}},
        phases=[p.batch for p in parts],
    )


def _position_labels(samples: dict[str, float]) -> list[str]:
    prefix = "vllm:spec_decode_num_accepted_tokens_per_pos_total{"
    labels = [key[len(prefix):-1] for key in samples if key.startswith(prefix)]
    return sorted(labels, key=lambda label: int(label.split('position="')[1].split('"')[0]))


def format_table(results: list[WorkloadResult], baseline: dict[tuple, float]) -> str:
    """Markdown table; ``baseline`` maps a result's ``key`` (workload, batch, temperature) to plain
    decoding's tokens/s. A workload column appears when some result names its workload."""
    named = any(r.workload for r in results)
    header = (
        ("| workload " if named else "")
        + "| config | batch | T | tokens/s | speedup vs plain | mean accepted length | α | per-position acceptance "
        "| draft time / step | c | Leviathan bound | verify cost r |"
    )
    lines = [header, "|" + "---|" * (13 if named else 12)]
    for r in results:
        plain = baseline.get(r.key)
        speedup = f"{r.tokens_per_s / plain:.2f}x" if plain else "-"
        per_position = (
            "[" + ", ".join(f"{a / r.drafts:.2f}" for a in r.accepted_per_position) + "]" if r.drafts else "-"
        )
        lines.append(
            (f"| {r.workload} " if named else "")
            + f"| {r.config} | {r.batch_label} | {_fmt_temperature(r.temperature)} | {r.tokens_per_s:.1f} | {speedup} "
            f"| {r.mean_accepted_length:.2f} | {_fmt(r.alpha)} | {per_position} | {_fmt(r.draft_time_fraction, '.0%')} "
            f"| {_fmt(r.cost_ratio)} | {_fmt(r.leviathan_bound(), '.2f', 'x')} | {_fmt(r.verify_cost_ratio(plain), '.2f')} |"
        )
    return "\n".join(lines)


def _fmt_temperature(temperature: float | str) -> str:
    return temperature if isinstance(temperature, str) else f"{temperature:g}"


def _fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def record_benchmark(benchmark, results: list[WorkloadResult], result: WorkloadResult) -> None:
    """Attach the cost model and the within-run speedup to the benchmark, and keep the result."""
    results.append(result)
    plain = next(
        (r.tokens_per_s for r in results
         if r.config == "plain" and r.key == result.key),
        None,
    )
    info = result.as_dict()
    info["speedup_vs_plain"] = result.tokens_per_s / plain if plain else None
    info["verify_cost_ratio"] = result.verify_cost_ratio(plain)
    benchmark.extra_info.update({k: v for k, v in info.items() if not isinstance(v, (list, dict))})
    benchmark.extra_info["accepted_per_position"] = result.accepted_per_position


def config_name(config) -> str:
    """The name of a ServedConfig, or of the one a ``pytest.param(config, marks=...)`` wraps."""
    return (config.values[0] if hasattr(config, "values") else config).name


def served_fixture(configs: list, target: str = os.path.join(DEMO, "target")):
    """A module-scoped pytest fixture that serves ``target`` (default: the small demo target) once
    per configuration, in order (plain first, so that every speedup has its baseline from the same
    run). Entries may be ``pytest.param(config, marks=...)``."""
    import pytest

    @pytest.fixture(scope="module", params=configs, ids=[config_name(c) for c in configs])
    def served(request):
        config = request.param
        server = config.server(target)
        with server:
            run_workload(server, config, ["def main():\n"] * 2, batch=2, temperature=1.0, max_tokens=8)  # warm-up
            yield config, server

    return served


def benchmark_throughput(benchmark, results, served, prompts, *, batch: int, temperature: float, max_tokens: int):
    """:func:`benchmark_workload`, plus: a fixed-γ configuration must actually have drafted."""
    result = benchmark_workload(
        benchmark, results, served, prompts, batch=batch, temperature=temperature, max_tokens=max_tokens
    )
    if served[0].gamma and "adaptive" not in served[0].name:
        assert result.drafts > 0
    return result


def benchmark_workload(
    benchmark, results, served, prompts=None, *, batch: int | None = None, temperature: float, max_tokens: int,
    rounds: int | None = None, phases: list[tuple[list, int]] | None = None, workload: str = "",
):
    """Time a workload with pytest-benchmark and record its fastest round with its cost model.

    The workload is ``prompts`` at concurrency ``batch``, or ``phases`` (:func:`run_phases`).
    Several rounds (``BENCH_ROUNDS``, default 3) because a 2-core machine shared with other jobs
    is noisy; the fastest round is the least disturbed one (pytest-benchmark's ``min``).
    """
    given = (prompts is not None, batch is not None)
    if given != ((False, False) if phases is not None else (True, True)):
        raise ValueError("give either prompts and batch, or phases")
    config, server = served
    rounds = rounds or int(os.environ.get("BENCH_ROUNDS", "3"))
    outcomes: list[WorkloadResult] = []
    workload_phases = phases if phases is not None else [(prompts, batch)]
    current: list[WorkloadRun] = []

    # pytest-benchmark times the generation alone (what tokens/s measures): reading the settled
    # counters before and after a round (the plugin's workers flush every 0.5 s) is its set-up and
    # tear-down, so its min / mean columns and --benchmark-compare agree with the tok/s tables.
    def setup():
        current.append(WorkloadRun(server, config, workload_phases, temperature=temperature, max_tokens=max_tokens,
                                   workload=workload))
        current[-1].begin()

    def teardown():
        outcomes.append(current[-1].finish())

    benchmark.pedantic(lambda: current[-1].generate(), setup=setup, teardown=teardown, rounds=rounds, iterations=1)
    if len(outcomes) < len(current):  # --benchmark-disable: pytest-benchmark runs once, without teardown
        teardown()
    result = max(outcomes, key=lambda r: r.tokens_per_s)
    record_benchmark(benchmark, results, result)
    benchmark.extra_info["rounds_tokens_per_s"] = [round(r.tokens_per_s, 1) for r in outcomes]
    requests = len(prompts) if phases is None else sum(len(p) for p, _ in phases)
    assert all(r.output_tokens == requests * max_tokens for r in outcomes)  # nobody lost tokens
    return result
