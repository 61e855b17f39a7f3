"""r by γ: what a verification step costs over a plain step, with drafts free.

``python -m vllm_specplugin.throughput.step_cost --model DIR`` runs, for each γ, one engine
(in this process, so steps can be timed and profiled) at batch 1 (``--batch N`` for more) with
``RepeatLastTokenProposer`` (a draft costs nothing) and reports the target step time against
plain decoding's (γ = 0): r(γ) = step time with γ draft tokens / plain step time. Compiled
(vLLM's default on CPU) and eager (``--eager``). ``--profile`` adds a cProfile table of the
spec-decode step, so the time beyond one forward pass can be attributed.

``--proposer plugin`` / ``--proposer draft_model`` time the same steps with a real draft
(``--draft DIR``, default the memory-bound family's): the plugin's proposer or vLLM's own
draft_model method. With ``--profile`` that is the step profile of issue 12: one plugin step
against one vLLM draft_model step with the same draft, split into draft forwards, sampling,
q hand-off and verification. Steps then carry ``tokens per step`` (accepted drafts + 1).

Threads: the engine here runs in this process, where vLLM does not bind OpenMP threads; a
served engine on this machine binds its worker to the cores vLLM does not reserve for the API
server (``VLLM_CPU_OMP_THREADS_BIND=auto``: all but one). ``--threads`` (default: that same
count) keeps the two comparable.

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

from vllm_specplugin.paths import demo_model, require_demo_models, runs_dir
from vllm_specplugin.server import engine_env

REPEAT = "vllm_specplugin.adapters.RepeatLastTokenProposer"
PLUGIN = "vllm_specplugin.adapters.MultiDraftProposer"
PROPOSERS = ("free", "plugin", "draft_model")
HEADS_DRAFTERS = ("eagle_head", "medusa_heads")  # plugin options that draft alone, without --draft


def heads_drafter(extra: dict | None) -> str | None:
    """The heads checkpoint an --additional-config names (a heads drafter drafts alone), or None."""
    options = (extra or {}).get("specplugin", {})
    return next((options[key] for key in HEADS_DRAFTERS if options.get(key)), None)


def served_threads() -> int:
    """OpenMP threads of a served engine's worker here: vLLM's auto binding reserves one CPU
    for the API server process (world size 1)."""
    return max(1, (os.cpu_count() or 1) - 1)


def _engine(model: str, gamma: int, eager: bool, extra: dict, proposer: str = "free", draft: str | None = None):
    from vllm import LLM

    extra = dict(extra or {})
    if gamma == 0:
        spec = None
    elif proposer == "free":
        spec = {"method": "custom_class", "model": REPEAT, "num_speculative_tokens": gamma}
    elif proposer == "plugin":
        spec = {"method": "custom_class", "model": PLUGIN, "num_speculative_tokens": gamma}
        if heads_drafter(extra) is None:
            extra.setdefault("specplugin", {}).setdefault("drafts", [draft])
    else:
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma,
                "draft_sample_method": "probabilistic"}
    return LLM(model=model, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
               speculative_config=spec, enforce_eager=eager, seed=0, enable_prefix_caching=False,
               additional_config=extra or {}, disable_log_stats=True)


def _measure(job: dict) -> dict:
    """In the child: time engine steps for one configuration."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import torch

    torch.set_num_threads(job.get("threads") or served_threads())
    t0 = time.perf_counter()
    llm = _engine(job["model"], job["gamma"], job["eager"], job.get("additional_config"),
                  job.get("proposer", "free"), job.get("draft"))
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    step_times: list[float] = []
    original_step = engine.step

    # Thread CPU time: the engine runs in this thread (one OpenMP thread), so it does not grow
    # when other processes take the core; wall time does (this machine is shared).
    clock = time.thread_time if job.get("cpu_time") else time.perf_counter

    def timed_step(*args, **kwargs):
        start = clock()
        out = original_step(*args, **kwargs)
        step_times.append(clock() - start)
        return out

    engine.step = timed_step
    params = SamplingParams(temperature=job.get("temperature", 0.0), max_tokens=job["tokens"], ignore_eos=True)
    batch = job.get("batch", 1)
    # Rows of a batch get different prompts (shifted token ranges), so their drafts differ.
    prompts = [TokensPrompt(prompt_token_ids=list(range(10 + 7 * row, 10 + 7 * row + job["prompt_len"])))
               for row in range(batch)]
    if job.get("heldout"):
        # The benchmarks' held-out prompts (real text, 53-116 tokens with the demo tokenizer).
        from vllm_specplugin.throughput.workloads import heldout_prompts

        tokenizer = llm.get_tokenizer()
        prompts = [TokensPrompt(prompt_token_ids=tokenizer(text).input_ids) for text in heldout_prompts(batch)]
    rounds = []
    profile_text = None
    for round_index in range(job["rounds"] + 1):  # round 0 warms up
        step_times.clear()
        if job.get("profile") and round_index == job["rounds"]:
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile(clock)  # the steps' clock (thread CPU time with --cpu-time)
            profiler.enable()
            llm.generate(prompts, params, use_tqdm=False)
            profiler.disable()
            buffer = io.StringIO()
            stats = pstats.Stats(profiler, stream=buffer)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(90)  # where each step's time goes, by caller
            profile_text = buffer.getvalue()
            continue
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(out.outputs[0].token_ids) for out in outs)
        # The first step is the prefill (all rows fit one step); decode steps follow.
        decode = sorted(step_times[1:])
        if round_index > 0:
            rounds.append({
                "steps": len(step_times) - 1,
                "tokens": tokens,
                "median_step_s": decode[len(decode) // 2],
                "prefill_s": step_times[0],  # the target's prefill (and the drafts' first propose)
                "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
                # per row: tokens after the prefill's first one, over decode steps
                "tokens_per_step": (tokens - batch) / batch / max(1, len(step_times) - 1),
                "mean_step_s": sum(decode) / len(decode),
            })
    return {"startup_s": startup, "rounds": rounds, "profile": profile_text}


def run_config(model: str, gamma: int, eager: bool, tokens: int, rounds: int, prompt_len: int,
               profile: bool = False, additional_config: dict | None = None, timeout: float = 1200,
               proposer: str = "free", draft: str | None = None, threads: int | None = None,
               batch: int = 1, cpu_time: bool = False, heldout: bool = False, temperature: float = 0.0) -> dict:
    job = dict(model=model, gamma=gamma, eager=eager, tokens=tokens, rounds=rounds, prompt_len=prompt_len,
               profile=profile, additional_config=additional_config, proposer=proposer, draft=draft,
               threads=threads or served_threads(), batch=batch,
               cpu_time=cpu_time, heldout=heldout, temperature=temperature)
    env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(job["threads"])}
    proc = subprocess.run([sys.executable, "-m", "vllm_specplugin.throughput.step_cost", "--child", json.dumps(job)],
                          env=env, capture_output=True, text=True, timeout=timeout)
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
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps in thread CPU time (robust on a loaded machine) instead of wall time")
    ap.add_argument("--heldout", action="store_true",
                    help="the benchmarks' held-out text prompts (one per batch row) instead of --prompt-len tokens")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the timed requests (unseeded, as the benchmarks send them)")
    ap.add_argument("--batch", type=int, default=1,
                    help="requests decoded together (distinct prompts); tokens per step is per request")
    ap.add_argument("--profile", action="store_true", help="print a cProfile table of each config's last round")
    ap.add_argument("--proposer", choices=PROPOSERS, default="free",
                    help="free: drafts cost nothing (r alone); plugin: the plugin's proposer with --draft; "
                         "draft_model: vLLM's own draft_model method with --draft")
    ap.add_argument("--draft", help="draft checkpoint dir (default: the memory-bound family's draft)")
    ap.add_argument("--additional-config", type=json.loads, default=None,
                    help='JSON for --additional-config, e.g. \'{"specplugin": {"draft_kernels": "torch"}}\'')
    ap.add_argument("--threads", type=int, default=None,
                    help=f"OpenMP threads (default {served_threads()}: what a served engine's worker gets here)")
    ap.add_argument("--out", default=runs_dir("step_cost"), help="output folder (default ./runs/step_cost)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = _measure(json.loads(args.child))
        print("STEP_COST_RESULT " + json.dumps(result), flush=True)
        return 0
    from tqdm import tqdm

    model = args.model or demo_model("demo-mb", "target")
    draft = args.draft or demo_model("demo-mb", "draft")
    require_demo_models(model, draft)
    results = {}
    for gamma in tqdm(args.gammas, desc="r by gamma", unit="engine"):
        res = run_config(model, gamma, args.eager, args.tokens, args.rounds, args.prompt_len, args.profile,
                         args.additional_config, proposer=args.proposer, draft=draft, threads=args.threads,
                         batch=args.batch, cpu_time=args.cpu_time, heldout=args.heldout,
                         temperature=args.temperature)
        best_round = min(res["rounds"], key=lambda r: r["median_step_s"])
        results[gamma] = {"best_median_step_ms": best_round["median_step_s"] * 1e3,
                          "prefill_ms": best_round["prefill_s"] * 1e3, "prompt_tokens": best_round["prompt_tokens"],
                          "tokens_per_step": best_round.get("tokens_per_step"),
                          "startup_s": res["startup_s"], "rounds": res["rounds"]}
        if res.get("profile"):
            print(f"\n=== profile, gamma {gamma} ===\n{res['profile']}")
    plain = results.get(0, {}).get("best_median_step_ms")
    mode = "eager" if args.eager else "compiled"
    heads = heads_drafter(args.additional_config)
    drafts = {"free": f"drafts free ({REPEAT})",
              "plugin": f"the plugin's proposer, {f'heads {heads}' if heads else f'draft {draft}'}",
              "draft_model": f"vLLM draft_model, draft {draft}"}[args.proposer]
    threads = args.threads or served_threads()
    print(f"\nmodel {model}, {mode}, batch {args.batch}, T={args.temperature:g}, {threads} thread(s), {drafts}; best of {args.rounds} rounds "
          f"of the median decode step")
    print(f"{'gamma':>5} {'step ms':>8} {'step/plain':>10} {'tokens/step':>11} {'prefill ms':>10}")
    for gamma, res in results.items():
        r = res["best_median_step_ms"] / plain if plain else float("nan")
        res["r" if args.proposer == "free" else "step_over_plain"] = r
        print(f"{gamma:>5} {res['best_median_step_ms']:8.2f} {r:10.2f} {res['tokens_per_step'] or 0:11.2f} "
              f"{res['prefill_ms']:10.2f}")
    if plain and args.proposer != "free":
        # What a request of n new tokens takes: the prefill (first token), then decode steps.
        base = results[0]
        print("\nspeedup over plain of a whole request (prefill + decode) by new tokens n:")
        for n in (64, 256, 1024):
            plain_ms = base["prefill_ms"] + (n - 1) * base["best_median_step_ms"]
            cells = []
            for gamma, res in results.items():
                if gamma:
                    spec_ms = res["prefill_ms"] + (n - 1) / (res["tokens_per_step"] or 1) * res["best_median_step_ms"]
                    cells.append(f"gamma {gamma}: {plain_ms / spec_ms:.2f}x")
            print(f"  n = {n:>4}: " + ", ".join(cells))
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.proposer == "free" else f"-{args.proposer}"
    suffix += ("" if args.batch == 1 else f"-b{args.batch}") + ("-cpu" if args.cpu_time else "")
    path = os.path.join(args.out, f"step_cost-{mode}-{os.path.basename(os.path.normpath(model))}{suffix}.json")
    with open(path, "w") as f:
        json.dump({"model": model, "mode": mode, "proposer": args.proposer, "draft": draft, "threads": threads,
                   "batch": args.batch, "cpu_time": args.cpu_time,
                   "heldout": args.heldout, "results": results}, f, indent=2)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
