"""Model shapes and the (deterministic, token-budgeted) training loops.

Budgets are counted in tokens / optimizer steps, never wall time, so a
rebuild on any machine gives the same weights (CPU, fixed seeds, fixed
thread count).  Training runs in float32: on this AVX2-only CPU bf16
autocast is >10x *slower* than fp32.  Weights are stored as bf16.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass(frozen=True)
class Spec:
    """One model of the family: shape + how it is trained."""

    name: str
    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    max_pos: int
    seed: int
    tokens: int  # training budget in tokens
    lr: float
    batch: int = 16
    seq: int = 256
    objective: str = "ce"  # "ce" (next-token cross-entropy) or "kl" (distill from target)
    init_from: str = ""  # start from this (already built) model's weights instead of random
    role: str = "draft"
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def llama_config(spec: Spec, tok):
    from transformers import LlamaConfig

    assert spec.head_dim in (32, 64, 128), "vLLM-CPU attention needs head_dim 32/64/128"
    assert spec.hidden == spec.heads * spec.head_dim
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,  # the 4096 x d embedding is a big share of a small model
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(spec: Spec, tok):
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, tok))
    return model.float()


def n_params(model) -> int:
    """Unique parameters (tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    # Linear warm-up, then cosine decay to 10 % of peak.
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay 0.1 on matrices only (norms and biases are not decayed)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


def batches(stream: torch.Tensor, spec: Spec, steps: int):
    """Random windows of ``seq+1`` tokens from the train stream, seeded."""
    g = torch.Generator().manual_seed(spec.seed + 1_000_003)
    hi = len(stream) - spec.seq - 1
    for _ in range(steps):
        starts = torch.randint(0, hi, (spec.batch,), generator=g)
        idx = starts[:, None] + torch.arange(spec.seq + 1)[None, :]
        yield stream[idx].long()


def objective_loss(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor, objective: str, teacher=None):
    """The training loss of a batch: cross-entropy on ``y`` ("ce"), or ("kl") forward
    KL(p_teacher || q_student) at T = 1 on the inputs ``x``: it matches the draft to the target's
    whole distribution, which is what acceptance depends on. ``logits`` [B, T, V], ``x``/``y`` [B, T]."""
    V = logits.shape[-1]
    if objective == "ce":
        return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
    return F.kl_div(F.log_softmax(logits, -1).reshape(-1, V), t_logp.reshape(-1, V),
                    log_target=True, reduction="batchmean")


def train(spec: Spec, tok, stream: torch.Tensor, teacher=None, init=None, log=print) -> tuple:
    """Train one model per ``spec`` (from ``init``'s weights if given); returns (model, stats)."""
    model = build_model(spec, tok)
    if init is not None:
        model.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
    model.train()
    steps = max(1, spec.tokens // (spec.batch * spec.seq))
    warmup = max(1, min(200, steps // 10))
    opt = make_optimizer(model, spec.lr)
    if spec.objective == "kl":
        assert teacher is not None
        teacher.eval()
    t0 = time.time()
    ema = None
    bar = tqdm(batches(stream, spec, steps), total=steps, desc=f"train {spec.name}",
               mininterval=15, unit="step", dynamic_ncols=False, ncols=100)
    for step, xy in enumerate(bar):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, spec.lr, warmup)
        x, y = xy[:, :-1], xy[:, 1:]
        loss = objective_loss(model(input_ids=x).logits, x, y, spec.objective, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
    bar.close()
    wall = time.time() - t0
    model.eval()
    stats = {
        "steps": steps,
        "train_tokens": steps * spec.batch * spec.seq,
        "train_wall_s": round(wall, 1),
        "train_tokens_per_s": round(steps * spec.batch * spec.seq / wall, 1),
        "final_train_loss_ema": round(ema, 4),
    }
    log(f"[{spec.name}] {stats}")
    return model, stats
