"""specplugin-verify's engine flags and its two-sample mode without an engine: argument
validation, the flags reaching the drivers, the power plan (refusal when underpowered), and the
whole two-sample run against seeded synthetic samplers and a stub OpenAI-compatible server."""

from __future__ import annotations

import http.server
import json
import threading

import numpy as np
import pytest

from vllm_specplugin.verification import cli, drivers, two_sample
from vllm_specplugin.verification.drivers import EngineRun, GenerationTask, SamplingConfig, TaskResult
from vllm_specplugin.verification.engine_settings import EngineSettings, engine_driver

V = 8  # vocabulary of the synthetic samplers


def markov_rows(seed: int, n: int, m: int, sharpen: float = 1.0) -> list[list[int]]:
    """n continuations of m tokens of a fixed Markov source; ``sharpen`` != 1 (a 'fault') applies
    from token 2 on, as a speculative fault does (token 1 is the target's prefill sample)."""
    source = np.random.default_rng(123)
    init = source.dirichlet(np.ones(V) * 2)
    trans = source.dirichlet(np.ones(V) * 2, size=V) ** sharpen
    trans /= trans.sum(axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    out = np.zeros((n, m), dtype=int)
    out[:, 0] = rng.choice(V, size=n, p=init)
    for t in range(1, m):
        for row in range(n):
            out[row, t] = rng.choice(V, p=trans[out[row, t - 1]])
    return out.tolist()


def fake_driver(sharpen: float = 1.0, seen: list | None = None):
    def run(tasks: list[GenerationTask]) -> EngineRun:
        if seen is not None:
            seen.append(tasks)
        results = []
        for task in tasks:
            sp = task.sampling
            outputs = [markov_rows(drivers.request_seed(sp.seed, i, 0, sp.n), sp.n, sp.max_tokens, sharpen)
                       for i in range(len(task.prompts))]
            results.append(TaskResult(outputs=outputs, generate_s=0.0))
        return EngineRun(startup_s=0.0, tasks=results)

    return run


def sampling(n: int = 1500, m: int = 3) -> SamplingConfig:
    return SamplingConfig(temperature=1.0, max_tokens=m, n=n, seed=7)


# --- engine flags --------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float64"], "invalid choice"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1"),
    (["--tensor-parallel-size", "two"], "--tensor-parallel-size must be an integer >= 1"),
    (["--max-model-len", "-5"], "--max-model-len must be an integer >= 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a fraction in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a fraction in (0, 1]"),
    (["--gpu-memory-utilization", "lots"], "--gpu-memory-utilization must be a number"),
])
@pytest.mark.parametrize("mode", ["reference", "two-sample"])
def test_bad_engine_flags_are_refused_with_their_name(mode, argv, message, capsys):
    base = ["--model", "m"] if mode == "reference" else [
        "two-sample", "--model", "m", "--speculative-config", '{"method": "ngram"}']
    with pytest.raises(SystemExit) as exit_:
        cli.main(base + argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_engine_settings_validate_in_the_api_too():
    with pytest.raises(ValueError, match="--dtype must be one of"):
        EngineSettings(dtype="fp8")
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        EngineSettings(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineSettings(gpu_memory_utilization=2.0)


def test_engine_flags_reach_the_offline_and_http_drivers(monkeypatch):
    calls = {}
    monkeypatch.setattr(drivers, "run_offline", lambda model, tasks, **kw: calls.setdefault("offline", kw))
    monkeypatch.setattr(drivers, "run_http", lambda model, tasks, **kw: calls.setdefault("http", kw))
    settings = EngineSettings(dtype="bfloat16", tensor_parallel_size=2, max_model_len=2048,
                              trust_remote_code=True, gpu_memory_utilization=0.85)
    engine_driver("M", settings, speculative_config={"x": 1}, driver="offline")([])
    engine_driver("M", settings, driver="http")([])
    offline, http = calls["offline"], calls["http"]
    assert offline["dtype"] == "bfloat16" and offline["max_model_len"] == 2048
    assert offline["engine_options"] == {"tensor_parallel_size": 2, "trust_remote_code": True}
    assert offline["gpu_memory_utilization"] == 0.85 and offline["speculative_config"] == {"x": 1}
    assert http["dtype"] == "bfloat16" and http["max_model_len"] == 2048 and http["speculative_config"] is None
    assert http["extra_args"] == ["--tensor-parallel-size", "2", "--trust-remote-code",
                                  "--gpu-memory-utilization", "0.85"]


def test_reference_mode_passes_the_engine_flags(monkeypatch):
    captured = {}

    def fake_run_check(model, samplings, prompts, **kw):
        captured.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_check", fake_run_check)
    monkeypatch.setattr(drivers, "run_offline", lambda model, tasks, **kw: captured.setdefault("offline", kw))
    with pytest.raises(SystemExit):
        cli.main(["--model", "m", "--prompt-ids", "[[5, 6]]", "--dtype", "float16", "--tensor-parallel-size", "2",
                  "--max-model-len", "1024", "--gpu-memory-utilization", "0.5"])
    captured["driver"]([])
    assert captured["driver_name"] == "offline dtype=float16 max_model_len=1024 tensor_parallel_size=2 " \
                                      "gpu_memory_utilization=0.5"
    assert captured["offline"]["dtype"] == "float16" and captured["offline"]["max_model_len"] == 1024
    assert captured["offline"]["engine_options"] == {"tensor_parallel_size": 2}


# --- two-sample: arguments -----------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--spec-url", "http://a"], "give both --spec-url and --plain-url"),
    (["--spec-url", "http://a", "--plain-url", "http://b", "--speculative-config", "{}"], "already configured"),
    ([], "--speculative-config is required"),
    (["--speculative-config", "{\"a\": 1}", "--temperature", "0"], "--temperature must be > 0"),
    (["--speculative-config", "{\"a\": 1}", "--prompt-ids", "[[]]"], "--prompt-ids must be"),
    (["--speculative-config", "{\"a\": 1}", "--max-bins", "1"], "--max-bins"),
    (["--speculative-config", "{\"a\": 1}", "--top-p", "0"], "--top-p"),
    (["--speculative-config", "{\"a\": 1}", "--plain-url-typo"], "unrecognized arguments"),
])
def test_two_sample_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["two-sample", "--model", "m"] + argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# --- two-sample: power plan ----------------------------------------------------------------


def test_plan_is_computed_before_sampling_and_refuses_when_underpowered():
    seen = []
    with pytest.raises(two_sample.Underpowered, match="Raise --samples to >= "):
        two_sample.run_two_sample(fake_driver(seen=seen), fake_driver(seen=seen), [sampling(n=200)], [[1], [2]],
                                  log=lambda *a: None)
    assert seen == []  # refused before anything was sampled
    plan = two_sample.plan([sampling(n=200)], 2)
    assert plan.underpowered and plan.n_needed > 200
    again = two_sample.plan([sampling(n=plan.n_needed)], 2)
    assert not again.underpowered and again.power >= 0.9
    with pytest.warns(UserWarning, match="UNDERPOWERED"):
        report = two_sample.run_two_sample(fake_driver(), fake_driver(), [sampling(n=200)], [[1], [2]],
                                           allow_underpowered=True, log=lambda *a: None)
    assert report.warnings and "UNDERPOWERED" in report.format_table()


# --- two-sample: decisions -----------------------------------------------------------------


def test_honest_passes_a_fault_is_caught_and_runs_reproduce():
    seen = []
    kwargs = dict(delta=0.2, log=lambda *a: None)
    honest = two_sample.run_two_sample(fake_driver(seen=seen), fake_driver(seen=seen), [sampling()], [[1], [2], [3]],
                                       **kwargs)
    spec_seeds = [t.sampling.seed for t in seen[0]]
    plain_seeds = [t.sampling.seed for t in seen[1]]
    assert spec_seeds == [7] and plain_seeds == [7 + 3 * 1500]  # disjoint request seeds
    assert honest.passed, honest.format_table()
    faulty = two_sample.run_two_sample(fake_driver(sharpen=1.6), fake_driver(), [sampling()], [[1], [2], [3]],
                                       **kwargs)
    print(faulty.format_table())
    assert not faulty.passed and faulty.verdict == "FAIL"
    worst = faulty.cases[0].prompts[0].worst_node
    assert worst["position"] >= 1  # the deviation is after the first token
    again = two_sample.run_two_sample(fake_driver(sharpen=1.6), fake_driver(), [sampling()], [[1], [2], [3]],
                                      **kwargs)
    assert again.to_json().replace(f'"wall_s": {again.wall_s}', "") == \
        faulty.to_json().replace(f'"wall_s": {faulty.wall_s}', "")  # same seeds, same report
    data = json.loads(faulty.to_json())
    assert data["verdict"] == "FAIL" and data["plan"]["df_bound"] == 30
    assert faulty.to_markdown().startswith("# Two-sample exactness check: FAIL")
    pvalues = [p.pvalue for p in faulty.cases[0].prompts]
    holm = [p.pvalue_holm for p in faulty.cases[0].prompts]
    assert all(h >= p for h, p in zip(holm, pvalues)) and min(holm) == pytest.approx(min(1.0, 3 * min(pvalues)))


def test_temperature_zero_and_missing_seed_are_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        two_sample.run_two_sample(fake_driver(), fake_driver(), [SamplingConfig(temperature=0.0, n=1)], [[1]])
    with pytest.raises(ValueError, match="seed"):
        two_sample.run_two_sample(fake_driver(), fake_driver(), [SamplingConfig(1.0, n=10, seed=None)], [[1]])


def test_empty_outputs_are_rejected_not_passed():
    def empty(tasks):
        return EngineRun(0.0, [TaskResult(outputs=[[] for _ in t.prompts], generate_s=0.0) for t in tasks])

    report = two_sample.run_two_sample(empty, fake_driver(), [sampling(n=3000)], [[1]], log=lambda *a: None)
    assert not report.passed


# --- two-sample: endpoints (a stub OpenAI-compatible server) -------------------------------


class _Stub(http.server.BaseHTTPRequestHandler):
    sharpen = 1.0
    requests: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        rows = markov_rows(body["seed"], body["n"], body["max_tokens"], self.sharpen)
        data = {"choices": [{"index": i, "text": "", "token_ids": row} for i, row in enumerate(rows)]}
        payload = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802  (/metrics: none)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def stubs():
    servers = []
    for sharpen in (1.0, 1.6):
        handler = type("Stub", (_Stub,), {"sharpen": sharpen, "requests": []})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append((f"http://127.0.0.1:{server.server_address[1]}", handler))
    yield servers
    for url, _ in servers:
        pass


@pytest.mark.parametrize("faulty, code", [(False, 0), (True, 1)])
def test_two_sample_cli_against_endpoints(stubs, tmp_path, faulty, code, capsys):
    (honest_url, honest), (faulty_url, _) = stubs
    report_path, md_path = tmp_path / "r.json", tmp_path / "r.md"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["two-sample", "--model", "served", "--spec-url", (faulty_url if faulty else honest_url) + "/v1",
                  "--plain-url", honest_url, "--prompt", "a", "--prompt", "b", "--samples", "1500", "--delta", "0.2",
                  "--top-k", "20", "--seed", "11", "--json", str(report_path), "--markdown", str(md_path)])
    out = capsys.readouterr().out
    assert exit_.value.code == code, out
    report = json.loads(report_path.read_text())
    assert report["verdict"] == ("FAIL" if faulty else "PASS") and report["mode"] == "endpoints"
    assert md_path.read_text().startswith("# Two-sample exactness check")
    body = honest.requests[-1]
    assert body["model"] == "served" and body["ignore_eos"] and body["return_token_ids"] and body["top_k"] == 20
    assert body["n"] <= 100 and body["prompt"] in ("a", "b")
    assert len({r["seed"] for r in honest.requests}) == len(honest.requests)  # a seed per request


def test_endpoint_errors_are_clear(stubs):
    with pytest.raises(ValueError, match="http://"):
        two_sample.endpoint_driver("localhost:8000", "m")
    with pytest.raises(two_sample.EndpointError, match="unreachable"):
        two_sample.endpoint_driver("http://127.0.0.1:9", "m")([GenerationTask(["x"], sampling(n=1))])


def test_two_sample_engine_mode_starts_a_speculative_and_a_plain_engine(monkeypatch, capsys):
    calls = []

    def fake_run_offline(model, tasks, **kw):
        calls.append(kw)
        return fake_driver()(tasks)

    monkeypatch.setattr(drivers, "run_offline", fake_run_offline)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["two-sample", "--model", "M", "--speculative-config", '{"method": "ngram"}',
                  "--additional-config", '{"specplugin": {}}', "--prompt-ids", "[[4, 5]]", "--dtype", "bfloat16",
                  "--tensor-parallel-size", "2", "--samples", "1200", "--delta", "0.2"])
    assert exit_.value.code == 0, capsys.readouterr().out
    spec, plain = calls
    assert spec["speculative_config"] == {"method": "ngram"} and spec["additional_config"] == {"specplugin": {}}
    assert plain["speculative_config"] is None and not plain["additional_config"]
    for kw in calls:
        assert kw["dtype"] == "bfloat16" and kw["engine_options"] == {"tensor_parallel_size": 2}
