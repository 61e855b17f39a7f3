"""A draft model with per-request KV caches, drafting for a whole batch of requests at once.

Each request keeps its own cache across steps, so a step forwards only the tokens that are new
since the last one; tokens the target rejected are rolled back by cutting the cache to the
longest prefix shared with the request's current context. A draft step runs every drafting
request in one forward: the caches are left-padded into one batch and a 4-D attention mask
hides the padding (lengths are ragged, so there are holes between a row's cache and its new
tokens). Caches live within a memory budget with least-recently-used eviction; an evicted
request just re-prefills next time.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_specplugin.proposers.base import Draft  # noqa: F401  (re-exported)
from vllm_specplugin.proposers.lean_llama import LeanLlama
from vllm_specplugin.proposers.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache, kv_nbytes
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A row with more new tokens than this (a fresh prompt, a re-prefill after eviction) is forwarded
# on its own first, so that one long prompt does not pad every other row of the batch.
SOLO_PREFILL_THRESHOLD = 16


class DraftModelError(ValueError):
    """A draft checkpoint that cannot serve the target (missing, or another vocabulary)."""


@dataclass
class _RequestCache:
    cached_tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in `layers`
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [heads, len, dim]
    nbytes: int = 0
    shared_chain: list = field(default_factory=list)  # prefix-cache nodes this request holds
    prompt_length: int = 0  # the first context seen: the part worth sharing with other requests


def load_causal_lm(path: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    # sdpa takes the custom boolean 4-D masks the batched forward needs.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device).eval()


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
        lean_forward: bool = True,
        prefix_sharing: bool = False,
        prefix_block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise DraftModelError(f"draft model {path!r}: no config.json there (a local checkpoint directory is needed)")
        config = AutoConfig.from_pretrained(path)
        if target_vocab_size is not None and config.vocab_size != target_vocab_size:
            raise DraftModelError(
                f"draft model {path!r} has vocabulary size {config.vocab_size}, but {target_name} has "
                f"{target_vocab_size}: drafts must share the target's tokenizer"
            )
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self.vocab_size = config.vocab_size
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = torch.device(device)
        self.model = load_causal_lm(path, dtype, device)
        # Llama drafts skip transformers' per-call overhead (same math; see proposers/lean_llama.py).
        self.lean = LeanLlama(self.model) if lean_forward and LeanLlama.supports(self.model) else None
        self.memory_budget_bytes = int(memory_budget_mb * 2**20)
        self.prefix_cache = PrefixCache(prefix_block_size) if prefix_sharing else None
        self._caches: OrderedDict[str, _RequestCache] = OrderedDict()
        self._too_long_logged: set[str] = set()
        self.tokens_forwarded = 0  # real (unpadded) tokens run through the model, for cost accounting
        self.evictions = 0

    # -- request lifecycle -----------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted request's cache."""
        cache = self._caches.pop(request_id, None)
        if cache is not None:
            self._unshare(cache)
        self._too_long_logged.discard(request_id)

    @property
    def request_ids(self) -> list[str]:
        return list(self._caches)

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self._caches.values())

    def room(self, request_id: str, context_length: int, gamma: int) -> int:
        """Draft tokens that fit after the context within the draft's maximum length.

        Says once per request, in the log, when nothing fits (the request then decodes plainly).
        """
        room = max(0, min(gamma, self.max_length - context_length))
        if room == 0 and gamma > 0 and request_id not in self._too_long_logged:
            self._too_long_logged.add(request_id)
            logger.warning(
                "request %s: context of %d tokens reaches the draft model's maximum length %d "
                "(%s); proposing no draft tokens for it (plain decoding continues).",
                request_id, context_length, self.max_length, self.path,
            )
        return room

    # -- batched forwards ------------------------------------------------------------------

    def open_batch(self, request_ids: Sequence[str], contexts: Sequence[Sequence[int]]) -> DraftBatch:
        """Bring each request's cache up to its context; the batch's ``logits`` are the next-token
        logits after each context. Extend with :meth:`DraftBatch.extend`, then ``close()``."""
        return DraftBatch(self, list(request_ids), [list(c) for c in contexts])

    def _take_cache(self, request_id: str) -> _RequestCache:
        cache = self._caches.pop(request_id, None) or _RequestCache()
        self._caches[request_id] = cache  # most recently used last
        return cache

    @property
    def total_bytes(self) -> int:
        return self.cache_bytes + (self.prefix_cache.nbytes if self.prefix_cache else 0)

    def _enforce_budget(self) -> None:
        if self.prefix_cache is not None and self.total_bytes > self.memory_budget_bytes:
            self.prefix_cache.evict(self.total_bytes - self.memory_budget_bytes)
        while self.total_bytes > self.memory_budget_bytes and len(self._caches) > 1:
            _, cache = self._caches.popitem(last=False)
            self._unshare(cache)
            self.evictions += 1

    # -- prefix sharing --------------------------------------------------------------------

    def _start_from_shared_prefix(self, cache: _RequestCache, context: list[int]) -> None:
        """An empty cache starts from the longest shared chain of whole blocks of the context."""
        if self.prefix_cache is None or cache.cached_tokens:
            return
        chain = self.prefix_cache.match(context[:-1])
        if chain:
            cache.layers = self.prefix_cache.load(chain)
            cache.cached_tokens = list(context[: len(chain) * self.prefix_cache.block_size])
            self.prefix_cache.acquire(chain)
            cache.shared_chain = chain

    def _share(self, cache: _RequestCache) -> None:
        """Offer the whole blocks of the request's prompt to other requests (once they are cached)."""
        if self.prefix_cache is None:
            return
        shareable = min(cache.prompt_length, len(cache.cached_tokens))
        block = self.prefix_cache.block_size
        if shareable // block <= len(cache.shared_chain):
            return
        chain = self.prefix_cache.insert(cache.cached_tokens[:shareable], cache.layers)
        self.prefix_cache.acquire(chain)
        self.prefix_cache.release(cache.shared_chain)
        cache.shared_chain = chain

    def _unshare(self, cache: _RequestCache) -> None:
        if self.prefix_cache is not None and cache.shared_chain:
            self.prefix_cache.release(cache.shared_chain)
            cache.shared_chain = []

    @torch.no_grad()
    def _forward_padded(self, layers, valid: torch.Tensor, input_ids, positions):
        """One forward of ``input_ids`` [B, n] on top of padded caches ``layers`` (None: empty).

        ``valid`` [B, past + n] marks real positions. Returns logits [B, n, V] and the new layers.
        """
        past = 0 if layers is None else layers[0][0].shape[2]
        n = input_ids.shape[1]
        query_columns = torch.arange(past, past + n, device=self.device)
        key_columns = torch.arange(past + n, device=self.device)
        causal = key_columns[None, :] <= query_columns[:, None]  # [n, past + n]
        mask = causal[None] & valid[:, None, :]
        # A padding query sees at least itself, so no softmax row is empty (no NaN).
        mask[:, torch.arange(n), query_columns] = True
        if self.lean is not None:
            logits, new_layers = self.lean.forward(input_ids, positions, layers, mask[:, None])
            return logits.float(), new_layers
        from transformers import DynamicCache

        cache = DynamicCache()
        for index, (keys, values) in enumerate(layers or []):
            cache.update(keys, values, index)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        new_layers = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits.float(), new_layers

    @torch.no_grad()
    def _prefill_alone(self, cache: _RequestCache, tokens: list[int]) -> None:
        """Forward ``tokens`` for one request outside the batch (long prompts)."""
        layers = [(k[None], v[None]) for k, v in cache.layers] or None
        past = len(cache.cached_tokens)
        valid = torch.ones(1, past + len(tokens), dtype=torch.bool, device=self.device)
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(past, past + len(tokens), device=self.device)[None]
        _, new_layers = self._forward_padded(layers, valid, ids, positions)
        cache.layers = [(k[0], v[0]) for k, v in new_layers]
        cache.cached_tokens.extend(tokens)
        self.tokens_forwarded += len(tokens)

    # -- one request at a time (tests, tools) ----------------------------------------------

    def draft(
        self,
        request_id: str,
        context: Sequence[int],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """Draft up to ``gamma`` tokens after ``context`` (the request's full token ids) with this
        one model; clipped to the draft's maximum length (nothing when the context fills it)."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        gamma = self.room(request_id, len(context), gamma)
        if gamma == 0 or not context:
            return Draft([], torch.empty(0, self.vocab_size))
        batch = self.open_batch([request_id], [context])
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        logits = batch.logits[0]
        for step in range(gamma):
            probs = processed_probs(logits, params)
            token = int(probs.argmax()) if params.greedy else int(sample(probs.unsqueeze(0), generator))
            tokens.append(token)
            rows.append(probs)
            if step + 1 < gamma:
                logits = batch.extend([token])[0]
        batch.close()
        return Draft(tokens, torch.stack(rows))


class DraftBatch:
    """The requests drafting this step, as one left-padded batch on one draft model."""

    def __init__(self, runtime: DraftRuntime, request_ids: list[str], contexts: list[list[int]]):
        caches = [runtime._take_cache(rid) for rid in request_ids]
        new_tokens: list[list[int]] = []
        for cache, context in zip(caches, contexts):
            if not context:
                raise ValueError("cannot draft after an empty context")
            _rollback(cache, context)
            if not cache.cached_tokens:
                runtime._unshare(cache)
                runtime._start_from_shared_prefix(cache, context)
            if not cache.prompt_length:
                cache.prompt_length = len(context)
            pending = context[len(cache.cached_tokens):]
            if len(pending) > SOLO_PREFILL_THRESHOLD:
                runtime._prefill_alone(cache, pending[:-1])
                runtime._share(cache)
                pending = pending[-1:]
            new_tokens.append(pending)
        self._build(runtime, request_ids, caches, new_tokens, writable=True)

    @classmethod
    def branches(cls, runtime: DraftRuntime, request_id: str, context: list[int], paths: list[list[int]]) -> DraftBatch:
        """One row per path: ``context + path``, on top of the request's cache (for token trees).

        Read-only: ``close()`` leaves the request's cache holding exactly ``context``.
        """
        if not context or not paths or not all(paths):
            raise ValueError("branches need a context and non-empty paths")
        cache = runtime._take_cache(request_id)
        _rollback(cache, context, keep_last_uncached=False)
        if len(cache.cached_tokens) < len(context):
            runtime._prefill_alone(cache, context[len(cache.cached_tokens):])
        batch = cls.__new__(cls)
        batch._build(runtime, [request_id] * len(paths), [cache] * len(paths), [list(p) for p in paths], writable=False)
        return batch

    def _build(self, runtime, request_ids, caches, new_tokens, writable: bool) -> None:
        self.runtime = runtime
        self.request_ids = request_ids
        self.writable = writable
        device = runtime.device
        self._caches = caches
        batch_size = len(caches)
        past = max(len(c.cached_tokens) for c in caches)
        width = max(len(t) for t in new_tokens)
        # Row layout: [pad][cache][pad][new tokens], so every row's last token is in the last column.
        valid = torch.zeros(batch_size, past + width, dtype=torch.bool, device=device)
        ids = torch.zeros(batch_size, width, dtype=torch.long, device=device)
        positions = torch.zeros(batch_size, width, dtype=torch.long, device=device)
        for row, (cache, tokens) in enumerate(zip(caches, new_tokens)):
            length = len(cache.cached_tokens)
            valid[row, past - length:past] = True
            valid[row, past + width - len(tokens):] = True
            ids[row, width - len(tokens):] = torch.tensor(tokens, device=device)
            positions[row, width - len(tokens):] = torch.arange(length, length + len(tokens), device=device)
        layers = None
        if past > 0:
            layers = []
            for index in range(_num_layers(caches, runtime)):
                keys, values = _left_pad([c.layers[index] if c.layers else None for c in caches], past, runtime)
                layers.append((keys, values))
        logits, self._layers = runtime._forward_padded(layers, valid, ids, positions)
        runtime.tokens_forwarded += sum(len(t) for t in new_tokens)
        self._valid = valid
        self._next_positions = positions[:, -1] + 1
        self._added = [list(t) for t in new_tokens]
        self.logits = logits[:, -1]  # [B, V]

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token per row; returns the next-token logits [B, V]."""
        runtime = self.runtime
        device = runtime.device
        ids = torch.tensor(list(tokens), device=device)[:, None]
        self._valid = torch.cat([self._valid, torch.ones(len(tokens), 1, dtype=torch.bool, device=device)], 1)
        logits, self._layers = runtime._forward_padded(self._layers, self._valid, ids, self._next_positions[:, None])
        self._next_positions = self._next_positions + 1
        for row, token in enumerate(tokens):
            self._added[row].append(int(token))
        runtime.tokens_forwarded += len(tokens)
        self.logits = logits[:, -1]
        return self.logits

    def close(self) -> None:
        """Split the batch back into per-request caches and apply the memory budget."""
        if not self.writable:
            self._layers = []
            self.runtime._enforce_budget()
            return
        for row, cache in enumerate(self._caches):
            keep = self._valid[row].nonzero().squeeze(-1)
            cache.layers = [(k[row].index_select(1, keep), v[row].index_select(1, keep)) for k, v in self._layers]
            cache.cached_tokens.extend(self._added[row])
            cache.nbytes = kv_nbytes(cache.layers)
            self.runtime._share(cache)
        self._layers = []
        self.runtime._enforce_budget()


def _num_layers(caches: list[_RequestCache], runtime: DraftRuntime) -> int:
    for cache in caches:
        if cache.layers:
            return len(cache.layers)
    return runtime.model.config.num_hidden_layers


def _left_pad(per_row, past: int, runtime: DraftRuntime) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-request [heads, len, dim] K/V into [B, heads, past, dim], real entries last."""
    template = next(kv for kv in per_row if kv is not None)[0]
    heads, _, dim = template.shape
    keys = template.new_zeros(len(per_row), heads, past, dim)
    values = template.new_zeros(len(per_row), heads, past, dim)
    for row, kv in enumerate(per_row):
        if kv is None:
            continue
        length = kv[0].shape[1]
        keys[row, :, past - length:] = kv[0]
        values[row, :, past - length:] = kv[1]
    return keys, values


def _rollback(cache: _RequestCache, context: list[int], keep_last_uncached: bool = True) -> None:
    """Cut the cache to the prefix it shares with ``context``; by default the last context token
    stays uncached, since its logits are needed."""
    cached = cache.cached_tokens
    # Contexts change at the tail: compare the long head in one C-level slice comparison.
    head = max(0, min(len(cached), len(context)) - 16)
    common = head if cached[:head] == context[:head] else 0
    for have, wanted in zip(cached[common:], context[common:]):
        if have != wanted:
            break
        common += 1
    if keep_last_uncached:
        common = min(common, len(context) - 1)
    if common < len(cache.cached_tokens):
        del cache.cached_tokens[common:]
        cache.layers = [(k[:, :common], v[:, :common]) for k, v in cache.layers] if common else []
