"""Build the memory-bound demo target by growing today's target: ``python -m models.grow``.

Why grow instead of training from scratch: on this 2-core CPU a 30 M-parameter
Llama trains at a few hundred tokens/s, so two hours buy ~2 M tokens, less than
the 4.5 M target has already seen.  A function-preserving expansion
(Net2Net / bert2BERT-style) starts the big model *at* the small one's held-out
perplexity (49.9) and every further step improves on it.  It also makes the
small target a natural draft for the big one (their distributions start equal).

Expansion (exact in float32 up to rounding, checked by ``verify_growth``):
- width 256 -> 512: every hidden dim is duplicated.  RMSNorm of a duplicated
  vector equals the norm of the original (mean of squares unchanged), so norm
  weights are duplicated; every linear map that *reads* the residual stream has
  its duplicated input columns halved; every map that *writes* it has its output
  rows duplicated.
- heads 4 -> 8 (head_dim 64 kept, so RoPE is unchanged): q/k/v heads are
  duplicated; o_proj reads each head twice, so its input columns are halved.
- FFN 768 -> 1536: neurons duplicated, down_proj's input columns halved.
- layers 4 -> 8: after every original layer a copy of it whose o_proj and
  down_proj are zero (it adds nothing to the residual stream until trained).
- LM head untied (initialised from the embedding): the duplicated hidden state
  would double tied logits.
Small noise (``--noise``) on the new copies breaks the symmetry so duplicated
units can diverge during training.

Training: cross-entropy on the demo corpus, a token budget (not wall time),
one torch thread (weights depend on the thread count), AdamW with a short
warm-up and cosine decay.  A state file in ``--work`` (model + optimizer + step
+ data position) is written every ``--save-every`` steps; re-running the same
command resumes from it.  The committed bf16 checkpoint plus ``progress.json``
let a later session continue (optimizer restarted; documented in the card).

    python -m models.grow                 # grow + train into models/demo-mb/target
    python -m models.grow --tokens 200000 --out /tmp/x   # a short run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_specplugin.paths import runs_dir

from . import DEMO_DIR, TARGET
from . import corpus as corpus_mod
from . import measure as M
from . import tokenizer as tok_mod

MB_DIR = DEMO_DIR.parent / "demo-mb"
DEFAULT_WORK = Path(runs_dir("grow-work"))

WIDTH_FACTOR = 2
DEPTH_FACTOR = 2


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def grown_config(small_cfg):
    from transformers import LlamaConfig

    d = small_cfg.to_dict()
    d.update(
        hidden_size=small_cfg.hidden_size * WIDTH_FACTOR,
        intermediate_size=small_cfg.intermediate_size * WIDTH_FACTOR,
        num_attention_heads=small_cfg.num_attention_heads * WIDTH_FACTOR,
        num_key_value_heads=small_cfg.num_key_value_heads * WIDTH_FACTOR,
        num_hidden_layers=small_cfg.num_hidden_layers * DEPTH_FACTOR,
        tie_word_embeddings=False,
    )
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        d.pop(k, None)
    cfg = LlamaConfig(**d)
    cfg._attn_implementation = "sdpa"
    return cfg


def _dup_rows(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [2 out, in]: each output unit twice (unit i -> i and i + out)."""
    return torch.cat([w, w], 0)


def _dup_cols_half(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, 2 in]: reads a duplicated input, so each copy gets half."""
    return torch.cat([w, w], 1) / 2


def _dup_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k/v [heads*hd, in] -> [2*heads*hd, in]: new heads = copies of the old ones."""
    return torch.cat([w, w], 0)


def grow(small, noise: float = 1e-3, seed: int = 0):
    """A 2x wider, 2x deeper LlamaForCausalLM computing the same function as ``small``."""
    from transformers import LlamaForCausalLM

    cfg = grown_config(small.config)
    big = LlamaForCausalLM(cfg).float()
    s = {k: v.float() for k, v in small.state_dict().items()}
    H = small.config.num_attention_heads
    new: dict[str, torch.Tensor] = {}
    emb = s["model.embed_tokens.weight"]
    new["model.embed_tokens.weight"] = torch.cat([emb, emb], 1)
    new["model.norm.weight"] = torch.cat([s["model.norm.weight"]] * 2)
    new["lm_head.weight"] = torch.cat([emb, emb], 1) / 2
    L = small.config.num_hidden_layers
    for i in range(L):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": torch.cat([s[p + "input_layernorm.weight"]] * 2),
            "post_attention_layernorm.weight": torch.cat([s[p + "post_attention_layernorm.weight"]] * 2),
            "self_attn.q_proj.weight": _dup_heads(_dup_cols_half(s[p + "self_attn.q_proj.weight"]), H),
            "self_attn.k_proj.weight": _dup_heads(_dup_cols_half(s[p + "self_attn.k_proj.weight"]), H),
            "self_attn.v_proj.weight": _dup_heads(_dup_cols_half(s[p + "self_attn.v_proj.weight"]), H),
            # reads 2H heads (each twice) -> halve; writes the duplicated stream -> dup rows
            "self_attn.o_proj.weight": _dup_rows(_dup_cols_half(s[p + "self_attn.o_proj.weight"])),
            "mlp.gate_proj.weight": _dup_rows(_dup_cols_half(s[p + "mlp.gate_proj.weight"])),
            "mlp.up_proj.weight": _dup_rows(_dup_cols_half(s[p + "mlp.up_proj.weight"])),
            "mlp.down_proj.weight": _dup_rows(_dup_cols_half(s[p + "mlp.down_proj.weight"])),
        }
        for k, v in layer.items():
            new[f"model.layers.{DEPTH_FACTOR * i}.{k}"] = v
            copy = v.clone()
            if k in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                copy.zero_()  # the inserted layer starts as the identity
            new[f"model.layers.{DEPTH_FACTOR * i + 1}.{k}"] = copy
    missing = set(big.state_dict()) - set(new)
    assert not missing, f"grow: no weights for {sorted(missing)[:5]}"
    g = torch.Generator().manual_seed(seed)
    if noise:
        for k, v in new.items():
            if v.ndim == 2 and "embed" not in k and "lm_head" not in k:
                # relative noise: breaks the symmetry between copies, keeps the function ~equal
                v.add_(torch.randn(v.shape, generator=g) * noise * v.abs().mean().clamp_min(1e-3))
    big.load_state_dict(new)
    return big.eval()


def verify_growth(small, big, ids: torch.Tensor) -> float:
    """Max |log-softmax difference| between the two models on ``ids`` [B, T]."""
    with torch.no_grad():
        a = F.log_softmax(small(input_ids=ids).logits.float(), -1)
        b = F.log_softmax(big(input_ids=ids).logits.float(), -1)
    return float((a - b).abs().max())


def streams(tok) -> tuple[torch.Tensor, torch.Tensor]:
    files = corpus_mod.load()
    train = tok_mod.encode_docs(tok, [f.text for f in files if not f.heldout])
    held = tok_mod.encode_docs(tok, [f.text for f in files if f.heldout])
    return train, held


CARD_DRAFTS = {  # candidate drafts for the grown target (all share the demo tokenizer)
    "demo-mb/draft (4.46 M, distilled from the grown target)": MB_DIR / "draft",
    "demo/target (4.46 M, the model it was grown from)": DEMO_DIR / TARGET,
    "demo/draft-distill (0.37 M)": DEMO_DIR / "draft-distill",
    "demo/draft-small (0.37 M)": DEMO_DIR / "draft-small",
}


def write_card(out: Path, held: torch.Tensor, windows: int = 300, alpha_windows: int = 32) -> dict:
    """Held-out loss, acceptance of each candidate draft (exact, teacher-forced), per-token cost;
    writes ``card.json`` and ``MODEL_CARD.md`` next to the grown target."""
    from .build import load_checkpoint

    big = load_checkpoint(out)
    progress = json.loads((out / "progress.json").read_text())
    eval_w = M.heldout_windows(held, 256, windows)
    alpha_w = M.heldout_windows(held, 256, alpha_windows)
    card = {"target": progress, "drafts": {}}
    card["target"]["heldout_loss_card"] = round(M.heldout_loss(big, eval_w), 4)
    card["target"]["forward_s_per_token_1x256"] = M.forward_time_per_token(big)
    for name, path in CARD_DRAFTS.items():
        draft = load_checkpoint(path)
        row = {"params": sum(p.numel() for p in draft.parameters()),
               "forward_s_per_token_1x256": M.forward_time_per_token(draft)}
        for temp in (0.0, 1.0):
            row[f"alpha_T{temp:g}"] = round(M.exact_alpha(big, M.Single(draft), alpha_w, temp), 4)
        card["drafts"][name] = row
        log(f"{name}: alpha T=0 {row['alpha_T0']:.3f}, T=1 {row['alpha_T1']:.3f}")
    card["alpha_positions"] = int(alpha_w[:, :-1].numel())
    (out.parent / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    t = card["target"]
    lines = [
        "# Memory-bound demo target (`models/demo-mb/target`)", "",
        "Built by `python -m models.grow` (see its docstring): today's 4.46 M demo target grown "
        "function-preservingly (width x2, heads x2 at head_dim 64, FFN x2, depth x2 with identity "
        "layers, untied LM head), then trained on with cross-entropy on the same corpus. Weights bf16.", "",
        "| | value |", "|---|---|",
        f"| shape | {big.config.num_hidden_layers} layers x {big.config.hidden_size} "
        f"({big.config.num_attention_heads} heads x {big.config.head_dim}), FFN {big.config.intermediate_size}, "
        f"vocab {big.config.vocab_size} |",
        f"| parameters | {t['params'] / 1e6:.2f} M ({t['params'] * 4 / 1e6:.0f} MB in fp32: above this CPU's 32 MB L3) |",
        f"| held-out loss / ppl | {t['heldout_loss']:.4f} / {t['heldout_ppl']:.2f} "
        f"(the 4.46 M target it grew from: {t['small_heldout_loss']:.4f} / {t['small_heldout_ppl']:.2f}; "
        f"{t['heldout_eval_tokens']} held-out tokens) |",
        f"| growth check | max abs log-prob difference to the small target before training: "
        f"{t['growth_max_dlogp']:.1e} (symmetry-breaking noise) |",
        f"| training | {t['train_tokens'] / 1e6:.2f} M tokens, {t['train_steps']} steps, "
        f"{t['train_wall_s'] / 60:.0f} min on {t['threads']} thread (a shared 2-core machine) |", "",
        "## Drafts for it", "",
        f"alpha = mean over {card['alpha_positions']} held-out positions of sum_x min(p(x), q(x)), "
        "teacher-forced (at T = 0: argmax agreement). Cost: forward time per token of a 1 x 256 batch, "
        "transformers, float32, 1 thread (the served cost c is measured by `make bench`).", "",
        "| draft | params | alpha T=0 | alpha T=1 | target/draft forward time |", "|---|---|---|---|---|",
    ]
    for name, row in card["drafts"].items():
        ratio = t["forward_s_per_token_1x256"] / row["forward_s_per_token_1x256"]
        lines.append(f"| {name} | {row['params'] / 1e6:.2f} M | {row['alpha_T0']:.3f} | {row['alpha_T1']:.3f} "
                     f"| {ratio:.1f}x |")
    lines += ["", "Why the 4.46 M target drafts so well: the grown target *starts* as that model and "
              "training moved it only a little (ppl above). That is the point of growing, and it is "
              "also why its alpha is not evidence about independently trained pairs.", ""]
    (out.parent / "MODEL_CARD.md").write_text("\n".join(lines))
    from .heads import restore_sections
    restore_sections(out.parent)  # the Medusa heads sections (models/heads.py)
    return card


def distill_draft(out: Path, tokens: int, threads: int) -> dict:
    """The 4.46 M target, distilled towards the grown one: forward KL(p_target || q_draft) at T = 1
    on the corpus (teacher-forced, not on the target's own samples: generating them with a 31 M
    model is too slow on this CPU), from the small target's weights. Writes ``MB_DIR / "draft"``."""
    from dataclasses import replace

    from .build import FULL, load_checkpoint, save_checkpoint
    from .train import train

    tok = tok_mod.load_tokenizer(DEMO_DIR / TARGET)
    train_stream, _ = streams(tok)
    teacher = load_checkpoint(out)
    small = load_checkpoint(DEMO_DIR / TARGET)
    spec = replace(FULL[TARGET], name="draft-mb", objective="kl", tokens=tokens, lr=3e-4, seed=5,
                   role="draft", note="demo target's weights, then KL to the grown target at T=1")
    model, stats = train(spec, tok, train_stream, teacher=teacher, init=small, log=log)
    save_checkpoint(model, tok, MB_DIR / "draft")
    (MB_DIR / "draft" / "progress.json").write_text(json.dumps({"spec": spec.to_dict(), **stats}, indent=2) + "\n")
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.grow", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MB_DIR / TARGET, help="checkpoint dir to write")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="resumable state (not committed)")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="training budget in tokens")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--noise", type=float, default=1e-3)
    ap.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-windows", type=int, default=300)
    ap.add_argument("--card-only", action="store_true", help="only (re)write the model card of --out")
    ap.add_argument("--distill-tokens", type=int, default=400_000,
                    help="budget of the draft distilled towards the grown target (0: skip)")
    ap.add_argument("--distill-only", action="store_true", help="only distill the draft, then write the card")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from .build import load_checkpoint, save_checkpoint
    from .train import _lr_at as lr_at
    from .train import make_optimizer

    tok = tok_mod.load_tokenizer(DEMO_DIR / TARGET)
    train_stream, held = streams(tok)
    if args.distill_only:
        distill_draft(args.out, args.distill_tokens, args.threads)
    if args.card_only or args.distill_only:
        write_card(args.out, held)
        return 0
    small = load_checkpoint(DEMO_DIR / TARGET)
    eval_w = M.heldout_windows(held, 256, args.eval_windows)
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "state.pt"
    steps = max(1, args.tokens // (args.batch * args.seq))
    # A fresh AdamW moves every weight by ~lr at once: warm up slowly or the grown
    # model first forgets what it inherited (measured: loss 3.81 -> 4.03 in 10 steps at 6e-4).
    warmup = min(100, steps // 10 + 1)
    t_start = time.time()
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        big = grow(small, noise=0.0)
        big.load_state_dict(st["model"])
        log(f"resuming at step {st['step']} / {steps} from {state_path}")
    else:
        big = grow(small, noise=args.noise)
        err = verify_growth(small, big, eval_w[:2, :128].long())
        log(f"grown: {sum(p.numel() for p in big.parameters())/1e6:.2f} M params, "
            f"max |dlogp| vs the small target {err:.2e}")
        st = {"step": 0, "opt": None, "wall_s": 0.0, "growth_max_dlogp": err,
              "small_heldout_loss": M.heldout_loss(small, eval_w)}
        st["grown_heldout_loss"] = M.heldout_loss(big, eval_w)
        log(f"held-out loss small {st['small_heldout_loss']:.4f}, grown {st['grown_heldout_loss']:.4f}")
    big.train()
    opt = make_optimizer(big, args.lr)
    if st.get("opt"):
        opt.load_state_dict(st["opt"])
    g = torch.Generator().manual_seed(1234)
    hi = len(train_stream) - args.seq - 1
    # Same data order whatever the resume point: draw (and discard) the windows already used.
    for _ in range(st["step"]):
        torch.randint(0, hi, (args.batch,), generator=g)
    ema = st.get("ema")
    bar = tqdm(range(st["step"], steps), initial=st["step"], total=steps, desc="train grown target",
               mininterval=30, ncols=100)
    t_seg = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup)  # step < steps: same as the small family's schedule
        starts = torch.randint(0, hi, (args.batch,), generator=g)
        xy = train_stream[starts[:, None] + torch.arange(args.seq + 1)[None, :]].long()
        logits = big(input_ids=xy[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(big.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == steps:
            st.update(step=step + 1, model=big.state_dict(), opt=opt.state_dict(), ema=ema,
                      wall_s=st["wall_s"] + time.time() - t_seg)
            t_seg = time.time()
            torch.save(st, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)
            if (step + 1) % (4 * args.save_every) == 0:
                big.eval()
                log(f"step {step + 1}: held-out loss (16 windows) {M.heldout_loss(big, eval_w[:16]):.4f}, "
                    f"small target {M.heldout_loss(small, eval_w[:16]):.4f}")
                big.train()
    bar.close()
    big.eval()
    loss = M.heldout_loss(big, eval_w)
    save_checkpoint(big, tok, args.out)
    progress = {
        "source": str((DEMO_DIR / TARGET).relative_to(DEMO_DIR.parent.parent)),
        "params": sum(p.numel() for p in big.parameters()),
        "growth_max_dlogp": st["growth_max_dlogp"],
        "small_heldout_loss": round(st["small_heldout_loss"], 4),
        "small_heldout_ppl": round(M.ppl(st["small_heldout_loss"]), 3),
        "grown_heldout_loss_before_training": round(st["grown_heldout_loss"], 4),
        "heldout_loss": round(loss, 4),
        "heldout_ppl": round(M.ppl(loss), 3),
        "heldout_eval_tokens": int(eval_w[:, 1:].numel()),
        "train_steps": steps,
        "train_tokens": steps * args.batch * args.seq,
        "train_wall_s": round(st["wall_s"], 1),
        "threads": args.threads,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    (args.out / "progress.json").write_text(json.dumps(progress, indent=2) + "\n")
    log(f"done: held-out loss {loss:.4f} (ppl {M.ppl(loss):.2f}); small target "
        f"{st['small_heldout_loss']:.4f}; {time.time() - t_start:.0f} s this run")
    if args.distill_tokens:
        distill_draft(args.out, args.distill_tokens, args.threads)
    write_card(args.out, held)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
