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

EAGLE-3 (``--method eagle3``, :class:`Eagle3Head`, served with ``method: "eagle3"``,
``llama_eagle3.py``): the first draft step reads ``fc`` [d, 3d] of the target's residual stream after
three layers (``--aux-layers``, default vLLM's 2, L // 2, L - 3; vLLM's Llama hands them to EAGLE-3
proposers), the layer's attention reads cat(input_layernorm(embed), hidden_norm(h)) [2d] with h as the
residual, and the head has its own final norm and LM head (started from the target's; the LM head is
kept frozen here and stored in the checkpoint, draft vocabulary = the target's); no feature
regression. Trained as served over ``--chain-steps`` draft steps (EAGLE-3's training-time test).

Objective (frozen target): at every position i, KL(p_target(. | i+1) || softmax(lm_head(g_i))) at T = 1
(self-distillation: the target's distribution, not the corpus token, is what verification compares
against) plus ``--reg-weight`` x EAGLE's smooth-L1 regression of g_i onto f_{i+1} (keeps g_i usable as
the next step's feature). Training data, resumable loop, measurement and card sections are shared with
the Medusa trainer (models/heads.py).

Output: ``config.json`` (the target's LlamaConfig with ``num_hidden_layers: 1``; vLLM's EAGLEConfig maps
``LlamaForCausalLM`` to ``EagleLlamaForCausalLM``), bf16 ``model.safetensors`` with ``fc.weight`` and
``layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`` (no
embedding or LM head: vLLM takes the target's), and ``heads_card.json``. EAGLE-3 adds
``layers.0.{input_layernorm, hidden_norm}.weight``, ``norm.weight`` and ``lm_head.weight``, and
``eagle_config.eagle_aux_hidden_state_layer_ids`` in the config (vLLM: ``Eagle3LlamaForCausalLM``).

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
        x, residual = self._layer_input(tokens, feats)
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
        r = residual + lay.self_attn.o_proj(att.transpose(1, 2).reshape(B, N, -1))
        n = self._rms(r, lay.post_attention_layernorm.weight)
        m = lay.mlp
        g = r + m.down_proj(F.silu(m.gate_proj(n)) * m.up_proj(n))
        return g, (k, v)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _layer_input(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual) of a step: EAGLE-1 fc(cat(embed, f)) for both."""
        x = self.fc(torch.cat([self.embed[tokens], feats], -1))
        return x, x

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., d] -> draft logits [..., V]: EAGLE-1 applies the target's LM head to g, no norm."""
        return g @ self.lm_head.T

    def first_feature(self, f: torch.Tensor) -> torch.Tensor:
        """What the first draft step reads from the target's inputs (:meth:`target_inputs`): EAGLE-1 f_i."""
        return f

    @staticmethod
    def target_inputs(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T] -> (the head's input from the target at every position, log p [B, T, V])."""
        return H.target_hidden_and_logp(target, x)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 over a window: tokens = x_{1..T-1} [B, N], feats = the target's inputs at 0..T-2
        (:meth:`target_inputs`) -> (g [B, N, d], logits [B, N, V]) at positions 0..N-1."""
        g, _ = self.step(tokens, self.first_feature(feats), torch.arange(tokens.shape[1]))
        return g, self.logits(g)

    def chain(self, x: torch.Tensor, f: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced autoregressive drafting from every start i: step m (1-based) drafts token
        i+m+1 from the token x_{i+m} and the previous step's g (the real f_i at step 1), at position
        i+m-1. x [B, T], f [B, T, d] -> ``steps`` logits [B, N, V] with N = T - steps."""
        return [logits for _, logits in self.chain_features(x, f, steps)]

    def chain_features(self, x: torch.Tensor, f: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``chain`` with each step's feature: ``steps`` pairs (g [B, N, d], logits [B, N, V])."""
        N = x.shape[1] - steps
        pos = torch.arange(N)
        g, real = self.step(x[:, 1:1 + N], self.first_feature(f[:, :N]), pos)
        out, extra = [(g, self.logits(g))], []
        for m in range(2, steps + 1):
            g, kv = self.step(x[:, m:m + N], g, pos + m - 1, real=real, extra=extra)
            extra.append(kv)
            out.append((g, self.logits(g)))
        return out


class Eagle3Head(EagleHead):
    """EAGLE-3 (Li et al. 2025) as vLLM 0.32's ``Eagle3LlamaForCausalLM`` computes it (``llama_eagle3.py``,
    the default ``norm_before_residual: false``): the first draft step reads ``fc(cat(a_l for l in
    aux_layers))`` [3d -> d], the target's residual stream after layers ``aux_layers`` (vLLM's
    ``_maybe_add_hidden_state``: hidden + residual, no norm; transformers' ``hidden_states[l]``);
    the decoder layer's attention reads cat(input_layernorm(embed(x)), hidden_norm(h)) [2d] and its
    residual is h itself; the draft's own final ``norm`` and LM head give the logits, and the
    pre-norm output g is the next step's h. The LM head starts as the target's (frozen, stored in
    the checkpoint: vLLM loads it as the draft's, draft vocabulary = the target's, no d2t)."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, aux_layers: tuple[int, ...],
                 final_norm: torch.Tensor | None = None):
        super().__init__(cfg, embed, lm_head)
        d = cfg["hidden_size"]
        if not aux_layers:
            raise ValueError("eagle3: at least one aux layer")
        self.aux_layers = tuple(int(a) for a in aux_layers)
        layer = self.layers[0]
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(torch.ones(d))
        layer.hidden_norm = nn.Module()
        layer.hidden_norm.weight = nn.Parameter(torch.ones(d))
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, nn.Linear(2 * d, old.out_features, bias=False))
            nn.init.normal_(getattr(layer.self_attn, name).weight, std=0.02)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(final_norm.detach().float().clone() if final_norm is not None else torch.ones(d))
        # Start from the latest aux layer's state (an early exit of the target) plus a little of the others.
        self.fc = nn.Linear(len(self.aux_layers) * d, d, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.fc.weight, std=0.02)
            self.fc.weight[:, -d:] += torch.eye(d)

    def _layer_input(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layers[0]
        embeds = self._rms(self.embed[tokens], lay.input_layernorm.weight)
        return torch.cat([embeds, self._rms(feats, lay.hidden_norm.weight)], -1), feats

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self._rms(g, self.norm.weight) @ self.lm_head.T

    def first_feature(self, f: torch.Tensor) -> torch.Tensor:
        return self.fc(f)

    def target_inputs(self, target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T] -> (cat of the aux layers' states [B, T, len(aux) * d], log p [B, T, V]), float32.

        Layer l < L: transformers' ``hidden_states[l]`` (the stream entering layer l). Layer L (the
        number of layers): the last layer's output before the final norm, as vLLM's Llama hands it
        out; transformers' ``hidden_states[L]`` is after the norm, so it is hooked instead."""
        n = target.config.num_hidden_layers
        last = {}
        hook = None
        if n in self.aux_layers:
            hook = target.model.layers[n - 1].register_forward_hook(
                lambda module, args, output: last.__setitem__("out", output[0] if isinstance(output, tuple) else output))
        try:
            with torch.no_grad():
                out = target.model(input_ids=x, output_hidden_states=True)
        finally:
            if hook is not None:
                hook.remove()
        states = [(last["out"] if a == n else out.hidden_states[a]).float() for a in self.aux_layers]
        return torch.cat(states, -1), F.log_softmax(target.lm_head(out.last_hidden_state.float()).float(), -1)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM 0.32's default EAGLE-3 layers for a Llama target (``get_eagle3_default_aux_hidden_state_layers``)."""
    return (2, num_layers // 2, num_layers - 3)


def eagle_loss(head: EagleHead, x: torch.Tensor, f: torch.Tensor, t_logp: torch.Tensor, reg_weight: float,
               chain_steps: int = 1):
    """KL(p_target(. | i+1) || q(. | g_i)) + reg_weight * smooth_L1(g_i, f_{i+1}), averaged over i.

    With ``chain_steps`` K > 1 the head is also trained on its own drafts' inputs, as it is served
    (EAGLE-3's "training-time test" for an EAGLE-1 head): draft step m (fed the previous step's g, not
    the target's feature) is scored against the target at position i+m, and the loss is the mean over
    the K steps. Returns (loss, [kl, reg]) with kl and reg averaged over the steps. EAGLE-3 has no
    regression (``reg_weight`` 0: reg is reported as 0)."""
    V = t_logp.shape[-1]
    zero = torch.zeros(())
    if chain_steps <= 1:
        g, logits = head(x[:, 1:], f[:, :-1])
        kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, V), t_logp[:, 1:].reshape(-1, V),
                      log_target=True, reduction="batchmean")
        reg = F.smooth_l1_loss(g, f[:, 1:]) if reg_weight else zero
        return kl + reg_weight * reg, [kl.item(), reg.item()]
    N = x.shape[1] - chain_steps
    kls, regs = [], []
    for m, (g, logits) in enumerate(head.chain_features(x, f, chain_steps), start=1):
        kls.append(F.kl_div(F.log_softmax(logits, -1).reshape(-1, V), t_logp[:, m:m + N].reshape(-1, V),
                            log_target=True, reduction="batchmean"))
        regs.append(F.smooth_l1_loss(g, f[:, m:m + N]) if reg_weight else zero)
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
        f, t_logp = head.target_inputs(target, x)
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
    """Write the vLLM EAGLE-1 checkpoint, or EAGLE-3's for an :class:`Eagle3Head` (its LM head and
    final norm included, the aux layers in ``eagle_config``), bf16; returns the safetensors size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    cfg = {k: v for k, v in target_cfg.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    cfg.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "torch_dtype": "bfloat16",
                "specplugin": extra})
    if isinstance(head, Eagle3Head):
        tensors["lm_head.weight"] = head.lm_head.detach().to(torch.bfloat16).contiguous()
        cfg.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
                                     "use_aux_hidden_state": True},
                    "draft_vocab_size": cfg["vocab_size"], "target_hidden_size": cfg["hidden_size"]})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return (out / "model.safetensors").stat().st_size


def load_eagle(eagle_dir: Path, target) -> EagleHead:
    """Read a checkpoint written by ``save_eagle`` back (float32), with ``target``'s embedding / LM head."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(eagle_dir) / "config.json").read_text())
    weights = {k: v.float() for k, v in load_file(str(Path(eagle_dir) / "model.safetensors")).items()}
    if "eagle_config" in cfg:  # EAGLE-3: its own LM head
        layers = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        head = Eagle3Head(cfg, target.model.embed_tokens.weight, weights.pop("lm_head.weight"), layers)
    else:
        head = EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    head.load_state_dict(weights)
    return head


def card_markdown(card: dict, target_name: str, heads_name: str) -> list[str]:
    """The "EAGLE head" section of a model card (called through heads.section_markdown)."""
    s, m = card["train"], card["measure"]
    K = len(m["heldout_text"]["T0"])
    method = card.get("method", "eagle")
    if method == "eagle3":
        design = (f"EAGLE-3: frozen target, fc(cat of the residual stream after target layers {s['aux_layers']}) "
                  "as the first step's input, one Llama decoder layer reading cat(norm(embed(x_(i+1))), norm(h_i)), "
                  "its own final norm and LM head (started from the target's, kept frozen), the target's embedding "
                  "shared; KL(target || head) at T = 1")
    else:
        design = ("EAGLE-1: frozen target, fc(cat(embed(x_(i+1)), f_i)) + one Llama decoder layer without input "
                  "norm, the target's embedding and LM head shared; "
                  f"KL(target || head) at T = 1 + {s['reg_weight']} x smooth-L1 feature regression")
    L = [f"## {'EAGLE-3' if method == 'eagle3' else 'EAGLE'} head (`{heads_name}`)", "",
         f"Built by `{card['command']}` (`models/eagle.py`; {design}, {H.training_text(s)}). "
         f"Served by vLLM's own method: `{{\"method\": \"{method}\", \"model\": \"{heads_name}\", "
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
    ap.add_argument("--method", choices=["eagle", "eagle3"], default="eagle",
                    help="eagle: an EAGLE-1 head (default); eagle3: an EAGLE-3 head, reading the target's "
                         "--aux-layers, served by vLLM's method \"eagle3\"")
    ap.add_argument("--aux-layers", type=int, nargs="+", default=None,
                    help="eagle3: the target layers whose residual stream the head reads: l < L the stream "
                         "entering layer l, L the last layer's output (default vLLM's for Llama: 2, L // 2, L - 3)")
    ap.add_argument("--reg-weight", type=float, default=None,
                    help="weight of the smooth-L1 feature regression next to the KL (default 1.0 for eagle; "
                         "eagle3 has none: 0)")
    ap.add_argument("--chain-steps", type=int, default=1,
                    help="train draft steps 1..K on the head's own features, as it drafts when served "
                         "(default 1: step 1 only, EAGLE-1's objective)")
    H.common_args(ap, tokens=200_000)
    args = ap.parse_args(argv)

    target_cfg = H.check_llama(args.target)  # refuse early, before any loading
    eagle3 = args.method == "eagle3"
    layers = target_cfg["num_hidden_layers"]
    aux_layers = tuple(args.aux_layers or default_aux_layers(layers))
    # l < L: the stream entering layer l; L: the last layer's output (vLLM 0.32's Llama hands out both).
    if eagle3 and (len(set(aux_layers)) != len(aux_layers) or not all(0 <= a <= layers for a in aux_layers)):
        raise SystemExit(f"eagle: --aux-layers {list(aux_layers)} must be distinct layers of 0..{layers} "
                         f"({layers}: the last layer's output)")
    if not eagle3 and args.aux_layers:
        raise SystemExit("eagle: --aux-layers applies to --method eagle3 only")
    if args.reg_weight is None:
        args.reg_weight = 0.0 if eagle3 else 1.0
    if eagle3 and args.reg_weight:
        raise SystemExit("eagle: EAGLE-3 has no feature regression (its input is the aux layers'); drop --reg-weight")
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
        if eagle3:
            head = Eagle3Head(target_cfg, target.model.embed_tokens.weight, target.lm_head.weight, aux_layers,
                              target.model.norm.weight)
        else:
            head = EagleHead(target_cfg, target.model.embed_tokens.weight, target.lm_head.weight)
        key = {k: getattr(args, k) for k in ("tokens", "batch", "seq", "lr", "seed", "reg_weight")}
        key["target"] = str(Path(args.target).resolve())
        if args.chain_steps > 1 or args.data != "corpus":  # keys of earlier default runs unchanged
            key.update(chain_steps=args.chain_steps, data=args.data, self_pool=args.self_pool)
        if eagle3:
            key.update(method="eagle3", aux_layers=list(aux_layers))

        def batch_loss(x):
            f, t_logp = head.target_inputs(target, x)
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
    extra = {"target": str(args.target), "trainer": "models/eagle.py", "method": args.method,
             "objective": "kl_self_distill_T1" + ("" if eagle3 else "+smooth_l1"), "data": args.data}
    size = save_eagle(head, args.out, target_cfg, extra)
    card = {"method": args.method, "command": command, "train": stats, "measure": meas, "checkpoint_bytes": size,
            "total_wall_s": round(time.time() - t_all, 1), "torch": torch.__version__}
    H.write_card(args, card)
    H.log(f"wrote {args.out} ({size / 1e6:.2f} MB) in {(time.time() - t_all) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
