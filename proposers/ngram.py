"""A zero-cost drafter: n-gram matching over the request's own context (vLLM's ``ngram`` method).

For n from ``max_n`` down to ``min_n``, find the most recent earlier occurrence of the context's
last n tokens and propose the tokens that followed it (up to the request's γ). Unlike
:class:`~proposers.suffix.SuffixDrafter` it votes nothing (the most recent match wins) and looks
only at the request's own context, so it never depends on other requests: a seeded request stays
reproducible. q is one-hot (the proposal is a function of the context): verification accepts x
with the target's p(x) and on rejection draws from p with x removed, which is exact.

Shapes: contexts are token ids; a :class:`Draft`'s probs are ``[len(tokens), vocab_size]`` float32
on CPU, one-hot rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer


@dataclass(frozen=True)
class NgramSettings:
    min_n: int = 2  # shortest context suffix that counts as a match (vLLM's prompt_lookup_min)
    max_n: int = 4  # longest suffix looked up first (vLLM's prompt_lookup_max)
    window: int = 4096  # only the last `window` context tokens are searched (bounded cost per step)

    def __post_init__(self):
        for name in ("min_n", "max_n", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ngram {name} must be an integer >= 1, got {value!r}")
        if self.min_n > self.max_n:
            raise ValueError(f"ngram min_n ({self.min_n}) must be <= max_n ({self.max_n})")


def match_ngram(context: np.ndarray, limit: int, settings: NgramSettings = NgramSettings()) -> list[int]:
    """Up to ``limit`` tokens following the most recent earlier occurrence of the context's longest
    matching suffix of ``max_n`` .. ``min_n`` tokens; [] when none matches. ``context`` [L] int64."""
    text = context[-settings.window:]
    size = text.size
    if limit <= 0:
        return []
    for n in range(min(settings.max_n, size - 1), settings.min_n - 1, -1):
        key = text[size - n:]
        # Windows starting at 0 .. size - n - 1 (the suffix itself excluded), all n positions equal.
        starts = np.arange(size - n)
        hit = np.ones(size - n, dtype=bool)
        for offset in range(n):
            hit &= text[starts + offset] == key[offset]
        found = np.flatnonzero(hit)
        if found.size:
            follow = int(found[-1]) + n  # the most recent occurrence
            return [int(t) for t in text[follow: follow + limit]]
    return []


class NgramDrafter(Proposer):
    """Drafts, per request, what followed the most recent earlier occurrence of its last n tokens."""

    name = "ngram"

    def __init__(self, vocab_size: int, settings: NgramSettings = NgramSettings()):
        self.vocab_size = int(vocab_size)
        self.settings = settings

    def free(self, request_id: str) -> None:  # stateless
        pass

    def tracked_request_ids(self) -> set[str]:
        return set()

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            tokens = []
            for token in match_ngram(np.asarray(request.context, dtype=np.int64), request.gamma, self.settings):
                if not 0 <= token < self.vocab_size:  # a token the target cannot emit ends the chain
                    break
                tokens.append(token)
            probs = torch.zeros(len(tokens), self.vocab_size, dtype=torch.float32)
            if tokens:
                probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            drafts.append(Draft(tokens, probs))
        return drafts
