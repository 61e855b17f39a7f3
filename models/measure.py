"""Measurements for the model card: held-out loss, forward cost, acceptance.

Acceptance rate of a draft q against the target p (Leviathan et al. 2023):
``alpha = E_positions[ sum_x min(p(x), q(x)) ]``; at temperature 0 both
distributions are one-hot on their argmax, so alpha is argmax agreement.
It is measured two ways:

* exact: teacher-forced on held-out text, averaging the formula per position;
* empirical: speculative sampling simulated on held-out prompts (gamma draft
  tokens per step, target verifies, standard accept/reject + bonus token),
  counting accepted draft tokens.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token NLL (nats) over held-out windows of shape [N, T+1]."""
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        xy = windows[i:i + batch].long()
        logits = model(input_ids=xy[:, :-1]).logits.float()
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += xy[:, 1:].numel()
    return tot / n


def heldout_windows(stream: torch.Tensor, seq: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping, evenly spread windows of ``seq+1`` tokens (deterministic)."""
    n = (len(stream) - 1) // seq
    idx = torch.linspace(0, n - 1, min(n, max_windows)).round().long()
    starts = idx * seq
    return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def forward_flops_per_token(cfg, ctx: int) -> float:
    """Analytic forward FLOPs per token (2 x MACs): matmuls + attention at ``ctx``."""
    d, L, f, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    qkvo = 2 * d * cfg.num_attention_heads * cfg.head_dim + 2 * d * cfg.num_key_value_heads * cfg.head_dim
    mats = L * (qkvo + 3 * d * f) + V * d  # + LM head
    attn = L * 2 * ctx * cfg.num_attention_heads * cfg.head_dim  # QK^T and AV
    return 2.0 * (mats + attn)


@torch.no_grad()
def forward_time_per_token(model, seq: int = 256, reps: int = 7) -> float:
    """Median wall time (s) per token of one forward pass over a 1 x seq batch."""
    x = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    model(input_ids=x)  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        model(input_ids=x)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] / seq


def _probs(logits: torch.Tensor, temp: float) -> torch.Tensor:
    if temp == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return F.softmax(logits.float() / temp, -1)


class Ensemble:
    """Uniform average of several drafts' distributions (at T=1 before tempering)."""

    def __init__(self, models):
        self.models = models

    def next_probs(self, ids: torch.Tensor, temp: float) -> torch.Tensor:
        p = torch.stack([F.softmax(m(input_ids=ids).logits.float(), -1) for m in self.models]).mean(0)
        if temp == 0:
            return F.one_hot(p.argmax(-1), p.shape[-1]).float()
        return F.softmax(p.clamp_min(1e-30).log() / temp, -1)


class Single:
    def __init__(self, model):
        self.model = model

    def next_probs(self, ids: torch.Tensor, temp: float) -> torch.Tensor:
        return _probs(self.model(input_ids=ids).logits, temp)


@torch.no_grad()
def exact_alpha(target, proposer, windows: torch.Tensor, temp: float, batch: int = 8) -> float:
    """Teacher-forced mean over positions of sum_x min(p(x), q(x))."""
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch, :-1].long()
        p = _probs(target(input_ids=x).logits, temp)
        q = proposer.next_probs(x, temp)
        tot += torch.minimum(p, q).sum(-1).sum().item()
        n += x.numel()
    return tot / n


@torch.no_grad()
def speculative_run(target, proposer, prompt: torch.Tensor, temp: float, gamma: int,
                    new_tokens: int, gen: torch.Generator) -> dict:
    """Simulate speculative sampling for one prompt; returns acceptance counts.

    No KV cache (contexts are short): each draft step and the verification
    re-run the full context, which is simple and exactly correct.
    """
    ids = prompt[None, :].long()
    start = ids.shape[1]
    steps = accepted = evaluated = 0
    while ids.shape[1] - start < new_tokens:
        # Draft gamma tokens autoregressively.
        ctx, qs, drafted = ids, [], []
        for _ in range(gamma):
            q = proposer.next_probs(ctx, temp)[0, -1]
            tok = q.argmax() if temp == 0 else torch.multinomial(q, 1, generator=gen)[0]
            qs.append(q)
            drafted.append(tok)
            ctx = torch.cat([ctx, tok.view(1, 1)], 1)
        # Target scores all gamma+1 positions in one pass.
        p_all = _probs(target(input_ids=ctx).logits[0, -gamma - 1:], temp)
        out = []
        for j in range(gamma):
            p, q, tok = p_all[j], qs[j], drafted[j]
            evaluated += 1
            if temp == 0:
                ok = bool(p[tok] > 0)
            else:
                ok = torch.rand((), generator=gen).item() < min(1.0, (p[tok] / q[tok]).item())
            if ok:
                out.append(tok)
                accepted += 1
                continue
            # Rejected: resample from the residual max(0, p - q).
            r = (p - q).clamp_min(0)
            r = r / r.sum() if r.sum() > 0 else p
            out.append(r.argmax() if temp == 0 else torch.multinomial(r, 1, generator=gen)[0])
            break
        else:
            p = p_all[gamma]  # all accepted: bonus token from the target
            out.append(p.argmax() if temp == 0 else torch.multinomial(p, 1, generator=gen)[0])
        ids = torch.cat([ids, torch.stack(out).view(1, -1)], 1)
        steps += 1
    return {"steps": steps, "accepted": accepted, "evaluated": evaluated,
            "generated": ids.shape[1] - start}


def empirical_alpha(target, proposer, prompts: list[torch.Tensor], temp: float, gamma: int,
                    new_tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    agg = {"steps": 0, "accepted": 0, "evaluated": 0, "generated": 0}
    for pr in prompts:
        r = speculative_run(target, proposer, pr, temp, gamma, new_tokens, gen)
        for k in agg:
            agg[k] += r[k]
    s = max(1, agg["steps"])
    return {
        # per-token acceptance: accepted / draft tokens the target examined
        "alpha": agg["accepted"] / max(1, agg["evaluated"]),
        "accepted_per_step": agg["accepted"] / s,
        "tokens_per_step": agg["generated"] / s,  # incl. the corrected / bonus token
        "steps": agg["steps"],
        "proposed": agg["steps"] * gamma,
    }


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - a^(g+1)) / (1 - a): tokens per target pass for i.i.d. acceptance."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@torch.no_grad()
def greedy_completion(model, tok, prompt_ids: torch.Tensor, new_tokens: int) -> str:
    ids = prompt_ids[None, :].long()
    for _ in range(new_tokens):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
        if nxt.item() == tok.eos_token_id:
            break
    return tok.decode(ids[0, prompt_ids.shape[0]:], skip_special_tokens=True)


def ppl(loss: float) -> float:
    return math.exp(loss)
