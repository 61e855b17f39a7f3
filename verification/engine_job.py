"""Run one offline vLLM engine for a list of generation tasks and write the sampled token ids.

Each job gets a fresh process: vLLM's kernel registry and engine state are per process, and a
fresh process frees all memory when it ends. Internal; see ``drivers.run_offline``:
``python -m vllm_specplugin.verification.engine_job JOB.json OUT.json``.
"""

from __future__ import annotations

import json
import sys
import time


def _spec_decode_counters(llm) -> dict:
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            counters[metric.name] = value if value is not None else list(getattr(metric, "values", []))
    return counters


def _difference(after: dict, before: dict) -> dict:
    diff = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            diff[name] = [a - b for a, b in zip(value, old)]
        else:
            diff[name] = value - (old or 0)
    return diff


def _plugin_counters(wait_s: float) -> dict:
    """The plugin's worker counters summed over this engine's workers (vllm_specplugin/metrics.py),
    read after ``wait_s`` (workers publish a snapshot every 0.5 s); {} without the plugin's proposer."""
    from vllm_specplugin.metrics import read_snapshots

    time.sleep(wait_s)
    totals: dict = {}
    for snapshot in read_snapshots():
        for key, value in snapshot.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "time":
                totals[key] = totals.get(key, 0) + value
    return totals


def _sampling_params(cls, sp: dict, prompt_index: int):
    from vllm_specplugin.verification.drivers import request_seed

    return cls(
        n=sp["n"],
        temperature=sp["temperature"],
        top_k=sp.get("top_k", 0) or -1,
        top_p=sp.get("top_p", 1.0),
        max_tokens=sp["max_tokens"],
        # ignore_eos alone: min_tokens would mask EOS and change the distribution.
        ignore_eos=True,
        seed=request_seed(sp.get("seed"), prompt_index, 0, sp["n"]),
        # per-request extra arguments (vllm_xargs), e.g. the lossy acceptance modes' specplugin_* keys
        extra_args=dict(sp["extra_args"]) if sp.get("extra_args") else None,
    )


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    options = dict(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 512),
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3),
        speculative_config=job.get("speculative_config"),
        additional_config=job.get("additional_config") or {},
        seed=job.get("seed", 0),
        enable_prefix_caching=job.get("enable_prefix_caching", False),
        max_num_seqs=job.get("max_num_seqs", 256),
        disable_log_stats=False,
    )
    options.update(job.get("engine_options", {}))  # the caller's engine arguments win
    llm = LLM(**options)
    startup_s = time.perf_counter() - t0
    tasks = []
    spec = job.get("speculative_config") or {}
    plugin = spec.get("method") == "custom_class" and str(spec.get("model", "")).startswith("vllm_specplugin.")
    plugin_before = _plugin_counters(0.0) if plugin else {}
    for task in job["tasks"]:
        sp = task["sampling"]
        before = _spec_decode_counters(llm)
        t1 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in task["prompts"]]
        if sp["n"] == 1:
            # One continuation per prompt (greedy): all prompts in one batch.
            results = llm.generate(prompts, [_sampling_params(SamplingParams, sp, i) for i in range(len(prompts))], use_tqdm=False)
        else:
            # Many continuations per prompt: one prompt at a time (n requests each).
            results = [llm.generate([p], _sampling_params(SamplingParams, sp, i), use_tqdm=False)[0] for i, p in enumerate(prompts)]
        outputs = [[list(c.token_ids) for c in result.outputs] for result in results]
        tasks.append(
            {
                "outputs": outputs,
                "generate_s": time.perf_counter() - t1,
                "spec_decode_metrics": _difference(_spec_decode_counters(llm), before),
            }
        )
        if plugin:
            plugin_after = _plugin_counters(1.5)
            tasks[-1]["plugin_metrics"] = _difference(plugin_after, plugin_before)
            plugin_before = plugin_after
    return {"startup_s": startup_s, "tasks": tasks}


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
