"""Engine drivers: sample continuations from vLLM offline (one process per job) or over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    max_tokens: int = 3
    n: int = 256
    seed: int | None = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GenerationTask:
    """Sample ``sampling.n`` continuations of each prompt (token ids)."""

    prompts: list[list[int]]
    sampling: SamplingConfig


@dataclass
class TaskResult:
    outputs: list[list[list[int]]]  # [prompt][sample][token]
    generate_s: float
    spec_decode_metrics: dict = field(default_factory=dict)  # counters accrued by this task


@dataclass
class EngineRun:
    startup_s: float
    tasks: list[TaskResult]


class EngineJobError(RuntimeError):
    pass


def engine_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_offline(
    model: str,
    tasks: list[GenerationTask],
    *,
    speculative_config: dict | None = None,
    additional_config: dict | None = None,
    dtype: str = "float32",
    max_model_len: int = 512,
    timeout_s: float = 900,
    log_path: str | None = None,
    extra_env: dict | None = None,
) -> EngineRun:
    """Run ``tasks`` on one fresh vLLM engine, in its own process."""
    job = dict(
        model=model,
        tasks=[{"prompts": t.prompts, "sampling": t.sampling.as_dict()} for t in tasks],
        speculative_config=speculative_config,
        additional_config=additional_config or {},
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=float(os.environ.get("SPECPLUGIN_GPU_MEMORY_UTILIZATION", "0.3")),
    )
    with tempfile.TemporaryDirectory(prefix="specplugin-job-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        log_file = open(log_path or os.path.join(tmp, "engine.log"), "w")
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "verification.engine_job", job_path, out_path],
                cwd=REPO_ROOT,
                env={**engine_env(), **(extra_env or {})},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            )
        finally:
            log_file.close()
        if proc.returncode != 0 or not os.path.exists(out_path):
            with open(log_path or os.path.join(tmp, "engine.log")) as f:
                tail = f.read()[-4000:]
            raise EngineJobError(f"vLLM job failed (exit {proc.returncode}):\n{tail}")
        with open(out_path) as f:
            result = json.load(f)
    return EngineRun(
        startup_s=result["startup_s"], tasks=[TaskResult(**t) for t in result["tasks"]]
    )
