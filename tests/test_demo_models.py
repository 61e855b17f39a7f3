"""The shipped demo model family (models/demo, built by `python -m models.build`).

Fast (< 60 s on 2 CPU cores): loads each checkpoint with transformers in
float32, checks shapes, tokenizer identity, the model card, and that the
target beats every draft on a few thousand held-out tokens.
SPECPLUGIN_DEMO_DIR points the tests at another build (e.g. a --quick one).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_specplugin.models import ALL, DEMO_DIR, DRAFTS, TARGET  # noqa: E402
from vllm_specplugin.models import corpus  # noqa: E402

DEMO = Path(os.environ.get("SPECPLUGIN_DEMO_DIR", DEMO_DIR))
HELDOUT_TOKENS = 3000


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads((DEMO / "card.json").read_text())


@pytest.fixture(scope="module")
def models() -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return {n: AutoModelForCausalLM.from_pretrained(str(DEMO / n), dtype=torch.float32).eval() for n in ALL}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO / TARGET))


def test_checkpoint_files():
    for n in ALL:
        d = DEMO / n
        for f in ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), d / f
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["torch_dtype"] == "bfloat16"
        assert cfg["head_dim"] in (32, 64, 128)  # vLLM-CPU attention supports only these
        assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
        assert cfg["vocab_size"] % 64 == 0
    assert json.loads((DEMO / TARGET / "config.json").read_text())["max_position_embeddings"] == 2048
    total = sum(p.stat().st_size for n in ALL for p in (DEMO / n).iterdir())
    assert total < 50e6


def test_shared_tokenizer(models, tokenizer):
    ref = (DEMO / TARGET / "tokenizer.json").read_bytes()
    for n in ALL:
        assert (DEMO / n / "tokenizer.json").read_bytes() == ref, n
        assert (DEMO / n / "tokenizer_config.json").read_bytes() == (
            DEMO / TARGET / "tokenizer_config.json").read_bytes(), n
        assert models[n].config.vocab_size == len(tokenizer)
        assert models[n].config.bos_token_id == tokenizer.bos_token_id == 0
        assert models[n].config.eos_token_id == tokenizer.eos_token_id == 1
    ids = tokenizer("def f(x):\n    return x\n")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"


def test_card_numbers(card):
    assert (DEMO / "MODEL_CARD.md").is_file()
    assert set(card["models"]) == set(ALL)
    for n in ALL:
        m = card["models"][n]
        for k in ("params", "heldout_loss", "heldout_ppl", "forward_flops_per_token",
                  "forward_s_per_token_1x256", "flops_ratio_target_over_this", "time_ratio_target_over_this"):
            assert isinstance(m[k], (int, float)) and math.isfinite(m[k]) and m[k] > 0, (n, k)
        assert card["training"][n]["train_tokens"] > 0
    for n in (*DRAFTS, "ensemble"):
        for t in ("T0", "T1"):
            row = card["alpha"][n][t]
            for k in ("exact", "empirical", "accepted_per_step", "tokens_per_step"):
                assert 0 <= row[k] <= 5, (n, t, k)
            assert 0 <= row["exact"] <= 1 and 0 <= row["empirical"] <= 1
    if not card["quick"]:
        for n in DRAFTS:
            # The family's point: the target costs >= 10x a draft per token (FLOPs).
            assert card["models"][n]["flops_ratio_target_over_this"] >= 10, n
            assert card["models"][TARGET]["heldout_ppl"] < card["models"][n]["heldout_ppl"], n


@torch.no_grad()
def test_forward_finite(models, tokenizer):
    x = torch.tensor([tokenizer("import os\n\ndef main():\n")["input_ids"]])
    for n, m in models.items():
        logits = m(input_ids=x).logits
        assert logits.shape == (1, x.shape[1], len(tokenizer))
        assert torch.isfinite(logits).all(), n


@torch.no_grad()
def test_target_beats_drafts_on_heldout(models, tokenizer, card):
    import torch.nn.functional as F

    # A few held-out files (never trained on), a few thousand tokens.
    held = [f for f in corpus.load("heldout") if f.relpath in set(card["corpus"]["heldout_file_list"])]
    assert held, "held-out files not found: different Python stdlib than the build?"
    ids: list[int] = []
    for f in held:
        ids += [tokenizer.bos_token_id] + tokenizer(f.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= HELDOUT_TOKENS:
            break
    seq = 256
    n = min(len(ids) - 1, HELDOUT_TOKENS) // seq
    xy = torch.tensor(ids[: n * seq + 1])
    x = torch.stack([xy[i * seq:(i + 1) * seq] for i in range(n)])
    y = torch.stack([xy[i * seq + 1:(i + 1) * seq + 1] for i in range(n)])
    loss = {}
    for name, m in models.items():
        logits = m(input_ids=x).logits
        loss[name] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    if card["quick"]:
        pytest.skip(f"quick build, losses {loss}")
    for d in DRAFTS:
        assert loss[TARGET] < loss[d] - 0.05, loss
