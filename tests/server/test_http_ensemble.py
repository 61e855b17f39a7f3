"""The draft ensemble served over HTTP: concurrent requests all return their full length, and
the plugin's metrics appear on /metrics next to vLLM's spec-decode counters, its health metrics
(failures, dropped drafts, evictions, the q buffer's size) among them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.server import VllmServer, metric_total

pytestmark = pytest.mark.server

DEMO = os.path.join(REPO_ROOT, "models", "demo")
ENSEMBLES = {
    "3 drafts": (["draft-distill", "draft-small", "draft-tiny"], {}),
    "2 drafts, all strategies": (
        ["draft-distill", "draft-small"],
        {"adaptive_gamma": {"mode": "threshold"}, "tree_drafting": {"node_budget": 8, "branching": 2},
         "prefix_sharing": True},
    ),
}
CONCURRENT_REQUESTS = 24
MAX_NUM_SEQS = 32
K = 3
VOCAB = 4096


# The three-draft ensemble alone in make test-extended (a server of its own, 85 s); make test keeps
# the two-draft ensemble with every strategy composed, which serves the same concurrent requests.
@pytest.mark.parametrize("drafts,options", [
    pytest.param(*ENSEMBLES[name], id=name, marks=[pytest.mark.extended] if name == "3 drafts" else [])
    for name in ENSEMBLES])
def test_ensemble_serves_concurrent_requests_in_full(drafts, options):
    from openai import OpenAI

    target = os.path.join(DEMO, "target")
    server = VllmServer(
        target,
        speculative_config={
            "method": "custom_class",
            "model": "vllm_specplugin.adapters.MultiDraftProposer",
            "num_speculative_tokens": K,
        },
        additional_config={"specplugin": {"drafts": [os.path.join(DEMO, d) for d in drafts], **options}},
        extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)],
    )
    rng = np.random.default_rng(0)
    jobs = []
    shared_prefix = rng.integers(3, 4096, size=40).tolist()  # half the requests start with it
    for i in range(CONCURRENT_REQUESTS):
        prompt = (shared_prefix if i % 2 else []) + rng.integers(3, 4096, size=int(rng.integers(5, 60))).tolist()
        temperature = [0.0, 0.7, 1.0][i % 3]
        jobs.append((prompt, temperature, int(rng.integers(24, 72))))
    with server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=600)

        def complete(job):
            prompt, temperature, max_tokens = job
            completion = client.completions.create(
                model=target, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 50, "top_p": 0.9},
            )
            return completion.choices[0]

        with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
            choices = list(pool.map(complete, jobs))
        for (prompt, temperature, max_tokens), choice in zip(jobs, choices):
            assert len(choice.token_ids) == max_tokens, (temperature, max_tokens, len(choice.token_ids))
            assert choice.finish_reason == "length"
        # One more request: the proposer frees the finished requests' state at its next step.
        last = complete(([5, 6, 7], 1.0, 8))
        assert len(last.token_ids) == 8

        vllm_counters = server.metrics()
        accepted = metric_total(vllm_counters, "vllm:spec_decode_num_accepted_tokens_total")
        drafted = metric_total(vllm_counters, "vllm:spec_decode_num_draft_tokens_total")
        plugin = server.settled_metrics("specplugin:")
    with open(server.log_path) as f:
        log = f.read()
    # The q buffer was allocated at start-up, and every draft was verified against its q: vLLM
    # never fell back to one-hot verification for want of a request's draft probabilities.
    assert f"draft-probability buffer [{MAX_NUM_SEQS}, {K}, {VOCAB}] float32" in log
    for trouble in ("Missing cached draft probabilities", "runner shim inactive", "drafting failed",
                    "dropped the draft", "cannot be handed to vLLM", "cannot read the input batch"):
        assert trouble not in log, trouble
    print({k: v for k, v in plugin.items() if "per_position" not in k})
    assert drafted > 0 and 0 < accepted <= drafted
    # The proposer's drafted tokens by position (vLLM counts accepted ones by position, not drafted
    # ones): it sees every verification except each request's last one.
    own_drafted = metric_total(plugin, "specplugin:drafted_per_position_total")
    assert 0.8 * drafted <= own_drafted <= drafted
    for name in drafts:
        if "tree_drafting" not in options:  # trees score paths, not each draft
            assert plugin[f'specplugin:draft_verified_positions_total{{draft="{name}"}}'] > 0
        assert 0 < plugin[f'specplugin:draft_weight{{draft="{name}"}}'] < 1
    if "tree_drafting" in options:
        assert metric_total(plugin, "specplugin:trees_total") > 0
    if "prefix_sharing" in options:
        assert metric_total(plugin, "specplugin:prefix_hit_tokens_total") >= 32  # two blocks, at least once
    if "adaptive_gamma" in options:
        assert metric_total(plugin, "specplugin:gamma_chosen_total") > 0
    assert metric_total(plugin, "specplugin:draft_weight") == pytest.approx(1.0)
    positions = [sum(v for k, v in vllm_counters.items()
                     if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{") and f'position="{j}"' in k)
                 for j in range(3)]
    assert positions[0] >= positions[1] >= positions[2] and positions[0] > 0
    assert metric_total(plugin, "specplugin:draft_time_seconds_total") > 0
    assert metric_total(plugin, "specplugin:tracked_requests") <= 1
    # Health: nothing failed, no draft was dropped, drafting is on; the q buffer is
    # max_num_seqs x k x V float32, allocated once.
    assert plugin["specplugin:drafting_disabled"] == 0
    assert plugin["specplugin:draft_failures_total"] == 0
    assert plugin["specplugin:nonfinite_draft_rows_total"] == 0
    assert "specplugin:draft_cache_evictions_total" in plugin
    assert plugin["specplugin:draft_probs_buffer_bytes"] == MAX_NUM_SEQS * K * VOCAB * 4
