"""Smoke path for the real HTTP server with a plugin proposer."""

from __future__ import annotations

import os
import signal
import time

import pytest

from vllm_specplugin.server import VllmServer, metric_total

pytestmark = pytest.mark.server

SPEC = {
    "method": "custom_class",
    "model": "vllm_specplugin.adapters.RepeatLastTokenProposer",
    "num_speculative_tokens": 3,
}


def test_completions_and_spec_decode_metrics(random_target):
    from openai import OpenAI

    server = VllmServer(random_target, speculative_config=SPEC)
    with server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        for temperature in (0.0, 1.0):
            completion = client.completions.create(
                model=random_target,
                prompt=[5, 9, 17, 33],
                max_tokens=12,
                temperature=temperature,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            choice = completion.choices[0]
            assert len(choice.token_ids) == 12, choice
            assert completion.usage.completion_tokens == 12
        metrics = server.metrics()
        drafts = metric_total(metrics, "vllm:spec_decode_num_drafts_total")
        draft_tokens = metric_total(metrics, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric_total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        print(f"drafts {drafts}, draft tokens {draft_tokens}, accepted {accepted}")
        assert drafts > 0
        assert draft_tokens == 3 * drafts
        assert 0 <= accepted <= draft_tokens
        process = server.process
        group = os.getpgid(process.pid)
    # Clean shutdown: the server exited on our SIGINT (not the SIGKILL fallback stop() uses when
    # SIGINT does not end it in time, which gives -SIGKILL) ...
    assert process.poll() is not None
    assert process.returncode in (0, -signal.SIGINT), process.returncode
    # ... and took its process group (engine core, workers) with it.
    assert group_gone(group, timeout_s=10), f"processes of group {group} outlived the server"


def group_gone(group: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_server_start_failure_is_reported_and_cleaned_up(random_target):
    """A malformed plugin config stops the server at start-up, before any model loads: the
    process exits by itself with an error code, and its output names the field."""
    from vllm_specplugin.server import ServerStartError

    server = VllmServer(
        random_target,
        speculative_config=SPEC,
        additional_config={"specplugin": {"cpu_sampler_repair": "sometimes"}},
        # Start-up fails in config validation (~20 s on a busy 2-core machine); a server still
        # up after this long did not refuse the config, and is stopped by us (returncode < 0).
        startup_timeout_s=180,
    )
    with pytest.raises(ServerStartError) as info:
        with server:
            pass
    message = str(info.value)
    assert message.startswith("server exited with"), message[:500]  # not "not healthy after"
    assert server.process.returncode is not None and server.process.returncode > 0, server.process.returncode
    assert "field 'cpu_sampler_repair'" in message and "sometimes" in message, message


def test_a_port_taken_during_start_up_gets_another(random_target):
    """The port is chosen free, but another process may bind it before vLLM does (seen in make test:
    two xdist workers' servers and engines start side by side): the server starts again on a fresh
    port instead of failing."""
    import socket

    server = VllmServer(random_target)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        holder.bind(("127.0.0.1", server.port))
        holder.listen(1)
        taken = server.port
        with server:
            assert server.port != taken
            assert "Address already in use" not in server.log_tail()
            import urllib.request

            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                assert r.status == 200
