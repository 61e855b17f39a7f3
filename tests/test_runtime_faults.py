"""Draft faults (``SPECPLUGIN_DRAFT_FAULT``) without an engine: the spec is read strictly, each
fault does what it says to the real draft runtime, and the adapter survives it: a step whose
draft raises or returns NaN decodes without drafts for the affected rows (counted), the others
draft as usual, and intermittent failures never switch drafting off. The server-side proof is
tests/server/test_http_runtime_faults.py."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplugin import adapters, faults
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.runner_shim import BatchView
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

DEMO = os.path.join(REPO_ROOT, "models", "demo")
K = 3
VOCAB = 4096


def test_parse_draft_faults():
    assert faults.parse_draft_faults("") is None
    assert faults.parse_draft_faults(" , ") is None
    parsed = faults.parse_draft_faults("raise:0.2, nan:0.1,slow:50ms,seed:3")
    assert parsed == faults.DraftFaults(raise_p=0.2, nan_p=0.1, slow_s=0.05, seed=3)
    assert faults.parse_draft_faults("slow:1.5s").slow_s == 1.5
    assert faults.parse_draft_faults("slow:20").slow_s == pytest.approx(0.02)
    for bad in ("raise:2", "nan:x", "slow:fast", "explode:0.1", "raise"):
        with pytest.raises(ValueError, match="SPECPLUGIN_DRAFT_FAULT"):
            faults.parse_draft_faults(bad)


def test_draft_faults_are_announced(monkeypatch, caplog):
    monkeypatch.setenv(faults.DRAFT_ENV_VAR, "nan:0.5")
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.setattr("vllm_specplugin.logging_utils._seen", set())
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        assert faults.requested_fault() is None  # read in every process by install.install
    assert any("DRAFT FAULT INJECTED" in r.getMessage() and "nan:0.5" in r.getMessage() for r in caplog.records)


def vllm_config():
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: VOCAB, model=os.path.join(DEMO, "target")),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        device_config=SimpleNamespace(device="cpu"),
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-tiny")]}},
    )


@pytest.fixture
def faulty(monkeypatch):
    """A MultiDraftProposer built under SPECPLUGIN_DRAFT_FAULT=<spec>, on classes of its own (the
    wrappers are class-level: subclasses keep them away from every other test)."""
    from vllm_specplugin.proposers import draft_runtime

    made = []

    def build(spec: str):
        runtime_class = type("FaultyDraftRuntime", (draft_runtime.DraftRuntime,), {})
        adapter_class = type("FaultyProposer", (adapters.MultiDraftProposer,), {})
        monkeypatch.setattr(draft_runtime, "DraftRuntime", runtime_class)
        monkeypatch.setenv(faults.DRAFT_ENV_VAR, spec)
        assert faults.install_draft_faults(runtime_class, adapter_class) is not None
        assert faults.install_draft_faults(runtime_class, adapter_class) is not None  # idempotent
        made.append(adapter_class(vllm_config()))
        assert type(made[-1]._runtimes[0]) is runtime_class
        return made[-1]

    yield build
    for adapter in made:
        adapter.publisher.close()


def step(adapter, ids, temperature=1.0, length=24, seed=0):
    tokens = np.zeros((len(ids), 512), dtype=np.int64)
    tokens[:, :length] = np.random.default_rng(seed).integers(3, VOCAB, (len(ids), length))
    params = [SamplingParams(temperature)] * len(ids)
    adapter.set_batch_view(BatchView(list(ids), params, [None] * len(ids), frozenset(ids)))
    drafts = adapter.propose([[5]] * len(ids), np.full(len(ids), length), tokens)
    return drafts, adapter.take_last_draft_probs()


def test_raise_every_step_fails_each_step_and_then_disables(faulty, caplog):
    adapter = faulty("raise:1")
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        for n in range(adapters.MAX_CONSECUTIVE_DRAFT_FAILURES):
            drafts, probs = step(adapter, ["a", "b"], seed=n)
            assert drafts == [[], []] and probs is None  # plain decoding, no token lost
    assert adapter.metrics.draft_failures == adapters.MAX_CONSECUTIVE_DRAFT_FAILURES
    assert adapter.drafting_disabled
    first = next(r for r in caplog.records if "drafting failed (1 time(s)" in r.getMessage())
    assert isinstance(first.exc_info[1], faults.InjectedDraftFault)


def test_intermittent_raise_keeps_drafting_between_failures(faulty):
    adapter = faulty("raise:0.3,seed:0")
    outcomes = []
    for n in range(40):
        drafts, probs = step(adapter, ["a", "b"], seed=n % 3)
        outcomes.append(bool(drafts[0]))
        assert (probs is None) == (not any(drafts))
    failures = adapter.metrics.draft_failures
    assert 0 < failures < 40 and outcomes.count(False) >= failures
    assert outcomes.count(True) >= 20 and not adapter.drafting_disabled


def test_nan_steps_drop_the_sampled_rows_drafts(faulty):
    adapter = faulty("nan:1")
    drafts, probs = step(adapter, ["hot", "warm"], temperature=1.0)
    assert drafts == [[], []] and probs is None
    assert adapter.metrics.nonfinite_draft_rows == 2 and adapter.metrics.draft_failures == 0
    greedy, probs = step(adapter, ["cold"], temperature=0.0, seed=1)
    assert len(greedy[0]) == K and torch.isfinite(probs).all()  # a one-hot q: exact, just a bad guess


def test_slow_draft_sleeps_per_forward(faulty):
    adapter = faulty("slow:30ms")
    started = time.perf_counter()
    drafts, _ = step(adapter, ["a"])
    assert len(drafts[0]) == K
    assert time.perf_counter() - started >= K * 0.03  # at least one forward per draft token


# -- the shutdown race (vllm_specplugin/shutdown_repair.py) ---------------------------------------


def test_shutdown_repair_fails_requests_left_in_flight():
    """What the API server does on SIGTERM: AsyncLLM.shutdown from a worker thread, its output
    handler cancelled. Without the repair the request below waits forever; with it, it gets
    EngineDeadError (the client sees HTTP 500 or an error event)."""
    import asyncio

    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from vllm_specplugin import shutdown_repair

    class Processor:
        def __init__(self):
            self.queues = {}

        def get_num_unfinished_requests(self):
            return len(self.queues)

        def propagate_error(self, error):
            for queue in self.queues.values():
                queue.put(error)

    async def scenario(repaired: bool):
        loop = asyncio.get_running_loop()
        engine = SimpleNamespace(output_processor=Processor())
        engine.output_handler = loop.create_task(asyncio.sleep(3600))
        from vllm.sampling_params import RequestOutputKind

        queue = RequestOutputCollector(RequestOutputKind.DELTA, "req-1")
        engine.output_processor.queues["req-1"] = queue

        def shutdown():  # AsyncLLM.shutdown's tail: the handler is cancelled, nobody fails the queue
            engine.output_handler.cancel()
            if repaired:
                assert shutdown_repair.fail_unfinished_requests(engine) == 1

        await loop.run_in_executor(None, shutdown)
        try:
            await asyncio.wait_for(queue.get(), timeout=2)
        except EngineDeadError:
            return "EngineDeadError"
        except asyncio.TimeoutError:
            return "hangs"
        return "output"

    assert asyncio.run(scenario(repaired=False)) == "hangs"
    assert asyncio.run(scenario(repaired=True)) == "EngineDeadError"


def test_shutdown_repair_wraps_async_llm_once(monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_specplugin import shutdown_repair

    # The plugin's registration (install.install) may have wrapped it already in this process:
    # start from vLLM's own method (restored afterwards).
    original = getattr(AsyncLLM.shutdown, "__wrapped__", AsyncLLM.shutdown)
    monkeypatch.setattr(AsyncLLM, "shutdown", original)
    assert shutdown_repair.apply() is True and shutdown_repair.apply() is False
    assert AsyncLLM.shutdown is not original and AsyncLLM.shutdown.__wrapped__ is original
    calls = []
    engine = SimpleNamespace(output_processor=SimpleNamespace(get_num_unfinished_requests=lambda: 0))
    monkeypatch.setattr(shutdown_repair, "fail_unfinished_requests", lambda e: calls.append(e))
    wrapped = shutdown_repair._failing_unfinished_requests(lambda self, timeout=None: calls.append(timeout))
    wrapped(engine, timeout=0)
    assert calls == [0, engine]  # the original first, then the pending requests
