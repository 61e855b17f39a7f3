"""models/eagle.py (EAGLE-1 head trainer): the checkpoint it writes is in the layout vLLM 0.32's
``EagleLlamaForCausalLM`` loads, and the trainer's forward (first draft step and the autoregressive
chain the card measures) is the computation of vLLM's ``llama_eagle.LlamaModel``: fc(cat(embeds,
hidden)), a Llama decoder layer with the input norm removed, output + residual, no final norm, the
target's LM head. The reference decoder layer is transformers' own ``LlamaDecoderLayer`` (the same
layer vLLM's EAGLE model subclasses), run on explicit sequences (a KV cache by construction).
A tiny run (~10 s) on a random 2-layer Llama; the committed head is served by vLLM in
tests/e2e/test_heads_engine.py (engine tier, make test-extended)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from vllm_specplugin.models import eagle as E  # noqa: E402
from vllm_specplugin.models import heads as H  # noqa: E402
from vllm_specplugin.models.random_llama import make_random_llama  # noqa: E402

# Parameter names vLLM's EagleLlamaForCausalLM.load_weights maps into model.* (llama_eagle.py):
# fc, one layer without input_layernorm, no embedding / lm_head (shared with the target).
EXPECTED = {"fc.weight", "layers.0.post_attention_layernorm.weight"} | {
    f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_random_llama(root / "target", logit_scale=15.0, seed=0)
    out = root / "eagle"
    rc = E.main(["--target", str(target), "--out", str(out), "--data", "self", "--tokens", "2048",
                 "--batch", "4", "--seq", "32", "--eval-windows", "2", "--eval-prompts", "2",
                 "--eval-new-tokens", "8", "--work", str(root / "work"), "--save-every", "4"])
    assert rc == 0
    return target, out


def _reference(out, target_model):
    """transformers' LlamaDecoderLayer loaded from the checkpoint, input norm -> identity (as vLLM)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig.from_pretrained(str(out))
    cfg._attn_implementation = "sdpa"  # causal when no mask is given
    w = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    assert set(w) == EXPECTED
    layer = LlamaDecoderLayer(cfg, layer_idx=0).float().eval()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")})
    rope = LlamaRotaryEmbedding(cfg)
    embed, lm_head = target_model.model.embed_tokens.weight.float(), target_model.lm_head.weight.float()

    def run(tokens, feats):
        """tokens [1, n], feats [1, n, d] at positions 0..n-1 -> g [1, n, d] (causal)."""
        x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T
        pos = torch.arange(x.shape[1])[None]
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return y  # vLLM: hidden_states + residual, no final norm; HF's layer returns exactly that sum

    return run, lm_head


def test_checkpoint_is_vllm_eagle_format_and_forward_matches(built):
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    target, out = built
    cfg = json.loads((out / "config.json").read_text())
    ecfg = EAGLEConfig(model=cfg, method="eagle")
    assert ecfg.architectures == ["EagleLlamaForCausalLM"] and ecfg.model.num_hidden_layers == 1
    tcfg = json.loads((target / "config.json").read_text())
    assert all(cfg[k] == tcfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "rms_norm_eps"))

    model = H.load_target(target)
    # The briefly trained head is near its init (small attention scores: RoPE or mask errors would hide),
    # so the comparison uses its checkpoint with every weight redrawn at a large scale, written by save_eagle.
    trained = E.load_eagle(out, model)
    # Trained: moved from its init (the trainer draws it after torch.manual_seed(--seed), default 0),
    # by more than the bf16 rounding of the checkpoint.
    torch.manual_seed(0)
    init = E.EagleHead(H.check_llama(target), model.model.embed_tokens.weight, model.lm_head.weight)
    rounded = {n: p.detach().to(torch.bfloat16).float() for n, p in init.named_parameters()}
    moved = {n: float((p.detach().float() - rounded[n]).abs().max()) for n, p in trained.named_parameters()}
    assert set(moved) == set(rounded) and max(moved.values()) > 1e-3, moved
    with torch.no_grad():
        g_ = torch.Generator().manual_seed(1)
        for p in trained.parameters():
            p.copy_(torch.randn(p.shape, generator=g_) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    loud = out.parent / "eagle-loud"
    E.save_eagle(trained, loud, json.loads((target / "config.json").read_text()), {"target": str(target)})
    head = E.load_eagle(loud, model)  # bf16 round trip: the reference reads the same bf16 weights
    run, lm_head = _reference(loud, model)
    g_ = torch.Generator().manual_seed(0)
    x = torch.randint(3, cfg["vocab_size"], (1, 12), generator=g_)
    f, _ = H.target_hidden_and_logp(model, x)
    with torch.no_grad():
        # First draft step over the window: (x_{i+1}, f_i) at position i.
        g_ref = run(x[:, 1:], f[:, :-1])
        g, logits = head(x[:, 1:], f[:, :-1])
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, g_ref @ lm_head.T, rtol=1e-4, atol=1e-3)
        # Autoregressive chain (3 steps): from start i, step m feeds (x_{i+m}, g of step m-1) at position
        # i+m-1 after the real entries 0..i, exactly a causal run over that explicit sequence.
        K = 3
        chain = head.chain(x, f, K)
        N = x.shape[1] - K
        for i in (0, 3, N - 1):
            toks, feats = x[:, 1:i + 2], f[:, :i + 1]
            for m in range(1, K + 1):
                g_seq = run(toks, feats)[:, -1:]
                torch.testing.assert_close(chain[m - 1][:, i], (g_seq @ lm_head.T)[:, 0], rtol=1e-3, atol=1e-3,
                                           msg=lambda s: f"start {i} step {m}: {s}")
                toks = torch.cat([toks, x[:, i + m + 1:i + m + 2]], 1)
                feats = torch.cat([feats, g_seq], 1)
    # The card holds every draft position's acceptance.
    card = json.loads((out / H.CARD_FILE).read_text())
    assert card["method"] == "eagle"
    for text in ("heldout_text", "target_greedy_text"):
        r = card["measure"][text]
        assert len(r["T0"]) == len(r["T1"]) == len(r["chain_T0"]) == E.CHAIN and r["positions"] > 0
    assert 0 < card["measure"]["params_fraction_of_target"] < 1


def test_card_sections_of_both_methods_survive_a_rewrite(built):
    """restore_sections re-appends an EAGLE section (its own markdown) next to any Medusa one."""
    _, out = built
    family = out.parent
    (family / "MODEL_CARD.md").write_text("# family card\n")
    (family / "card.json").write_text("{}\n")
    for _ in range(2):
        H.restore_sections(family)
    md = (family / "MODEL_CARD.md").read_text()
    assert md.count("## EAGLE head") == 1 and "| target greedy, chain T = 0 |" in md
    assert '"method": "eagle"' in md
    (name,) = json.loads((family / "card.json").read_text())["heads"]
    assert name.endswith("eagle")
