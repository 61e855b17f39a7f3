"""Engine-agnostic drafting cost on one device (made for the lent CUDA machine, which has no vLLM).

Measures, for the draft runtime and the ensemble (proposers/):
- draft tokens/s per batch size (γ = 4 draft steps per call, incremental KV caches);
- the effect of KV reuse: the same steps with every request's cache dropped before each call;
- the effect of prefix sharing: 32 requests with one 256-token system prompt, tokens forwarded
  and time with and without sharing;
on the demo drafts and on a larger randomly initialised Llama pair (random weights: systems cost
only, no quality meaning). Writes a JSON report and prints a table.

    python ci/gpu_bench.py --device cuda --out runs/gpu       # on the GPU machine (< 10 minutes)
    python ci/gpu_bench.py --device cpu --quick               # smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_specplugin.proposers.base import DraftRequest  # noqa: E402
from vllm_specplugin.proposers.draft_runtime import DraftRuntime  # noqa: E402
from vllm_specplugin.proposers.ensemble import EnsembleProposer  # noqa: E402
from vllm_specplugin.proposers.sampling import SamplingParams  # noqa: E402
from vllm_specplugin.models.random_llama import make_random_llama  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "demo")
GAMMA = 4
T1 = SamplingParams(temperature=1.0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def contexts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(batch)]


def draft_throughput(proposer: EnsembleProposer, batch: int, vocab: int, steps: int, device: str, reuse: bool):
    """Draft tokens per second over ``steps`` calls (the first call, the prefill, is not timed)."""
    ctxs = contexts(batch, 128, vocab)
    requests = [DraftRequest(f"r{i}", c, GAMMA, T1) for i, c in enumerate(ctxs)]
    drafts = proposer.propose(requests)
    sync(device)
    started, drafted = time.perf_counter(), 0
    for _ in range(steps):
        requests = [
            DraftRequest(r.request_id, list(r.context) + d.token_ids[:2] + [5], GAMMA, T1)
            for r, d in zip(requests, drafts)
        ]
        if not reuse:
            for r in requests:
                proposer.free(r.request_id)
        drafts = proposer.propose(requests)
        drafted += sum(len(d.token_ids) for d in drafts)
    sync(device)
    elapsed = time.perf_counter() - started
    for r in requests:
        proposer.free(r.request_id)
    return drafted / elapsed


def prefix_sharing_effect(path: str, vocab: int, device: str, dtype: str) -> dict:
    system = contexts(1, 256, vocab, seed=1)[0]
    own = contexts(32, 24, vocab, seed=2)
    out = {}
    for sharing in (False, True):
        rt = DraftRuntime(path, target_vocab_size=vocab, device=device, dtype=dtype, prefix_sharing=sharing)
        proposer = EnsembleProposer([rt])
        sync(device)
        started = time.perf_counter()
        proposer.propose([DraftRequest(f"s{i}", system + o, GAMMA, T1) for i, o in enumerate(own)])
        sync(device)
        out["with sharing" if sharing else "without sharing"] = {
            "tokens_forwarded": rt.tokens_forwarded, "seconds": time.perf_counter() - started,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps (a smoke run)")
    parser.add_argument("--out", default=os.path.join("runs", "gpu"))
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    batches = [1, 4] if args.quick else [1, 4, 16, 64]
    steps = 3 if args.quick else 20
    os.makedirs(args.out, exist_ok=True)

    workdir = tempfile.mkdtemp(prefix="gpu-bench-")
    large = {"hidden_size": 256, "num_layers": 2} if args.quick else {"hidden_size": 1024, "num_layers": 8}
    pairs = {
        "demo drafts (trained)": ([os.path.join(DEMO, d) for d in ("draft-distill", "draft-small", "draft-tiny")], 4096),
        f"random Llama {large['num_layers']}x{large['hidden_size']} (random weights: systems cost only)": (
            [str(make_random_llama(os.path.join(workdir, "large"), vocab_size=32000, num_heads=8,
                                   max_position_embeddings=2048, **large))],
            32000,
        ),
    }
    report = {"device": args.device, "dtype": dtype, "gamma": GAMMA, "torch": torch.__version__, "results": []}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    print(f"device {args.device} ({report.get('gpu', 'cpu')}), dtype {dtype}, gamma {GAMMA}")
    print(f"{'models':70s} {'drafts':>6s} {'batch':>5s} {'tok/s reuse':>12s} {'tok/s no reuse':>15s}")
    for label, (paths, vocab) in pairs.items():
        for n_drafts in sorted({1, len(paths)}):
            runtimes = [DraftRuntime(p, target_vocab_size=vocab, device=args.device, dtype=dtype) for p in paths[:n_drafts]]
            proposer = EnsembleProposer(runtimes)
            for batch in batches:
                reuse = draft_throughput(proposer, batch, vocab, steps, args.device, reuse=True)
                no_reuse = draft_throughput(proposer, batch, vocab, steps, args.device, reuse=False)
                report["results"].append({"models": label, "drafts": n_drafts, "batch": batch,
                                          "draft_tokens_per_s": reuse, "draft_tokens_per_s_no_kv_reuse": no_reuse})
                print(f"{label:70s} {n_drafts:>6d} {batch:>5d} {reuse:>12.0f} {no_reuse:>15.0f}")
        sharing = prefix_sharing_effect(paths[0], vocab, args.device, dtype)
        report["results"].append({"models": label, "prefix_sharing_32_requests_256_token_system_prompt": sharing})
        print(f"{label:70s} prefix sharing, 32 requests x 256-token system prompt: {json.dumps(sharing)}")
    path = os.path.join(args.out, "gpu_bench.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
