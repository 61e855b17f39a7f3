"""specplugin-verify's two-sample mode on real engines (issue 32 item 3): the demo pair
(models/demo target + draft-distill) served in bfloat16, a speculative engine (the plugin's
MultiDraftProposer, runner shim on) against a plain one, no reference model.

- the exact plugin passes;
- the plugin's q hand-off fault (``handoff_q_temperature``: vLLM verifies against norm(q^2), not the
  q the drafts were drawn from; vllm_specplugin/faults.py) is caught;
- the same two at tensor_parallel_size=2.

All engine cases are in the extended tier (make test-extended): make test is near its 45-minute
budget; the statistics and the CLI are tested in make test (tests/stats/test_stats_two_sample.py,
tests/verification/test_two_sample_logic.py), and so is the fault's power at its exact effect.

The plain engine is started once per module (its seeded samples are reused). Engines run eager:
bfloat16 on an AVX2-only CPU compiled for minutes. N is small so that a test takes a few minutes on
a 2-core CPU; the planned power is stated against a binned TV of DELTA at the first token, and the
power at the fault's own exact effect (float32 laws from transformers, simulated runs of this very
decision's noncentrality at its nodes of position 2) is computed by ``test_fault_power_at_its_exact_effect``.
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin.fault_switch import switch_env
from vllm_specplugin.verification.drivers import SamplingConfig
from vllm_specplugin.verification.engine_settings import EngineSettings, engine_driver
from vllm_specplugin.verification.two_sample import run_two_sample

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(REPO, "models", "demo", "target")
DRAFT = os.path.join(REPO, "models", "demo", "draft-distill")
SPEC = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": 3}
ADDITIONAL = {"specplugin": {"drafts": [DRAFT], "runner_shim": True}}
# "import os\nimport sys\n" and "    def __init__(self" with the demo tokenizer: their first token is
# nearly certain, so most samples reach the nodes of position 2, where the fault acts.
PROMPTS = [[0, 692, 590, 201, 692, 703, 201], [0, 261, 338, 471, 601, 529, 276]]
N = 400
# T = 1 without top-k / top-p: the fault's effect is largest there (at top-k 50, top-p 0.9 and the
# random-id prompts of test_tensor_parallel.py, N = 400 had a simulated power of 0.275 against it).
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=3, n=N, seed=0)
DELTA = 0.25  # the planned power's effect size (binned TV at the first token of one prompt)
EAGER = {"enforce_eager": True, "max_num_seqs": 256}
FAULT = {"SPECPLUGIN_INJECT_FAULT": "handoff_q_temperature", **switch_env()}
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (tests/e2e/test_tensor_parallel.py)

pytestmark = pytest.mark.engine


def cached(driver):
    """The plain side's samples, drawn once (same tasks and seeds -> the same run)."""
    runs = {}

    def run(tasks):
        key = json.dumps([(t.prompts, t.sampling.as_dict()) for t in tasks])
        if key not in runs:
            runs[key] = driver(tasks)
        return runs[key]

    return run


def check(spec_driver, plain_driver, settings: EngineSettings, label: str):
    report = run_two_sample(spec_driver, plain_driver, [SAMPLING], PROMPTS, delta=DELTA, model=TARGET,
                            spec=label, plain="no speculative config", settings=settings.__dict__)
    print("\n" + report.format_table())
    out = os.path.join(REPO, "runs", "two-sample")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{label}.json"), "w") as f:
        f.write(report.to_json())
    assert report.plan.power >= 0.9 and not report.warnings  # planned before the run
    assert all(p.n_spec == N and p.n_plain == N for c in report.cases for p in c.prompts)
    return report


BF16 = EngineSettings(dtype="bfloat16", max_model_len=256)


@pytest.fixture(scope="module")
def plain_bf16():
    return cached(engine_driver(TARGET, BF16, engine_options=EAGER))


@pytest.mark.extended  # three bfloat16 engines: make test-extended (make test is near its time budget)
def test_exact_plugin_passes_in_bfloat16(plain_bf16):
    report = check(engine_driver(TARGET, BF16, speculative_config=SPEC, additional_config=ADDITIONAL,
                                 engine_options=EAGER), plain_bf16, BF16, "bf16-exact")
    assert report.passed
    assert report.cases[0].acceptance_rate and report.cases[0].acceptance_rate > 0.05  # it did speculate


@pytest.mark.extended
def test_q_handoff_fault_is_caught_in_bfloat16(plain_bf16):
    report = check(engine_driver(TARGET, BF16, speculative_config=SPEC, additional_config=ADDITIONAL,
                                 engine_options=EAGER, extra_env=FAULT), plain_bf16, BF16, "bf16-handoff-fault")
    assert not report.passed
    assert report.cases[0].acceptance_rate and report.cases[0].acceptance_rate > 0.05


@pytest.mark.extended  # three TP=2 engines (make test-extended)
def test_tensor_parallel_two_sample():
    tp2 = EngineSettings(dtype="bfloat16", max_model_len=256, tensor_parallel_size=2)
    plain = cached(engine_driver(TARGET, tp2, engine_options=EAGER, extra_env=TP_ENV))
    honest = check(engine_driver(TARGET, tp2, speculative_config=SPEC, additional_config=ADDITIONAL,
                                 engine_options=EAGER, extra_env=TP_ENV), plain, tp2, "tp2-bf16-exact")
    assert honest.passed
    faulty = check(engine_driver(TARGET, tp2, speculative_config=SPEC, additional_config=ADDITIONAL,
                                 engine_options=EAGER, extra_env={**TP_ENV, **FAULT}), plain, tp2,
                   "tp2-bf16-handoff-fault")
    assert not faulty.passed


def _normalised_square(prompt, prefixes, p, q):
    squared = q ** 2
    return squared / squared.sum(-1, keepdims=True)


def binned_noncentrality(p, f, n_per_side: float, max_bins: int, min_expected: float = 5.0) -> float:
    """The 2 x bins noncentrality at one node with n samples per side from laws f and p, binned as
    the test bins the pooled counts (expected cells >= 5, at most max_bins bins, a remainder)."""
    import numpy as np

    from vllm_specplugin.stats.two_sample import homogeneity_noncentrality

    pbar = (p + f) / 2
    order = np.argsort(-pbar, kind="stable")
    keep = int(np.count_nonzero(n_per_side * pbar[order] >= min_expected))
    keep = min(keep, max_bins - 1)
    if keep < 1:
        return 0.0
    rest = order[keep:]
    pb = np.append(p[order[:keep]], p[rest].sum())
    fb = np.append(f[order[:keep]], f[rest].sum())
    return homogeneity_noncentrality(fb, pb, n_per_side, n_per_side)


@pytest.mark.statistical
def test_fault_power_at_its_exact_effect():
    """The power of this module's decision (N, prompts, caps, Holm at 0.01) against the hand-off
    fault's exact law (float32 target and draft from transformers; the engines run bfloat16).
    Noncentrality: the binned 2 x bins noncentrality at the prompt's largest nodes of position 2
    (max_nodes - 1 of them: the root, which the fault leaves alone, takes one), at their expected
    sizes N p(first token); df: the bound max_nodes (max_bins - 1). Position 3 is ignored. No engine."""
    import numpy as np

    from vllm_specplugin.stats.power import chain_power
    from vllm_specplugin.stats.two_sample import two_sample_df_bound
    from vllm_specplugin.verification.check import speculative_law
    from vllm_specplugin.verification.reference import TargetReference, target_law

    target, draft = TargetReference(TARGET), TargetReference(DRAFT)
    s, max_nodes, max_bins, alpha = SAMPLING, 6, 6, 0.01
    faulty = speculative_law(lambda prompt: target_law(draft, prompt, s.temperature, s.top_k, s.top_p),
                             fault="wrong_q", fault_arg=_normalised_square)
    powers = []
    for prompt in PROMPTS:
        plain = target_law(target, prompt, s.temperature, s.top_k, s.top_p)
        first = plain([()])[0]
        top = [(int(x),) for x in np.argsort(-first)[:max_nodes - 1]]
        p_rows, f_rows = plain(top), faulty(prompt, plain)(top)
        lam = sum(binned_noncentrality(p, f, N * first[x[0]], max_bins) for x, p, f in zip(top, p_rows, f_rows))
        powers.append(float(chain_power(lam, two_sample_df_bound(max_nodes, max_bins), alpha / len(PROMPTS))))
        print(f"\nprompt {prompt}: P(first token) of the top nodes {np.round(first[[x[0] for x in top]], 3)}, "
              f"noncentrality {lam:.1f}, power {powers[-1]:.4f}")
    # The prompts' samples are independent: P(some prompt rejected at Holm's first step alpha / P).
    family = 1.0 - float(np.prod([1.0 - x for x in powers]))
    print(f"handoff_q_temperature, N = {N} per side: power of the decision >= {family:.4f}")
    assert family >= 0.95
