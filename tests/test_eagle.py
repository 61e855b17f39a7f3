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
        """tokens [1, n], feats [1, n, d] at positions 0..n-1 -> (g [1, n, d], logits [1, n, V]), causal."""
        x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T
        pos = torch.arange(x.shape[1])[None]
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        # vLLM: hidden_states + residual, no final norm (HF's layer returns exactly that sum); the target's LM head
        return y, y @ lm_head.T

    return run


def _loud_copy(trained, name: str, out, target, model):
    """The trained head with every weight redrawn at a large scale (a briefly trained head is near its
    init: small attention scores would hide RoPE or mask errors), written by save_eagle next to ``out``
    as ``name`` and read back (bf16 round trip: the reference reads the same bf16 weights)."""
    with torch.no_grad():
        g_ = torch.Generator().manual_seed(1)
        for p in trained.parameters():
            p.copy_(torch.randn(p.shape, generator=g_) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    loud = out.parent / name
    E.save_eagle(trained, loud, json.loads((target / "config.json").read_text()), {"target": str(target)})
    return E.load_eagle(loud, model), loud


@torch.no_grad()
def _assert_step_and_chain(head, run, x, inputs, hidden) -> None:
    """The head's first draft step over the window ((x_{i+1}, its inputs at i) at position i) and its
    3-step autoregressive chain equal the reference ``run(tokens, hidden) -> (g, logits)``: from start i,
    step m feeds (x_{i+m}, g of step m-1) at position i+m-1 after the real entries 0..i, exactly a
    causal run over that explicit sequence. ``inputs``: what the head reads from the target [1, T, F];
    ``hidden``: the first step's hidden input the reference takes [1, T, d]."""
    g_ref, logits_ref = run(x[:, 1:], hidden[:, :-1])
    g, logits = head(x[:, 1:], inputs[:, :-1])
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-3)
    K = 3
    chain = head.chain(x, inputs, K)
    N = x.shape[1] - K
    for i in (0, 3, N - 1):
        toks, feats = x[:, 1:i + 2], hidden[:, :i + 1]
        for m in range(1, K + 1):
            g_seq, logits_seq = run(toks, feats)
            torch.testing.assert_close(chain[m - 1][:, i], logits_seq[:, -1], rtol=1e-3, atol=1e-3,
                                       msg=lambda s: f"start {i} step {m}: {s}")
            toks = torch.cat([toks, x[:, i + m + 1:i + m + 2]], 1)
            feats = torch.cat([feats, g_seq[:, -1:]], 1)


def test_checkpoint_is_vllm_eagle_format_and_forward_matches(built):
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    target, out = built
    cfg = json.loads((out / "config.json").read_text())
    ecfg = EAGLEConfig(model=cfg, method="eagle")
    assert ecfg.architectures == ["EagleLlamaForCausalLM"] and ecfg.model.num_hidden_layers == 1
    tcfg = json.loads((target / "config.json").read_text())
    assert all(cfg[k] == tcfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "rms_norm_eps"))

    model = H.load_target(target)
    trained = E.load_eagle(out, model)
    # Trained: moved from its init (the trainer draws it after torch.manual_seed(--seed), default 0),
    # by more than the bf16 rounding of the checkpoint.
    torch.manual_seed(0)
    init = E.EagleHead(H.check_llama(target), model.model.embed_tokens.weight, model.lm_head.weight)
    rounded = {n: p.detach().to(torch.bfloat16).float() for n, p in init.named_parameters()}
    moved = {n: float((p.detach().float() - rounded[n]).abs().max()) for n, p in trained.named_parameters()}
    assert set(moved) == set(rounded) and max(moved.values()) > 1e-3, moved
    head, loud = _loud_copy(trained, "eagle-loud", out, target, model)
    g_ = torch.Generator().manual_seed(0)
    x = torch.randint(3, cfg["vocab_size"], (1, 12), generator=g_)
    f, _ = H.target_hidden_and_logp(model, x)
    _assert_step_and_chain(head, _reference(loud, model), x, f, f)  # EAGLE-1 reads f_i itself
    # The card holds every draft position's acceptance.
    card = json.loads((out / H.CARD_FILE).read_text())
    assert card["method"] == "eagle"
    for text in ("heldout_text", "target_greedy_text"):
        r = card["measure"][text]
        assert len(r["T0"]) == len(r["T1"]) == len(r["chain_T0"]) == E.CHAIN and r["positions"] > 0
    assert 0 < card["measure"]["params_fraction_of_target"] < 1


# EAGLE-3 (vLLM's Eagle3LlamaForCausalLM, llama_eagle3.py): fc over the aux layers' states, the layer's
# input_layernorm and hidden_norm, q/k/v over 2d inputs, its own final norm and LM head.
EXPECTED3 = EXPECTED | {"layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight",
                        "lm_head.weight"}
AUX3 = (0, 2, 4)  # of a 4-layer target: entering layers 0 and 2, and the last layer's output (4)


@pytest.fixture(scope="module")
def built3(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_random_llama(root / "target", logit_scale=15.0, seed=0, num_layers=4)
    out = root / "eagle3"
    rc = E.main(["--method", "eagle3", "--aux-layers", *map(str, AUX3), "--chain-steps", "2",
                 "--target", str(target), "--out", str(out), "--data", "self", "--tokens", "2048",
                 "--batch", "4", "--seq", "32", "--eval-windows", "2", "--eval-prompts", "2",
                 "--eval-new-tokens", "8", "--work", str(root / "work"), "--save-every", "4"])
    assert rc == 0
    return target, out


def _reference3(out, target_model):
    """vLLM's EAGLE-3 layer (llama_eagle3.LlamaDecoderLayer, layer 0, norm after residual) and model
    (final norm with the residual; the pre-norm sum is the next step's hidden state) from transformers'
    Llama attention, MLP and RMSNorm, q/k/v widened to the 2d input; weights from the checkpoint."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    cfg = LlamaConfig.from_pretrained(str(out))
    cfg._attn_implementation = "sdpa"  # causal when no mask is given
    w = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    assert set(w) == EXPECTED3
    d = cfg.hidden_size
    attn, mlp = LlamaAttention(cfg, layer_idx=0).float().eval(), LlamaMLP(cfg).float().eval()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * d, getattr(attn, name).out_features, bias=False))
    attn.load_state_dict({k[len("layers.0.self_attn."):]: v for k, v in w.items() if ".self_attn." in k})
    mlp.load_state_dict({k[len("layers.0.mlp."):]: v for k, v in w.items() if ".mlp." in k})
    norms = {}
    for name in ("layers.0.input_layernorm", "layers.0.hidden_norm", "layers.0.post_attention_layernorm", "norm"):
        norms[name] = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[name + ".weight"])
    rope = LlamaRotaryEmbedding(cfg)
    embed = target_model.model.embed_tokens.weight.float()

    def run(tokens, hidden):
        """tokens [1, n], hidden [1, n, d] (fc(aux) for the target's positions, a draft step's g after)
        at positions 0..n-1 -> (g [1, n, d], logits [1, n, V]), causal."""
        x = torch.cat([norms["layers.0.input_layernorm"](embed[tokens]), norms["layers.0.hidden_norm"](hidden)], -1)
        pos = torch.arange(x.shape[1])[None]
        a, _ = attn(x, position_embeddings=rope(hidden, pos), attention_mask=None)
        residual = hidden + a
        g = residual + mlp(norms["layers.0.post_attention_layernorm"](residual))
        return g, norms["norm"](g) @ w["lm_head.weight"].T

    return run, w["fc.weight"]


def test_eagle3_checkpoint_is_vllm_eagle3_format_and_forward_matches(built3):
    """The EAGLE-3 checkpoint: vLLM's EAGLEConfig makes it an Eagle3LlamaForCausalLM reading the aux
    layers asked for; the head's input is the target's residual stream entering those layers (what
    vLLM's Llama hands EAGLE-3, hooked here), and its first step and autoregressive chain are vLLM's
    EAGLE-3 computation (reference above) on large random weights."""
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    target, out = built3
    cfg = json.loads((out / "config.json").read_text())
    ecfg = EAGLEConfig(model=cfg, method="eagle3")
    assert ecfg.architectures == ["Eagle3LlamaForCausalLM"] and ecfg.model.num_hidden_layers == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX3)
    model = H.load_target(target)
    trained = E.load_eagle(out, model)
    assert isinstance(trained, E.Eagle3Head) and trained.aux_layers == AUX3
    head, loud = _loud_copy(trained, "eagle3-loud", out, target, model)
    run, fc = _reference3(loud, model)
    g_ = torch.Generator().manual_seed(0)
    x = torch.randint(3, cfg["vocab_size"], (1, 12), generator=g_)
    entering = {}  # layer a < L: the stream entering it; a = L: the last layer's output (before the final norm)
    L = model.config.num_hidden_layers
    hooks = [model.model.layers[a].register_forward_pre_hook(
        lambda module, args, kwargs, a=a: entering.__setitem__(a, (kwargs.get("hidden_states") if not args else args[0])),
        with_kwargs=True) for a in AUX3 if a < L]
    hooks += [model.model.layers[L - 1].register_forward_hook(
        lambda module, args, output: entering.__setitem__(L, output[0] if isinstance(output, tuple) else output))]
    aux, _ = head.target_inputs(model, x)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(aux, torch.cat([entering[a].float() for a in AUX3], -1))
    _assert_step_and_chain(head, run, x, aux, aux @ fc.T)  # the first step's hidden input: fc(aux)
    card = json.loads((out / H.CARD_FILE).read_text())
    assert card["method"] == "eagle3" and card["train"]["aux_layers"] == list(AUX3)
    md = "\n".join(H.section_markdown(card, "t", "h"))
    assert md.startswith("## EAGLE-3 head") and '"method": "eagle3"' in md


def test_eagle3_options_are_checked(tmp_path):
    target = make_random_llama(tmp_path / "target", seed=0, num_layers=4)
    base = ["--target", str(target), "--out", str(tmp_path / "out"), "--data", "self", "--tokens", "64"]
    for extra, message in ((["--method", "eagle3"], "distinct layers"),  # vLLM's default (2, 2, 1) for 4 layers
                           (["--method", "eagle3", "--aux-layers", "0", "5"], "distinct layers"),  # 4: the last output
                           (["--aux-layers", "0", "1"], "eagle3 only"),
                           (["--method", "eagle3", "--aux-layers", "0", "1", "--reg-weight", "1"], "no feature regression")):
        with pytest.raises(SystemExit, match=message):
            E.main(base + extra)


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


def test_chain_loss_scores_step_m_against_the_token_after_next(tmp_path):
    """``--chain-steps``: draft step m from start i drafts token i+m+1, so its KL must be taken against
    the target's distribution at position i+m. With a target distribution that is (smoothed) one-hot
    on the window's next token, step m's KL is a cross-entropy on x[i+m+1], computed here from the
    tokens alone; an off-by-one in the loss's alignment changes it."""
    from vllm_specplugin.models.heads import check_llama
    import torch.nn.functional as F

    target = make_random_llama(tmp_path / "target", logit_scale=15.0, seed=0)
    cfg = check_llama(target)
    torch.manual_seed(0)
    V, d, B, T, K = cfg["vocab_size"], cfg["hidden_size"], 2, 12, 3
    head = E.EagleHead(cfg, torch.randn(V, d), torch.randn(V, d))
    x, f = torch.randint(0, V, (B, T)), torch.randn(B, T, d)
    nxt = torch.cat([x[:, 1:], x[:, :1]], 1)  # p at position j is about x[j + 1]
    p = 0.9 * F.one_hot(nxt, V).double() + 0.1 / V
    t_logp = p.log().float()
    loss, (kl, _) = E.eagle_loss(head, x, f, t_logp, reg_weight=0.0, chain_steps=K)
    N = T - K
    want = []
    for m, logits in enumerate(head.chain(x, f, K), start=1):
        logq = F.log_softmax(logits, -1).double()
        pm = p[:, m:m + N]
        # x[i + m + 1]: the token step m drafts (past the window's end for the last start of step K)
        k = min(N, T - m - 1)
        assert torch.equal(pm.argmax(-1)[:, :k], x[:, m + 1:m + 1 + k])
        want.append(((pm * (pm.log() - logq)).sum(-1)).mean())
    torch.testing.assert_close(torch.tensor(kl, dtype=torch.float64), torch.stack(want).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss.double(), torch.stack(want).mean(), rtol=1e-4, atol=1e-5)


def test_self_corpus_data_and_learning_curve_resume(tmp_path):
    """``--data self-corpus``: the target's continuations of corpus prompts, cached in shards (a re-run
    generates nothing and gets the same tokens); training draws half of each batch from each stream;
    ``--curve-every`` records the curve at step 0, every N steps and at the end, and a resumed run keeps
    the points measured before the stop."""
    target = make_random_llama(tmp_path / "target", logit_scale=15.0, seed=0)
    model = H.load_target(target)
    V = model.config.vocab_size
    corpus = torch.randint(3, V, (5000,))
    a = H.corpus_continuations(model, corpus, 2 * 4 * 32, seed=3, work=tmp_path / "w", key="k", prompt_len=8,
                               seq=32, batch=4)
    shards = sorted((tmp_path / "w" / "selfgen-k").iterdir())
    assert len(shards) == 2 and a.shape == (2 * 4 * 32,)
    rows = a.view(-1, 32)
    text = "," + ",".join(map(str, corpus.tolist())) + ","
    assert all("," + ",".join(map(str, r[:8].tolist())) + "," in text for r in rows)  # corpus prompts
    mtimes = [s.stat().st_mtime_ns for s in shards]
    b = H.corpus_continuations(model, corpus, 2 * 4 * 32, seed=3, work=tmp_path / "w", key="k", prompt_len=8,
                               seq=32, batch=4)
    assert torch.equal(a, b) and [s.stat().st_mtime_ns for s in shards] == mtimes

    # Two streams with disjoint token ranges: even rows from the first, odd rows from the second.
    s0, s1 = torch.randint(3, 100, (400,)), torch.randint(200, 300, (400,))
    seen = []

    class Args:
        lr, tokens, batch, seq, seed, save_every, stop_after, curve_every = 1e-3, 4 * 16 * 6, 4, 16, 0, 2, 0, 2
        work, out = tmp_path / "w2", tmp_path / "out"

    lin = torch.nn.Linear(1, 1)

    def batch_loss(xb):
        seen.append(xb.clone())
        return lin(xb[:, :1].float()).mean(), [0.0]

    calls = []

    def curve(m):
        calls.append(1)
        return {"accepted_per_step_T0": 0.0, "T0": [0.0], "T1": [0.0]}

    args = Args()
    args.stop_after = 4
    model_out, st = H.resumable_train(lin, batch_loss, [s0, s1], args, {"k": 1}, "t", "p", log=lambda m: None,
                                      curve_fn=curve)
    assert model_out is None  # stopped after the state at step 4
    assert all((xb[0::2] < 100).all() and (xb[1::2] >= 200).all() for xb in seen)
    args.stop_after = 0
    _, st = H.resumable_train(lin, batch_loss, [s0, s1], args, {"k": 1}, "t", "p", log=lambda m: None,
                              curve_fn=curve)
    assert [c["step"] for c in st["curve"]] == [0, 2, 4, 6]
    assert st["resumed_from_step"] == 4 and len(calls) == 4


def test_export_state_ships_an_unfinished_run_and_the_run_resumes(tmp_path):
    """``--export-state`` writes the checkpoint and card from a run's last resumable state (marked
    interrupted, with its learning curve so far); re-running the command then resumes the training
    from that state rather than starting over."""
    target = make_random_llama(tmp_path / "target", logit_scale=15.0, seed=0)
    args = ["--target", str(target), "--out", str(tmp_path / "eagle"), "--data", "self", "--tokens", "1024",
            "--batch", "4", "--seq", "32", "--eval-windows", "1", "--eval-prompts", "1", "--eval-new-tokens", "4",
            "--save-every", "4", "--curve-every", "2", "--chain-steps", "2", "--work", str(tmp_path / "w")]
    with pytest.raises(SystemExit, match="no resumable state"):
        E.main(args + ["--export-state"])
    assert E.main(args + ["--stop-after", "4"]) == 0
    assert E.main(args + ["--export-state"]) == 0
    card = json.loads((tmp_path / "eagle" / H.CARD_FILE).read_text())
    assert card["train"]["interrupted"] and card["train"]["steps"] == 4 and card["train"]["planned_steps"] == 8
    assert [c["step"] for c in card["train"]["curve"]] == [0, 2, 4]
    exported = E.load_eagle(tmp_path / "eagle", H.load_target(target))
    assert E.main(args) == 0
    card = json.loads((tmp_path / "eagle" / H.CARD_FILE).read_text())
    assert card["train"]["resumed_from_step"] == 4 and [c["step"] for c in card["train"]["curve"]] == [0, 2, 4, 6, 8]
    assert not torch.equal(exported.fc.weight, E.load_eagle(tmp_path / "eagle", H.load_target(target)).fc.weight)
