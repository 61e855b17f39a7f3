"""One vLLM engine for the tree-verification tests: generate, then report outputs and counters.

``python tests/engine/tree_job.py JOB.json OUT.json`` (a fresh process per engine; vLLM spawns
workers, hence the ``__main__`` guard). JOB: model, speculative_config, additional_config,
enforce_eager, requests [{prompt: [ids], params: {vLLM SamplingParams kwargs}}].
OUT: outputs [[ids]], spec_decode (vLLM's vllm:spec_decode_* counters), plugin (the plugin's
worker snapshot counters summed, vllm_specplugin/metrics.py), plugin_groups ({group: the plugin's
counters accrued while that group ran}: requests carry an optional "group", default "all"; groups
run one after another in order of first appearance), startup_s, generate_s.
"""

from __future__ import annotations

import json
import sys
import time


def _plugin_counters(read_snapshots) -> dict:
    plugin: dict = {}
    for snapshot in read_snapshots():
        for key, value in snapshot.items():
            if isinstance(value, (int, float)) and key != "time":
                plugin[key] = plugin.get(key, 0) + value
    return plugin


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specplugin.metrics import read_snapshots

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=job.get("max_model_len", 512),
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3),
        speculative_config=job.get("speculative_config"),
        additional_config=job.get("additional_config") or {},
        enforce_eager=job.get("enforce_eager", False),
        seed=0,
        enable_prefix_caching=False,
        max_num_seqs=16,
        disable_log_stats=False,
    )
    startup_s = time.perf_counter() - t0
    requests = job["requests"]
    groups = list(dict.fromkeys(r.get("group", "all") for r in requests))
    results: list = [None] * len(requests)
    plugin_groups = {}
    before = _plugin_counters(read_snapshots)
    t1 = time.perf_counter()
    for group in groups:
        members = [i for i, r in enumerate(requests) if r.get("group", "all") == group]
        prompts = [TokensPrompt(prompt_token_ids=requests[i]["prompt"]) for i in members]
        params = [SamplingParams(ignore_eos=True, **requests[i]["params"]) for i in members]
        for i, result in zip(members, llm.generate(prompts, params, use_tqdm=False)):
            results[i] = result
        time.sleep(1.5)  # the worker writes its snapshot every 0.5 s
        after = _plugin_counters(read_snapshots)
        plugin_groups[group] = {k: v - before.get(k, 0) for k, v in after.items()}
        before = after
    generate_s = time.perf_counter() - t1
    spec = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            spec[metric.name] = value if value is not None else list(getattr(metric, "values", []))
    plugin = _plugin_counters(read_snapshots)
    return {
        "outputs": [list(r.outputs[0].token_ids) for r in results],
        "spec_decode": spec,
        "plugin": plugin,
        "plugin_groups": plugin_groups,
        "startup_s": startup_s,
        "generate_s": generate_s,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
