"""Shared fixtures (small peaked Llama checkpoints, made once per machine; vLLM's CPU rejection sampler) and the set-up of parallel runs (pytest-xdist)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from vllm_specplugin.fault_switch import switch_env
from vllm_specplugin.models.random_llama import cached_random_llama

# Fault injection is off in production (vllm_specplugin/fault_switch.py); the suite injects faults
# on purpose, so its processes and the engines and servers they start (which inherit the
# environment) get the testing switch. tests/test_fault_switch.py checks it is off without it.
os.environ.update(switch_env())

# No per-example deadline anywhere: with two workers (below) on a shared 2-core machine an
# example's time says nothing about the code, and a deadline failure would be noise.
settings.register_profile("specplugin", deadline=None)
settings.load_profile("specplugin")

# `make test` runs the suite on two pytest-xdist workers (ci/test.sh: -n 2): each engine test
# spends most of its time in one single-threaded vLLM worker, so two run side by side on two cores.
# vLLM's "auto" binding would pin every engine to the same core (it reserves the other for the
# front end), so each xdist worker's engines get a core of their own (a test that needs its own
# binding, tensor parallelism's "0|1", passes it explicitly), and each xdist worker's own torch
# work (references, enumeration) one thread.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... (unset without xdist)
if _XDIST_WORKER:
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        _cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cpus[int(_XDIST_WORKER[2:]) % len(_cpus)])
    import torch

    torch.set_num_threads(1)

# The run this process belongs to (the xdist workers inherit it from the controller): the
# statistical suite's records carry it, so its Holm decision reads this run's p-values only.
RUN_ID_ENV = "SPECPLUGIN_TEST_RUN_ID"

# Longest first, so that the last units to start are short ones and the two workers finish
# together. Whole modules move; the order inside a module is kept. The statistical suite's Holm
# decision goes last of all: it waits for every case of the suite, which may run on either worker.
SUITE_MODULE = "tests/statistical/test_stat_engine_exactness.py"
SUITE_DECISION = SUITE_MODULE + "::test_suite_holm_decision"
_SLOW_FIRST = (
    SUITE_MODULE,
    "tests/statistical/",
    "tests/server/",
    "tests/engine/",
    "tests/e2e/",
)
# Modules whose tests the scheduler hands out one by one (each starts its own engine and shares
# nothing costly through module fixtures); every other module is one unit (its module fixtures,
# e.g. one engine for all its tests, run once).
SPLIT_MODULES = (SUITE_MODULE,)


def pytest_configure(config):
    if not _XDIST_WORKER:
        import uuid

        os.environ.setdefault(RUN_ID_ENV, uuid.uuid4().hex)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_SplitModulesScheduling(), "specplugin-split-modules")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A statistical-suite test that failed or was skipped is marked in the suite's records, so the
    Holm decision, which may be waiting for that test's record in the other worker, stops waiting
    and says which."""
    outcome = yield
    report = outcome.get_result()
    if (report.failed or report.skipped) and item.nodeid.startswith(SUITE_MODULE + "::") \
            and item.nodeid != SUITE_DECISION and item.get_closest_marker("extended") is None:
        import hashlib

        key = hashlib.sha1(item.nodeid.encode()).hexdigest()[:12]
        item.module.write_record(f"not-passed-{key}", {"not_passed": True, "test": item.nodeid})


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        if item.nodeid == SUITE_DECISION:
            return len(_SLOW_FIRST) + 1
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(_SLOW_FIRST) if path.startswith(prefix)), len(_SLOW_FIRST))

    items.sort(key=rank)  # stable


class _SplitModulesScheduling:
    """Registered when pytest-xdist is loaded (pytest_configure; its hook is unknown otherwise):
    xdist's loadfile (one unit per module, in collection order), but each test of SPLIT_MODULES is
    a unit of its own."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class ModulesAndSplitTests(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return nodeid if path in SPLIT_MODULES else path

        return ModulesAndSplitTests(config, log)


@pytest.fixture(scope="session")
def random_target() -> str:
    """2-layer, 128-wide float32 Llama over a 512-token vocabulary, peaked next-token distributions."""
    return cached_random_llama("target", seed=0)


@pytest.fixture(scope="session")
def peaked_target() -> str:
    """As random_target with LM-head scale 15: max p 0.3-0.5, entropy ~2.6 nats, like real LMs.

    The statistical tests use it: near-uniform distributions make sparse bins and weak tests.
    """
    return cached_random_llama("peaked-target", logit_scale=15.0, seed=0)


@pytest.fixture(scope="session")
def peaked_draft() -> str:
    """peaked_target's weights with LM-head scale 10.5 (0.7x): acceptance sum min(p, q) ~0.72."""
    return cached_random_llama("peaked-draft", logit_scale=10.5, seed=0)


@pytest.fixture(scope="session")
def flat_draft() -> str:
    """peaked_target's weights with LM-head scale 4: flatter than the target, so on random prompts it
    predicts the prompt's tokens better than peaked_draft (routing by prompt picks it) and still
    accepts often."""
    return cached_random_llama("flat-draft", logit_scale=4.0, seed=0)


@pytest.fixture(scope="session")
def unrelated_draft() -> str:
    """A 1-layer random draft with the target's vocabulary and unrelated weights (acceptance ~3%).

    Low acceptance means most emitted tokens are resampled, which is where vLLM-CPU's expand bug
    shows most plainly.
    """
    return cached_random_llama("unrelated-draft", num_layers=1, logit_scale=3.0, seed=1)


@pytest.fixture(scope="module")
def cpu_rejection_sampler():
    """vLLM's rejection_sampler module with the CPU kernel fallbacks registered and the expand
    repair on; whatever expand implementation was registered before is put back afterwards."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU-only test")
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    from vllm_specplugin import sampler_repair

    before = sampler_repair.registered_expand_impl()
    sampler_repair.apply("on")
    assert sampler_repair.registered_expand_impl() is not None
    assert not sampler_repair.expand_is_broken(sampler_repair.registered_expand_impl())
    from vllm.v1.sample import rejection_sampler

    yield rejection_sampler
    if before is not None:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({sampler_repair.EXPAND_KERNEL: before})


def pytest_terminal_summary(terminalreporter):
    """Test time per module (set-up + call + tear-down, summed over both workers), the longest
    first: what `make test`'s wall time is made of, for keeping it under its budget."""
    per_module: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, duration = getattr(report, "nodeid", None), getattr(report, "duration", None)
            if nodeid and isinstance(duration, float):
                module = nodeid.split("::", 1)[0]
                per_module[module] = per_module.get(module, 0.0) + duration
    if not per_module:
        return
    total = sum(per_module.values())
    terminalreporter.write_sep("=", f"test time by module: {total:.0f} s in all")
    for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.0f} s  {100 * seconds / total:5.1f}%  {module}")
