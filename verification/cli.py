"""``python -m vllm_specplugin.verification`` / ``specplugin-verify``: check a model + speculative config for exactness.

Example (a plugin proposer, three temperatures, top-k 50 and top-p 0.9):

    python -m vllm_specplugin.verification --model PATH \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3}' \\
        --temperature 0.7 1.0 1.3 --top-k 50 --top-p 0.9 --samples 2000 --tokens 3 --json report.json
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_specplugin.verification.check import random_prompts, run_check
from vllm_specplugin.verification.drivers import SamplingConfig
from vllm_specplugin.verification.engine_settings import add_engine_arguments, engine_driver, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.verification",
        description=(
            "Statistical exactness check: sample continuations from vLLM (with or without "
            "speculative decoding) and test, at every visited prefix, the next-token counts "
            "against the target's exact processed distribution computed with transformers."
        ),
        epilog=__doc__.split("\n", 2)[2] + "\nSubcommand: lossy-sweep (see `... lossy-sweep --help`): what each "
               "opt-in lossy acceptance setting costs (TV, log-likelihood, speed).\nSubcommand: two-sample (see "
               "`... two-sample --help`): a speculative deployment against a plain one, no reference model "
               "(verification/two_sample.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="target checkpoint directory (local)")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="JSON, as for vllm serve; omit to check plain decoding")
    parser.add_argument("--additional-config", type=json.loads, default=None,
                        help='JSON, as for vllm serve, e.g. \'{"specplugin": {"cpu_sampler_repair": "auto"}}\'')
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="one case per value")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--samples", type=int, default=2000, help="continuations per prompt (N)")
    parser.add_argument("--tokens", type=int, default=3, help="tokens per continuation (m >= 1)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", default=None,
                        help="a text prompt (repeatable); tokenised with the model's tokenizer")
    prompt.add_argument("--prompt-ids", type=json.loads, default=None,
                        help="JSON list of token-id lists")
    parser.add_argument("--random-prompts", type=int, default=4,
                        help="number of random-token prompts when no prompt is given")
    parser.add_argument("--greedy-prompts", type=int, default=32,
                        help="T = 0 cases (one continuation per prompt, as vLLM requires): number of "
                             "random-token prompts of 4-48 tokens when no prompt is given")
    parser.add_argument("--greedy-tokens", type=int, default=32,
                        help="T = 0 cases: tokens per continuation; every one must be the reference argmax")
    parser.add_argument("--alpha", type=float, default=0.01, help="suite-level significance (Holm)")
    parser.add_argument("--delta", type=float, default=0.1, help="TV distance to report power for")
    parser.add_argument("--method", choices=["pearson", "g"], default="pearson")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--driver", choices=["offline", "http"], default="offline",
                        help="offline: LLM.generate in a fresh process; http: the real OpenAI server on 127.0.0.1")
    add_engine_arguments(parser)  # --dtype, --tensor-parallel-size, --max-model-len, ... (engine_settings.py)
    parser.add_argument("--json", dest="json_path", help="write the report as JSON here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG: node p-values vs uniform, Holm p per case")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lossy-sweep"]:  # the lossy acceptance modes' trade-off (verification/lossy.py)
        from vllm_specplugin.verification import lossy

        return lossy.main(argv[1:])
    if argv[:1] == ["two-sample"]:  # speculative vs plain sampler, no reference (verification/two_sample.py)
        from vllm_specplugin.verification import two_sample

        return two_sample.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.tokens < 1 or args.samples < 1 or args.greedy_tokens < 1 or args.greedy_prompts < 1:
        sys.exit("--tokens, --samples, --greedy-tokens and --greedy-prompts must be >= 1")
    settings = settings_from_args(args)
    if args.prompt_ids is not None:
        prompts = greedy_prompts = args.prompt_ids
    elif args.prompt:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = greedy_prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
    else:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        prompts = random_prompts(vocab, args.random_prompts, seed=args.seed)
        greedy_prompts = random_prompts(vocab, args.greedy_prompts, length=(4, 48), seed=args.seed + 1)
    samplings = [
        SamplingConfig(temperature=0.0, max_tokens=args.greedy_tokens, n=1, seed=None) if t == 0 else
        SamplingConfig(temperature=t, top_k=args.top_k, top_p=args.top_p, max_tokens=args.tokens,
                       n=args.samples, seed=args.seed)
        for t in args.temperature
    ]
    report = run_check(
        args.model, samplings, prompts, greedy_prompts=greedy_prompts, speculative_config=args.speculative_config,
        additional_config=args.additional_config, alpha=args.alpha, delta=args.delta,
        method=args.method, max_model_len=args.max_model_len,
        driver=engine_driver(args.model, settings, speculative_config=args.speculative_config,
                             additional_config=args.additional_config, driver=args.driver),
        driver_name=f"{args.driver} {settings.describe()}",
    )
    from vllm_specplugin.verification.plots import plot_report

    publish(report, args.json_path, args.plot_path,
            lambda path: plot_report(report, {c.name: list(c.node_pvalues) for c in report.cases}, path))
    sys.exit(0 if report.passed else 1)


def publish(report, json_path: str | None, plot_path: str | None, plot) -> None:
    """Print a report's table, write its JSON and its PNG (``plot(path)``) where asked."""
    print(report.format_table())
    if json_path:
        with open(json_path, "w") as f:
            f.write(report.to_json())
        print(f"report written to {json_path}")
    if plot_path:
        plot(plot_path)
        print(f"plot written to {plot_path}")


if __name__ == "__main__":
    main()
