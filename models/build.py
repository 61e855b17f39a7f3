"""Rebuild the demo model family: ``python -m models.build`` (from the repo root).

Stages: corpus -> tokenizer -> target + CE drafts (in parallel) -> distilled
draft -> measurements -> MODEL_CARD.md / card.json.  Everything is seeded
and budgeted in tokens, so a rebuild reproduces the same checkpoints on the
same interpreter (the corpus is this Python's stdlib; its fingerprint is in
the card).

Threads: each training process uses ONE torch thread.  Measured on the
2-core build machine: with other busy processes on the box, 2 OpenMP threads
ran 2.3x *slower* than 1 (threads wait on each other at every barrier), so
the build instead runs single-thread processes side by side (the target in
the main process, each cross-entropy draft in a worker).  The thread count
is fixed because float summation order, hence the weights, depend on it.

    python -m models.build            # full build into models/demo (~40 min)
    python -m models.build --quick    # smoke run (~2 min) into a temp dir
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import DEMO_DIR, DRAFTS, TARGET
from . import corpus as corpus_mod
from . import measure as M
from . import tokenizer as tok_mod
from .train import Spec, n_params, train

VOCAB = 4096

# Target gets most of the compute; drafts are >= 10x cheaper per token
# (forward FLOPs) and differ on purpose: depth, seed and objective.
FULL = {
    TARGET: Spec(TARGET, hidden=256, layers=4, heads=4, head_dim=64, intermediate=768,
                 max_pos=2048, seed=0, tokens=2_600_000, lr=2e-3, batch=8, role="target",
                 note="4-layer Llama, the model to be served"),
    "draft-small": Spec("draft-small", hidden=64, layers=2, heads=2, head_dim=32, intermediate=192,
                        max_pos=1024, seed=1, tokens=1_600_000, lr=4e-3, batch=16,
                        note="2-layer, trained on the corpus (cross-entropy)"),
    "draft-distill": Spec("draft-distill", hidden=64, layers=2, heads=2, head_dim=32, intermediate=192,
                          max_pos=1024, seed=2, tokens=1_200_000, lr=2e-3, batch=16, objective="kl",
                          init_from="draft-small",
                          note="draft-small's weights, then distilled: KL(target || draft) at T=1"),
    "draft-tiny": Spec("draft-tiny", hidden=64, layers=1, heads=2, head_dim=32, intermediate=192,
                       max_pos=1024, seed=3, tokens=1_600_000, lr=4e-3, batch=16,
                       note="1-layer, trained on the corpus (cross-entropy)"),
}
QUICK_TOKENS = {TARGET: 40_000, "draft-small": 40_000, "draft-distill": 20_000, "draft-tiny": 40_000}

# Measurement sizes (full / quick).
EVAL = {
    "full": dict(loss_windows=300, alpha_windows=32, prompts=16, prompt_len=48, new_tokens=40, gamma=4),
    "quick": dict(loss_windows=16, alpha_windows=4, prompts=3, prompt_len=32, new_tokens=12, gamma=4),
}
COMPLETION_PROMPTS = 3
COMPLETION_TOKENS = 40


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def specs_for(quick: bool) -> dict[str, Spec]:
    if not quick:
        return FULL
    from dataclasses import replace
    return {k: replace(s, tokens=QUICK_TOKENS[k]) for k, s in FULL.items()}


def save_checkpoint(model, tok, out: Path) -> None:
    """bf16 safetensors + config + generation config + tokenizer files."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    model.float()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes "dtype"; older readers (and some vLLM paths) read "torch_dtype".
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_mod.save_tokenizer(tok, out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    # Class name every transformers version (and vLLM) resolves.
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):  # loader bookkeeping, not tokenizer config
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def load_checkpoint(path: Path):
    """Load a saved checkpoint in float32 (what measurements use)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return m.eval()


# ---------------------------------------------------------------- stages

def stage_data(work: Path) -> dict:
    t = time.time()
    files = corpus_mod.load()
    train_files = [f for f in files if not f.heldout]
    held_files = [f for f in files if f.heldout]
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files "
        f"from {corpus_mod.stdlib_root()}")
    tok = tok_mod.train_tokenizer([f.text for f in train_files], VOCAB)
    tok_dir = work / "tokenizer"
    tok_mod.save_tokenizer(tok, tok_dir)
    tok = tok_mod.load_tokenizer(tok_dir)  # use exactly what is shipped
    train_stream = tok_mod.encode_docs(tok, [f.text for f in train_files])
    held_stream = tok_mod.encode_docs(tok, [f.text for f in held_files])
    torch.save({"train": train_stream, "heldout": held_stream}, work / "streams.pt")
    info = {
        "stdlib_root": str(corpus_mod.stdlib_root()),
        "python": platform.python_version(),
        "fingerprint": corpus_mod.fingerprint(files),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "heldout_file_list": [f.relpath for f in held_files],
        "train_chars": sum(len(f.text) for f in train_files),
        "heldout_chars": sum(len(f.text) for f in held_files),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(held_stream),
        "chars_per_token": round(sum(len(f.text) for f in train_files) / len(train_stream), 3),
        "wall_s": round(time.time() - t, 1),
    }
    log(f"tokenizer + encoding: {info['train_tokens']} train / {info['heldout_tokens']} held-out "
        f"tokens ({info['wall_s']} s)")
    return info


def train_and_save(names: list[str], specs: dict[str, Spec], work: Path, out: Path,
                   teacher_dir: Path | None = None) -> None:
    tok = tok_mod.load_tokenizer(work / "tokenizer")
    stream = torch.load(work / "streams.pt")["train"]
    teacher = load_checkpoint(teacher_dir) if teacher_dir else None
    for name in names:
        init = load_checkpoint(out / specs[name].init_from) if specs[name].init_from else None
        model, stats = train(specs[name], tok, stream, teacher=teacher, init=init, log=log)
        save_checkpoint(model, tok, out / name)
        (work / f"{name}.stats.json").write_text(json.dumps(stats))
        log(f"saved {out / name}")


def stage_measure(specs: dict[str, Spec], work: Path, out: Path, ev: dict) -> dict:
    tok = tok_mod.load_tokenizer(out / TARGET)
    held = torch.load(work / "streams.pt")["heldout"]
    models = {n: load_checkpoint(out / n) for n in specs}
    target = models[TARGET]
    res: dict = {"models": {}, "alpha": {}}

    t = time.time()
    loss_w = M.heldout_windows(held, 256, ev["loss_windows"])
    for n, m in models.items():
        loss = M.heldout_loss(m, loss_w)
        cfg = m.config
        res["models"][n] = {
            "params": n_params(m),
            "heldout_loss": round(loss, 4),
            "heldout_ppl": round(M.ppl(loss), 3),
            "forward_flops_per_token": M.forward_flops_per_token(cfg, ctx=128),
            "forward_s_per_token_1x256": M.forward_time_per_token(m),
        }
        log(f"{n}: held-out loss {loss:.4f} ppl {M.ppl(loss):.2f}")
    res["heldout_eval_tokens"] = int(loss_w[:, 1:].numel())
    tf = res["models"][TARGET]
    for n in specs:
        r = res["models"][n]
        r["flops_ratio_target_over_this"] = round(tf["forward_flops_per_token"] / r["forward_flops_per_token"], 2)
        r["time_ratio_target_over_this"] = round(tf["forward_s_per_token_1x256"] / r["forward_s_per_token_1x256"], 2)
        r["param_ratio_target_over_this"] = round(tf["params"] / r["params"], 2)
    res["loss_wall_s"] = round(time.time() - t, 1)

    t = time.time()
    drafts = [n for n in specs if n != TARGET]
    proposers = {n: M.Single(models[n]) for n in drafts}
    proposers["ensemble"] = M.Ensemble([models[n] for n in drafts])
    a_w = M.heldout_windows(held, 256, ev["alpha_windows"])
    # Prompts: evenly spaced slices of the held-out stream (other positions than a_w).
    n_pr, plen = ev["prompts"], ev["prompt_len"]
    starts = torch.linspace(97, len(held) - plen - 1, n_pr).long().tolist()
    prompts = [held[s:s + plen] for s in starts]
    for i, (n, prop) in enumerate(proposers.items()):
        row = {}
        for temp in (0.0, 1.0):
            ex = M.exact_alpha(target, prop, a_w, temp)
            em = M.empirical_alpha(target, prop, prompts, temp, ev["gamma"], ev["new_tokens"], seed=100 + i)
            row[f"T{temp:g}"] = {
                "exact": round(ex, 4),
                "empirical": round(em["alpha"], 4),
                "accepted_per_step": round(em["accepted_per_step"], 3),
                "tokens_per_step": round(em["tokens_per_step"], 3),
                "expected_tokens_per_step_from_exact": round(M.expected_tokens_per_step(ex, ev["gamma"]), 3),
                "steps": em["steps"],
            }
            log(f"alpha {n} T={temp:g}: exact {ex:.3f} empirical {em['alpha']:.3f} "
                f"accepted/step {em['accepted_per_step']:.2f}")
        res["alpha"][n] = row
    res["alpha_setup"] = {"exact_positions": int(a_w[:, :-1].numel()), **ev}
    res["alpha_wall_s"] = round(time.time() - t, 1)

    comps = []
    for s in torch.linspace(1000, len(held) - 200, COMPLETION_PROMPTS).long().tolist():
        # Start each prompt at a line start so it reads naturally.
        text = tok.decode(held[s:s + 200].long(), skip_special_tokens=True)
        text = text[text.find("\n") + 1:]
        prompt_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:40])
        prompt = tok.decode(prompt_ids)
        comps.append({"prompt": prompt,
                      "completions": {n: M.greedy_completion(models[n], tok, prompt_ids, COMPLETION_TOKENS)
                                      for n in specs}})
    res["completions"] = comps
    return res


# ---------------------------------------------------------------- card

def write_card(out: Path, card: dict) -> None:
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    ms, sp, al = card["models"], card["specs"], card["alpha"]
    L = ["# vllm-specplugin demo models", "",
         "Generated by `python -m models.build`; numbers from that run (card.json has them all).", "",
         "A Llama target LM and three draft LMs trained on CPU (seeded, token budgets) on the Python "
         f"{card['corpus']['python']} standard library source (`*.py`, no tests, no site-packages, "
         f"no `encodings/` tables; {card['corpus']['train_files']} train files, "
         f"{card['corpus']['heldout_files']} held-out files chosen by hash of the path, "
         f"corpus fingerprint `{card['corpus']['fingerprint']}`).", "",
         f"Tokenizer: byte-level BPE, vocab {card['tokenizer']['vocab_size']}, specials `<s>`=0 (bos), "
         f"`</s>`=1 (eos), `<pad>`=2; {card['corpus']['chars_per_token']} chars/token. "
         "All checkpoints ship the identical tokenizer files. Weights: bf16 safetensors.", "",
         "## Models", "",
         "| model | layers x hidden (heads x head_dim), ffn | max pos | params | objective | train tokens | train wall | held-out loss | ppl | notes |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for n, m in ms.items():
        s, tr = sp[n], card["training"][n]
        L.append(f"| {n} | {s['layers']} x {s['hidden']} ({s['heads']} x {s['head_dim']}), {s['intermediate']} "
                 f"| {s['max_pos']} | {m['params']/1e6:.3f} M | {s['objective']} | {tr['train_tokens']/1e6:.2f} M "
                 f"| {tr['train_wall_s']/60:.1f} min | {m['heldout_loss']:.3f} | {m['heldout_ppl']:.2f} | {s['note']} |")
    L += ["", f"Held-out loss: mean NLL in nats per token over {card['heldout_eval_tokens']} held-out tokens.", "",
          "## Per-token forward cost", "",
          "FLOPs: analytic forward FLOPs per token at context 128 (2 x MACs of all matmuls incl. LM head, plus attention). "
          "Time: median forward wall time of a 1 x 256 batch / 256, float32, "
          f"{card['threads']} torch thread(s) (tiny models are overhead-bound, so the time ratio is below the FLOPs ratio).", "",
          "| model | MFLOPs/token | us/token | target/this FLOPs | target/this time | target/this params |",
          "|---|---|---|---|---|---|"]
    for n, m in ms.items():
        L.append(f"| {n} | {m['forward_flops_per_token']/1e6:.2f} | {m['forward_s_per_token_1x256']*1e6:.1f} "
                 f"| {m['flops_ratio_target_over_this']} | {m['time_ratio_target_over_this']} | {m['param_ratio_target_over_this']} |")
    st = card["alpha_setup"]
    L += ["", "## Acceptance rate vs the target", "",
          "alpha = mean over positions of sum_x min(p(x), q(x)) (p target, q draft); at T=0 that is argmax agreement. "
          f"*Exact*: teacher-forced on {st['exact_positions']} held-out positions. *Empirical*: speculative sampling "
          f"simulated on {st['prompts']} held-out prompts of {st['prompt_len']} tokens, {st['new_tokens']} new tokens "
          f"each, gamma={st['gamma']}; alpha = accepted / draft tokens the target examined; per step = per target pass "
          "(tokens/step includes the target's corrected or bonus token). "
          "`ensemble` = uniform average of the three drafts' distributions.", "",
          "| draft | T | alpha exact | alpha empirical | accepted/step | tokens/step | expected tokens/step (from exact) |",
          "|---|---|---|---|---|---|---|"]
    for n, row in al.items():
        for T, r in row.items():
            L.append(f"| {n} | {T[1:]} | {r['exact']:.3f} | {r['empirical']:.3f} | {r['accepted_per_step']:.2f} "
                     f"| {r['tokens_per_step']:.2f} | {r['expected_tokens_per_step_from_exact']:.2f} |")
    L += ["", "## Greedy completions of held-out prompts", ""]
    for c in card["completions"]:
        L += ["Prompt:", "", "```python", c["prompt"], "```", ""]
        for n, txt in c["completions"].items():
            L += [f"{n}:", "", "```python", txt, "```", ""]
    L += ["## Build", "",
          f"Command: `python -m models.build`; stage wall times (s): "
          + ", ".join(f"{k} {v}" for k, v in card["stage_wall_s"].items())
          + f"; torch {card['torch']}, transformers {card['transformers']}, {card['threads']} thread(s) per process.", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(L))
    from .heads import restore_sections
    restore_sections(out)  # the Medusa heads sections (models/heads.py) of heads built for this family


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny budgets, smoke test (~2 min)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output dir (default {DEMO_DIR}; with --quick a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1, see doc)")
    ap.add_argument("--resume", choices=["distill", "measure"], default=None,
                    help="keep the checkpoints already in --out, redo the pipeline from this stage "
                         "(the data stage is always redone; it is deterministic)")
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: train these specs
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    specs = specs_for(args.quick)
    out = args.out or (Path(tempfile.gettempdir()) / "specplugin-demo-quick" if args.quick else DEMO_DIR)

    if args.worker:  # child process: train CE drafts side by side with the target
        train_and_save(args.worker.split(","), specs, args.work, out)
        return 0

    import transformers
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="specplugin-build-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"build: out={out} work={work} quick={args.quick} threads={args.threads}")
    t_all = time.time()
    walls: dict = {}

    t = time.time()
    info = stage_data(work)
    walls["data"] = round(time.time() - t, 1)
    if args.resume:
        # Reuse earlier stages' checkpoints: same tokenizer, and their numbers from the old card.
        assert (work / "tokenizer" / "tokenizer.json").read_bytes() == (out / TARGET / "tokenizer.json").read_bytes()
        old = json.loads((out / "card.json").read_text())
        keep = [TARGET] + [n for n in DRAFTS if specs[n].objective == "ce" or args.resume == "measure"]
        for n in keep:
            (work / f"{n}.stats.json").write_text(json.dumps(old["training"][n]))
        walls.update({k: v for k, v in old["stage_wall_s"].items()
                      if k in ("target", "target+ce_drafts") or (k == "distill" and args.resume == "measure")})

    if not args.resume:
        t = time.time()
        # One single-thread worker process per cross-entropy draft, side by side
        # with the target (the drafts do not depend on it).
        children = []
        for name in (n for n in DRAFTS if specs[n].objective == "ce"):
            cmd = [sys.executable, "-m", "vllm_specplugin.models.build", "--worker", name, "--work", str(work),
                   "--out", str(out), "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
            children.append(subprocess.Popen(cmd))
        train_and_save([TARGET], specs, work, out)
        walls["target"] = round(time.time() - t, 1)
        for child in children:
            if child.wait() != 0:
                raise SystemExit(f"draft worker failed with code {child.returncode}")
        walls["target+ce_drafts"] = round(time.time() - t, 1)

    if args.resume != "measure":
        t = time.time()
        kl = [n for n in DRAFTS if specs[n].objective == "kl"]
        train_and_save(kl, specs, work, out, teacher_dir=out / TARGET)
        walls["distill"] = round(time.time() - t, 1)

    t = time.time()
    res = stage_measure(specs, work, out, EVAL["quick" if args.quick else "full"])
    walls["measure"] = round(time.time() - t, 1)
    walls["total"] = round(time.time() - t_all, 1)
    if args.resume:
        walls["total_incl_reused_stages"] = round(sum(v for k, v in walls.items()
                                                      if k not in ("target", "total")), 1)

    training = {n: json.loads((work / f"{n}.stats.json").read_text()) for n in specs}
    size = sum(p.stat().st_size for n in specs for p in (out / n).iterdir())
    card = {
        "quick": args.quick,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "corpus": info,
        "tokenizer": {"type": "byte-level BPE", "vocab_size": VOCAB, "bos": "<s>", "eos": "</s>", "pad": "<pad>"},
        "specs": {n: s.to_dict() for n, s in specs.items()},
        "training": training,
        "checkpoint_bytes": size,
        "stage_wall_s": walls,
        **res,
    }
    write_card(out, card)
    log(f"done in {walls['total']/60:.1f} min; checkpoints {size/1e6:.1f} MB in {out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
