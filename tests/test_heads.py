"""models/heads.py (Medusa heads trainer): the checkpoint it writes is in vLLM 0.32's Medusa format,
and a non-Llama target is refused. A tiny training run (a few seconds) on a random 2-layer Llama;
the real heads are loaded by vLLM in tests/e2e/test_heads_engine.py (engine tier, make test-extended)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from vllm_specplugin.models import heads as H  # noqa: E402
from vllm_specplugin.models.random_llama import make_random_llama  # noqa: E402

K, LAYERS = 3, 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = make_random_llama(root / "target", logit_scale=15.0, seed=0)
    out = root / "medusa"
    rc = H.main(["--target", str(target), "--out", str(out), "--data", "self", "--tokens", "2048",
                 "--batch", "4", "--seq", "32", "--num-heads", str(K), "--layers", str(LAYERS),
                 "--eval-windows", "2", "--eval-prompts", "2", "--eval-new-tokens", "8",
                 "--work", str(root / "work"), "--save-every", "4"])
    assert rc == 0
    return target, out


def test_checkpoint_is_vllm_medusa_format(built):
    """vLLM's MedusaConfig reads the config, and vLLM's own ResidualBlock + the shared LM head, loaded
    under the parameter names vLLM's Medusa.load_weights maps them to, compute the trainer's logits."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.medusa import Medusa, ResidualBlock
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    target, out = built
    cfg = MedusaConfig.from_pretrained(str(out))
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg.architectures == ["MedusaModel"] and cfg.model_type == "medusa"
    assert (cfg.num_heads, cfg.num_hidden_layers) == (K, LAYERS)
    assert cfg.hidden_size == tcfg["hidden_size"] and cfg.vocab_size == cfg.truncated_vocab_size == tcfg["vocab_size"]
    assert cfg.original_lm_head is True and cfg.medusa_fc_bias is True
    weights = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    names = {Medusa._remap_old_checkpoint_key(n.replace("medusa_heads.", "")) for n in weights}
    expected = {f"blocks.{j}.layers.{l}.{p}" for j in range(K) for l in range(LAYERS) for p in ("weight", "bias")}
    assert names == expected | {"lm_head.weight"}

    ours = H.load_heads(out)
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    mine = ours(h)
    lm_head = weights["lm_head.weight"].float()
    for j in range(K):
        block = ResidualBlock(cfg, cfg.hidden_size, cfg.num_hidden_layers)
        block.load_state_dict({n[len(f"blocks.{j}."):]: weights[n].float() for n in expected
                               if n.startswith(f"blocks.{j}.")})
        torch.testing.assert_close(block(h) @ lm_head.T, mine[j], rtol=1e-5, atol=1e-4)
    # Trained: the blocks moved from their zero init, and the card holds every head's acceptance.
    assert any(float(w.abs().max()) > 0 for n, w in weights.items() if n.endswith(".weight") and "blocks" in n)
    card = json.loads((out / H.CARD_FILE).read_text())
    for text in ("heldout_text", "target_greedy_text"):
        assert len(card["measure"][text]["T0"]) == len(card["measure"][text]["T1"]) == K
    assert 0 < card["measure"]["params_fraction_of_target"] < 1


@pytest.mark.parametrize("trainer", ["heads", "eagle"])
def test_refuses_non_llama_target(tmp_path, trainer):
    """Both trainers (Medusa: models/heads.py, EAGLE: models/eagle.py) refuse before writing anything."""
    import importlib

    main = importlib.import_module(f"vllm_specplugin.models.{trainer}").main
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SystemExit, match="only Llama targets"):
        main(["--target", str(tmp_path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_training_resumes_from_state(tmp_path):
    """A run stopped after its last saved state and restarted gives the same heads as one run."""
    target = make_random_llama(tmp_path / "target", logit_scale=15.0, seed=0)
    args = ["--target", str(target), "--data", "self", "--tokens", "1024", "--batch", "4", "--seq", "32",
            "--num-heads", "2", "--eval-windows", "1", "--eval-prompts", "1", "--eval-new-tokens", "4",
            "--save-every", "4"]
    H.main(args + ["--out", str(tmp_path / "once"), "--work", str(tmp_path / "w1")])
    # Simulate a stop: a state saved at step 4 of 8 (the trainer writes it there), then a re-run.
    H.main(args + ["--out", str(tmp_path / "twice"), "--work", str(tmp_path / "w2"), "--stop-after", "4"])
    assert any((tmp_path / "w2").iterdir())
    H.main(args + ["--out", str(tmp_path / "twice"), "--work", str(tmp_path / "w2")])
    # Training is seeded, so starting over would give the same weights: the run must say (and have
    # done) that it resumed at the saved step, training only the steps after it.
    once = json.loads((tmp_path / "once" / H.CARD_FILE).read_text())["train"]
    twice = json.loads((tmp_path / "twice" / H.CARD_FILE).read_text())["train"]
    assert (once["resumed_from_step"], once["steps_trained_this_run"]) == (0, 8)
    assert (twice["resumed_from_step"], twice["steps_trained_this_run"]) == (4, 4)
    a, b = H.load_heads(tmp_path / "once"), H.load_heads(tmp_path / "twice")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=n)


def test_card_section_survives_a_card_rewrite(built):
    """models/build.py and models/grow.py rewrite a family's card, then call restore_sections: the heads'
    section comes back exactly once (MODEL_CARD.md and card.json), however often it runs."""
    _, out = built
    family = out.parent
    (family / "MODEL_CARD.md").write_text("# family card\n")
    (family / "card.json").write_text("{}\n")
    for _ in range(2):
        H.restore_sections(family)
    md = (family / "MODEL_CARD.md").read_text()
    assert md.startswith("# family card\n") and md.count("## Medusa heads") == 1
    assert "| target greedy, chain T = 0 |" in md
    (name,) = json.loads((family / "card.json").read_text())["heads"]
    assert name.endswith("medusa")


def test_learning_curve_is_recorded_across_a_resume(tmp_path):
    """``--curve-every`` records the Medusa heads' learning curve (every head's teacher-forced
    acceptance at step 0, every N steps and at the end), kept across a resume, in the card's JSON
    and its markdown section (the option was once ignored by this trainer)."""
    target = make_random_llama(tmp_path / "target", logit_scale=15.0, seed=0)
    args = ["--target", str(target), "--out", str(tmp_path / "medusa"), "--data", "self", "--tokens", "1024",
            "--batch", "4", "--seq", "32", "--num-heads", "2", "--eval-windows", "1", "--eval-prompts", "1",
            "--eval-new-tokens", "4", "--save-every", "4", "--curve-every", "2", "--work", str(tmp_path / "w"),
            "--card", str(tmp_path / "card")]
    assert H.main(args + ["--stop-after", "4"]) == 0
    assert H.main(args) == 0
    train = json.loads((tmp_path / "medusa" / H.CARD_FILE).read_text())["train"]
    assert train["resumed_from_step"] == 4
    assert [c["step"] for c in train["curve"]] == [0, 2, 4, 6, 8]
    assert all(len(c["T0"]) == 2 and len(c["T1"]) == 2 for c in train["curve"])
    assert train["data"] == "self"  # a run on other text is another run: its own resumable state
    card = (tmp_path / "card" / "MODEL_CARD.md").read_text()
    assert "Learning curve" in card and (tmp_path / "card" / H.curve_png_name("medusa")).exists()
    assert "on the target's own T = 1 samples" in card and "on corpus text" not in card
