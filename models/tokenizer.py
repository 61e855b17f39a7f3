"""Byte-level BPE tokenizer shared by every demo model.

Saved in Hugging Face format (``tokenizer.json`` + ``tokenizer_config.json``)
so ``AutoTokenizer.from_pretrained(dir)`` and vLLM load it unchanged.
Encoding with special tokens prepends ``<s>`` (a TemplateProcessing
post-processor), matching how documents are framed in training:
``<s> file text </s>``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIALS = [BOS, EOS, PAD]  # ids 0, 1, 2


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Train byte-level BPE on ``texts``; returns a PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code is whitespace-sensitive, do not invent a space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )


def save_tokenizer(hf_tok, out_dir: Path) -> list[Path]:
    """Save HF-format tokenizer files; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [Path(p) for p in hf_tok.save_pretrained(str(out_dir))]


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_docs(hf_tok, texts: list[str]) -> torch.Tensor:
    """Concatenate ``<s> text </s>`` for every document into one int16 stream.

    int16 is enough for a 4096 vocab and keeps the stream small.
    """
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    enc = hf_tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for e in enc:
        ids.append(bos)
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int16)
