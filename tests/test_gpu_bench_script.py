"""The prepared device script (ci/gpu_bench.py) runs end to end; here on CPU with --quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT


def test_gpu_bench_script_smoke_run_on_cpu(tmp_path):
    script = os.path.join(REPO_ROOT, "ci", "gpu_bench.py")
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    rates = [r["draft_tokens_per_s"] for r in report["results"] if "draft_tokens_per_s" in r]
    assert rates and all(rate > 0 for rate in rates)
    sharing = [r for r in report["results"] if "prefix_sharing_32_requests_256_token_system_prompt" in r]
    for entry in sharing:
        numbers = entry["prefix_sharing_32_requests_256_token_system_prompt"]
        assert numbers["with sharing"]["tokens_forwarded"] < numbers["without sharing"]["tokens_forwarded"]
