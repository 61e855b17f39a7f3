"""A per-request lossy acceptance class on a running server, beside exact requests (issue 15 A).

One server (127.0.0.1, demo target, the plugin's MultiDraftProposer with draft-distill, k = 3,
server-wide acceptance exact) gets, concurrently and interleaved so that they share batches,
requests of the exact class and of a lossy class (``vllm_xargs: {"specplugin_acceptance":
"lenient", "specplugin_lenience": 0.2}``). The chain-rule test (``verification.check``) runs on
each class: the exact class must pass, the lossy class must be flagged. Bad per-request values get
HTTP 400 with the plugin's message while the server keeps serving; /metrics counts the lossy
class's tokens separately, and the server log warns once for the class.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from vllm_specplugin.server import VllmServer, metric_total
from vllm_specplugin.verification.check import analyse, decide
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.verification.drivers import SamplingConfig, request_seed
from vllm_specplugin.verification.reference import TargetReference

pytestmark = pytest.mark.server

DEMO = os.path.join(REPO_ROOT, "models", "demo")
TARGET = os.path.join(DEMO, "target")
LOSSY = {"specplugin_acceptance": "lenient", "specplugin_lenience": 0.2}
EXACT = {"specplugin_acceptance": "exact"}
N, M, PER_REQUEST = 1000, 3, 125  # samples per prompt and class, tokens, n per request
ALPHA = 0.01


@pytest.fixture(scope="module")
def server():
    server = VllmServer(
        TARGET,
        speculative_config={"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                            "num_speculative_tokens": 3},
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, "draft-distill")]}},
        max_model_len=512, extra_args=["--max-num-seqs", "32", "--enforce-eager"],  # eager: a start 20 s shorter
        # Client ids kept as given (X-Request-Id), so that a test can reuse one (issue 29 item 1).
        extra_env={"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"},
    )
    with server:
        yield server


def post(server, body: dict, timeout: float = 600) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json={"model": TARGET, **body}, timeout=timeout)


@pytest.mark.parametrize("xargs, message", [
    ({"specplugin_acceptance": "fast"}, "specplugin_acceptance"),
    ({"specplugin_acceptance": "lenient", "specplugin_lenience": 0}, "specplugin_lenience: must be in (0, 1]"),
    ({"specplugin_acceptance": "lenient", "specplugin_lenience": 1.5}, "specplugin_lenience: must be in (0, 1]"),
    ({"specplugin_acceptance": "typical", "specplugin_typical_epsilon": 2}, "specplugin_typical_epsilon"),
    ({"specplugin_acceptance": "typical", "specplugin_typical_delta": -0.5}, "specplugin_typical_delta"),
    ({"specplugin_lenience": 0.5}, "applies to specplugin_acceptance='lenient'"),
    ({"specplugin_acceptence": "typical"}, "unknown extra argument"),
])
def test_bad_per_request_values_get_a_400_and_the_server_keeps_serving(server, xargs, message):
    response = post(server, {"prompt": "def f():", "max_tokens": 4, "temperature": 1.0, "vllm_xargs": xargs})
    assert response.status_code == 400, (response.status_code, response.text[:500])
    assert message in response.text, response.text[:500]
    ok = post(server, {"prompt": "def f():", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                       "vllm_xargs": LOSSY})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, ok.text[:500]


def _sample(server, prompt_index: int, prompt: list[int], xargs: dict, first: int, seed_base: int) -> list[list[int]]:
    response = post(server, {
        "prompt": prompt, "n": PER_REQUEST, "max_tokens": M, "temperature": 1.0, "ignore_eos": True,
        "return_token_ids": True, "seed": request_seed(seed_base, prompt_index, first, N), "vllm_xargs": xargs})
    assert response.status_code == 200, response.text[:500]
    return [choice["token_ids"] for choice in response.json()["choices"]]


def test_a_reused_request_id_does_not_inherit_a_lenient_rule(server):
    """A lenient request, then an exact one under the same client id (X-Request-Id; the server keeps
    ids as given): the lossy counters move for the first and not at all for the second, which must
    still be speculated (its drafts are counted by vLLM)."""
    body = {"prompt": "def parse(line):\n    ", "max_tokens": 48, "temperature": 1.0, "ignore_eos": True,
            "seed": 5}
    key = 'specplugin:lossy_drafted_tokens_total{mode="lenient"}'
    drafts = "vllm:spec_decode_num_draft_tokens_total"
    before = server.settled_metrics("specplugin:lossy").get(key, 0)
    response = httpx.post(server.base_url + "/v1/completions", headers={"X-Request-Id": "reused-id"},
                          json={"model": TARGET, **body, "vllm_xargs": LOSSY}, timeout=600)
    assert response.status_code == 200, response.text[:500]
    after_lenient = server.settled_metrics("specplugin:lossy").get(key, 0)
    assert after_lenient > before, "the lenient request was not counted as lossy"
    drafted_before = metric_total(server.metrics("vllm:spec_decode"), drafts)
    for xargs in (EXACT, None):  # explicitly exact, and the server's (exact) default
        response = httpx.post(server.base_url + "/v1/completions", headers={"X-Request-Id": "reused-id"},
                              json={"model": TARGET, **body, **({"vllm_xargs": xargs} if xargs else {})},
                              timeout=600)
        assert response.status_code == 200, response.text[:500]
    assert server.settled_metrics("specplugin:lossy").get(key, 0) == after_lenient, \
        "an exact request that reused a lenient request's id was verified leniently"
    assert metric_total(server.metrics("vllm:spec_decode"), drafts) > drafted_before  # it was speculated


@pytest.mark.extended  # a statistical test of two classes on a live server (make test-extended)
def test_lossy_class_is_flagged_while_the_exact_class_passes_on_the_same_server(server):
    from transformers import AutoTokenizer

    from vllm_specplugin.throughput.workloads import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tokenizer(t)["input_ids"] for t in heldout_prompts(2)]
    before = server.settled_metrics("specplugin:lossy")
    jobs = [(cls, i, first) for first in range(0, N, PER_REQUEST) for i in range(len(prompts)) for cls in (0, 1)]
    with ThreadPoolExecutor(8) as pool:  # exact and lossy requests interleaved: they share batches
        results = list(pool.map(lambda job: (job, _sample(server, job[1], prompts[job[1]], (EXACT, LOSSY)[job[0]],
                                                           job[2], seed_base=1000 * job[0])), jobs))
    outputs = {cls: [[] for _ in prompts] for cls in (0, 1)}
    for (cls, i, _), samples in sorted(results, key=lambda r: r[0]):
        outputs[cls][i] += samples
    reference = TargetReference(TARGET)
    sampling = SamplingConfig(temperature=1.0, max_tokens=M, n=N)
    cases = decide([analyse(reference, prompts, outputs[cls], sampling, alpha=ALPHA / 2, delta=0.1,
                            method="pearson", acceptance_rate=None, generate_s=0.0) for cls in (0, 1)], ALPHA)
    exact, lossy = cases
    print(f"exact class: p={exact.pvalue:.3g} df={exact.df} nodes={exact.n_chi2_nodes} power@0.1="
          f"{exact.power_at_delta:.4f}; lossy class: p={lossy.pvalue:.3g} df={lossy.df}")
    assert exact.tokens_checked == len(prompts) * N * M and not exact.rejected
    assert lossy.rejected, "lenient(l=0.2) served per request must be flagged by the chain test"
    # /metrics: the lossy class's tokens, counted apart (lenient only; no typical request was sent)
    after = server.settled_metrics("specplugin:lossy")
    key = 'specplugin:lossy_{}_tokens_total{{mode="lenient"}}'
    drafted = after.get(key.format("drafted"), 0) - before.get(key.format("drafted"), 0)
    accepted = after.get(key.format("accepted"), 0) - before.get(key.format("accepted"), 0)
    only = after.get(key.format("only_accepted"), 0) - before.get(key.format("only_accepted"), 0)
    assert drafted > 0 and 0 < only < accepted <= drafted, (drafted, accepted, only)
    assert not any("typical" in k for k in after), after
    # the log warns once for the class
    with open(server.log_path) as f:
        log = f.read()
    assert log.count("LOSSY acceptance lenient(l=0.2)") == 1, [l for l in log.splitlines() if "LOSSY" in l]
    print(json.dumps({"lossy_drafted": drafted, "lossy_accepted": accepted, "lossy_only_accepted": only}))
    assert np.isfinite(lossy.pvalue)
