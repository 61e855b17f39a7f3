"""Run one offline vLLM generation job in its own process and write the sampled token ids.

Each job gets a fresh process: vLLM's kernel registry and engine state are per process, and
a fresh process frees all memory when it ends. Usage (internal; see ``drivers.py``):
``python -m verification.engine_job JOB.json OUT.json``.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
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
    t_start = time.perf_counter() - t0
    sp = job["sampling"]
    outputs_per_prompt = []
    t1 = time.perf_counter()
    for prompt_index, prompt in enumerate(job["prompts"]):
        params = SamplingParams(
            n=sp["n"],
            temperature=sp["temperature"],
            top_k=sp.get("top_k", 0) or -1,
            top_p=sp.get("top_p", 1.0),
            max_tokens=sp["max_tokens"],
            min_tokens=sp["max_tokens"],
            ignore_eos=True,
            seed=None if sp.get("seed") is None else sp["seed"] + prompt_index,
        )
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        outputs_per_prompt.append([list(c.token_ids) for c in result.outputs])
    t_gen = time.perf_counter() - t1
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            if value is None:
                value = getattr(metric, "values", None)
            metrics[metric.name] = value
    return {
        "outputs": outputs_per_prompt,
        "startup_s": t_start,
        "generate_s": t_gen,
        "spec_decode_metrics": metrics,
    }


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
