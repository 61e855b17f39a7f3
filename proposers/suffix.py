"""A zero-cost drafter: continue the context the way it went on after the same suffix before.

Suffix decoding (Oliaro et al., 2024; vLLM's ``suffix`` method through arctic-inference) and
n-gram matching (vLLM's ``ngram``) draft without a model: find the longest recent suffix of the
context that occurred earlier, and propose what followed it. Where the text repeats itself
(code, copy-edits, a greedy target that loops) that costs nothing and is accepted often.

:class:`SuffixDrafter` matches the context's last ``max_match`` .. ``min_match`` tokens against
the request's own context and, optionally, a shared corpus of recently finished requests (prompt
and output). Of the earlier occurrences of the longest suffix that matches (at most
``max_occurrences``, the most recent), it follows the most frequent continuation token by token
(ties to the most recent occurrence), as suffix decoding's greedy path does, while the path's
empirical probability (the share of occurrences that agree with the whole path so far) stays at
or above ``min_token_prob``. Each token's q is one-hot: the drafter is deterministic given the
context (and the corpus), so verification accepts token x with the target's p(x) and, on
rejection, draws from p with x removed: exact.

The shared corpus makes a request's drafts depend on other requests. Verification stays exact,
but a *seeded* request's text depends on its drafts (which draft tokens consume its random
numbers), so a seeded request sampled at temperature > 0 is matched against its own context only:
the same seed, prompt and settings then give the same text whatever else the server serves.

Shapes: contexts are token ids (any int sequence); a :class:`Draft`'s probs are
``[len(tokens), vocab_size]`` float32 on CPU, one-hot rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specplugin.proposers.base import Draft, DraftRequest, Proposer

SEPARATOR = -1  # between documents of the shared corpus: never a token, so no match crosses it


@dataclass(frozen=True)
class SuffixSettings:
    max_match: int = 16  # longest context suffix looked up
    min_match: int = 2  # shortest suffix that counts as a match (one token matches too much)
    max_occurrences: int = 64  # the most recent occurrences of the matched suffix that vote
    min_token_prob: float = 0.1  # stop the path when the share of occurrences agreeing with it falls below
    corpus_requests: int = 32  # finished requests kept as the shared corpus (0: each request's own context only)

    def __post_init__(self):
        for name in ("max_match", "min_match", "max_occurrences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must be <= max_match ({self.max_match})")
        if not 0 < self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in (0, 1], got {self.min_token_prob!r}")
        if isinstance(self.corpus_requests, bool) or not isinstance(self.corpus_requests, int) or self.corpus_requests < 0:
            raise ValueError(f"corpus_requests must be an integer >= 0, got {self.corpus_requests!r}")


@dataclass(frozen=True)
class SuffixChain:
    """What the matcher proposes for one context: tokens, each token's empirical probability
    (share of the surviving occurrences that continue with it), and the matched suffix length."""

    tokens: list[int]
    token_probs: list[float]
    match_length: int

    @property
    def path_prob(self) -> float:
        return float(np.prod(self.token_probs)) if self.token_probs else 0.0


NO_MATCH = SuffixChain([], [], 0)


def match_suffix(text: np.ndarray, key_end: int, settings: SuffixSettings, limit: int = 32,
                 search_end: int | None = None) -> SuffixChain:
    """Continue ``text[:key_end]`` from earlier occurrences of its longest suffix.

    ``text``: int64 [n] (documents separated by :data:`SEPARATOR`); the key is the suffix of
    ``text[:key_end]``; occurrences must end before ``search_end`` (default ``key_end - 1``: the
    key itself is not an occurrence) and continuations run until a separator or ``key_end``.
    Returns at most ``limit`` tokens.
    """
    search_end = key_end - 1 if search_end is None else search_end
    if key_end < settings.min_match + 1 or search_end <= 0:
        return NO_MATCH
    # Occurrences end at i (inclusive) with text[i] == the key's last token; extend backwards.
    ends = np.flatnonzero(text[:search_end] == text[key_end - 1])
    matched, best = 0, ends[:0]
    for length in range(1, settings.max_match + 1):
        if length > 1:
            back = ends - (length - 1)
            keep = back >= 0
            ends = ends[keep]
            ends = ends[text[back[keep]] == text[key_end - length]]
        if ends.size == 0:
            break
        matched, best = length, ends
        if length == key_end:
            break
    if matched < settings.min_match:
        return NO_MATCH
    starts = best[-settings.max_occurrences:] + 1  # where each continuation begins: most recent last
    tokens: list[int] = []
    token_probs: list[float] = []
    path_prob = 1.0
    for depth in range(limit):
        at = starts + depth
        at = at[at < key_end]
        at = at[text[at] != SEPARATOR]
        if at.size == 0:
            break
        # Occurrences that ran into the context's end or a document's end no longer vote.
        following = text[at]
        values, counts = np.unique(following, return_counts=True)
        top = counts.max()
        candidates = values[counts == top]
        # A tie goes to the token of the most recent occurrence among them.
        token = int(following[np.isin(following, candidates)][-1]) if candidates.size > 1 else int(candidates[0])
        share = float(top) / float(following.size)
        if path_prob * share < settings.min_token_prob:
            break
        path_prob *= share
        tokens.append(token)
        token_probs.append(share)
        starts = at[following == token] - depth
        if starts.size == 0:
            break
    return SuffixChain(tokens, token_probs, matched)


class SuffixDrafter(Proposer):
    """Drafts, per request, the continuation of its longest matching suffix (one-hot q)."""

    def __init__(self, vocab_size: int, settings: SuffixSettings = SuffixSettings()):
        self.vocab_size = int(vocab_size)
        self.settings = settings
        self._last_context: dict[str, list[int]] = {}  # request id -> its latest context (for the corpus)
        self._corpus: OrderedDict[str, np.ndarray] = OrderedDict()
        self._corpus_text: np.ndarray | None = None  # the documents joined, each followed by a separator

    # -- the shared corpus -------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """The request ended: its text joins the shared corpus (the oldest leaves when full)."""
        context = self._last_context.pop(request_id, None)
        if context is None or self.settings.corpus_requests == 0:
            return
        self._corpus[request_id] = np.asarray(context, dtype=np.int64)
        while len(self._corpus) > self.settings.corpus_requests:
            self._corpus.popitem(last=False)
        self._corpus_text = None

    def tracked_request_ids(self) -> set[str]:
        return set(self._last_context)

    def _corpus_array(self) -> np.ndarray:
        if self._corpus_text is None:
            parts = []
            for document in self._corpus.values():
                parts.extend([document, np.array([SEPARATOR], dtype=np.int64)])
            self._corpus_text = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._corpus_text

    @staticmethod
    def own_context_only(request: DraftRequest) -> bool:
        """A seeded request sampled at T > 0: its text must not depend on other requests."""
        return request.seeded and request.params.temperature > 0

    # -- drafting ----------------------------------------------------------------------------

    def chain(self, request: DraftRequest) -> SuffixChain:
        """The proposal for one request (at most ``request.gamma`` tokens); remembers its context."""
        context = np.asarray(request.context, dtype=np.int64)
        self._last_context[request.request_id] = list(request.context)
        if request.gamma <= 0 or context.size == 0:
            return NO_MATCH
        corpus = self._corpus_array()
        if corpus.size and not self.own_context_only(request):
            # The corpus first, the request last: the key is the text's suffix, and "most recent"
            # means the request's own occurrences before the corpus's.
            text = np.concatenate([corpus, context])
        else:
            text = context
        return match_suffix(text, text.size, self.settings, limit=request.gamma)

    def one_hot(self, tokens: Sequence[int]) -> torch.Tensor:
        """q of a deterministic draft: [len(tokens), vocab_size] float32, one 1 per row."""
        probs = torch.zeros(len(tokens), self.vocab_size, dtype=torch.float32)
        if tokens:
            probs[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)] = 1.0
        return probs

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            tokens = []
            for token in self.chain(request).tokens:  # a token the target cannot emit ends the chain
                if not 0 <= token < self.vocab_size:
                    break
                tokens.append(token)
            drafts.append(Draft(tokens, self.one_hot(tokens)))
        return drafts
