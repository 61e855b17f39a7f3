"""vLLM 0.32 on CPU loads its saved compiled model instead of compiling again (compile_cache_repair.py).

Three engine starts of the demo target in one fresh compile cache (``VLLM_CACHE_ROOT``): the first
compiles and saves; the second, with the repair off, shows vLLM's failure ("Compiling model again
due to a load failure ... finalize_loading") and compiles again; the third, with the repair on,
loads the saved compile ("Directly load AOT compilation") and compiles nothing. The three greedy
outputs are identical (a wrong loaded graph would show here) and the start-up times are printed.
"""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

# make test-extended: three engine starts in a fresh compile cache (3-5 min on 2 cores).
pytestmark = [pytest.mark.engine, pytest.mark.extended]

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "demo", "target")
GREEDY = SamplingConfig(temperature=0.0, max_tokens=24, n=1, seed=None)
PROMPTS = [[(7 * i + 3 * j) % 900 + 5 for j in range(5 + 3 * i)] for i in range(4)]


def start(cache_root: str, log_path: str, repair: str):
    env = {"VLLM_CACHE_ROOT": cache_root, "SPECPLUGIN_COMPILE_CACHE_REPAIR": repair}
    run = run_offline(os.path.abspath(TARGET), [GenerationTask(PROMPTS, GREEDY)], log_path=log_path, extra_env=env)
    return run, open(log_path).read()


def test_saved_compile_is_loaded(tmp_path):
    cache = str(tmp_path / "vllm-cache")
    cold, cold_log = start(cache, str(tmp_path / "cold.log"), "auto")
    assert "saved AOT compiled function" in cold_log, "the first start did not save a compiled model"

    off, off_log = start(cache, str(tmp_path / "off.log"), "off")
    assert "Compiling model again due to a load failure" in off_log and "finalize_loading" in off_log, (
        "vLLM loaded its saved compile without the repair: the repair may no longer be needed")

    warm, warm_log = start(cache, str(tmp_path / "warm.log"), "auto")
    assert "Directly load AOT compilation" in warm_log, warm_log[-3000:]
    assert "Compiling model again" not in warm_log
    assert "Repaired vLLM 0.32's compile cache on CPU" in warm_log

    outputs = [run.tasks[0].outputs for run in (cold, off, warm)]
    assert [len(s) for p in outputs[2] for s in p] == [GREEDY.max_tokens] * len(PROMPTS)
    assert outputs[0] == outputs[1] == outputs[2]
    print(f"engine start-up: cold {cold.startup_s:.1f} s, saved compile not loaded (repair off) {off.startup_s:.1f} s, "
          f"loaded (repair on) {warm.startup_s:.1f} s")
