"""Are seeded outputs the same whatever else is in the batch? Plain vLLM and the plugin's variants.

``python -m vllm_specplugin.verification.seed_repro VARIANT`` starts one offline engine (the soak's
target, :mod:`vllm_specplugin.throughput.soak`) and sends 24 seeded requests (T = 1.0, or 0.7
with top-k 50 / top-p 0.9; 32–64 tokens) three times: beside 40 unseeded companions, beside 40
different ones, and alone. It prints, for each pair of passes, how many of the 24 seeded outputs
differ and where each first differs. Plain vLLM gives 0 everywhere; see docs/reliability.md,
"Seeded outputs with the plugin under load", for what the plugin's variants give and why.
"""

from __future__ import annotations

import argparse
import json
import random
import time

VARIANTS = ("plain", "fixed", "fixed2", "adaptive_gamma", "adapt_weights", "prefix_budget", "tree", "soak")


def _variant_config(variant: str, soak) -> dict | None:
    options = soak.plugin_options()
    one = options["drafts"][:1]
    return {
        "plain": None,
        "fixed": {"drafts": one},
        "fixed2": {"drafts": options["drafts"]},
        "adaptive_gamma": {"drafts": one, "adaptive_gamma": {"mode": "threshold"}},
        "adapt_weights": {"drafts": options["drafts"], "adapt_draft_weights": True},
        "prefix_budget": {"drafts": one, "prefix_sharing": True, "draft_memory_budget_mb": 64},
        "tree": {"drafts": one, "tree_drafting": {"node_budget": 8, "branching": 2}},
        "soak": options,
    }[variant]


def run(variant: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specplugin.throughput import soak

    workload = soak.Workload(soak.SoakConfig(seed=5), "m")
    rng = random.Random(7)
    # (prompt token ids, seed or None, temperature, max_tokens)
    seeded = [(workload.window(rng.randint(8, 96)), 1000 + i, [1.0, 0.7][i % 2], rng.randint(32, 64)) for i in range(24)]

    def companions(seed: int):
        r = random.Random(seed)
        return [(workload.window(r.randint(1, 200)), None, r.choice([0.0, 0.7, 1.0]), r.randint(4, 96)) for _ in range(40)]

    options = dict(model=soak.TARGET, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, seed=0,
                   max_num_seqs=64, enable_prefix_caching=False)
    config = _variant_config(variant, soak)
    if config is not None:
        options["speculative_config"] = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer",
                                         "num_speculative_tokens": soak.K}
        options["additional_config"] = {"specplugin": config}
    llm = LLM(**options)

    def params(temperature: float, seed: int | None, max_tokens: int):
        return SamplingParams(temperature=temperature, top_k=(50 if temperature == 0.7 else -1),
                              top_p=(0.9 if temperature == 0.7 else 1.0), max_tokens=max_tokens, ignore_eos=True,
                              seed=seed)

    passes = []
    for index, companion_seed in enumerate([11, 12, 13]):
        if index == 2:
            batch = list(seeded)  # alone
        else:
            batch = seeded + companions(companion_seed)
            random.Random(companion_seed).shuffle(batch)
        started = time.time()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, *_ in batch],
                               [params(t, s, n) for _, s, t, n in batch], use_tqdm=False)
        passes.append({s: list(o.outputs[0].token_ids) for (_, s, _, _), o in zip(batch, outputs) if s is not None})
        print(f"pass {index + 1} took {time.time() - started:.1f} s", flush=True)
    summary = {}
    for a, b in ((0, 1), (0, 2), (1, 2)):
        differ = [s for s in passes[a] if passes[a][s] != passes[b][s]]
        first = [next(i for i, (x, y) in enumerate(zip(passes[a][s], passes[b][s])) if x != y) for s in differ]
        summary[f"{a + 1}v{b + 1}"] = {"pairs": len(passes[a]), "differ": len(differ), "first_diff_pos": first}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.verification.seed_repro", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=VARIANTS, help="plain vLLM, or the plugin with these settings")
    args = ap.parse_args(argv)
    print("RESULT", args.variant, json.dumps(run(args.variant)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
