"""MultiDraftProposer's vLLM-facing propose(), driven the way vLLM 0.32's runner calls it.

The engine is replaced by the arguments it passes (rows, token ids, the shim's BatchView); the
proposer, its drafts and the adapter's bookkeeping are the real ones. Faults are injected into
the real draft runtime (a forward that raises, NaN logits) or the proposer's own methods.
"""

from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplugin import adapters, metrics as plugin_metrics
from vllm_specplugin.proposers.sampling import SamplingParams
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.runner_shim import BatchView

DEMO = os.path.join(REPO_ROOT, "models", "demo")
K = 3
VOCAB = 4096
MAX_NUM_SEQS = 8


def vllm_config(**plugin):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: VOCAB, model=os.path.join(DEMO, "target")),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        device_config=SimpleNamespace(device="cpu"),
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-tiny")], **plugin}},
    )


def make_adapter(**plugin):
    from vllm_specplugin.adapters import MultiDraftProposer

    return MultiDraftProposer(vllm_config(**plugin))


@pytest.fixture(scope="module")
def adapter():
    adapter = make_adapter()
    yield adapter
    adapter.publisher.close()


@pytest.fixture
def fresh():
    """A proposer of its own, for tests that break it."""
    made = []

    def build(**plugin):
        made.append(make_adapter(**plugin))
        return made[-1]

    yield build
    for adapter in made:
        adapter.publisher.close()


def batch(rows: int, length: int = 20, seed: int = 0):
    tokens = np.zeros((rows, 512), dtype=np.int64)
    tokens[:, :length] = np.random.default_rng(seed).integers(3, VOCAB, (rows, length))
    return [[5]] * rows, np.full(rows, length), tokens


def view_of(ids, params=None, seeds=None):
    params = params or [SamplingParams(0.0)] * len(ids)
    return BatchView(list(ids), params, seeds or [None] * len(ids), frozenset(ids))


def test_shim_view_gives_ids_params_and_q(adapter):
    sampled, num_tokens, tokens = batch(3)
    sampled[1] = []  # row 1 is not decoding this step
    params = [SamplingParams(1.0, 50, 0.9), SamplingParams(0.0), SamplingParams(0.0)]
    adapter.set_batch_view(BatchView(["a", "b", "c"], params, [7, None, None], frozenset({"a", "b", "c"})))
    drafts = adapter.propose(sampled, num_tokens, tokens)
    assert [len(d) for d in drafts] == [K, 0, K]
    probs = adapter.take_last_draft_probs()
    assert probs.shape == (3, K, VOCAB) and probs.dtype == torch.float32 and probs.device.type == "cpu"
    assert float(probs[0].sum(-1).min()) == pytest.approx(1.0)
    assert int((probs[0] > 0).sum(-1).max()) <= 50  # row 0's q carries its top-k
    assert torch.equal(probs[2], torch.nn.functional.one_hot(torch.tensor(drafts[2]), VOCAB).float())
    assert float(probs[1].abs().sum()) == 0
    assert adapter.take_last_draft_probs() is None  # taken once
    # Requests that left the runner are forgotten at the next step.
    adapter.set_batch_view(BatchView(["c"], [SamplingParams(0.0)], [None], frozenset({"c"})))
    adapter.propose([[5]], num_tokens[:1], tokens[2:3])
    assert adapter.proposer.tracked_request_ids() == {"c"}


def test_q_buffer_is_allocated_once_sized_by_max_num_seqs_and_reused(adapter):
    """Item 8: one [max_num_seqs, k, V] float32 buffer; each step hands out a view of it, and a
    reused row carries no stale q past its new, shorter draft."""
    assert adapter.q_buffer_bytes == MAX_NUM_SEQS * K * VOCAB * 4
    assert adapter.metrics.draft_probs_buffer_bytes == adapter.q_buffer_bytes
    params = [SamplingParams(1.0), SamplingParams(0.7, 20)]
    sampled, num_tokens, tokens = batch(2)
    adapter.set_batch_view(view_of(["r1", "r2"], params))
    assert [len(d) for d in adapter.propose(sampled, num_tokens, tokens)] == [K, K]
    first = adapter.take_last_draft_probs()
    first_copy = first.clone()
    # Next step: row 0 now sits near max_model_len (room for one draft), row 1 does not decode.
    sampled, num_tokens, tokens = batch(2, length=510, seed=1)
    sampled[1] = []
    adapter.set_batch_view(view_of(["r3", "r4"], params))
    assert [len(d) for d in adapter.propose(sampled, num_tokens, tokens)] == [1, 0]
    second = adapter.take_last_draft_probs()
    assert second.data_ptr() == first.data_ptr()  # the same memory, no new allocation
    assert float(second[0, 1:].abs().sum()) == 0 and float(second[1].abs().sum()) == 0
    assert float(second[0, 0].sum()) == pytest.approx(1.0)
    assert not torch.equal(first_copy[0, 1:], torch.zeros_like(first_copy[0, 1:]))  # there was q to clear


def test_without_the_shim_drafts_are_greedy_per_row(fresh, caplog):
    """Item 17: the warning that the shim is off is logged, once per proposer."""
    adapter = fresh()
    sampled, num_tokens, tokens = batch(2)
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        first = adapter.propose(sampled, num_tokens, tokens)
        assert adapter.take_last_draft_probs() is None
        assert first == adapter.propose(sampled, num_tokens, tokens)  # greedy: deterministic
    warnings = [r for r in caplog.records if "runner shim inactive" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert all(len(d) == K for d in first)


def test_without_the_shim_a_row_keeps_state_only_for_its_own_request(fresh):
    """Item 11: rows are batch positions; after vLLM condenses the batch a row holds another
    request, whose tokens must not score the row's last draft (acceptance, weights, γ)."""
    adapter = fresh()
    forwarded = lambda: sum(rt.tokens_forwarded for rt in adapter._runtimes)  # noqa: E731
    sampled, num_tokens, tokens = batch(2, length=30)
    drafts = adapter.propose(sampled, num_tokens, tokens)
    assert adapter.proposer.tracked_request_ids() == {"row-0", "row-1"}
    # Next step: row 0 is the same request (its draft's first token accepted, plus one token of the
    # target's); row 1 is a different, longer request that vLLM moved into the row.
    tokens[0, 30:32] = [drafts[0][0], 11]
    num_tokens = np.array([32, 40])
    tokens[1, :40] = np.random.default_rng(9).integers(3, VOCAB, 40)
    before = forwarded()
    adapter.propose(sampled, num_tokens, tokens)
    metrics = adapter.metrics
    assert metrics.verify_steps == 1 and metrics.drafted_tokens == K and metrics.accepted_tokens == 1
    # Row 0 continued its cache (the draft's first token was cached already: 1 new token, then
    # the drafts); row 1 was prefilled afresh.
    assert forwarded() - before == 1 + 40 + 2 * (K - 1)
    # The batch shrinks to one row: row 1's state goes.
    adapter.propose([[5]], np.array([33]), tokens[:1])
    assert adapter.proposer.tracked_request_ids() == {"row-0"}


def test_a_drafting_error_falls_back_to_no_drafts(fresh, monkeypatch, caplog):
    adapter = fresh()

    def broken(requests):
        raise RuntimeError("simulated draft failure")

    monkeypatch.setattr(adapter.proposer, "propose", broken)
    sampled, num_tokens, tokens = batch(2)
    adapter.set_batch_view(view_of(["a", "b"]))
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        assert adapter.propose(sampled, num_tokens, tokens) == [[], []]
    assert adapter.take_last_draft_probs() is None
    assert adapter.metrics.draft_failures == 1 and not adapter.drafting_disabled
    (record,) = [r for r in caplog.records if "decodes without drafts" in r.getMessage()]
    assert record.exc_info is not None and "simulated draft failure" in str(record.exc_info[1])


def test_repeated_failures_disable_drafting_loudly_and_serving_goes_on(fresh, monkeypatch, caplog):
    adapter = fresh()
    calls = []

    def broken(requests):
        calls.append(len(requests))
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    sampled, num_tokens, tokens = batch(2)
    adapter.set_batch_view(view_of(["a", "b"]))
    adapter.propose(sampled, num_tokens, tokens)  # one good step: state to free later
    assert adapter.proposer.tracked_request_ids() == {"a", "b"}
    monkeypatch.setattr(adapter.proposer, "propose", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        for step in range(adapters.MAX_CONSECUTIVE_DRAFT_FAILURES + 2):
            adapter.set_batch_view(view_of(["a", "b"]))
            assert adapter.propose(sampled, num_tokens, tokens) == [[], []]  # plain decoding, every step
            assert adapter.take_last_draft_probs() is None
    assert len(calls) == adapters.MAX_CONSECUTIVE_DRAFT_FAILURES  # not called once disabled
    assert adapter.drafting_disabled and adapter.metrics.drafting_disabled == 1
    assert adapter.metrics.draft_failures == adapters.MAX_CONSECUTIVE_DRAFT_FAILURES
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DISABLED" in errors[0].getMessage()
    assert isinstance(errors[0].exc_info[1], torch.OutOfMemoryError)
    assert adapter.proposer.tracked_request_ids() == set() and adapter.q_buffer_bytes == 0


def test_intermittent_failures_do_not_disable(fresh, monkeypatch):
    """A draft whose forward raises on some steps: those steps decode plainly, the others draft."""
    adapter = fresh()
    runtime = adapter._runtimes[0]
    original = runtime._run
    step = {"n": 0}

    def sometimes_raising(*args, **kwargs):
        if step["n"] % 2:
            raise RuntimeError("simulated forward failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(runtime, "_run", sometimes_raising)
    sampled, num_tokens, tokens = batch(2)
    lengths = []
    for n in range(3 * adapters.MAX_CONSECUTIVE_DRAFT_FAILURES):
        step["n"] = n
        adapter.set_batch_view(view_of(["a", "b"], [SamplingParams(1.0), SamplingParams(0.0)]))
        lengths.append([len(d) for d in adapter.propose(sampled, num_tokens, tokens)])
        probs = adapter.take_last_draft_probs()
        assert (probs is None) == (n % 2 == 1)
    assert lengths == [[K, K] if n % 2 == 0 else [0, 0] for n in range(len(lengths))]
    assert not adapter.drafting_disabled
    assert adapter.metrics.draft_failures == len(lengths) // 2


def test_nan_logits_never_reach_vllm(fresh, monkeypatch, caplog):
    """A draft producing NaN logits: rows sampled at T > 0 get NaN q and are dropped (counted);
    greedy rows get the one-hot at the drafted token, a valid q."""
    adapter = fresh()
    runtime = adapter._runtimes[0]
    original = runtime._run

    def nan_logits(*args, **kwargs):
        logits, *rest = original(*args, **kwargs)
        return (None if logits is None else logits * float("nan")), *rest

    monkeypatch.setattr(runtime, "_run", nan_logits)
    sampled, num_tokens, tokens = batch(3)
    adapter.set_batch_view(view_of(["hot", "cold", "warm"], [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.5, 10)]))
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        drafts = adapter.propose(sampled, num_tokens, tokens)
    probs = adapter.take_last_draft_probs()
    assert [len(d) for d in drafts] == [0, K, 0]
    assert adapter.metrics.nonfinite_draft_rows == 2
    assert torch.isfinite(probs).all()
    assert float(probs[0].abs().sum()) == 0 and float(probs[2].abs().sum()) == 0
    assert torch.equal(probs[1], torch.nn.functional.one_hot(torch.tensor(drafts[1]), VOCAB).float())
    assert sum("dropped the draft" in r.getMessage() for r in caplog.records) == 2
    assert adapter.proposer.tracked_request_ids() == {"cold"}  # the dropped rows' state is freed
    assert not adapter.drafting_disabled


@pytest.mark.parametrize("corrupt", ["negative", "unnormalised", "inf", "token out of range"])
def test_invalid_q_is_dropped(fresh, monkeypatch, corrupt):
    adapter = fresh()
    propose = adapter.proposer.propose

    def corrupted(requests):
        drafts = propose(requests)
        draft = drafts[0]
        if corrupt == "negative":
            draft.probs[0, 0] -= 0.5
        elif corrupt == "unnormalised":
            draft.probs[1] *= 0.9
        elif corrupt == "inf":
            draft.probs[2, 0] = float("inf")
        else:
            draft.token_ids[1] = VOCAB
        return drafts

    monkeypatch.setattr(adapter.proposer, "propose", corrupted)
    for shim in (True, False):
        sampled, num_tokens, tokens = batch(2)
        if shim:
            adapter.set_batch_view(view_of(["a", "b"], [SamplingParams(1.0)] * 2))
        drafts = adapter.propose(sampled, num_tokens, tokens)
        assert [len(d) for d in drafts] == [0, K]
        probs = adapter.take_last_draft_probs()
        if shim:
            assert float(probs[0].abs().sum()) == 0 and torch.isfinite(probs).all()
    assert adapter.metrics.nonfinite_draft_rows == 2


def test_free_errors_are_logged_not_hidden(fresh, monkeypatch, caplog):
    adapter = fresh()
    sampled, num_tokens, tokens = batch(2)
    adapter.set_batch_view(view_of(["a", "b"]))
    adapter.propose(sampled, num_tokens, tokens)

    def broken_propose(requests):
        raise RuntimeError("simulated draft failure")

    def broken_free(request_id):
        raise KeyError(f"simulated free failure {request_id}")

    monkeypatch.setattr(adapter.proposer, "propose", broken_propose)
    monkeypatch.setattr(adapter.proposer, "free", broken_free)
    adapter.set_batch_view(view_of(["a", "b"]))
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        assert adapter.propose(sampled, num_tokens, tokens) == [[], []]
    freed = [r for r in caplog.records if "freeing the draft state" in r.getMessage()]
    assert sorted(r.args[0] for r in freed) == ["a", "b"]
    assert all(r.levelno == logging.ERROR and isinstance(r.exc_info[1], KeyError) for r in freed)


def test_cache_evictions_are_counted(fresh):
    adapter = fresh()
    adapter._runtimes[0].memory_budget_bytes = 1  # every request but the newest is evicted
    for step in range(2):
        sampled, num_tokens, tokens = batch(3, seed=step)
        adapter.set_batch_view(view_of(["a", "b", "c"]))
        adapter.propose(sampled, num_tokens, tokens)
    assert adapter.metrics.draft_cache_evictions == adapter._runtimes[0].evictions >= 4
    assert adapter.metrics.snapshot()["draft_cache_evictions"] == adapter.metrics.draft_cache_evictions


def test_room_near_max_model_len(adapter):
    sampled, num_tokens, tokens = batch(1, length=509)
    adapter.set_batch_view(BatchView(["n"], [SamplingParams(0.0)], [None], frozenset({"n"})))
    (draft,) = adapter.propose(sampled, num_tokens, tokens)
    assert len(draft) == 2  # max_model_len 512: 509 tokens leave room for 2 drafts (and the bonus)


# -- /metrics -------------------------------------------------------------------------------


class FlakyMetrics:
    """DraftMetrics' snapshot() raising now and then, like a dict resized while it is read."""

    def __init__(self, inner, fail_calls):
        self.inner, self.fail_calls, self.calls = inner, set(fail_calls), 0

    def snapshot(self):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("dictionary changed size during iteration (simulated)")
        return self.inner.snapshot()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_metrics_thread_survives_a_bad_snapshot(tmp_path, monkeypatch, caplog):
    from vllm_specplugin.proposers.metrics import DraftMetrics

    monkeypatch.setenv(plugin_metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plugin_metrics, "WRITE_INTERVAL_S", 0.02)
    metrics = FlakyMetrics(DraftMetrics(["d"]), fail_calls={1, 2})
    with caplog.at_level(logging.WARNING, logger="vllm.specplugin"):
        publisher = plugin_metrics.MetricsPublisher(metrics, "draft[d]")
        deadline = time.monotonic() + 10
        while not os.path.exists(publisher.path) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(publisher.path) and publisher._thread.is_alive()
        metrics.inner.drafting_disabled = 1  # a change without a proposer call is written too
        while json.load(open(publisher.path)).get("drafting_disabled") != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        publisher.close()
    assert json.load(open(publisher.path))["drafting_disabled"] == 1
    assert publisher.flush_failures == 2
    logged = [r for r in caplog.records if "metrics snapshot failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # the first failure, with its traceback


def test_collector_exports_health_metrics(tmp_path, monkeypatch):
    from vllm_specplugin.proposers.metrics import DraftMetrics

    monkeypatch.setenv(plugin_metrics.METRICS_DIR_ENV, str(tmp_path))
    for worker, (disabled, evictions) in enumerate([(0, 3), (1, 4)]):
        metrics = DraftMetrics(["d"], draft_failures=worker + 1, drafting_disabled=disabled,
                               nonfinite_draft_rows=2, draft_cache_evictions=evictions, draft_probs_buffer_bytes=100)
        (tmp_path / f"worker-{worker}.json").write_text(json.dumps(dict(metrics.snapshot(), label="x")))
    samples = {
        sample.name: sample.value
        for family in plugin_metrics.SnapshotCollector().collect()
        for sample in family.samples
    }
    assert samples["specplugin:drafting_disabled"] == 1
    assert samples["specplugin:draft_failures_total"] == 3
    assert samples["specplugin:nonfinite_draft_rows_total"] == 4
    assert samples["specplugin:draft_cache_evictions_total"] == 7
    assert samples["specplugin:draft_probs_buffer_bytes"] == 200


def test_seeded_draft_streams_never_are_a_target_stream(adapter):
    """Issue 29 item 5: vLLM samples a seeded request from manual_seed(seed), whose CPU stream depends
    on seed % 2**32 only. A request's draft stream must be none of those: not its own seed's, not
    another seed's (the old derivation seed * 0x9E3779B1 + 1 gave seed 0 the stream of seed 1), and
    the same for the same seed (reproducible)."""
    from vllm_specplugin.proposers.sampling import is_seeded_mt19937_state

    seeds = list(range(64)) + [2**32 - 1, 2**32, 2**40 + 3, -1]
    targets = {tuple(torch.rand(4, generator=torch.Generator().manual_seed(t)).tolist()): t
               for t in range(-1, 300)}
    drafts = set()
    for seed in seeds:
        generator = adapter._generator(f"seed-test-{seed}", seed)
        assert not is_seeded_mt19937_state(generator), seed
        draws = tuple(torch.rand(4, generator=generator).tolist())
        assert draws not in targets, f"seed {seed} drafts with the target stream of seed {targets[draws]}"
        drafts.add(draws)
        again = adapter._generators.pop(f"seed-test-{seed}") and adapter._generator(f"seed-test-{seed}-2", seed)
        assert tuple(torch.rand(4, generator=again).tolist()) == draws
        adapter._generators.pop(f"seed-test-{seed}-2")
    assert len(drafts) == len(seeds)  # distinct seeds, distinct draft streams (2**32 apart included)
