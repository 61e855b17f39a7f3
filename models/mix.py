"""The heterogeneous demo family (code + prose): ``python -m vllm_specplugin.models.mix``.

Why a second family: the memory-bound pair (``models/demo-mb``) is one domain (stdlib code) and a
draft that is the target's own ancestor, so every draft is good everywhere and no strategy has
anything to win. This family has a target that knows two domains and drafts that do not:

* ``target`` (31.5 M): the memory-bound target, trained on further with cross-entropy on a 50/50
  mixture of code (``models/corpus.py``) and English prose (``models/prose.py``, the Python
  documentation). Trained on, not grown anew: growing again would start from a 4.46 M model that has
  never seen prose, and on one CPU thread (about 240 tokens/s for this size) hours buy a couple of
  million tokens; starting from a model that already has 0.8 M + 2.6 M tokens of code keeps the code
  domain and spends the whole budget on prose.
* ``draft-code`` (4.46 M): the memory-bound draft (the 4.46 M demo target, distilled towards the
  code-only 31.5 M target), distilled further towards the new target on code only.
* ``draft-prose`` (4.46 M, same shape): random init, distilled towards the new target on prose only
  (a specialist that has never seen code, as a model trained for another domain would be).
* ``draft-tiny`` (0.37 M): the small family's distilled 2-layer draft, distilled towards the new
  target on the mixture: weak everywhere, and far cheaper than the others.

Every stage is resumable: a state file (model + optimizer + step; the data windows are drawn from a
seeded generator, replayed on resume) in ``--work`` every ``--save-every`` steps; re-running the same
command continues. One torch thread per process (the weights depend on the thread count).

    python -m vllm_specplugin.models.mix target     # hours: the 31.5 M target on the mixture
    python -m vllm_specplugin.models.mix drafts     # the three drafts (needs the target)
    python -m vllm_specplugin.models.mix card       # per-domain perplexity and alpha -> MODEL_CARD.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_specplugin.paths import runs_dir

from . import DEMO_DIR, TARGET
from . import corpus as corpus_mod
from . import measure as M
from . import prose as prose_mod
from . import tokenizer as tok_mod

MB_DIR = DEMO_DIR.parent / "demo-mb"
MIX_DIR = DEMO_DIR.parent / "demo-mix"
DEFAULT_WORK = Path(runs_dir("mix-work"))
DOMAINS = ("code", "prose")
SEQ = 256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def domain_streams(tok, work: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{domain: {"train": int16 stream, "heldout": int16 stream}}, cached in ``work``."""
    cache = work / "streams.pt"
    if cache.exists():
        return torch.load(cache)
    code = corpus_mod.load()
    prose = prose_mod.load()
    out = {
        "code": {"train": tok_mod.encode_docs(tok, [f.text for f in code if not f.heldout]),
                 "heldout": tok_mod.encode_docs(tok, [f.text for f in code if f.heldout])},
        "prose": {"train": tok_mod.encode_docs(tok, [f.text for f in prose if not f.heldout]),
                  "heldout": tok_mod.encode_docs(tok, [f.text for f in prose if f.heldout])},
    }
    work.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    log("streams: " + ", ".join(f"{d} {len(s['train'])} train / {len(s['heldout'])} held-out tokens"
                                 for d, s in out.items()))
    return out


@dataclass(frozen=True)
class Job:
    """One resumable training run."""

    name: str
    tokens: int  # budget
    lr: float
    seed: int
    mixture: dict  # domain -> windows per batch
    objective: str  # "ce" or "kl" (forward KL(p_target || q_student) at T = 1)
    batch: int = 8

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch * SEQ))


def _windows(streams: dict, job: Job, g: torch.Generator) -> torch.Tensor:
    rows = []
    for dom, n in job.mixture.items():
        s = streams[dom]["train"]
        starts = torch.randint(0, len(s) - SEQ - 1, (n,), generator=g)
        rows.append(s[starts[:, None] + torch.arange(SEQ + 1)[None, :]].long())
    return torch.cat(rows)


def run_job(job: Job, model, streams: dict, work: Path, save_every: int, teacher=None,
            on_save=None, start_step: int = 0) -> dict:
    """Train ``model`` in place per ``job``, resuming from ``work/<name>.state.pt``; returns stats.

    Without a state file, ``start_step`` > 0 continues a run whose weights (``model``) came from a
    committed checkpoint saved at that step: same data order and schedule, a fresh AdamW warmed up
    again over 20 steps (the optimizer state is too big to commit)."""
    from tqdm import tqdm

    from .train import _lr_at, make_optimizer, objective_loss

    assert sum(job.mixture.values()) == job.batch, job
    state_path = work / f"{job.name}.state.pt"
    opt = make_optimizer(model, job.lr)
    st = {"step": start_step, "wall_s": 0.0, "ema": None}
    rewarm_from = start_step if start_step and not state_path.exists() else None
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st.pop("model"))
        opt.load_state_dict(st.pop("opt"))
        log(f"{job.name}: resuming at step {st['step']} / {job.steps} from {state_path}")
    g = torch.Generator().manual_seed(job.seed)
    for _ in range(st["step"]):  # same data order whatever the resume point
        _windows(streams, job, g)
    warmup = min(50, job.steps // 10 + 1)
    model.train()
    ema = st["ema"]
    t_seg = time.time()
    bar = tqdm(range(st["step"], job.steps), initial=st["step"], total=job.steps, desc=job.name,
               mininterval=30, ncols=100)
    for step in bar:
        lr = _lr_at(step, job.steps, job.lr, warmup)
        if rewarm_from is not None:
            lr *= min(1.0, (step - rewarm_from + 1) / 20)
        for group in opt.param_groups:
            group["lr"] = lr
        xy = _windows(streams, job, g)
        x, y = xy[:, :-1], xy[:, 1:]
        loss = objective_loss(model(input_ids=x).logits, x, y, job.objective, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if (step + 1) % save_every == 0 or step + 1 == job.steps:
            st.update(step=step + 1, ema=ema, wall_s=st["wall_s"] + time.time() - t_seg)
            t_seg = time.time()
            torch.save({**st, "model": model.state_dict(), "opt": opt.state_dict()},
                       state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)
            if on_save is not None:
                model.eval()
                on_save(step + 1)
                model.train()
    bar.close()
    model.eval()
    return {"steps": job.steps, "train_tokens": job.steps * job.batch * SEQ,
            "train_wall_s": round(st["wall_s"], 1), "final_train_loss_ema": round(ema, 4),
            "mixture": job.mixture, "objective": job.objective, "lr": job.lr, "seed": job.seed}


def heldout_losses(model, streams: dict, windows: int) -> dict:
    return {d: round(M.heldout_loss(model, M.heldout_windows(streams[d]["heldout"], SEQ, windows)), 4)
            for d in DOMAINS}


# ------------------------------------------------------------------ stages

TARGET_JOB = Job("target", tokens=500_000, lr=3e-4, seed=4242, mixture={"code": 4, "prose": 4},
                 objective="ce")
DRAFT_JOBS = {
    "draft-code": Job("draft-code", tokens=100_000, lr=3e-4, seed=11, mixture={"code": 8}, objective="kl"),
    "draft-prose": Job("draft-prose", tokens=1_600_000, lr=2e-3, seed=12, mixture={"prose": 8}, objective="kl"),
    "draft-tiny": Job("draft-tiny", tokens=200_000, lr=2e-3, seed=13, mixture={"code": 8, "prose": 8},
                      objective="kl", batch=16),
}


def stage_target(args) -> dict:
    from .build import load_checkpoint, save_checkpoint

    tok = tok_mod.load_tokenizer(MB_DIR / TARGET)
    streams = domain_streams(tok, args.work)
    job = TARGET_JOB if not args.tokens else Job(**{**TARGET_JOB.__dict__, "tokens": args.tokens})
    out = args.out / TARGET
    # A later session (no state file in --work) continues from the committed checkpoint.
    committed = json.loads((out / "progress.json").read_text()) if (out / "progress.json").exists() else {}
    start_step = 0
    if (not (args.work / f"{job.name}.state.pt").exists() and committed.get("of") == job.steps
            and 0 < committed.get("step", 0) < job.steps):
        start_step = committed["step"]
        model = load_checkpoint(out)
        log(f"target: continuing from the committed checkpoint {out} at step {start_step} / {job.steps}")
    else:
        model = load_checkpoint(MB_DIR / TARGET)
    before_path = args.work / "target.before.json"
    if not before_path.exists():
        before = committed.get("heldout_loss_before") or heldout_losses(load_checkpoint(MB_DIR / TARGET), streams,
                                                                        args.eval_windows)
        before_path.write_text(json.dumps(before))
        log(f"memory-bound target before: held-out loss {before}")
    before = json.loads(before_path.read_text())

    def checkpoint(step: int) -> None:
        # A committed checkpoint at every save: a later session can continue from the repository.
        if step % (4 * args.save_every) == 0 or step == job.steps:
            save_checkpoint(model, tok, out)
            (out / "progress.json").write_text(json.dumps(
                {"step": step, "of": job.steps, "source": "models/demo-mb/target", "heldout_loss_before": before,
                 "partial": step < job.steps}, indent=2) + "\n")
            log(f"target: step {step}, checkpoint written; held-out loss (16 windows) "
                f"{heldout_losses(model, streams, 16)}")

    torch.set_num_threads(args.threads)
    stats = run_job(job, model, streams, args.work, args.save_every, on_save=checkpoint, start_step=start_step)
    after = heldout_losses(model, streams, args.eval_windows)
    save_checkpoint(model, tok, out)
    progress = {"source": "models/demo-mb/target", "params": sum(p.numel() for p in model.parameters()),
                "heldout_loss_before": before, "heldout_loss": after,
                "heldout_ppl": {d: round(M.ppl(v), 3) for d, v in after.items()},
                "heldout_ppl_before": {d: round(M.ppl(v), 3) for d, v in before.items()},
                "eval_windows": args.eval_windows, "threads": args.threads, **stats}
    (out / "progress.json").write_text(json.dumps(progress, indent=2) + "\n")
    log(f"target done: held-out loss {before} -> {after}")
    return progress


def stage_drafts(args) -> dict:
    from dataclasses import replace

    from .build import FULL, load_checkpoint, save_checkpoint
    from .train import build_model

    torch.set_num_threads(args.threads)
    tok = tok_mod.load_tokenizer(MB_DIR / TARGET)
    streams = domain_streams(tok, args.work)
    teacher = load_checkpoint(args.out / TARGET)
    done = {}
    for name in args.only or DRAFT_JOBS:
        job = DRAFT_JOBS[name]
        if (args.out / name / "progress.json").exists():
            log(f"{name}: already built, skipped (delete {args.out / name} to rebuild)")
            continue
        if name == "draft-code":
            model = load_checkpoint(MB_DIR / "draft")
        elif name == "draft-prose":
            model = build_model(replace(FULL[TARGET], name=name, seed=job.seed), tok)
        else:
            model = load_checkpoint(DEMO_DIR / "draft-distill")
        stats = run_job(job, model, streams, args.work, args.save_every, teacher=teacher)
        save_checkpoint(model, tok, args.out / name)
        (args.out / name / "progress.json").write_text(json.dumps(stats, indent=2) + "\n")
        done[name] = stats
        log(f"{name}: {stats}")
    return done


def stage_card(args) -> dict:
    from .build import load_checkpoint

    torch.set_num_threads(args.threads)
    tok = tok_mod.load_tokenizer(MB_DIR / TARGET)
    streams = domain_streams(tok, args.work)
    target = load_checkpoint(args.out / TARGET)
    t_prog = json.loads((args.out / TARGET / "progress.json").read_text())
    card = {"target": t_prog, "drafts": {}, "corpus": {
        "code": {"root": str(corpus_mod.stdlib_root()), "fingerprint": corpus_mod.fingerprint(corpus_mod.load())},
        "prose": {"root": str(prose_mod.prose_root()), "documents": len(prose_mod.iter_paths()),
                  "heldout_documents": sum(prose_mod.is_heldout(p) for p in prose_mod.iter_paths())}}}
    t_cost = M.forward_time_per_token(target)
    card["target"]["forward_s_per_token_1x256"] = t_cost
    alpha_w = {d: M.heldout_windows(streams[d]["heldout"], SEQ, args.alpha_windows) for d in DOMAINS}
    for name in DRAFT_JOBS:
        path = args.out / name
        if not (path / "progress.json").exists():
            continue
        draft = load_checkpoint(path)
        row = {"params": sum(p.numel() for p in draft.parameters()),
               "forward_s_per_token_1x256": M.forward_time_per_token(draft), "alpha": {}}
        for d in DOMAINS:
            for temp in (0.0, 1.0):
                row["alpha"][f"{d}_T{temp:g}"] = round(M.exact_alpha(target, M.Single(draft), alpha_w[d], temp), 4)
        card["drafts"][name] = row
        log(f"{name}: {row['alpha']}")
    card["alpha_positions_per_domain"] = int(alpha_w["code"][:, :-1].numel())
    (args.out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    write_card_md(args.out, card)
    return card


def write_card_md(out: Path, card: dict) -> None:
    t = card["target"]
    lines = [
        "# Heterogeneous demo family (`models/demo-mix`): code + prose", "",
        "Built by `python -m vllm_specplugin.models.mix` (see its docstring). Weights bf16, shared "
        "byte-level BPE tokenizer (vocab 4096) of the other families.", "",
        "## Corpora", "",
        "- **code**: the Python 3.11 standard library's `.py` files (`models/corpus.py`; PSF License), "
        "split by file, ~5 % held out.",
        "- **prose**: the Python 3.11 documentation's reStructuredText sources as Debian's "
        "`python3.11-doc` installs them (`/usr/share/doc/python3.11/html/_sources`; `models/prose.py`), "
        "English prose with light markup; licence: PSF License Agreement (code examples Zero-Clause BSD). "
        f"{card['corpus']['prose']['documents']} documents, {card['corpus']['prose']['heldout_documents']} "
        "held out by a hash of their path.", "",
        "## Target", "",
        "The memory-bound target (`models/demo-mb/target`, 31.5 M, code only) trained on with "
        "cross-entropy on a 50/50 code + prose mixture (why not grown anew: in the module docstring).", "",
        "| domain | held-out loss before | ppl before | held-out loss after | ppl after |", "|---|---|---|---|---|",
    ]
    for d in DOMAINS:
        if "heldout_loss_before" in t:
            lines.append(f"| {d} | {t['heldout_loss_before'][d]:.4f} | {t['heldout_ppl_before'][d]:.2f} "
                         f"| {t['heldout_loss'][d]:.4f} | {t['heldout_ppl'][d]:.2f} |")
    if "train_tokens" in t:
        lines += ["", f"Training: {t['train_tokens'] / 1e6:.2f} M tokens, {t['steps']} steps, "
                  f"{t['train_wall_s'] / 60:.0f} min on {t.get('threads', 1)} thread.", ""]
    lines += [
        "## Drafts", "",
        f"alpha = mean over {card['alpha_positions_per_domain']} held-out positions per domain of "
        "sum_x min(p(x), q(x)), teacher-forced (T = 0: argmax agreement). Cost ratio: target forward "
        "time per token over the draft's (1 x 256, transformers, float32, 1 thread); the served c is "
        "measured by `make bench`.", "",
        "| draft | params | code α T=0 | code α T=1 | prose α T=0 | prose α T=1 | target/draft time |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in card["drafts"].items():
        a = row["alpha"]
        ratio = t["forward_s_per_token_1x256"] / row["forward_s_per_token_1x256"]
        lines.append(f"| {name} | {row['params'] / 1e6:.2f} M | {a['code_T0']:.3f} | {a['code_T1']:.3f} "
                     f"| {a['prose_T0']:.3f} | {a['prose_T1']:.3f} | {ratio:.1f}x |")
    lines.append("")
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.models.mix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["target", "drafts", "card", "all"])
    ap.add_argument("--out", type=Path, default=MIX_DIR, help="family folder to write")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="resumable state (not committed)")
    ap.add_argument("--tokens", type=int, default=0, help="target budget (default: TARGET_JOB's)")
    ap.add_argument("--only", nargs="*", choices=list(DRAFT_JOBS), help="drafts stage: these drafts only")
    ap.add_argument("--save-every", type=int, default=25, help="steps between resumable states")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-windows", type=int, default=150)
    ap.add_argument("--alpha-windows", type=int, default=24)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage in ("target", "all"):
        stage_target(args)
    if args.stage in ("drafts", "all"):
        stage_drafts(args)
    if args.stage in ("card", "all"):
        stage_card(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
