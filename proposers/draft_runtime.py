"""A draft model with per-request KV caches, for drafting γ tokens at a time.

Each request keeps its own cache across steps, so a step forwards only the tokens that are new
since the last one; tokens the target rejected are rolled back by cropping the cache to the
longest prefix shared with the request's current context. Caches live within a memory budget
with least-recently-used eviction (an evicted request just re-prefills next time).

Not yet here: batching several requests into one forward per draft step (each request is
forwarded on its own), and sharing caches across requests with a common prefix.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from proposers.sampling import SamplingParams, processed_probs, sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DraftModelError(ValueError):
    """A draft checkpoint that cannot serve the target (missing, or another vocabulary)."""


@dataclass
class Draft:
    """Tokens drafted for one request and, per token, the distribution q it was drawn from."""

    token_ids: list[int]
    probs: torch.Tensor  # [len(token_ids), vocab], float32; rows are one-hot for greedy drafts


@dataclass
class _RequestCache:
    cached_tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    past_key_values: object | None = None
    nbytes: int = 0


class DraftRuntime:
    """One draft model serving many requests, each with its own incremental KV cache."""

    def __init__(
        self,
        path: str,
        *,
        target_vocab_size: int | None = None,
        target_name: str = "target",
        dtype: str = "float32",
        device: str = "cpu",
        memory_budget_mb: float = 512,
    ):
        import os

        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise DraftModelError(f"draft model {path!r}: no config.json there (a local checkpoint directory is needed)")
        config = AutoConfig.from_pretrained(path)
        if target_vocab_size is not None and config.vocab_size != target_vocab_size:
            raise DraftModelError(
                f"draft model {path!r} has vocabulary size {config.vocab_size}, but {target_name} has "
                f"{target_vocab_size}: drafts must share the target's tokenizer"
            )
        self.path = path
        self.vocab_size = config.vocab_size
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(self.device).eval()
        self.memory_budget_bytes = int(memory_budget_mb * 2**20)
        self._caches: OrderedDict[str, _RequestCache] = OrderedDict()
        self._too_long_logged: set[str] = set()
        self.tokens_forwarded = 0  # all tokens run through the model, for cost accounting
        self.evictions = 0

    # -- request lifecycle -----------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted request's cache."""
        self._caches.pop(request_id, None)
        self._too_long_logged.discard(request_id)

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self._caches.values())

    # -- drafting --------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self,
        request_id: str,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """Draft up to ``gamma`` tokens after ``context`` (the request's full token ids).

        Returns no tokens, and says so once per request, when the context plus the drafts would
        exceed the draft model's maximum length.
        """
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        gamma = min(gamma, self.max_length - len(context))
        if gamma <= 0 or not context:
            if request_id not in self._too_long_logged and context:
                self._too_long_logged.add(request_id)
                logger.warning(
                    "request %s: context of %d tokens reaches the draft model's maximum length %d "
                    "(%s); proposing no draft tokens for it (plain decoding continues).",
                    request_id, len(context), self.max_length, self.path,
                )
            return Draft([], torch.empty(0, self.vocab_size))
        cache = self._caches.pop(request_id, None) or _RequestCache()
        self._caches[request_id] = cache  # most recently used last
        logits = self._sync(cache, list(context))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(gamma):
            probs = processed_probs(logits, params)
            token = int(probs.argmax()) if params.greedy else int(sample(probs.unsqueeze(0), generator))
            tokens.append(token)
            rows.append(probs)
            if step + 1 < gamma:
                logits = self._forward(cache, [token])
        self._account(cache)
        return Draft(tokens, torch.stack(rows))

    def _sync(self, cache: _RequestCache, context: list[int]) -> torch.Tensor:
        """Roll the cache back to the prefix it shares with ``context``, forward the rest, return
        the logits after the last context token."""
        common = 0
        for cached, wanted in zip(cache.cached_tokens, context):
            if cached != wanted:
                break
            common += 1
        common = min(common, len(context) - 1)  # the last token is forwarded to get its logits
        if cache.past_key_values is not None and common < len(cache.cached_tokens):
            # A negative argument removes that many tokens (transformers 5.x).
            cache.past_key_values.crop(common - len(cache.cached_tokens))
            del cache.cached_tokens[common:]
        if common == 0:
            cache.past_key_values, cache.cached_tokens = None, []
        return self._forward(cache, context[common:])

    def _forward(self, cache: _RequestCache, new_tokens: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        if cache.past_key_values is None:
            cache.past_key_values = DynamicCache()
        input_ids = torch.tensor([new_tokens], device=self.device)
        out = self.model(input_ids=input_ids, past_key_values=cache.past_key_values, use_cache=True)
        cache.cached_tokens.extend(new_tokens)
        self.tokens_forwarded += len(new_tokens)
        return out.logits[0, -1].float()

    def _account(self, cache: _RequestCache) -> None:
        """Update the cache's size and evict least-recently-used requests beyond the budget."""
        nbytes = 0
        for layer in getattr(cache.past_key_values, "layers", []):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    nbytes += tensor.numel() * tensor.element_size()
        cache.nbytes = nbytes
        while self.cache_bytes > self.memory_budget_bytes and len(self._caches) > 1:
            self._caches.popitem(last=False)
            self.evictions += 1
