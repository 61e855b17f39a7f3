"""vLLM's placeholder drafts (-1) leave the other requests' verification alone (runner_shim, sampler_repair).

vLLM's scheduler pads a request admitted with one token to compute (a one-token prompt) beside
decoding requests with k drafts of -1 (tests/e2e/placeholder_job.py says when). That request has
no q in the plugin's hand-over; vLLM then verified the WHOLE step one-hot ("Missing cached draft
probabilities"), which changed the seeded samples of every other request in the step. The shim
now gives the placeholders a zero q (always rejected; the token recovered there is a sample of p)
and the others keep their own q, which needs vLLM-CPU's rejection kernel to reject -1
(sampler_repair's placeholder repair: unrepaired it read p and q at index -1 and could accept).
The six seeded decoding requests must then sample exactly what they sample alone. The padded
request's own output is not compared: its first token comes from the rejection sampler, a
correct sample from other random numbers (vLLM's behaviour with every speculative method).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT
from vllm_specplugin.server import engine_env

pytestmark = pytest.mark.engine


def run_job(tmp_path, sampler_repair: str = "auto"):
    out, log = tmp_path / "out.json", tmp_path / "engine.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "e2e", "placeholder_job.py"), str(out),
                               sampler_repair], cwd=REPO_ROOT, env=engine_env(), stdout=f, stderr=subprocess.STDOUT,
                              timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return json.loads(out.read_text()), text


def test_placeholder_drafts_leave_the_other_requests_alone(tmp_path):
    result, log = run_job(tmp_path)
    assert "admitted with 3 placeholder draft(s)" in log, "the scheduler did not pad B: the test checked nothing"
    assert "placeholder drafts (-1) are rejected" in log  # the CPU kernel repair is on
    assert "Missing cached draft probabilities" not in log
    together, alone = result["together"], result["alone"]
    assert sorted(together) == sorted(alone) == ["A0", "A1", "A2", "A3", "A4", "A5", "B"]
    assert all(len(tokens) == 16 for tokens in together.values())
    differ = [rid for rid in together if rid != "B" and together[rid] != alone[rid]]
    assert not differ, f"seeded requests changed by a padded neighbour: {differ}"
