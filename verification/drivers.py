"""Engine drivers: sample continuations from vLLM offline (one process per job) or over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from vllm_specplugin.server import engine_env  # noqa: F401  (re-exported for the harness)


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


def request_seed(base: int | None, prompt_index: int, first_sample: int, samples_per_prompt: int) -> int | None:
    """The seed of one request for ``n`` samples of a prompt, starting at sample ``first_sample``.

    vLLM seeds a request's k-th sample (of ``n``) with seed + k, so each prompt owns the seeds
    [base + prompt_index * samples_per_prompt, ...) and no two samples of the whole task share a
    random stream (the chain-rule test sums the prompts' statistics as independent; with seed +
    prompt_index, prompt 0's sample k + 1 and prompt 1's sample k were the same draw)."""
    return None if base is None else base + prompt_index * samples_per_prompt + first_sample


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
    plugin_metrics: dict = field(default_factory=dict)  # the plugin's worker counters accrued (offline driver)


@dataclass
class EngineRun:
    startup_s: float
    tasks: list[TaskResult]


class EngineJobError(RuntimeError):
    pass


def run_offline(
    model: str,
    tasks: list[GenerationTask],
    *,
    speculative_config: dict | None = None,
    additional_config: dict | None = None,
    dtype: str = "float32",
    max_model_len: int = 512,
    timeout_s: float = 1500,
    log_path: str | None = None,
    extra_env: dict | None = None,
    engine_options: dict | None = None,
    gpu_memory_utilization: float | None = None,
) -> EngineRun:
    """Run ``tasks`` on one fresh vLLM engine, in its own process. ``engine_options``: more
    ``vllm.LLM`` arguments (e.g. ``enable_chunked_prefill``, ``max_num_batched_tokens``).
    ``gpu_memory_utilization`` None: ``SPECPLUGIN_GPU_MEMORY_UTILIZATION``, or 0.3.
    ``timeout_s`` bounds the whole job (start-up included): the statistical tier's longest job,
    four temperatures of tree verification, took 9-15 minutes on a loaded 2-core AVX2 machine."""
    job = dict(
        engine_options=engine_options or {},
        model=model,
        tasks=[{"prompts": t.prompts, "sampling": t.sampling.as_dict()} for t in tasks],
        speculative_config=speculative_config,
        additional_config=additional_config or {},
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=(gpu_memory_utilization if gpu_memory_utilization is not None
                                else float(os.environ.get("SPECPLUGIN_GPU_MEMORY_UTILIZATION", "0.3"))),
    )
    with tempfile.TemporaryDirectory(prefix="specplugin-job-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        log_file = open(log_path or os.path.join(tmp, "engine.log"), "w")
        # A session of its own: vLLM's engine core and worker are its children, and on a timeout
        # (or any exception here, a test's timeout included) the whole group goes. Killing the job
        # process alone left them running, a core busy for an hour in one test run.
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_specplugin.verification.engine_job", job_path, out_path],
            env={**engine_env(), **(extra_env or {})},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = None
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = f"timed out after {timeout_s:.0f} s; its {kill_process_group(proc)} process(es) killed"
        finally:
            if proc.poll() is None:
                kill_process_group(proc)
            log_file.close()
        if timed_out or proc.returncode != 0 or not os.path.exists(out_path):
            with open(log_path or os.path.join(tmp, "engine.log")) as f:
                tail = f.read()[-4000:]
            raise EngineJobError(f"vLLM job failed ({timed_out or f'exit {proc.returncode}'}):\n{tail}")
        with open(out_path) as f:
            result = json.load(f)
    return EngineRun(
        startup_s=result["startup_s"], tasks=[TaskResult(**t) for t in result["tasks"]]
    )


def kill_process_group(proc: subprocess.Popen) -> int:
    """SIGKILL every process of ``proc``'s session (started with ``start_new_session``); returns
    how many there were."""
    import signal

    members = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == proc.pid:
                    members += 1
            except OSError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return members


def run_http(
    model: str,
    tasks: list[GenerationTask],
    *,
    speculative_config: dict | None = None,
    additional_config: dict | None = None,
    dtype: str = "float32",
    max_model_len: int = 512,
    extra_env: dict | None = None,
    max_n_per_request: int = 500,
    extra_args: list[str] | None = None,
) -> EngineRun:
    """Run ``tasks`` against the real OpenAI-compatible server (logprobs off, token ids on).
    ``extra_args``: more ``vllm serve`` arguments (e.g. ``--tensor-parallel-size 2``)."""
    import time

    from openai import OpenAI

    from vllm_specplugin.server import VllmServer

    t0 = time.perf_counter()
    server = VllmServer(model, speculative_config=speculative_config, additional_config=additional_config,
                        dtype=dtype, max_model_len=max_model_len, extra_env=extra_env, extra_args=extra_args)
    with server:
        startup_s = time.perf_counter() - t0
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=600)
        results = []
        for task in tasks:
            sp = task.sampling
            before = server.metrics()
            t1 = time.perf_counter()
            outputs = []
            for prompt_index, prompt in enumerate(task.prompts):
                samples: list[list[int]] = []
                while len(samples) < sp.n:
                    n = min(max_n_per_request, sp.n - len(samples))
                    seed = request_seed(sp.seed, prompt_index, len(samples), sp.n)
                    completion = client.completions.create(
                        model=model, prompt=prompt, n=n, max_tokens=sp.max_tokens,
                        temperature=sp.temperature, top_p=sp.top_p, seed=seed, logprobs=None,
                        extra_body={"top_k": sp.top_k or -1, "ignore_eos": True, "return_token_ids": True},
                    )
                    samples += [list(choice.token_ids) for choice in completion.choices]
                outputs.append(samples)
            after = server.metrics()
            results.append(TaskResult(
                outputs=outputs, generate_s=time.perf_counter() - t1,
                spec_decode_metrics=_http_counter_difference(after, before),
            ))
    return EngineRun(startup_s=startup_s, tasks=results)


def _http_counter_difference(after: dict, before: dict) -> dict:
    """Prometheus totals -> the offline driver's counter names, accrued between two scrapes."""
    from vllm_specplugin.server import metric_total

    names = {
        "vllm:spec_decode_num_drafts": "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    }
    return {short: metric_total(after, full) - metric_total(before, full) for short, full in names.items()}
