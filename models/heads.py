"""Train Medusa-1 heads for a Llama demo target: ``python -m vllm_specplugin.models.heads``.

Medusa-1 (Cai et al. 2024): the target stays frozen; head j (0-based) reads
the target's last hidden state h_t (after the final RMSNorm, exactly what
vLLM's runner hands ``MedusaProposer``) and guesses token t+2+j, i.e. the
token after the one the target itself samples from h_t.  A head is a
residual block ``x + SiLU(W x + b)`` (``--layers`` of them) followed by the
target's own LM head, shared by all heads and frozen (vLLM's
``original_lm_head`` format), so a head adds d*d + d parameters per layer.

Objective (self-distillation): at every position t of a corpus window, head j
is trained towards the *target's* next-token distribution at position t+1+j,
forward KL(p_target || q_head) at T = 1, weighted 0.8^j as in Medusa.  The
target's distribution, not the corpus token, is what verification compares
against, so distilling raises acceptance (the corpus token is only one sample
of it).  Contexts are corpus text by default; ``--data self`` trains on the
target's own T = 1 samples instead (any Llama target, e.g. the random test
models; slower to make on CPU).  The card measures acceptance on held-out
text and on the target's own greedy text.

Output: a directory vLLM 0.32 loads with
``speculative_config={"method": "medusa", "model": DIR, "num_speculative_tokens": k}``
(config.json with ``architectures: ["MedusaModel"]``, ``num_heads``,
``num_hidden_layers`` (per head), ``hidden_size``, ``vocab_size``,
``truncated_vocab_size``, ``original_lm_head``, ``medusa_fc_bias``; bf16
safetensors with ``blocks.{j}.layers.{l}.weight|bias`` and ``lm_head.weight``),
plus ``heads_card.json`` with the training stats and measured acceptance.

Training is resumable: a state file in ``--work`` is written every
``--save-every`` steps; re-running the same command continues from it.

``make heads`` builds both demo targets' heads (wall time on the shared 2-core machine, 1 thread,
load 10-30: 16.5 min for the 4.46 M target, 0.5 M tokens; 24.5 min for the 31.5 M one, 0.3 M tokens):

    python -m vllm_specplugin.models.heads --target models/demo/target --out models/demo/medusa \
        --tokens 500000 --card models/demo
    python -m vllm_specplugin.models.heads --target models/demo-mb/target --out models/demo-mb/medusa \
        --tokens 300000 --lr 2e-3 --card models/demo-mb
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from vllm_specplugin.paths import CHECKOUT_ROOT, runs_dir

from . import measure as M
from . import tokenizer as tok_mod

DEFAULT_WORK = Path(runs_dir("heads-work"))


def _names_root() -> Path:
    """What the cards' model paths are relative to: the checkout (else the current directory)."""
    return Path(CHECKOUT_ROOT) if CHECKOUT_ROOT else Path.cwd()


HEAD_DECAY = 0.8  # Medusa's per-head loss weight lambda_j = 0.8^j
CARD_FILE = "heads_card.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class MedusaHeads(nn.Module):
    """k heads of ``layers`` residual blocks each; the same math as vLLM's ``Medusa``
    (``vllm/model_executor/models/medusa.py``) with ``original_lm_head``."""

    def __init__(self, hidden: int, num_heads: int, layers: int, lm_head_weight: torch.Tensor):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, bias=True) for _ in range(layers))
            for _ in range(num_heads))
        for blk in self.blocks:  # zero init: every head starts as the target's own next-token guess
            for lin in blk:
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)
        # Frozen copy of the target's LM head [vocab, hidden].
        self.register_buffer("lm_head", lm_head_weight.detach().float().clone(), persistent=False)

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        """h: [..., hidden] float32 -> k logits tensors [..., vocab]."""
        out = []
        for blk in self.blocks:
            x = h
            for lin in blk:
                x = x + F.silu(lin(x))
            out.append(x @ self.lm_head.T)
        return out

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def check_llama(target_dir: Path) -> dict:
    """The target's config.json, or SystemExit when it is not a Llama model."""
    cfg_path = Path(target_dir) / "config.json"
    if not cfg_path.exists():
        raise SystemExit(f"heads: {target_dir} has no config.json (not a Hugging Face model directory)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" or archs != ["LlamaForCausalLM"]:
        raise SystemExit(
            f"heads: {target_dir} is model_type={cfg.get('model_type')!r}, architectures={archs}; "
            "only Llama targets (LlamaForCausalLM) are supported: the heads read the Llama model's "
            "final normed hidden state and reuse its LM head")
    return cfg


def load_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    check_llama(target_dir)
    m = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@torch.no_grad()
def target_hidden_and_logp(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T] int64 -> (h [B, T, d] final normed hidden states, log p [B, T, V]) float32."""
    h = target.model(input_ids=x).last_hidden_state.float()
    return h, F.log_softmax(target.lm_head(h).float(), -1)


def heads_loss(heads: MedusaHeads, h: torch.Tensor, t_logp: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Sum_j 0.8^j KL(p_target(. | t+1+j) || q_j(. | h_t)) averaged over positions."""
    V = t_logp.shape[-1]
    total, per = 0.0, []
    for j, logits in enumerate(heads(h)):
        n = h.shape[1] - 1 - j
        q = F.log_softmax(logits[:, :n], -1).reshape(-1, V)
        p = t_logp[:, 1 + j:1 + j + n].reshape(-1, V)
        kl = F.kl_div(q, p, log_target=True, reduction="batchmean")
        total = total + HEAD_DECAY ** j * kl
        per.append(kl.item())
    return total, per


def resumable_train(model: nn.Module, batch_loss, stream, args, key: dict, desc: str,
                    parts_name: str, log=log, curve_fn=None) -> tuple[nn.Module | None, dict]:
    """The shared training loop of the heads trainers (Medusa here, EAGLE in models/eagle.py): AdamW with
    warm-up + cosine, random ``[batch, seq]`` windows of ``stream`` (seeded; a list of streams: batch
    row r from stream r mod n, so each stream gets an equal share), grad clip 1, a resumable state in
    ``args.work`` every ``args.save_every`` steps (keyed by ``key``: a changed setting starts afresh).
    ``batch_loss(x [B, T] int64) -> (loss, parts: list[float])``. With ``curve_fn(model) -> dict`` and
    ``args.curve_every`` > 0, the learning curve: ``curve_fn`` every ``curve_every`` steps and at the end,
    kept in the state and returned in stats["curve"]. Returns (model, stats), or
    (None, {stopped_at_step, state}) under ``--stop-after`` (tests)."""
    from .train import _lr_at, make_optimizer

    opt = make_optimizer(model, args.lr)
    steps = max(1, args.tokens // (args.batch * args.seq))
    warmup = max(1, min(50, steps // 10))
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = state_file(args, key)
    start, wall0, ema, curve = 0, 0.0, None, []
    if state_path.exists():
        st = torch.load(state_path)
        if st["key"] == key:
            model.load_state_dict(st["heads"])
            opt.load_state_dict(st["opt"])
            start, wall0, ema, curve = st["step"], st["wall_s"], st["ema"], st.get("curve", [])
            log(f"resuming from {state_path} at step {start}/{steps}")
    g = torch.Generator().manual_seed(args.seed + 1_000_003)
    streams = list(stream) if isinstance(stream, (list, tuple)) else [stream]
    rows = [list(range(j, args.batch, len(streams))) for j in range(len(streams))]
    every = getattr(args, "curve_every", 0) if curve_fn is not None else 0

    def point(step: int) -> None:
        model.eval()
        curve.append({"step": step, "train_tokens": step * args.batch * args.seq, **curve_fn(model)})
        model.train()
        log(f"curve at step {step}: {curve[-1]}")
    t0 = time.time()
    per, trained = [], 0
    bar = tqdm(range(steps), total=steps, initial=0, desc=desc, mininterval=15, unit="step", ncols=100)
    for step in bar:
        # Drawn even when skipped: the same data order after a resume.
        starts = [torch.randint(0, len(s) - args.seq - 1, (len(r),), generator=g) for s, r in zip(streams, rows)]
        if step < start:
            continue
        if every and step == 0:
            point(0)
        x = torch.empty(args.batch, args.seq, dtype=torch.long)
        for s, r, st0 in zip(streams, rows, starts):
            x[r] = s[st0[:, None] + torch.arange(args.seq)[None, :]].long()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, args.lr, warmup)
        loss, per = batch_loss(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        trained += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if every and ((step + 1) % every == 0 or step + 1 == steps):
            point(step + 1)
        if (step + 1) % args.save_every == 0 and step + 1 < steps:
            torch.save({"key": key, "heads": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "wall_s": wall0 + time.time() - t0, "ema": ema, "curve": curve}, state_path)
            if args.stop_after and step + 1 >= args.stop_after:  # tests: a run stopped after a saved state
                bar.close()
                return None, {"stopped_at_step": step + 1, "state": str(state_path)}
    bar.close()
    wall = wall0 + time.time() - t0
    stats = {"steps": steps, "train_tokens": steps * args.batch * args.seq, "train_wall_s": round(wall, 1),
             "resumed_from_step": start, "steps_trained_this_run": trained,
             "final_loss_ema": round(ema, 4), parts_name: [round(v, 4) for v in per],
             "threads": torch.get_num_threads(), **{k: v for k, v in key.items() if k != "target"}}
    if curve:
        stats["curve"], stats["curve_every"] = curve, every
    return model, stats


def state_file(args, key: dict) -> Path:
    """Where :func:`resumable_train` keeps the resumable state of a run with settings ``key``."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(args.work) / f"{Path(args.out).name}-{digest}.pt"


def export_state(model: nn.Module, args, key: dict, parts_name: str) -> dict:
    """``--export-state``: load the last resumable state of a run that has not finished into
    ``model`` and return its stats (what :func:`resumable_train` returns, marked ``interrupted``),
    so that a long run's head can be measured and shipped while it goes on (re-running the
    training command still resumes from the same state)."""
    path = state_file(args, key)
    if not path.exists():
        raise SystemExit(f"--export-state: no resumable state {path} for these settings")
    st = torch.load(path)
    if st["key"] != key:
        raise SystemExit(f"--export-state: {path} holds another run's state")
    model.load_state_dict(st["heads"])
    steps = max(1, args.tokens // (args.batch * args.seq))
    stats = {"steps": st["step"], "train_tokens": st["step"] * args.batch * args.seq, "train_wall_s": round(st["wall_s"], 1),
             "interrupted": True, "planned_steps": steps, "planned_tokens": steps * args.batch * args.seq,
             "final_loss_ema": round(st["ema"], 4), parts_name: [], "threads": args.threads,
             **{k: v for k, v in key.items() if k != "target"}}
    if st.get("curve"):
        stats["curve"], stats["curve_every"] = st["curve"], args.curve_every
    log(f"exported {path} at step {st['step']}/{steps}")
    return stats


def train_heads(target, stream: torch.Tensor, args, held: torch.Tensor | None = None,
                log=log) -> tuple[MedusaHeads, dict]:
    """Resumable, seeded, token-budgeted training; returns (heads, stats). With ``args.curve_every``,
    the learning curve on the target's greedy continuations of held-out prompts from ``held``."""
    d = target.config.hidden_size
    torch.manual_seed(args.seed)
    heads = MedusaHeads(d, args.num_heads, args.layers, target.lm_head.weight)
    key = {k: getattr(args, k) for k in ("num_heads", "layers", "tokens", "batch", "seq", "lr", "seed")}
    key["target"] = str(Path(args.target).resolve())
    if getattr(args, "data", "corpus") != "corpus":  # another text, another run (corpus runs' keys unchanged)
        key.update(data=args.data, self_pool=args.self_pool)
    if getattr(args, "curve_every", 0) and held is None:
        raise ValueError("--curve-every needs the held-out text (train_heads(..., held=...))")

    def batch_loss(x):
        h, t_logp = target_hidden_and_logp(target, x)
        return heads_loss(heads, h, t_logp)

    if getattr(args, "export_state", False):
        return heads, export_state(heads, args, key, "final_kl_per_head")
    curve = curve_fn(target, held) if getattr(args, "curve_every", 0) else None
    return resumable_train(heads, batch_loss, stream, args, key, "train medusa heads", "final_kl_per_head", log,
                           curve_fn=curve)


def curve_fn(target, held: torch.Tensor, acceptance=None, prompts: int = 8, new_tokens: int = 64, **options):
    """The learning curve's measurement (:func:`resumable_train`'s ``curve_fn``): ``acceptance(target,
    model, windows, start=..., **options)`` (default :func:`head_acceptance`, every Medusa head;
    ``models/eagle.py`` passes its own), teacher-forced on the target's greedy continuations of
    ``prompts`` held-out prompts (made once)."""
    acceptance = acceptance or head_acceptance
    pr = M.heldout_windows(held, 48, prompts)[:, :-1].contiguous()
    windows = greedy_windows(target, pr, new_tokens)

    def measure_curve(model: nn.Module) -> dict:
        r = acceptance(target, model, windows, start=pr.shape[1] - 1, **options)
        return {"accepted_per_step_T0": r["accepted_per_step_T0"], "T0": r["T0"], "T1": r["T1"]}
    return measure_curve


def save_heads(heads: MedusaHeads, out: Path, target_cfg: dict, extra: dict) -> int:
    """Write the vLLM Medusa checkpoint (bf16); returns the safetensors size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for j, blk in enumerate(heads.blocks):
        for l, lin in enumerate(blk):
            tensors[f"blocks.{j}.layers.{l}.weight"] = lin.weight
            tensors[f"blocks.{j}.layers.{l}.bias"] = lin.bias
    tensors["lm_head.weight"] = heads.lm_head
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": target_cfg["hidden_size"],
        "vocab_size": target_cfg["vocab_size"],
        "truncated_vocab_size": target_cfg["vocab_size"],
        # MedusaConfig.from_pretrained renames any key containing "num" + "heads"/"layers":
        # keep exactly these two such keys.
        "num_heads": len(heads.blocks),
        "num_hidden_layers": len(heads.blocks[0]),
        "original_lm_head": True,  # one LM head shared by all heads: the target's, frozen
        "medusa_fc_bias": True,
        "torch_dtype": "bfloat16",
        "specplugin": extra,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return (out / "model.safetensors").stat().st_size


def load_heads(heads_dir: Path) -> MedusaHeads:
    """Read a checkpoint written by ``save_heads`` back (float32)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(heads_dir) / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(Path(heads_dir) / "model.safetensors")).items()}
    heads = MedusaHeads(cfg["hidden_size"], cfg["num_heads"], cfg["num_hidden_layers"], w.pop("lm_head.weight"))
    heads.load_state_dict({k.replace("layers.", ""): v for k, v in w.items()})
    return heads


# ---------------------------------------------------------------- measurement

@torch.no_grad()
def head_acceptance(target, heads: MedusaHeads, windows: torch.Tensor, start: int = 0, batch: int = 8) -> dict:
    """Teacher-forced on ``windows`` [N, T] (context = the window's tokens).  Per head j, averaged
    over positions t >= ``start`` with t+1+j inside the window:

    * ``T0``: head j's argmax == the target's argmax at t+1+j (greedy acceptance of head j when the
      tokens before it are the window's);
    * ``T1``: p_target(head j's argmax at t+1+j) at T = 1: vLLM drafts Medusa greedily, so a draft is
      verified one-hot and accepted with probability p(draft);
    * ``chain_T0``: P(heads 0..j all agree) and ``accepted_per_step_T0`` = its sum: on the target's own
      greedy text (then agreement with the target's argmax is exactly acceptance) the mean number of
      drafts accepted per verification step started at t."""
    k = len(heads.blocks)
    agree = torch.zeros(k, dtype=torch.float64)
    pacc = torch.zeros(k, dtype=torch.float64)
    chain = torch.zeros(k, dtype=torch.float64)
    cnt = torch.zeros(k, dtype=torch.float64)
    n_chain = 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].long()
        h, t_logp = target_hidden_and_logp(target, x)
        t_arg = t_logp.argmax(-1)
        T = x.shape[1]
        n_all = T - k - start  # positions where every head has a target position
        lead = torch.ones(x.shape[0], n_all, dtype=torch.bool)
        for j, logits in enumerate(heads(h[:, start:])):
            n = T - 1 - j - start
            d = logits[:, :n].argmax(-1)
            tpos = slice(start + 1 + j, start + 1 + j + n)
            ok = d == t_arg[:, tpos]
            agree[j] += ok.sum().item()
            pacc[j] += t_logp[:, tpos].gather(-1, d[..., None]).exp().sum().item()
            cnt[j] += ok.numel()
            lead &= ok[:, :n_all]
            chain[j] += lead.sum().item()
        n_chain += lead.numel()
    ch = (chain / n_chain).tolist()
    return {"T0": [round(v, 4) for v in (agree / cnt).tolist()],
            "T1": [round(v, 4) for v in (pacc / cnt).tolist()],
            "chain_T0": [round(v, 4) for v in ch],
            "accepted_per_step_T0": round(sum(ch), 4),
            "positions": int(cnt[0].item())}


@torch.no_grad()
def greedy_windows(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[N, P] prompts -> [N, P + new_tokens]: each prompt and the target's own greedy continuation
    (KV-cached)."""
    out = target.generate(input_ids=prompts.long(), attention_mask=torch.ones_like(prompts.long()),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=target.config.pad_token_id)
    return out


def measure(target, heads: nn.Module, held: torch.Tensor, windows: int, prompts: int, new_tokens: int,
            acceptance=head_acceptance) -> dict:
    """The card's measurement: ``acceptance(target, heads, windows [N, T], start=0)`` on held-out text and
    on the target's own greedy text (``heads.trainable_params()`` for the size)."""
    t = time.time()
    ho = acceptance(target, heads, M.heldout_windows(held, 256, windows)[:, :-1])
    pr = M.heldout_windows(held, 48, prompts)[:, :-1].contiguous()
    # Positions from the prompt's last token on: there the window is the target's greedy text.
    gr = acceptance(target, heads, greedy_windows(target, pr, new_tokens), start=pr.shape[1] - 1)
    tp = sum(p.numel() for p in target.parameters())
    return {"heldout_text": ho, "target_greedy_text": gr,
            "setup": {"heldout_windows": windows, "window": 255, "greedy_prompts": prompts,
                      "greedy_prompt_len": 48, "greedy_new_tokens": new_tokens},
            "params_trainable": heads.trainable_params(),
            "target_params": tp,
            "params_fraction_of_target": round(heads.trainable_params() / tp, 5),
            "measure_wall_s": round(time.time() - t, 1)}


TRAINING_TEXTS = {"corpus": "on corpus text", "self": "on the target's own T = 1 samples",
                  "self-corpus": "on corpus text and the target's own T = 1 continuations of it"}


def training_text(train: dict) -> str:
    """What a card says the heads were trained on (runs before the data was recorded: corpus text)."""
    return TRAINING_TEXTS.get(train.get("data", "corpus"), f"on {train.get('data')}")


def card_markdown(card: dict, target_name: str, heads_name: str) -> list[str]:
    """The "Medusa heads" section appended to a model card (a list of lines)."""
    s, m = card["train"], card["measure"]
    k = s["num_heads"]
    L = [f"## Medusa heads (`{heads_name}`)", "",
         f"Built by `{card['command']}` (`models/heads.py`; Medusa-1: frozen target, {k} heads of "
         f"{s['layers']} residual block(s) each, the target's LM head shared and frozen; self-distilled: "
         "KL(target || head) at T = 1 towards the target's distribution at the head's position, "
         f"{training_text(s)}). Served by vLLM's own method: `{{\"method\": \"medusa\", \"model\": \"{heads_name}\", "
         f"\"num_speculative_tokens\": {k}}}` with `{target_name}` as the target.", "",
         "| | value |", "|---|---|",
         f"| trainable parameters | {m['params_trainable'] / 1e6:.3f} M = {100 * m['params_fraction_of_target']:.2f} % "
         f"of the target's {m['target_params'] / 1e6:.2f} M (the checkpoint also stores a bf16 copy of the "
         f"target's LM head, which vLLM loads as the shared head) |",
         f"| checkpoint | {card['checkpoint_bytes'] / 1e6:.2f} MB bf16 safetensors |",
         f"| training | {s['train_tokens'] / 1e6:.2f} M tokens ({s['steps']} steps of {s['batch']} x {s['seq']}), "
         f"lr {s['lr']}, {s['train_wall_s'] / 60:.1f} min on {s['threads']} thread(s) of a shared 2-core CPU |", "",
         "Per-head acceptance, exact, teacher-forced (head j guesses the token after the target's own next "
         "token). *T = 0*: head j's argmax equals the target's argmax at that position. *T = 1*: the target's "
         "probability of head j's argmax (vLLM drafts Medusa greedily, so verification is one-hot and accepts "
         "with probability p(draft)). *Chain T = 0*: heads 0..j all agree, so on the target's own greedy text "
         "it is the probability that drafts 0..j are all accepted; accepted/step = its sum. "
         f"Held-out text: {m['heldout_text']['positions']} positions of {m['setup']['heldout_windows']} held-out "
         f"windows. Target's greedy text: {m['setup']['greedy_prompts']} held-out prompts of "
         f"{m['setup']['greedy_prompt_len']} tokens, {m['setup']['greedy_new_tokens']} greedy tokens each.", ""]
    return L + acceptance_table(m, [f"head {j}" for j in range(k)]) + curve_markdown(card, heads_name)


def acceptance_table(m: dict, columns: list[str]) -> list[str]:
    """The card's acceptance table (rows T = 0 / T = 1 / chain T = 0 on held-out and greedy text) of a
    ``measure`` result, one column per head / draft position."""
    L = ["| text | " + " | ".join(columns) + " | accepted/step T=0 |", "|---|" + "---|" * (len(columns) + 1)]
    for name, key in (("held-out", "heldout_text"), ("target greedy", "target_greedy_text")):
        r = m[key]
        for row, lab in (("T0", "T = 0"), ("T1", "T = 1"), ("chain_T0", "chain T = 0")):
            extra = f"{r['accepted_per_step_T0']:.2f}" if row == "chain_T0" else ""
            L.append(f"| {name}, {lab} | " + " | ".join(f"{v:.3f}" for v in r[row]) + f" | {extra} |")
    L.append("")
    return L


def _marks(heads_name: str) -> tuple[str, str]:
    return f"<!-- heads {heads_name} -->", f"<!-- /heads {heads_name} -->"


def section_markdown(card: dict, target_name: str, heads_name: str) -> list[str]:
    """The card section of one heads checkpoint, by its ``method`` (Medusa when absent)."""
    if card.get("method", "medusa") in ("eagle", "eagle3"):
        from .eagle import card_markdown as eagle_markdown  # eagle imports this module: import late
        return eagle_markdown(card, target_name, heads_name)
    return card_markdown(card, target_name, heads_name)


def append_card(card_dir: Path, card: dict, target_name: str, heads_name: str) -> None:
    """Add (or replace) the section of heads ``heads_name`` in ``card_dir``'s MODEL_CARD.md and
    card.json (key ``heads``)."""
    md_path, js_path = card_dir / "MODEL_CARD.md", card_dir / "card.json"
    md = md_path.read_text() if md_path.exists() else ""
    start, end = _marks(heads_name)
    if start in md and end in md:
        md = md[:md.index(start)].rstrip("\n") + "\n" + md[md.index(end) + len(end):].lstrip("\n")
    md = md.rstrip("\n") + "\n\n" + start + "\n\n" + "\n".join(section_markdown(card, target_name, heads_name)) + end + "\n"
    md_path.write_text(md)
    js = json.loads(js_path.read_text()) if js_path.exists() else {}
    js.setdefault("heads", {})[heads_name] = card
    js_path.write_text(json.dumps(js, indent=2) + "\n")


def restore_sections(card_dir: Path) -> None:
    """Re-append the section of every heads checkpoint in ``card_dir`` (``*/heads_card.json``) after the
    family's card was rewritten (models/build.py and models/grow.py call this last)."""
    root = _names_root()
    for path in sorted(Path(card_dir).glob(f"*/{CARD_FILE}")):
        target = json.loads((path.parent / "config.json").read_text())["specplugin"]["target"]
        heads_dir = path.parent.resolve()
        name = str(heads_dir.relative_to(root)) if heads_dir.is_relative_to(root) else str(heads_dir)
        append_card(Path(card_dir), json.loads(path.read_text()), target, name)


@torch.no_grad()
def sample_stream(target, tokens: int, seed: int, seq: int = 128, batch: int = 16) -> torch.Tensor:
    """``--data self``: the target's own samples at T = 1 (KV-cached generate from a random first
    token), concatenated into one int64 stream of >= ``tokens`` tokens. For targets without the demo
    corpus (the random test models) and for self-distillation on the target's outputs."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    V, out, n = target.config.vocab_size, [], 0
    while n < tokens:
        first = torch.randint(3, V, (batch, 1), generator=g)
        ids = target.generate(input_ids=first, attention_mask=torch.ones_like(first), max_new_tokens=seq - 1,
                              min_new_tokens=seq - 1, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=target.config.pad_token_id or 0)
        out.append(ids.reshape(-1))
        n += ids.numel()
    return torch.cat(out)


@torch.no_grad()
def corpus_continuations(target, corpus: torch.Tensor, tokens: int, seed: int, work: Path, key: str,
                         prompt_len: int = 32, seq: int = 256, batch: int = 32) -> torch.Tensor:
    """``--data self-corpus``: the target's own T = 1 continuations of corpus prompts (``prompt_len``
    tokens of ``corpus`` at seeded random offsets, continued to ``seq`` tokens), concatenated into one
    int64 stream of >= ``tokens`` tokens. Generated in shards of ``batch`` rows, each saved under
    ``work`` as it is made (an interrupted build resumes; HF generate runs at about 400 tok/s on one
    thread here for the 31.5 M target, so 0.4 M tokens take about 17 min)."""
    shard_dir = Path(work) / f"selfgen-{key}"
    shard_dir.mkdir(parents=True, exist_ok=True)
    n_shards = -(-tokens // (batch * seq))
    out = []
    for k in tqdm(range(n_shards), desc="target continuations", unit="shard", mininterval=15, ncols=100):
        path = shard_dir / f"shard-{k:05d}.pt"
        if path.exists():
            out.append(torch.load(path).long().reshape(-1))
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        starts = torch.randint(0, len(corpus) - prompt_len, (batch,), generator=g)
        prompts = corpus[starts[:, None] + torch.arange(prompt_len)[None, :]].long()
        torch.manual_seed(seed * 1_000_003 + k)
        ids = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=seq - prompt_len, min_new_tokens=seq - prompt_len, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=target.config.pad_token_id or 0)
        torch.save(ids.to(torch.int32), path)
        out.append(ids.reshape(-1))
    return torch.cat(out)


def training_data(target, args) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
    """(train stream(s), held-out stream) int64 for ``--data corpus|self|self-corpus`` (shared by the
    heads trainers). ``self-corpus`` returns two train streams, corpus text and the target's own
    continuations of it, which the training loop draws in equal shares."""
    if args.data in ("corpus", "self-corpus"):
        from .grow import streams
        train_stream, held = streams(tok_mod.load_tokenizer(args.target))
        if args.data == "self-corpus":
            key = hashlib.sha1(f"{Path(args.target).resolve()}|{args.seed}|{args.self_pool}".encode()).hexdigest()[:10]
            own = corpus_continuations(target, train_stream, args.self_pool, args.seed, args.work, key)
            log(f"self-corpus: {len(own)} tokens of the target's own continuations")
            train_stream = [train_stream, own]
    else:
        train_stream = sample_stream(target, args.tokens + args.seq + 1, seed=args.seed)
        held = sample_stream(target, 256 * (args.eval_windows + 1), seed=args.seed + 1)
    n_train = sum(len(s) for s in train_stream) if isinstance(train_stream, list) else len(train_stream)
    log(f"target {args.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.2f} M params; "
        f"corpus {n_train} train / {len(held)} held-out tokens")
    return train_stream, held


def curve_png_name(heads_name: str) -> str:
    return f"{Path(heads_name).name}-curve.png"


def curve_markdown(card: dict, heads_name: str) -> list[str]:
    """The learning-curve table (and plot) of a card whose training recorded one (``--curve-every``)."""
    curve = card["train"].get("curve")
    if not curve:
        return []
    K = len(curve[-1]["T0"])
    L = ["", f"Learning curve (`--curve-every {card['train'].get('curve_every', '?')}`): teacher-forced acceptance "
         f"of {K} draft positions on the target's greedy continuations of 8 held-out prompts (64 tokens each), "
         "measured during training. Accepted/step = expected accepted drafts of a chain of "
         f"{K} at T = 0; T1 = the target's probability of the first draft (greedy drafts).", "",
         f"![learning curve]({curve_png_name(heads_name)})", "",
         "| training tokens | accepted/step T = 0 | position 1 T = 0 | position 1 T = 1 |", "|---|---|---|---|"]
    for c in curve:
        L.append(f"| {c['train_tokens'] / 1e6:.2f} M | {c['accepted_per_step_T0']:.3f} | {c['T0'][0]:.3f} | {c['T1'][0]:.3f} |")
    return L + [""]


def plot_curve(card: dict, path: Path) -> None:
    """PNG of accepted/step (T = 0) against training tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = card["train"]["curve"]
    x = [c["train_tokens"] / 1e6 for c in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [c["accepted_per_step_T0"] for c in curve], marker="o", label="accepted/step, T = 0")
    ax.plot(x, [c["T0"][0] for c in curve], marker=".", label="position 1, T = 0")
    ax.plot(x, [c["T1"][0] for c in curve], marker=".", label="position 1, T = 1")
    ax.set_xlabel("training tokens (M)")
    ax.set_title(f"{card.get('method', 'medusa')} head learning curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(args, card: dict) -> None:
    """``heads_card.json`` in ``--out`` and, with ``--card``, the family card's section (and the learning
    curve's PNG beside it when training recorded one)."""
    (args.out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    if args.card and card["train"].get("curve"):
        Path(args.card).mkdir(parents=True, exist_ok=True)
        plot_curve(card, Path(args.card) / curve_png_name(str(args.out)))
    if args.card:
        root = _names_root()
        rel = lambda p: str(p.resolve().relative_to(root)) if p.resolve().is_relative_to(root) else str(p)
        append_card(args.card, card, rel(args.target), rel(args.out))


def common_args(ap: argparse.ArgumentParser, tokens: int) -> None:
    """The CLI options shared by the heads trainers (this one and models/eagle.py)."""
    ap.add_argument("--target", type=Path, required=True, help="Llama target checkpoint dir")
    ap.add_argument("--out", type=Path, required=True, help="heads checkpoint dir to write")
    ap.add_argument("--tokens", type=int, default=tokens, help=f"training budget in tokens (default {tokens})")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="resumable training state (not committed)")
    ap.add_argument("--save-every", type=int, default=25, help="steps between resumable states")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows for the card")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the greedy-text rows")
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--data", choices=["corpus", "self", "self-corpus"], default="corpus",
                    help="training text: the demo corpus (default; needs the demo tokenizer), the "
                         "target's own T = 1 samples (any Llama target), or self-corpus: half corpus text, "
                         "half the target's own T = 1 continuations of corpus prompts (self-distillation)")
    ap.add_argument("--self-pool", type=int, default=400_000,
                    help="self-corpus: tokens of target continuations to generate (cached in --work)")
    ap.add_argument("--curve-every", type=int, default=0,
                    help="measure the learning curve (acceptance on the target's greedy text) every N "
                         "steps (default 0: off)")
    ap.add_argument("--card", type=Path, default=None,
                    help="model-card dir to extend (MODEL_CARD.md + card.json), e.g. models/demo")
    ap.add_argument("--stop-after", type=int, default=0, help=argparse.SUPPRESS)  # tests: interrupt here
    ap.add_argument("--card-only", action="store_true", help="measure existing --out heads, rewrite the card")
    ap.add_argument("--export-state", action="store_true",
                    help="write --out (and the card) from the last resumable state of this command's run, "
                         "which has not finished; re-running without it resumes the training")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.models.heads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-heads", type=int, default=4, help="k: heads = drafted tokens per step (default 4)")
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head (default 1)")
    common_args(ap, tokens=400_000)
    args = ap.parse_args(argv)

    target_cfg = check_llama(args.target)  # refuse early, before any loading
    torch.set_num_threads(args.threads)
    t_all = time.time()
    target = load_target(args.target)
    train_stream, held = training_data(target, args)
    command = "python -m vllm_specplugin.models.heads " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.card_only:
        heads = load_heads(args.out)
        old = json.loads((args.out / CARD_FILE).read_text())
        stats = old["train"]
        command = old["command"]
    else:
        heads, stats = train_heads(target, train_stream, args, held)
        if heads is None:
            log(f"stopped at step {stats['stopped_at_step']}; state in {stats['state']} (re-run to resume)")
            return 0
    meas = measure(target, heads, held, args.eval_windows, args.eval_prompts, args.eval_new_tokens)
    log(f"acceptance held-out T0 {meas['heldout_text']['T0']} T1 {meas['heldout_text']['T1']}; "
        f"greedy-text chain {meas['target_greedy_text']['chain_T0']} "
        f"-> {meas['target_greedy_text']['accepted_per_step_T0']} accepted/step")
    extra = {"target": str(args.target), "trainer": "models/heads.py", "objective": "kl_self_distill_T1",
             "data": args.data}
    size = save_heads(heads, args.out, target_cfg, extra)
    card = {"command": command, "train": stats, "measure": meas, "checkpoint_bytes": size,
            "total_wall_s": round(time.time() - t_all, 1), "torch": torch.__version__}
    write_card(args, card)
    log(f"wrote {args.out} ({size / 1e6:.2f} MB) in {(time.time() - t_all) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
