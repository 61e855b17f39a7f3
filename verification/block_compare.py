"""Accepted length of vLLM's ``rejection_sample_method`` values against each other, one run.

Same target, draft, gamma, prompts, seeds and sampling for every method; one fresh offline engine
per (method, draft_sample_method). Reports, from vLLM's own counters, alpha (accepted / drafted
tokens), the mean accepted length per verify step (1 + accepted / steps with drafts: the tokens a
step emits) and the per-position acceptance (P(draft i accepted) per step).

    python -m vllm_specplugin.verification.block_compare --help
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from vllm_specplugin.paths import demo_model, require_demo_models
from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def summarise(metrics: dict, gamma: int) -> dict:
    """alpha, mean accepted length and per-position acceptance from one task's counters."""
    steps = metrics.get("vllm:spec_decode_num_drafts") or 0
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
    per_pos = list(metrics.get(PER_POSITION) or [0] * gamma)
    if not steps:
        raise ValueError(f"no speculative step was counted: {metrics}")
    return {"steps": int(steps), "draft_tokens": int(drafted), "accepted": int(accepted),
            "alpha": accepted / drafted, "mean_accepted_length": 1.0 + accepted / steps,
            "per_position": [round(a / steps, 4) for a in per_pos]}


def compare(target: str, draft: str, prompts: list[list[int]], sampling: SamplingConfig, *, gamma: int = 3,
            methods=("standard", "block"), draft_sample_methods=("probabilistic",),
            engine_options: dict | None = None) -> list[dict]:
    rows = []
    runs = [(m, d) for d in draft_sample_methods for m in methods]
    for method, draft_sampling in tqdm(runs, desc="engines", unit="engine"):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma,
                "draft_sample_method": draft_sampling, "rejection_sample_method": method}
        run = run_offline(target, [GenerationTask(prompts, sampling)], speculative_config=spec,
                          engine_options=engine_options)
        (task,) = run.tasks
        rows.append({"rejection_sample_method": method, "draft_sample_method": draft_sampling,
                     **summarise(task.spec_decode_metrics, gamma), "generate_s": round(task.generate_s, 2)})
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'method':9s} {'draft sampling':14s} {'steps':>6s} {'alpha':>6s} {'mean len':>8s}  per-position acceptance"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['rejection_sample_method']:9s} {r['draft_sample_method']:14s} {r['steps']:6d} "
                     f"{r['alpha']:6.3f} {r['mean_accepted_length']:8.3f}  {r['per_position']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_specplugin.verification.block_compare",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=demo_model("demo", "target"))
    parser.add_argument("--draft", default=demo_model("demo", "draft-distill"))
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--samples", type=int, default=8, help="continuations per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per continuation")
    parser.add_argument("--methods", nargs="+", default=["standard", "block"])
    parser.add_argument("--draft-sample-methods", nargs="+", default=["probabilistic", "greedy"])
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    require_demo_models(args.target, args.draft)
    from transformers import AutoTokenizer

    from vllm_specplugin.throughput.workloads import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts(args.prompts)]
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, max_tokens=args.tokens, n=args.samples, seed=0)
    rows = compare(args.target, args.draft, prompts, sampling, gamma=args.gamma, methods=args.methods,
                   draft_sample_methods=args.draft_sample_methods,
                   engine_options={"enforce_eager": True} if args.enforce_eager else None)
    print(f"target {args.target}, draft {args.draft}, gamma {args.gamma}, {sampling}")
    print(format_rows(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
