"""Bad requests to a server running the plugin (every strategy on): each gets vLLM's normal 4xx
answer with an error message, the server stays healthy, and requests sent alongside the bad ones
are served in full (issue 14, item 4)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vllm_specplugin.server import VllmServer
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

pytestmark = pytest.mark.server

DEMO = os.path.join(REPO_ROOT, "models", "demo")
TARGET = os.path.join(DEMO, "target")
MAX_MODEL_LEN = 512
GOOD_TOKENS = 24

# name -> (JSON body for /v1/completions, or a raw malformed body as bytes)
BAD_REQUESTS = {
    "negative temperature": {"prompt": "def f():", "max_tokens": 8, "temperature": -1.0},
    "top_p above 1": {"prompt": "def f():", "max_tokens": 8, "top_p": 1.5},
    "top_k below -1": {"prompt": "def f():", "max_tokens": 8, "top_k": -5},
    "n = 0": {"prompt": "def f():", "max_tokens": 8, "n": 0},
    "max_tokens = 0": {"prompt": "def f():", "max_tokens": 0},
    "presence_penalty out of range": {"prompt": "def f():", "max_tokens": 8, "presence_penalty": 5.0},
    "prompt longer than max_model_len": {"prompt": [5] * (MAX_MODEL_LEN + 88), "max_tokens": 8},
    "max_tokens beyond max_model_len": {"prompt": [5] * 10, "max_tokens": MAX_MODEL_LEN * 4},
    "empty prompt": {"prompt": "", "max_tokens": 8},
    "empty token list": {"prompt": [], "max_tokens": 8},
    "token id outside the vocabulary": {"prompt": [5, 4096 * 10], "max_tokens": 8},
    "huge n": {"prompt": "def f():", "max_tokens": 8, "n": 100_000},
    "malformed JSON": b'{"prompt": "def f():", "max_tokens": 8',
    "wrong type": {"prompt": "def f():", "max_tokens": "eight"},
}


@pytest.fixture(scope="module")
def server():
    server = VllmServer(
        TARGET,
        speculative_config={
            "method": "custom_class",
            "model": "vllm_specplugin.adapters.MultiDraftProposer",
            "num_speculative_tokens": 3,
        },
        additional_config={"specplugin": {
            "drafts": [os.path.join(DEMO, "draft-distill"), os.path.join(DEMO, "draft-small")],
            "adaptive_gamma": {"mode": "threshold"}, "tree_drafting": {"node_budget": 8, "branching": 2},
            "prefix_sharing": True,
        }},
        max_model_len=MAX_MODEL_LEN,
        extra_args=["--max-num-seqs", "16", "--enforce-eager"],  # what it checks is not compiled: a start 20 s shorter
    )
    with server:
        yield server


def post(server: VllmServer, body, timeout: float = 300) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps({"model": TARGET, **body}).encode()
    return httpx.post(server.base_url + "/v1/completions", content=content,
                      headers={"Content-Type": "application/json"}, timeout=timeout)


def good(server: VllmServer, seed: int) -> dict:
    response = post(server, {"prompt": [5 + seed, 9, 13], "max_tokens": GOOD_TOKENS, "temperature": 1.0,
                             "top_k": 50, "top_p": 0.9, "ignore_eos": True, "seed": seed})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_and_the_server_keeps_serving(server, name):
    response = post(server, BAD_REQUESTS[name])
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:500])
    body = response.json()
    message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("detail")
    assert message, (name, body)  # a reason, not a bare status
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    assert len(good(server, seed=len(name))["choices"][0]["text"]) > 0


def test_bad_requests_alongside_good_ones(server):
    """Every bad request at once, interleaved with 16 good ones: the good ones are served in full."""
    jobs = [("bad", name) for name in BAD_REQUESTS] + [("good", i) for i in range(16)]
    jobs = jobs[::2] + jobs[1::2]

    def run(job):
        kind, what = job
        if kind == "bad":
            return kind, post(server, BAD_REQUESTS[what]).status_code
        completion = good(server, seed=100 + what)
        return kind, completion["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(run, jobs))
    assert all(400 <= value < 500 for kind, value in outcomes if kind == "bad"), outcomes
    assert [value for kind, value in outcomes if kind == "good"] == [GOOD_TOKENS] * 16, outcomes
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    with open(server.log_path) as f:
        log = f.read()
    assert "EngineCore encountered a fatal error" not in log and "EngineDeadError" not in log
