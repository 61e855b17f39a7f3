"""What a step without drafts costs through the rejection sampler, against vLLM's plain sampler.

``python -m vllm_specplugin.throughput.draft_free_ab`` builds one engine with the plugin's
proposer and adaptive γ that drafts nothing above ``max_batch`` 4, decodes ``--batch``
requests (so every decode step is draft-free), and alternates round by round between the two
ways such a step can be sampled (``draft_free_sampler``: ``plain``, the plugin's default, and
``rejection``, vLLM's behaviour) by flipping the runner's setting in place: same engine, same
prompts, same moment. ``--plain-engine`` runs the same rounds on an engine without a
speculative config instead (the baseline both should match).

Each step is timed in thread CPU time, not wall time: the engine runs in this thread with one
OpenMP thread, so its CPU time does not grow when other processes take the core (this machine
is shared). Reported: the median over rounds of each round's median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from vllm_specplugin.paths import demo_model, require_demo_models
from vllm_specplugin.server import engine_env

DEMO_MB = demo_model("demo-mb")


def _measure(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    spec = None if args.plain_engine else {
        "method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": 4}
    extra = {} if args.plain_engine else {"specplugin": {"drafts": [args.draft], "adaptive_gamma": {"max_batch": 4}}}
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
              speculative_config=spec, additional_config=extra, seed=0, enable_prefix_caching=False,
              disable_log_stats=True)
    # In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the runner is reachable.
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    engine = llm.llm_engine
    step_cpu_s: list[float] = []
    original_step = engine.step

    def timed_step(*a, **k):
        start = time.thread_time()
        out = original_step(*a, **k)
        step_cpu_s.append(time.thread_time() - start)
        return out

    engine.step = timed_step
    prompts = [TokensPrompt(prompt_token_ids=list(range(10 + 7 * r, 42 + 7 * r))) for r in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, top_k=50, top_p=0.9, max_tokens=args.tokens,
                            ignore_eos=True, seed=1)
    rounds: dict[str, list[float]] = {"plain": [], "rejection": []}
    for index in range(2 * args.rounds + 1):  # round 0 warms up
        mode = "plain" if index % 2 else "rejection"
        runner._specplugin_draft_free_plain = mode == "plain"  # draft_free_steps._enabled's cache
        step_cpu_s.clear()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outputs)
        if index:
            rounds[mode].append(statistics.median(step_cpu_s[1:]) * 1e3)  # decode steps (the first is the prefill)
    if args.plain_engine:
        rounds = {"plain engine": rounds["plain"] + rounds["rejection"]}
    return {name: {"median_step_cpu_ms": statistics.median(v), "rounds_ms": v} for name, v in rounds.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.throughput.draft_free_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(DEMO_MB, "target"))
    ap.add_argument("--draft", default=os.path.join(DEMO_MB, "draft"))
    ap.add_argument("--batch", type=int, default=16, help="requests decoded together (> 4: no drafts)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request per round")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per mode")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (top-k 50, top-p 0.9)")
    ap.add_argument("--plain-engine", action="store_true", help="an engine without speculative config instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    require_demo_models(args.model, args.draft)
    if args.batch <= 4 and not args.plain_engine:
        ap.error("--batch must be above 4 (adaptive gamma's max_batch here), or steps would draft")
    if args.child:
        print("DRAFT_FREE_AB " + json.dumps(_measure(args)), flush=True)
        return 0
    env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    argv = list(argv if argv is not None else sys.argv[1:])
    proc = subprocess.run([sys.executable, "-m", "vllm_specplugin.throughput.draft_free_ab", "--child", *argv],
                          env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("DRAFT_FREE_AB ")), None)
    if line is None:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(line.split(" ", 1)[1])
    print(f"batch {args.batch}, T={args.temperature}, {args.tokens} tokens x {args.rounds} rounds per mode; "
          "thread CPU time per decode step (median of round medians):")
    for name, res in result.items():
        print(f"  {name:<14} {res['median_step_cpu_ms']:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
