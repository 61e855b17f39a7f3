"""r by γ: what a verification step costs over a plain step, with drafts free.

``python -m vllm_specplugin.throughput.step_cost --model DIR`` runs, for each γ, one engine
(in this process, so steps can be timed and profiled) at batch 1 with
``RepeatLastTokenProposer`` (a draft costs nothing) and reports the target step time against
plain decoding's (γ = 0): r(γ) = step time with γ draft tokens / plain step time. Compiled
(vLLM's default on CPU) and eager (``--eager``). ``--profile`` adds a cProfile table of the
spec-decode step, so the time beyond one forward pass can be attributed.

Each configuration runs in a fresh subprocess (vLLM's compile caches and kernel registry are
per process); within it, rounds of ``--tokens`` tokens after a warm-up, best round kept (the
machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from vllm_specplugin.server import REPO_ROOT, engine_env

REPEAT = "vllm_specplugin.adapters.RepeatLastTokenProposer"


def _engine(model: str, gamma: int, eager: bool, extra: dict):
    from vllm import LLM

    spec = None if gamma == 0 else {"method": "custom_class", "model": REPEAT, "num_speculative_tokens": gamma}
    return LLM(model=model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
               speculative_config=spec, enforce_eager=eager, seed=0, enable_prefix_caching=False,
               additional_config=extra or {}, disable_log_stats=True)


def _measure(job: dict) -> dict:
    """In the child: time engine steps for one configuration."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = _engine(job["model"], job["gamma"], job["eager"], job.get("additional_config"))
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    step_times: list[float] = []
    original_step = engine.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        out = original_step(*args, **kwargs)
        step_times.append(time.perf_counter() - start)
        return out

    engine.step = timed_step
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 10 + job["prompt_len"])))
    rounds = []
    profile_text = None
    for round_index in range(job["rounds"] + 1):  # round 0 warms up
        step_times.clear()
        if job.get("profile") and round_index == job["rounds"]:
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            llm.generate([prompt], params, use_tqdm=False)
            profiler.disable()
            buffer = io.StringIO()
            pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(30)
            profile_text = buffer.getvalue()
            continue
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens = len(out.outputs[0].token_ids)
        # The first step is the prefill; decode steps follow.
        decode = sorted(step_times[1:])
        if round_index > 0:
            rounds.append({
                "steps": len(step_times) - 1,
                "tokens": tokens,
                "median_step_s": decode[len(decode) // 2],
                "mean_step_s": sum(decode) / len(decode),
            })
    return {"startup_s": startup, "rounds": rounds, "profile": profile_text}


def run_config(model: str, gamma: int, eager: bool, tokens: int, rounds: int, prompt_len: int,
               profile: bool = False, additional_config: dict | None = None, timeout: float = 1200) -> dict:
    job = dict(model=model, gamma=gamma, eager=eager, tokens=tokens, rounds=rounds, prompt_len=prompt_len,
               profile=profile, additional_config=additional_config)
    env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "vllm_specplugin.throughput.step_cost", "--child", json.dumps(job)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    marker = "STEP_COST_RESULT "
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    raise RuntimeError(f"step_cost child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.throughput.step_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target checkpoint dir (default: the memory-bound demo target if built)")
    ap.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6])
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: compiled, vLLM's default)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="print a cProfile table of each config's last round")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "runs", "step_cost"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = _measure(json.loads(args.child))
        print("STEP_COST_RESULT " + json.dumps(result), flush=True)
        return 0
    from tqdm import tqdm

    model = args.model or os.path.join(REPO_ROOT, "models", "demo-mb", "target")
    results = {}
    for gamma in tqdm(args.gammas, desc="r by gamma", unit="engine"):
        res = run_config(model, gamma, args.eager, args.tokens, args.rounds, args.prompt_len, args.profile)
        best = min(r["median_step_s"] for r in res["rounds"])
        results[gamma] = {"best_median_step_ms": best * 1e3, "startup_s": res["startup_s"], "rounds": res["rounds"]}
        if res.get("profile"):
            print(f"\n=== profile, gamma {gamma} ===\n{res['profile']}")
    plain = results.get(0, {}).get("best_median_step_ms")
    mode = "eager" if args.eager else "compiled"
    print(f"\nmodel {model}, {mode}, batch 1, T=0, drafts free ({REPEAT}); best of {args.rounds} rounds "
          f"of the median decode step")
    print(f"{'gamma':>5} {'step ms':>8} {'r':>6}")
    for gamma, res in results.items():
        r = res["best_median_step_ms"] / plain if plain else float("nan")
        res["r"] = r
        print(f"{gamma:>5} {res['best_median_step_ms']:8.2f} {r:6.2f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"step_cost-{mode}-{os.path.basename(os.path.normpath(model))}.json")
    with open(path, "w") as f:
        json.dump({"model": model, "mode": mode, "results": results}, f, indent=2)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
