"""A draft checkpoint that cannot serve (missing, truncated, a vocabulary that does not fit the
target) stops the server at start-up, before it serves anything: the process exits by itself
with an error code and its output names the draft and the problem (issue 14, item 3)."""

from __future__ import annotations

import os
import shutil

import pytest

from vllm_specplugin.server import ServerStartError, VllmServer
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

pytestmark = pytest.mark.server

DEMO = os.path.join(REPO_ROOT, "models", "demo")


def damaged_draft(tmp_path, damage: str, random_target: str) -> str:
    if damage == "missing":
        return str(tmp_path / "no-such-draft")
    if damage == "mismatched vocabulary":
        return random_target  # 512 token ids against the demo target's 4096
    path = tmp_path / "truncated-draft"
    shutil.copytree(os.path.join(DEMO, "draft-tiny"), path)
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    return str(path)


EXPECTED = {
    "missing": "no config.json",
    "truncated": "could not be loaded",
    "mismatched vocabulary": "has vocabulary size 512",
}


@pytest.mark.parametrize("damage", list(EXPECTED))
def test_bad_draft_stops_the_server_before_serving(tmp_path, random_target, damage):
    draft = damaged_draft(tmp_path, damage, random_target)
    server = VllmServer(
        os.path.join(DEMO, "target"),
        speculative_config={"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                            "num_speculative_tokens": 3},
        additional_config={"specplugin": {"drafts": [draft]}},
        extra_args=["--enforce-eager"],  # nothing compiled is checked: a shorter start where a draft slips through
        startup_timeout_s=300,  # a server still up after this did not refuse the draft
    )
    with pytest.raises(ServerStartError) as info:
        with server:
            pass
    message = str(info.value)
    assert message.startswith("server exited with"), message[:500]  # refused, not "not healthy after"
    assert server.process.returncode is not None and server.process.returncode > 0, server.process.returncode
    log = server.log_tail(chars=10**7)  # what `vllm serve` printed: the root cause precedes vLLM's wrap-up
    cause = next((line for line in log.splitlines() if "DraftModelError:" in line or "SpecPluginConfigError:" in line), None)
    assert cause is not None and EXPECTED[damage] in cause and draft in cause, log[-3000:]
    assert "Application startup complete" not in log  # it never served
