"""The plugin's metrics with several API server processes (issue 32 item 7).

With ``--api-server-count 2`` vLLM 0.32 builds the engine config in a parent process, which starts
the engine and then two API server processes that each build the config again and share the port
(``vllm/entrypoints/cli/serve.py: run_multi_api_server``). It sets ``PROMETHEUS_MULTIPROC_DIR``, and
``/metrics`` (prometheus_fastapi_instrumentator's ``expose``) is then served from a registry holding
only prometheus_client's multiprocess collector, not the default registry the plugin's collector was
registered in. Before the fix every ``specplugin:`` series was missing there, while
``vllm:spec_decode_*`` was served (measured: docs/observability.md).

Extended tier: three front-end processes and an engine start slowly on 2 cores (the server was
healthy after 287 s in one run; the test took 18.5 min at load average 12-18). tests/test_metrics_export.py
covers both causes in seconds in ``make test``.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from vllm_specplugin.server import VllmServer, metric_total

pytestmark = [pytest.mark.server, pytest.mark.extended]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
K = 3
REQUESTS = 6
SCRAPES = 8  # each a new connection: the kernel spreads them over the two API servers (SO_REUSEPORT)


def test_plugin_metrics_are_served_with_two_api_servers():
    target = str(DEMO / "target")
    server = VllmServer(
        target,
        speculative_config={"method": "custom_class", "num_speculative_tokens": K,
                            "model": "vllm_specplugin.adapters.MultiDraftProposer"},
        additional_config={"specplugin": {"drafts": [str(DEMO / "draft-distill")]}},
        # eager: the start-up of three front-end processes and the engine is long enough on 2 cores
        extra_args=["--api-server-count", "2", "--enforce-eager"],
        startup_timeout_s=1200,  # three front-end processes and the engine: 287 s measured, > 600 s under load
    )
    with server:
        for i in range(REQUESTS):
            body = json.dumps({"model": target, "prompt": [5, 9, 17 + i, 33], "max_tokens": 24,
                               "temperature": 1.0, "ignore_eos": True}).encode()
            request = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                assert json.load(response)["usage"]["completion_tokens"] == 24
        settled = server.settled_metrics("specplugin:")
        scrapes = [(server.metrics("specplugin:"), server.metrics("vllm:spec_decode")) for _ in range(SCRAPES)]
    with open(server.log_path) as f:
        log = f.read()
    assert "Started 2 API server processes" in log
    print({k: v for k, v in settled.items() if "{" not in k})
    for plugin, vllm in scrapes:
        # vLLM's own counters, through its multiprocess collector ...
        assert metric_total(vllm, "vllm:spec_decode_num_draft_tokens_total") > 0
        # ... and the plugin's, from whichever API server answered: the same snapshot directory.
        assert metric_total(plugin, "specplugin:propose_calls_total") > 0, sorted(plugin)
        assert metric_total(plugin, "specplugin:drafted_per_position_total") > 0
        assert plugin["specplugin:draft_time_seconds_total"] > 0
        assert plugin["specplugin:drafting_disabled"] == 0
        assert plugin["specplugin:draft_probs_buffer_bytes"] > 0
        assert plugin == settled, "the API servers serve different plugin values"
