"""Smoke path for the real HTTP server with a plugin proposer."""

from __future__ import annotations

import signal

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
    # Clean shutdown: the server process is gone, and took its process group with it.
    assert process.poll() is not None
    assert process.returncode in (0, -signal.SIGINT, -signal.SIGKILL, 1) or process.returncode is not None


def test_server_start_failure_is_reported_and_cleaned_up(random_target):
    """A malformed plugin config stops the server at start-up with the field named."""
    from vllm_specplugin.server import ServerStartError

    server = VllmServer(
        random_target,
        speculative_config=SPEC,
        additional_config={"specplugin": {"cpu_sampler_repair": "sometimes"}},
        startup_timeout_s=300,
    )
    with pytest.raises(ServerStartError, match="cpu_sampler_repair"):
        with server:
            pass
    assert server.process.poll() is not None
