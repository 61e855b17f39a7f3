"""The soak's checks, without a server: each fails for the right reason on a crafted bad answer
(a dropped token, a wrong finish reason, broken SSE, a stop string left in the text, a usage
mismatch), the memory fit sees an injected leak, the greedy comparison tells a near-tie from a
real difference, and the workload stays within its bounds."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vllm_specplugin.throughput import soak


def job(max_tokens=8, n=1, stop=None, endpoint="completions", stream=False, ignore_eos=True):
    body = {"max_tokens": max_tokens, "n": n}
    if ignore_eos:
        body["ignore_eos"] = True
    return soak.Job(0, endpoint, body, stream, max_tokens, n, stop, 1.0, False)


def payload(choices, completion_tokens=None):
    tokens = sum(len(c["token_ids"]) for c in choices)
    return {"choices": choices, "usage": {"completion_tokens": tokens if completion_tokens is None else completion_tokens}}


def choice(index=0, tokens=8, finish="length", stop_reason=None, text="abc"):
    return {"index": index, "text": text, "token_ids": list(range(tokens)), "finish_reason": finish,
            "stop_reason": stop_reason, "prompt_token_ids": [1, 2]}


def test_a_full_answer_passes():
    problems, choices, prompt = soak.check_response(job(), payload([choice()]))
    assert problems == [] and prompt == [1, 2] and len(choices) == 1


def test_a_dropped_token_fails():
    problems, _, _ = soak.check_response(job(), payload([choice(tokens=7)]))
    assert problems == ["choice 0: finish_reason length with 7 tokens, asked 8"]


def test_missing_choice_and_wrong_usage_fail():
    problems, _, _ = soak.check_response(job(n=2), payload([choice()], completion_tokens=9))
    assert any("choice indices" in p for p in problems)
    assert any("usage.completion_tokens 9 != 8" in p for p in problems)


def test_stop_rules():
    stop = ["\n"]
    assert soak.check_response(job(stop=stop), payload([choice(tokens=3, finish="stop", stop_reason="\n")]))[0] == []
    bad_text = soak.check_response(job(stop=stop), payload([choice(tokens=3, finish="stop", stop_reason="\n", text="a\nb")]))[0]
    assert bad_text == ["choice 0: the text contains a stop string"]
    unknown = soak.check_response(job(stop=stop), payload([choice(tokens=3, finish="stop", stop_reason="x")]))[0]
    assert "not among the stop strings" in unknown[0]
    eos = soak.check_response(job(), payload([choice(tokens=3, finish="stop")]))[0]
    assert eos == ["choice 0: stopped (EOS) although ignore_eos"]
    assert soak.check_response(job(ignore_eos=False), payload([choice(tokens=3, finish="stop")]))[0] == []
    assert "finish_reason 'abort'" in soak.check_response(job(), payload([choice(finish="abort")]))[0][0]


def sse(chunks, done=True):
    lines = []
    for c in chunks:
        lines += ["data: " + json.dumps(c), ""]
    if done:
        lines += ["data: [DONE]", ""]
    return lines


def stream_chunks(tokens=(3, 3, 2), finish="length"):
    chunks = []
    for i, count in enumerate(tokens):
        last = i == len(tokens) - 1
        chunks.append({"choices": [{"index": 0, "text": "x", "token_ids": list(range(count)),
                                    "finish_reason": finish if last else None, "stop_reason": None,
                                    "prompt_token_ids": [1] if i == 0 else None}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": sum(tokens)}})
    return chunks


def test_stream_checks():
    j = job(stream=True)
    assert soak.check_stream(j, sse(stream_chunks()))[0] == []
    assert soak.check_stream(j, sse(stream_chunks(), done=False))[0] == ["stream did not end with data: [DONE]"]
    short = soak.check_stream(j, sse(stream_chunks(tokens=(3, 3, 1))))[0]
    assert "finish_reason length with 7 tokens, asked 8" in short[0]
    broken = sse(stream_chunks())
    broken[2] = "data: {not json"
    assert any("chunk is not JSON" in p for p in soak.check_stream(j, broken)[0])
    twice = stream_chunks()
    twice.insert(2, {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]})
    assert any("after its finish_reason" in p for p in soak.check_stream(j, sse(twice))[0])


def test_slope_sees_a_leak_and_not_noise():
    rng = np.random.default_rng(0)
    t = np.arange(0, 600, 2.0)
    flat = 2000 + rng.normal(0, 3, t.size)
    slope, se = soak.fit_slope(t.tolist(), flat.tolist())
    assert abs(slope) < 0.5 and se < 0.5
    leaking = flat + 5.0 * t / 60  # 5 MiB/min
    assert soak.fit_slope(t.tolist(), leaking.tolist())[0] == pytest.approx(5.0, abs=0.5)


class FakeReference:
    """Logits with a near-tie between tokens 3 and 4 after prefix (7,), token 5 far ahead elsewhere."""

    def __init__(self):
        import torch

        self.torch = torch
        self.model = self

    def next_logits(self, prompt, prefixes):
        rows = []
        for prefix in prefixes:
            row = np.zeros(16, dtype=np.float32)
            if tuple(prefix) == (7,):
                row[3], row[4] = 10.0, 10.0 - 1e-5
            else:
                row[5] = 10.0
            rows.append(row)
        return np.stack(rows)

    def __call__(self, input_ids):
        class Out:
            pass

        out = Out()
        out.logits = self.torch.zeros((1, input_ids.shape[1], 16))
        out.logits[..., 5] = 10.0
        return out


def test_greedy_difference_at_a_near_tie_passes_and_elsewhere_fails():
    ref = FakeReference()
    tie = soak.compare_greedy([{"index": 0, "prompt": [1], "plugin": [7, 3, 9], "plain": [7, 4, 9]}], ref, 1e-3)
    assert tie["sequences_differing"] == 1 and tie["not_near_tie"] == 0 and tie["tokens_compared"] == 2
    real = soak.compare_greedy([{"index": 0, "prompt": [1], "plugin": [5, 3], "plain": [6, 3]}], ref, 1e-3)
    assert real["not_near_tie"] == 1
    assert real["differences"][0]["plain_gap_to_top"] == pytest.approx(10.0)
    same = soak.compare_greedy([{"index": 0, "prompt": [1], "plugin": [5, 5], "plain": [5, 5]}], ref, 1e-3)
    assert same["tokens_compared"] == 2 and same["sequences_differing"] == 0


def test_seeded_repeats_compared_choice_by_choice():
    first = soak.Job(0, "completions", {}, False, 4, 1, None, 1.0, True)
    again = soak.Job(9, "completions", {}, False, 4, 1, None, 1.0, True, repeat_of=0)
    outcome = lambda i, toks: soak.Outcome(i, "completions", False, "ok", choices=[{"index": 0, "token_ids": toks}])
    same = soak.compare_repeats([first, again], {0: outcome(0, [1, 2, 3, 4]), 9: outcome(9, [1, 2, 3, 4])})
    assert same == {"pairs": 1, "differing": 0, "details": []}
    differ = soak.compare_repeats([first, again], {0: outcome(0, [1, 2, 3, 4]), 9: outcome(9, [1, 2, 5, 4])})
    assert differ["differing"] == 1 and differ["details"][0]["position"] == 2


def test_workload_within_bounds():
    pytest.importorskip("tokenizers")
    cfg = soak.SoakConfig()
    workload = soak.Workload(cfg, soak.TARGET)
    jobs = [workload.next_job() for _ in range(3000)]
    for j in jobs:
        prompt = j.body.get("prompt")
        if isinstance(prompt, list):
            assert 1 <= len(prompt) and len(prompt) + j.max_tokens <= cfg.max_model_len
        assert j.max_tokens >= 1
        assert j.n == 1 or j.temperature > 0  # vLLM refuses n > 1 with greedy sampling
        if "top_k" in j.body:
            assert j.body.get("top_p", 1.0) < 1.0  # see the module docstring: top-k alone kills the engine
    streams = [j for j in jobs if j.stream and j.repeat_of is None]
    assert 0.06 < sum(j.disconnect_after is not None for j in streams) / len(streams) < 0.14
    assert {j.temperature for j in jobs} == {0.0, 0.7, 1.0, 1.3}  # 1.3: creative's hot setting
    assert any(j.repeat_of is not None for j in jobs) and any(j.endpoint == "chat" for j in jobs)
    assert min(len(j.body["prompt"]) for j in jobs if isinstance(j.body.get("prompt"), list)) == 1
    assert any(j.max_tokens == 1 for j in jobs) and any(j.stop for j in jobs) and any(j.seeded for j in jobs)
    levels = soak.concurrency_schedule(cfg)
    assert min(levels) == 1 and max(levels) == cfg.max_concurrency


def test_workload_draws_every_category_of_the_library():
    """The soak's prompts come from the workload library (throughput/workloads.py): every text
    category is drawn, creative only at its own temperatures, every prompt a window of its
    category's prompts, and a copy prompt ends where a copy prompt of the library ends."""
    pytest.importorskip("tokenizers")
    from vllm_specplugin.throughput.workloads import CATEGORIES, TEXT_CATEGORIES

    workload = soak.Workload(soak.SoakConfig(), soak.TARGET)
    jobs = [workload.next_job() for _ in range(2000)]
    counts = {name: sum(j.category == name for j in jobs) for name in TEXT_CATEGORIES}
    assert all(count > 300 for count in counts.values()), counts
    assert {j.temperature for j in jobs if j.category == "creative"} == set(CATEGORIES["creative"].temperatures)
    token_windows = [j for j in jobs if isinstance(j.body.get("prompt"), list) and j.repeat_of is None]
    assert token_windows
    for j in token_windows:
        ids = j.body["prompt"]
        if j.category == "copy":
            assert any(full[-len(ids):] == ids for full in workload.copies), j.index
        else:
            stream = workload.streams[j.category]
            assert any(stream[i : i + len(ids)] == ids for i in range(len(stream) - len(ids) + 1)), j.index


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "vllm_specplugin.throughput.soak", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--duration-s" in out.stdout and "--plain-model" in out.stdout
