"""The one proposer interface every drafter in this package implements.

A proposer sees a batch of requests, each with its full token context and a budget of draft
tokens, and returns per request the tokens it drafts and the distribution q each was drawn
from. Verification (exact rejection sampling: accept with min(1, p/q)) needs that q, so a
proposer must return exactly what it sampled from: one-hot rows for deterministic choices.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_specplugin.proposers.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Draft:
    """Tokens drafted for one request and, per token, the distribution q it was drawn from."""

    token_ids: list[int]
    probs: torch.Tensor  # [len(token_ids), vocab] float32 on the proposer's device; one-hot rows for greedy drafts
    # A token tree instead of a chain (tree verification): parents[i] is the parent of node i,
    # nodes parents first, node 0 the root (the last context token, not drafted), so
    # len(parents) == len(token_ids) + 1 and token_ids[i - 1] is node i's token. None: a chain.
    parents: list[int] | None = None


@dataclass(frozen=True)
class DraftRequest:
    """One request asking for draft tokens this step."""

    request_id: str
    context: Sequence[int]  # every token so far: prompt and output, including this step's
    gamma: int  # the most draft tokens wanted (0: none)
    params: SamplingParams = GREEDY
    generator: torch.Generator | None = None
    # The verifier can check a token tree for this request (tree verification on, and the request
    # needs no chain-only feature); otherwise drafts must be chains.
    tree_ok: bool = False
    # The request has its own seed: its text must then depend only on its own history (a drafter
    # may not let other requests or timings change what it drafts for it at temperature > 0).
    seeded: bool = False
    # The target's hidden states (after its final norm) at context positions [hidden_start,
    # hidden_start + n): those the target verified since the last call, [n, d] (float32 or the
    # target's dtype). Only drafters that read the target's states (heads) use them; None: none.
    hidden_states: torch.Tensor | None = None
    hidden_start: int = 0


class Proposer(abc.ABC):
    """Drafts tokens for a batch of requests; keeps per-request state until :meth:`free`."""

    vocab_size: int

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One :class:`Draft` per request (possibly empty), in order."""

    @abc.abstractmethod
    def free(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    @abc.abstractmethod
    def tracked_request_ids(self) -> set[str]:
        """Every request this proposer (and whatever it wraps) holds state for; the vLLM adapter
        frees those the engine no longer runs."""

    def empty_draft(self) -> Draft:
        return Draft([], torch.empty(0, self.vocab_size))
