"""run_offline's job timeout takes vLLM's engine core and worker down with the job.

Killing only the job process (subprocess.run's timeout) left vLLM's EngineCore and Worker running:
in one suite run the tree-verification job timed out and its worker kept a core busy for an hour.
"""

from __future__ import annotations

import os
import re
import uuid

import pytest

from vllm_specplugin.verification.drivers import EngineJobError, GenerationTask, SamplingConfig, run_offline

# make test-extended: the harness's own clean-up (1.5 min); no product code runs.
pytestmark = [pytest.mark.engine, pytest.mark.extended]

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "demo", "target")


def processes_with(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_timed_out_job_leaves_no_process():
    mark = f"specplugin-timeout-{uuid.uuid4().hex}"
    # Far more work than fits in the timeout (4096 sequences of 400 tokens), which is long enough
    # for the engine core and its worker to exist (they start 25-45 s into a job on 2 cores).
    task = GenerationTask([[5 + i, 6, 7] for i in range(64)], SamplingConfig(temperature=1.0, max_tokens=400, n=64, seed=0))
    with pytest.raises(EngineJobError, match="timed out after 90 s") as error:
        run_offline(os.path.abspath(TARGET), [task], timeout_s=90, extra_env={"SPECPLUGIN_TEST_MARK": mark})
    killed = int(re.search(r"its (\d+) process\(es\) killed", str(error.value)).group(1))
    print(f"killed {killed} processes")
    assert killed >= 3, str(error.value)[-2000:]  # the job, vLLM's engine core and its worker at least
    assert processes_with(mark) == []
