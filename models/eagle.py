"""Train an EAGLE-1 head for a Llama demo target: ``python -m vllm_specplugin.models.eagle``.

EAGLE-1 (Li et al. 2024), in the form vLLM 0.32 serves with ``method: "eagle"``
(``vllm/model_executor/models/llama_eagle.py``, ``v1/spec_decode/llm_base_proposer.py``):

* input at position i: ``fc(cat(embed(x_{i+1}), f_i))``, ``fc`` [d, 2d] without bias, where f_i is the
  target's hidden state at i *after* its final RMSNorm (what vLLM's runner hands the proposer for
  ``eagle``; EAGLE-3 would take auxiliary layers instead) and ``embed`` the target's embedding (vLLM
  shares it); position id i (vLLM shifts the tokens, not the positions);
* one Llama decoder layer without input RMSNorm (vLLM replaces it by the identity), causal attention
  with its own KV cache, RoPE as the target's;
* output g_i = the layer's output plus residual, *no* final norm; the draft's logits are the target's
  LM head applied to g_i (shared, frozen); g_i is also the next draft step's "hidden state" input, at
  position i+1 with the drafted token.

Why EAGLE-1 and not EAGLE-3: vLLM's EAGLE-3 path needs the target to expose auxiliary hidden states
(``SupportsEagle3``) and a draft vocabulary mapping; EAGLE-1 reads the final hidden state every Llama
target already returns, so the head is a single extra layer, trained here in minutes on one CPU thread.

Objective (frozen target): at every position i, KL(p_target(. | i+1) || softmax(lm_head(g_i))) at T = 1
(self-distillation: the target's distribution, not the corpus token, is what verification compares
against) plus ``--reg-weight`` x EAGLE's smooth-L1 regression of g_i onto f_{i+1} (keeps g_i usable as
the next step's feature). Training data, resumable loop, measurement and card sections are shared with
the Medusa trainer (models/heads.py).

Output: ``config.json`` (the target's LlamaConfig with ``num_hidden_layers: 1``; vLLM's EAGLEConfig maps
``LlamaForCausalLM`` to ``EagleLlamaForCausalLM``), bf16 ``model.safetensors`` with ``fc.weight`` and
``layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`` (no
embedding or LM head: vLLM takes the target's), and ``heads_card.json``.

``make heads`` builds both demo targets' heads (wall time, 1 thread of the shared 2-core machine, load
4-12: 9.8 min for the 4.46 M target, 0.6 M tokens; 6.2 min for the 31.5 M one, 0.3 M tokens):

    python -m vllm_specplugin.models.eagle --target models/demo/target --out models/demo/eagle \\
        --tokens 600000 --lr 2e-3 --save-every 20 --card models/demo
    python -m vllm_specplugin.models.eagle --target models/demo-mb/target --out models/demo-mb/eagle \\
        --tokens 300000 --lr 2e-3 --save-every 10 --card models/demo-mb
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import heads as H

CHAIN = 3  # draft positions measured autoregressively (teacher-forced)


class EagleHead(nn.Module):
    """fc + one Llama decoder layer without input norm, as vLLM's ``EagleLlamaForCausalLM``; parameter
    names are the checkpoint's. The target's embedding and LM head are frozen buffers."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise SystemExit(f"eagle: rope type {rope.get('rope_type')!r} is not supported (default RoPE only)")
        d, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.n_heads, self.n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.hd = cfg.get("head_dim") or d // self.n_heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        bias = bool(cfg.get("attention_bias", False))
        if bias or cfg.get("mlp_bias"):
            raise SystemExit("eagle: targets with attention/MLP biases are not supported")
        self.fc = nn.Linear(2 * d, d, bias=False)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=False)
        layer.self_attn.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        layer.self_attn.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        layer.self_attn.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=False)
        layer.post_attention_layernorm = nn.Module()
        layer.post_attention_layernorm.weight = nn.Parameter(torch.ones(d))
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        layer.mlp.up_proj = nn.Linear(d, inter, bias=False)
        layer.mlp.down_proj = nn.Linear(inter, d, bias=False)
        self.layers = nn.ModuleList([layer])
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj):
            nn.init.normal_(lin.weight, std=0.02)
        # Start as the identity on the feature: g_i = f_i (the target's own next-token guess).
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        nn.init.zeros_(layer.mlp.down_proj.weight)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            nn.init.normal_(self.fc.weight[:, :d], std=0.02)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)  # [V, d]
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)  # [V, d]

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, N, hd], pos [N] -> rotated (neox / rotate-half style, as Llama in vLLM and HF)."""
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., :self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def step(self, tokens: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, real=None, extra=()):
        """One draft step for every start i at once.

        tokens [B, N] int64, feats [B, N, d] float32, pos [N] (the step's position ids). Step 1
        (``real=None``): entry i is the real input (x_{i+1}, f_i) at position i, attending causally to
        entries 0..i. Later steps: entry i attends to the real keys 0..i (``real`` = step 1's (K, V)),
        to the earlier draft steps' keys of the same start (``extra``) and to itself, exactly what
        vLLM's draft KV cache holds. Returns (g [B, N, d], (K, V) of this step)."""
        lay = self.layers[0]
        B, N, _ = feats.shape
        x = self.fc(torch.cat([self.embed[tokens], feats], -1))
        q = lay.self_attn.q_proj(x).view(B, N, self.n_heads, self.hd).transpose(1, 2)
        k = lay.self_attn.k_proj(x).view(B, N, self.n_kv, self.hd).transpose(1, 2)
        v = lay.self_attn.v_proj(x).view(B, N, self.n_kv, self.hd).transpose(1, 2)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = self.n_heads // self.n_kv
        kr, vr = (k, v) if real is None else real
        kr, vr = kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1)
        scale = self.hd ** -0.5
        s_real = (q @ kr.transpose(-1, -2)) * scale  # [B, H, N, N]
        s_real = s_real.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        own = list(extra) + ([] if real is None else [(k, v)])
        ke = [kk.repeat_interleave(rep, 1) for kk, _ in own]
        ve = [vv.repeat_interleave(rep, 1) for _, vv in own]
        s_ext = [((q * kk).sum(-1, keepdim=True)) * scale for kk in ke]  # [B, H, N, 1] each
        p = torch.softmax(torch.cat([s_real] + s_ext, -1), -1)
        att = p[..., :N] @ vr
        for j, vv in enumerate(ve):
            att = att + p[..., N + j:N + j + 1] * vv
        r = x + lay.self_attn.o_proj(att.transpose(1, 2).reshape(B, N, -1))
        n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * lay.post_attention_layernorm.weight
        m = lay.mlp
        g = r + m.down_proj(F.silu(m.gate_proj(n)) * m.up_proj(n))
        return g, (k, v)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 over a window: tokens = x_{1..T-1} [B, N], feats = f_{0..T-2} [B, N, d] ->
        (g [B, N, d], logits [B, N, V]) at positions 0..N-1."""
        g, _ = self.step(tokens, feats, torch.arange(tokens.shape[1]))
        return g, g @ self.lm_head.T

    def chain(self, x: torch.Tensor, f: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced autoregressive drafting from every start i: step m (1-based) drafts token
        i+m+1 from the token x_{i+m} and the previous step's g (the real f_i at step 1), at position
        i+m-1. x [B, T], f [B, T, d] -> ``steps`` logits [B, N, V] with N = T - steps."""
        return [logits for _, logits in self.chain_features(x, f, steps)]

    def chain_features(self, x: torch.Tensor, f: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``chain`` with each step's feature: ``steps`` pairs (g [B, N, d], logits [B, N, V])."""
        N = x.shape[1] - steps
        pos = torch.arange(N)
        g, real = self.step(x[:, 1:1 + N], f[:, :N], pos)
        out, extra = [(g, g @ self.lm_head.T)], []
        for m in range(2, steps + 1):
            g, kv = self.step(x[:, m:m + N], g, pos + m - 1, real=real, extra=extra)
            extra.append(kv)
            out.append((g, g @ self.lm_head.T))
        return out


def eagle_loss(head: EagleHead, x: torch.Tensor, f: torch.Tensor, t_logp: torch.Tensor, reg_weight: float,
               chain_steps: int = 1):
    """KL(p_target(. | i+1) || q(. | g_i)) + reg_weight * smooth_L1(g_i, f_{i+1}), averaged over i.

    With ``chain_steps`` K > 1 the head is also trained on its own drafts' inputs, as it is served
    (EAGLE-3's "training-time test" for an EAGLE-1 head): draft step m (fed the previous step's g, not
    the target's feature) is scored against the target at position i+m, and the loss is the mean over
    the K steps. Returns (loss, [kl, reg]) with kl and reg averaged over the steps."""
    V = t_logp.shape[-1]
    if chain_steps <= 1:
        g, logits = head(x[:, 1:], f[:, :-1])
        kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, V), t_logp[:, 1:].reshape(-1, V),
                      log_target=True, reduction="batchmean")
        reg = F.smooth_l1_loss(g, f[:, 1:])
        return kl + reg_weight * reg, [kl.item(), reg.item()]
    N = x.shape[1] - chain_steps
    kls, regs = [], []
    for m, (g, logits) in enumerate(head.chain_features(x, f, chain_steps), start=1):
        kls.append(F.kl_div(F.log_softmax(logits, -1).reshape(-1, V), t_logp[:, m:m + N].reshape(-1, V),
                            log_target=True, reduction="batchmean"))
        regs.append(F.smooth_l1_loss(g, f[:, m:m + N]))
    kl, reg = torch.stack(kls).mean(), torch.stack(regs).mean()
    return kl + reg_weight * reg, [kl.item(), reg.item()]


@torch.no_grad()
def eagle_acceptance(target, head: EagleHead, windows: torch.Tensor, start: int = 0, batch: int = 8,
                     steps: int = CHAIN) -> dict:
    """Teacher-forced on ``windows`` [N, T], starts i >= ``start``, draft step m = 1..CHAIN (token i+m+1):

    * ``T0``: step m's argmax == the target's argmax at position i+m (the inputs before it are the
      window's tokens);
    * ``T1``: the target's probability of step m's argmax (vLLM drafts EAGLE greedily: one-hot
      verification accepts with probability p(draft));
    * ``chain_T0``: steps 1..m all agree; on the target's greedy text that is the probability that drafts
      1..m are all accepted, and ``accepted_per_step_T0`` its sum."""
    K = steps
    agree, pacc, chain = (torch.zeros(K, dtype=torch.float64) for _ in range(3))
    n = 0
    for b in range(0, len(windows), batch):
        x = windows[b:b + batch].long()
        f, t_logp = H.target_hidden_and_logp(target, x)
        t_arg = t_logp.argmax(-1)
        N = x.shape[1] - K
        lead = torch.ones(x.shape[0], N - start, dtype=torch.bool)
        for m, logits in enumerate(head.chain(x, f, K), start=1):
            d = logits[:, start:].argmax(-1)
            tpos = slice(start + m, start + m + N - start)
            ok = d == t_arg[:, tpos]
            agree[m - 1] += ok.sum().item()
            pacc[m - 1] += t_logp[:, tpos].gather(-1, d[..., None]).exp().sum().item()
            lead &= ok
            chain[m - 1] += lead.sum().item()
        n += lead.numel()
    ch = (chain / n).tolist()
    return {"T0": [round(v, 4) for v in (agree / n).tolist()],
            "T1": [round(v, 4) for v in (pacc / n).tolist()],
            "chain_T0": [round(v, 4) for v in ch],
            "accepted_per_step_T0": round(sum(ch), 4),
            "positions": n}


def save_eagle(head: EagleHead, out: Path, target_cfg: dict, extra: dict) -> int:
    """Write the vLLM EAGLE-1 checkpoint (bf16); returns the safetensors size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in target_cfg.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    cfg.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "torch_dtype": "bfloat16",
                "specplugin": extra})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return (out / "model.safetensors").stat().st_size


def load_eagle(eagle_dir: Path, target) -> EagleHead:
    """Read a checkpoint written by ``save_eagle`` back (float32), with ``target``'s embedding / LM head."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(eagle_dir) / "config.json").read_text())
    head = EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    head.load_state_dict({k: v.float() for k, v in load_file(str(Path(eagle_dir) / "model.safetensors")).items()})
    return head


def card_markdown(card: dict, target_name: str, heads_name: str) -> list[str]:
    """The "EAGLE head" section of a model card (called through heads.section_markdown)."""
    s, m = card["train"], card["measure"]
    K = len(m["heldout_text"]["T0"])
    L = [f"## EAGLE head (`{heads_name}`)", "",
         f"Built by `{card['command']}` (`models/eagle.py`; EAGLE-1: frozen target, fc(cat(embed(x_(i+1)), "
         "f_i)) + one Llama decoder layer without input norm, the target's embedding and LM head shared; "
         f"KL(target || head) at T = 1 + {s['reg_weight']} x smooth-L1 feature regression, "
         f"{H.training_text(s)}). "
         f"Served by vLLM's own method: `{{\"method\": \"eagle\", \"model\": \"{heads_name}\", "
         f"\"num_speculative_tokens\": {K}}}` with `{target_name}` as the target.", "",
         "| | value |", "|---|---|",
         f"| trainable parameters | {m['params_trainable'] / 1e6:.3f} M = {100 * m['params_fraction_of_target']:.2f} % "
         f"of the target's {m['target_params'] / 1e6:.2f} M |",
         f"| checkpoint | {card['checkpoint_bytes'] / 1e6:.2f} MB bf16 safetensors |",
         f"| training | {s['train_tokens'] / 1e6:.2f} M tokens ({s['steps']} steps of {s['batch']} x {s['seq']}), "
         f"lr {s['lr']}, {s['train_wall_s'] / 60:.1f} min on {s['threads']} thread(s) of a shared 2-core CPU"
         + (f"; exported from the run's state at step {s['steps']} of {s['planned_steps']} (the run goes on: "
            "re-run the command to resume)" if s.get("interrupted") else "")
         + (f"; data {s['data']}, draft steps 1-{s['chain_steps']} trained as served" if s.get("chain_steps") else "")
         + " |", "",
         "Per-draft-position acceptance, exact, teacher-forced; EAGLE drafts autoregressively, so position m "
         "feeds the head its own feature from position m-1 and the window's token. *T = 0*: the draft's argmax "
         "equals the target's argmax. *T = 1*: the target's probability of the draft (greedy drafts, one-hot "
         "verification). *Chain T = 0*: positions 1..m all agree; on the target's greedy text the probability "
         "that drafts 1..m are all accepted; accepted/step = its sum. "
         f"Held-out text: {m['heldout_text']['positions']} starts of {m['setup']['heldout_windows']} windows. "
         f"Target's greedy text: {m['setup']['greedy_prompts']} held-out prompts of "
         f"{m['setup']['greedy_prompt_len']} tokens, {m['setup']['greedy_new_tokens']} greedy tokens each.", ""]
    return L + H.acceptance_table(m, [f"position {j + 1}" for j in range(K)]) + H.curve_markdown(card, heads_name)


CURVE_STEPS = 5  # draft positions the learning curve measures (the card's table keeps CHAIN)


def curve_fn(target, held: torch.Tensor, prompts: int = 8, new_tokens: int = 64):
    """The learning curve's measurement: teacher-forced acceptance of ``CURVE_STEPS`` draft positions on
    the target's greedy continuations of ``prompts`` held-out prompts (:func:`heads.curve_fn`)."""
    return H.curve_fn(target, held, eagle_acceptance, prompts, new_tokens, steps=CURVE_STEPS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_specplugin.models.eagle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reg-weight", type=float, default=1.0,
                    help="weight of the smooth-L1 feature regression next to the KL (default 1.0)")
    ap.add_argument("--chain-steps", type=int, default=1,
                    help="train draft steps 1..K on the head's own features, as it drafts when served "
                         "(default 1: step 1 only, EAGLE-1's objective)")
    H.common_args(ap, tokens=200_000)
    args = ap.parse_args(argv)

    target_cfg = H.check_llama(args.target)  # refuse early, before any loading
    torch.set_num_threads(args.threads)
    t_all = time.time()
    target = H.load_target(args.target)
    train_stream, held = H.training_data(target, args)
    command = "python -m vllm_specplugin.models.eagle " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.card_only:
        head = load_eagle(args.out, target)
        old = json.loads((args.out / H.CARD_FILE).read_text())
        stats, command = old["train"], old["command"]
    else:
        torch.manual_seed(args.seed)
        head = EagleHead(target_cfg, target.model.embed_tokens.weight, target.lm_head.weight)
        key = {k: getattr(args, k) for k in ("tokens", "batch", "seq", "lr", "seed", "reg_weight")}
        key["target"] = str(Path(args.target).resolve())
        if args.chain_steps > 1 or args.data != "corpus":  # keys of earlier default runs unchanged
            key.update(chain_steps=args.chain_steps, data=args.data, self_pool=args.self_pool)

        def batch_loss(x):
            f, t_logp = H.target_hidden_and_logp(target, x)
            return eagle_loss(head, x, f, t_logp, args.reg_weight, args.chain_steps)

        if args.export_state:
            stats = H.export_state(head, args, key, "final_kl_reg")
        else:
            head, stats = H.resumable_train(head, batch_loss, train_stream, args, key, "train eagle head",
                                            "final_kl_reg", curve_fn=curve_fn(target, held) if args.curve_every else None)
        if head is None:
            H.log(f"stopped at step {stats['stopped_at_step']}; state in {stats['state']} (re-run to resume)")
            return 0
    meas = H.measure(target, head, held, args.eval_windows, args.eval_prompts, args.eval_new_tokens,
                     acceptance=eagle_acceptance)
    H.log(f"acceptance held-out T0 {meas['heldout_text']['T0']} T1 {meas['heldout_text']['T1']}; "
          f"greedy-text chain {meas['target_greedy_text']['chain_T0']} "
          f"-> {meas['target_greedy_text']['accepted_per_step_T0']} accepted/step")
    extra = {"target": str(args.target), "trainer": "models/eagle.py", "method": "eagle",
             "objective": "kl_self_distill_T1+smooth_l1", "data": args.data}
    size = save_eagle(head, args.out, target_cfg, extra)
    card = {"method": "eagle", "command": command, "train": stats, "measure": meas, "checkpoint_bytes": size,
            "total_wall_s": round(time.time() - t_all, 1), "torch": torch.__version__}
    H.write_card(args, card)
    H.log(f"wrote {args.out} ({size / 1e6:.2f} MB) in {(time.time() - t_all) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
