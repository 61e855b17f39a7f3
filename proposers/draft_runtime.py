"""A draft model with per-request KV caches, drafting for a whole batch of requests at once.

Each request keeps its own cache across steps, so a step forwards only the tokens that are new
since the last one; tokens the target rejected are rolled back by moving the cache's length
back to the longest prefix shared with the request's current context.

A request's keys and values live in one preallocated buffer [layers, 2, kv_heads, capacity,
head_dim] that grows in chunks (``kv_chunk_tokens``, then by half its size), so a step writes
its new tokens in place and never copies a whole cache. A draft step runs every drafting
request in one forward: the new tokens of all rows are packed into one sequence for the matrix
products, and each row's attention reads its own buffer where it lies (proposers/lean_llama.py).
Drafts that the lean forward does not cover go through transformers, which needs one padded
batch: their caches are gathered into it for each forward (a copy, for those drafts only).

Caches live within a memory budget (their capacity, plus the prefix tree and whatever a
proposer reserves per request with :meth:`DraftRuntime.set_resident_bytes`) with
least-recently-used eviction; an evicted request just re-prefills next time.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_specplugin.proposers.base import Draft  # noqa: F401  (re-exported)
from vllm_specplugin.proposers.lean_decode import LeanDecode, OutKernels
from vllm_specplugin.proposers.lean_llama import LeanKernels, LeanLlama, RowAttention
from vllm_specplugin.proposers.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache
from vllm_specplugin.proposers.sampling import SamplingParams, processed_probs, sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Defaults of the DraftRuntime parameters of the same names (documented there).
SOLO_PREFILL_THRESHOLD = 16
KV_CHUNK_TOKENS = 256
LOG_FLOOR = math.log(1e-12)  # the least a scored token's log-probability counts (here and in the ensemble)


class DraftModelError(ValueError):
    """A draft checkpoint that cannot serve the target (missing, or another vocabulary)."""


@dataclass
class _RequestCache:
    cached_tokens: list[int] = field(default_factory=list)  # tokens whose K/V are kv[..., :len, :]
    kv: torch.Tensor | None = None  # [layers, 2 (K, V), kv_heads, capacity, head_dim], model dtype
    shared_chain: list = field(default_factory=list)  # prefix-cache nodes this request holds
    prompt_length: int = 0  # the first context seen: the part worth sharing with other requests
    tracked: bool = False  # in DraftRuntime._caches, so counted in its cache_bytes
    # Bumped whenever the cached context's entries change (a forward that commits, a cut, a
    # shared prefix loaded): token-tree nodes computed before are stale then.
    version: int = 0
    # Token-tree nodes of the current context (DraftBatch.branches_of), kept from one wave of a
    # tree's growth to the next so a path's ancestors are not forwarded again: path (tuple of
    # tokens after the context) -> the scratch entry of its last token; valid while ``version``
    # equals ``tree_version`` and the context has ``tree_base`` tokens; ``tree_end``: next free entry.
    tree_nodes: dict = field(default_factory=dict)
    tree_version: int = -1
    tree_base: int = -1
    tree_end: int = 0

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(eq=False)
class _Row:
    """One row of an open batch: a request (or a token-tree path on top of one)."""

    cache: _RequestCache
    prefix: int  # buffer entries [0, prefix) the row attends to
    position: int  # RoPE position of the row's next token
    # Token-tree rows share their request's buffer: their tokens go to scratch entries past the
    # cached context (``scratch[0]``: the next free one, shared by the request's rows), and
    # ``extra`` lists the row's own entries there.
    scratch: list[int] | None = None
    extra: list[int] = field(default_factory=list)
    added: list[int] = field(default_factory=list)  # tokens forwarded in this batch


def load_causal_lm(path: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    # sdpa takes the custom boolean 4-D masks the padded transformers forward needs.
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    except Exception as error:  # noqa: BLE001 - safetensors, OSError, ValueError...: all mean "cannot load"
        raise DraftModelError(
            f"draft model {path!r} could not be loaded ({type(error).__name__}: {str(error)[:300]}); "
            "is the checkpoint complete (config.json and every weight file, not truncated)?"
        ) from error
    return model.to(device).eval()


def load_vocabulary(path: str) -> dict[int, str] | None:
    """id -> token of the tokenizer at ``path`` (a checkpoint directory, or a model name already
    in the local Hugging Face cache), added tokens included; None when there is none to read."""
    tokenizer_json = os.path.join(path, "tokenizer.json")
    try:
        if os.path.isfile(tokenizer_json):
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(tokenizer_json).get_vocab(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            vocab = AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()
    except Exception:  # no tokenizer files, or files transformers cannot read: nothing to compare
        return None
    return {index: token for token, index in vocab.items()}


def vocabulary_disagreement(draft: dict[int, str], target: dict[int, str], size: int) -> str | None:
    """None when the two tokenizers give every id below ``size`` the same token (or both none),
    else a description of the first id where they differ."""
    for index in range(size):
        if draft.get(index) != target.get(index):
            return f"id {index} is {draft.get(index)!r} for the draft but {target.get(index)!r} for the target"
    return None


class DraftRuntime:
    """One draft model serving many requests, each with its own incremental KV cache.

    Vocabulary: a draft with the target's vocabulary size is accepted as it is. A smaller one is
    accepted when its vocabulary is a prefix of the target's: both tokenizers must be readable
    (the draft's from ``path``, the target's from ``target_path``; by default ``target_name``
    when that is a directory) and give every draft id the same token. Its distributions are then
    padded with zeros to the target's size (``vocab_size`` is the target's; ``draft_vocab_size``
    the draft's own), so ids the draft lacks are never drafted and carry q = 0; context tokens it
    lacks are fed to it as id 0 (its drafts after them are just worse). Anything else is refused
    (:class:`DraftModelError`, naming both models and sizes).

    Tunables:

    - ``solo_prefill_threshold``: a row with more new tokens than this (a fresh prompt, a
      re-prefill after eviction) is forwarded on its own before the batched forward. The prompt's
      whole blocks are then in the prefix tree before the next row of the same batch looks
      there (prefix sharing within one step), and on the transformers path one long row does
      not pad every other row. Lower: more forwards per step; higher: less sharing in the step
      a shared prompt first arrives.
    - ``fast_path``: a forward of one request whose new tokens see its whole cache (every forward
      at batch 1) runs :class:`~vllm_specplugin.proposers.lean_decode.LeanDecode`'s one-row
      path: the same logits, 14-26% less CPU per draft forward on the memory-bound demo draft.
    - ``kv_chunk_tokens``: the smallest KV buffer, and the granularity of its growth (by half
      its capacity, never past the draft's maximum length unless asked to). Larger: fewer
      regrowth copies, more memory held by short requests (capacity counts in the budget).
    """

    def __init__(
        self,
        path: str,
        *,
        target_vocab_size: int | None = None,
        target_name: str = "target",
        target_path: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        memory_budget_mb: float = 512,
        lean_forward: bool = True,
        kernels: LeanKernels | None = None,
        out_kernels: OutKernels | None = None,
        fast_path: bool = True,
        prefix_sharing: bool = False,
        prefix_block_size: int = DEFAULT_BLOCK_SIZE,
        solo_prefill_threshold: int = SOLO_PREFILL_THRESHOLD,
        kv_chunk_tokens: int = KV_CHUNK_TOKENS,
    ):
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise DraftModelError(f"draft model {path!r}: no config.json there (a local checkpoint directory is needed)")
        if solo_prefill_threshold < 0 or kv_chunk_tokens < 1:
            raise ValueError(
                f"need solo_prefill_threshold >= 0 and kv_chunk_tokens >= 1, got {solo_prefill_threshold} "
                f"and {kv_chunk_tokens}"
            )
        config = AutoConfig.from_pretrained(path)
        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self.draft_vocab_size = config.vocab_size
        self.vocab_size = self._check_vocabulary(
            config.vocab_size, target_vocab_size, target_name,
            target_path if target_path is not None else (target_name if os.path.isdir(target_name) else None),
        )
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = torch.device(device)
        self.model = load_causal_lm(path, dtype, device)
        # Llama drafts skip transformers' per-call overhead (same math; see proposers/lean_llama.py).
        # ``kernels``: the lean forward's operations (default torch's; the vLLM adapter passes vLLM's CPU kernels).
        self.lean = (
            LeanLlama(self.model, kernels) if lean_forward and LeanLlama.supports(self.model) else None
        )
        # One request's catch-up and one-token extends (the batch-1 hot path) through
        # preallocated buffers and fewer operations; same kernels, same logits
        # (proposers/lean_decode.py). ``out_kernels``: the out forms matching ``kernels``.
        if self.lean is not None and fast_path:
            self.lean = LeanDecode(self.lean, out_kernels)
        num_heads = config.num_attention_heads
        self._kv_geometry = (
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or num_heads,
            getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        )
        self._kv_dtype = next(self.model.parameters()).dtype
        self.memory_budget_bytes = int(memory_budget_mb * 2**20)
        self.prefix_cache = PrefixCache(prefix_block_size) if prefix_sharing else None
        self.solo_prefill_threshold = solo_prefill_threshold
        self.kv_chunk_tokens = kv_chunk_tokens
        self._caches: OrderedDict[str, _RequestCache] = OrderedDict()
        # Sum of the tracked caches' nbytes, kept as buffers grow and caches leave: the budget is
        # checked after every batch, and a sum over thousands of tracked requests there cost a
        # quarter of the worker's time (6000 requests of n = 3000 samples, tree drafting).
        self._cache_bytes = 0
        self._resident: dict[str, int] = {}  # per request: bytes a proposer keeps beside the KV
        self._resident_bytes = 0  # their sum
        self._too_long_logged: set[str] = set()
        self.tokens_forwarded = 0  # real (unpadded) tokens run through the model, for cost accounting
        self.evictions = 0

    def _check_vocabulary(self, draft_size, target_size, target_name, target_path) -> int:
        """The output vocabulary size (the target's), or :class:`DraftModelError`."""
        if target_size is None or draft_size == target_size:
            return draft_size
        mismatch = f"draft model {self.path!r} has vocabulary size {draft_size}, but {target_name} has {target_size}"
        if draft_size > target_size:
            raise DraftModelError(f"{mismatch}: a draft may not have more token ids than the target")
        draft_vocab = load_vocabulary(self.path)
        target_vocab = load_vocabulary(target_path) if target_path is not None else None
        if draft_vocab is None or target_vocab is None:
            missing = " and ".join(
                name for name, vocab in ((f"the draft ({self.path})", draft_vocab),
                                         (f"the target ({target_path or target_name})", target_vocab))
                if vocab is None
            )
            raise DraftModelError(
                f"{mismatch}: a smaller draft vocabulary is accepted only as a prefix of the target's, "
                f"which needs both tokenizers to compare, and none could be read for {missing}"
            )
        disagreement = vocabulary_disagreement(draft_vocab, target_vocab, draft_size)
        if disagreement is not None:
            raise DraftModelError(
                f"{mismatch}, and the draft's vocabulary is not a prefix of the target's ({disagreement}): "
                "drafts must share the target's tokenizer"
            )
        logger.info(
            "draft model %s: vocabulary of %d ids is a prefix of %s's %d (same tokens); its "
            "distributions are padded with zeros", self.path, draft_size, target_name, target_size,
        )
        return target_size

    # -- request lifecycle -----------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted request's cache (and whatever was reserved for it)."""
        cache = self._caches.pop(request_id, None)
        if cache is not None:
            self._untrack(cache)
            self._unshare(cache)
        self._resident_bytes -= self._resident.pop(request_id, 0)
        self._too_long_logged.discard(request_id)

    @property
    def request_ids(self) -> list[str]:
        return list(self._caches)

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the requests' KV buffers, by capacity (not by the tokens in them)."""
        return self._cache_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes proposers reserved beside the KV (:meth:`set_resident_bytes`)."""
        return self._resident_bytes

    def set_resident_bytes(self, request_id: str, nbytes: int) -> None:
        """Count ``nbytes`` that a proposer keeps for ``request_id`` (say, what its weight update
        needs) in this draft's memory budget, until :meth:`free` or the next call."""
        self._resident_bytes -= self._resident.pop(request_id, 0)
        if nbytes > 0:
            self._resident[request_id] = nbytes
            self._resident_bytes += nbytes

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
        cache = self._caches.pop(request_id, None)
        if cache is None:
            cache = _RequestCache()
            self._cache_bytes += cache.nbytes
            cache.tracked = True
        self._caches[request_id] = cache  # most recently used last
        return cache

    def _untrack(self, cache: _RequestCache) -> None:
        """``cache`` has left ``_caches``."""
        self._cache_bytes -= cache.nbytes
        cache.tracked = False

    @property
    def total_bytes(self) -> int:
        return self.cache_bytes + self.resident_bytes + (self.prefix_cache.nbytes if self.prefix_cache else 0)

    def _enforce_budget(self) -> None:
        if self.prefix_cache is not None and self.total_bytes > self.memory_budget_bytes:
            self.prefix_cache.evict(self.total_bytes - self.memory_budget_bytes)
        while self.total_bytes > self.memory_budget_bytes and len(self._caches) > 1:
            _, cache = self._caches.popitem(last=False)
            self._untrack(cache)
            self._unshare(cache)
            self.evictions += 1

    def _reserve(self, cache: _RequestCache, needed: int) -> None:
        """Grow the cache's buffer to hold at least ``needed`` entries (a copy, only on growth)."""
        capacity = cache.capacity
        if needed <= capacity:
            return
        chunk = self.kv_chunk_tokens
        grown = -(-max(needed, capacity + capacity // 2) // chunk) * chunk
        if needed <= self.max_length:
            grown = min(grown, self.max_length)  # the draft never needs more (room() clips)
        layers, heads, dim = self._kv_geometry
        # Zeros, not empty: attention never weighs unwritten entries, but 0 * NaN would poison it.
        kv = torch.zeros(layers, 2, heads, grown, dim, dtype=self._kv_dtype, device=self.device)
        if cache.kv is not None:
            kv[:, :, :, :capacity] = cache.kv  # everything: token-tree scratch entries too
        if cache.tracked:
            self._cache_bytes += kv.numel() * kv.element_size() - cache.nbytes
        cache.kv = kv

    # -- prefix sharing --------------------------------------------------------------------

    def _start_from_shared_prefix(self, cache: _RequestCache, context: list[int]) -> None:
        """An empty cache starts from the longest shared chain of whole blocks of the context."""
        if self.prefix_cache is None or cache.cached_tokens:
            return
        chain = self.prefix_cache.match(context[:-1])
        if chain:
            length = len(chain) * self.prefix_cache.block_size
            self._reserve(cache, length)
            self.prefix_cache.load_into(chain, cache.kv)
            cache.cached_tokens = list(context[:length])
            cache.version += 1
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
        chain = self.prefix_cache.insert_kv(cache.cached_tokens[:shareable], cache.kv)
        self.prefix_cache.acquire(chain)
        self.prefix_cache.release(cache.shared_chain)
        cache.shared_chain = chain

    def _unshare(self, cache: _RequestCache) -> None:
        if self.prefix_cache is not None and cache.shared_chain:
            self.prefix_cache.release(cache.shared_chain)
            cache.shared_chain = []

    # -- the forward -------------------------------------------------------------------------

    @torch.no_grad()
    def _run(self, rows: list[_Row], tokens: list[list[int]], need_logits: bool = True):
        """Forward ``tokens[i]`` (non-empty) on top of ``rows[i]``, all rows at once; writes their
        K/V into the rows' buffers and advances the rows.

        Returns (logits [B, vocab_size] float32 after each row's last token, final hidden states
        [B, hidden] in the model dtype, or None on the transformers path), or (None, None) when
        ``need_logits`` is False.
        """
        writes = []
        for row, new in zip(rows, tokens):
            if not new:
                raise ValueError("every row of a forward needs at least one token")
            at = row.scratch[0] if row.scratch is not None else row.prefix
            if row.scratch is not None:
                row.scratch[0] += len(new)
            writes.append(at)
        needed: dict[int, tuple[_RequestCache, int]] = {}
        for row, new, at in zip(rows, tokens, writes):
            _, most = needed.get(id(row.cache), (row.cache, 0))
            needed[id(row.cache)] = (row.cache, max(most, at + len(new)))
        for cache, most in needed.values():
            self._reserve(cache, most)
        flat_ids = [t for new in tokens for t in new]
        flat_positions = [row.position + j for row, new in zip(rows, tokens) for j in range(len(new))]
        ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        if self.draft_vocab_size < self.vocab_size:
            ids = ids.masked_fill(ids >= self.draft_vocab_size, 0)  # target tokens the draft lacks
        positions = torch.tensor(flat_positions, dtype=torch.long, device=self.device)
        if self.lean is not None:
            logits, hidden = self._forward_lean(rows, tokens, writes, ids, positions, need_logits)
        else:
            logits, hidden = self._forward_transformers(rows, tokens, writes, ids, positions, need_logits)
        for row, new, at in zip(rows, tokens, writes):
            if row.scratch is None:
                row.prefix += len(new)
                row.cache.version += 1
            else:
                row.extra.extend(range(at, at + len(new)))
            row.position += len(new)
            row.added.extend(new)
        self.tokens_forwarded += len(flat_ids)
        if logits is not None and self.vocab_size > self.draft_vocab_size:
            # Ids the draft lacks: probability 0 under every processing (softmax of -inf).
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - self.draft_vocab_size), value=float("-inf"))
        return logits, hidden

    def _row_mask(self, row: _Row, n: int, at: int) -> torch.Tensor | None:
        """[n, at + n] bool, or None for the common case: the row sees every entry before its
        new tokens, and those causally."""
        if row.scratch is None:
            return None
        mask = torch.zeros(n, at + n, dtype=torch.bool, device=self.device)
        mask[:, :row.prefix] = True
        if row.extra:
            mask[:, row.extra] = True
        mask[:, at:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        return mask

    def _forward_lean(self, rows, tokens, writes, ids, positions, need_logits):
        attention, ends, end = [], [], 0
        for row, new, at in zip(rows, tokens, writes):
            n = len(new)
            mask = self._row_mask(row, n, at)
            previous = attention[-1] if attention else None
            if (mask is not None and previous is not None and previous.mask is not None
                    and previous.kv is row.cache.kv and previous.keys == at):
                # The next path of the same request's tree, written right after the previous
                # one: one attention row with both masks (a wave of a tree is then one row, which
                # the one-row fast path takes at batch 1), not one attention call per path.
                merged = torch.zeros(previous.n + n, at + n, dtype=torch.bool, device=self.device)
                merged[:previous.n, :previous.keys] = previous.mask
                merged[previous.n:] = mask
                attention[-1] = RowAttention(row.cache.kv, previous.n + n, previous.write_at, at + n, merged)
            else:
                attention.append(RowAttention(row.cache.kv, n, at, at + n, mask))
            end += n
            ends.append(end - 1)
        last = torch.tensor(ends, dtype=torch.long, device=self.device) if need_logits else None
        return self.lean.forward_rows(ids, positions, attention, last)

    def _forward_transformers(self, rows, tokens, writes, ids, positions, need_logits):
        """The padded batch transformers needs: row layout [pad][visible cache][pad][new tokens],
        so every row's last token is in the last column. Copies each row's cache in (drafts
        without the lean forward only) and writes the new K/V back into its buffer."""
        from transformers import DynamicCache

        device = self.device
        visible = [list(range(row.prefix)) + row.extra for row in rows]
        past = max(len(v) for v in visible)
        width = max(len(new) for new in tokens)
        batch = len(rows)
        valid = torch.zeros(batch, past + width, dtype=torch.bool, device=device)
        padded_ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        padded_positions = torch.zeros(batch, width, dtype=torch.long, device=device)
        start = 0
        for index, (seen, new) in enumerate(zip(visible, tokens)):
            n = len(new)
            valid[index, past - len(seen):past] = True
            valid[index, past + width - n:] = True
            padded_ids[index, width - n:] = ids[start:start + n]
            padded_positions[index, width - n:] = positions[start:start + n]
            start += n
        query_columns = torch.arange(past, past + width, device=device)
        causal = torch.arange(past + width, device=device)[None, :] <= query_columns[:, None]
        mask = causal[None] & valid[:, None, :]
        mask[:, torch.arange(width), query_columns] = True  # a padding query sees itself: no NaN
        cache = DynamicCache()
        if past:
            layers, heads, dim = self._kv_geometry
            for layer in range(layers):
                keys = torch.zeros(batch, heads, past, dim, dtype=self._kv_dtype, device=device)
                values = torch.zeros_like(keys)
                for index, (row, seen) in enumerate(zip(rows, visible)):
                    if not seen:
                        continue
                    kv = row.cache.kv[layer]
                    if row.extra:
                        kv = kv.index_select(2, torch.tensor(seen, device=device))
                    keys[index, :, past - len(seen):] = kv[0, :, :len(seen)]
                    values[index, :, past - len(seen):] = kv[1, :, :len(seen)]
                cache.update(keys, values, layer)
        out = self.model(
            input_ids=padded_ids,
            position_ids=padded_positions,
            attention_mask=mask[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        for layer, cached in enumerate(cache.layers):
            if tuple(cached.keys.shape[1::2]) != tuple(self._kv_geometry[1:]):
                raise DraftModelError(
                    f"draft model {self.path!r}: its attention caches keys of shape {tuple(cached.keys.shape)}, "
                    f"not [batch, {self._kv_geometry[1]}, length, {self._kv_geometry[2]}] as its config says"
                )
            for index, (row, new, at) in enumerate(zip(rows, tokens, writes)):
                n = len(new)
                row.cache.kv[layer, 0, :, at:at + n] = cached.keys[index, :, past + width - n:]
                row.cache.kv[layer, 1, :, at:at + n] = cached.values[index, :, past + width - n:]
        if not need_logits:
            return None, None
        return out.logits[:, -1].float(), None

    def token_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N] float32 of ``tokens`` [N] (int64, target ids) after final hidden states
        [N, hidden] from :attr:`DraftBatch.hidden` (lean drafts only); -inf for ids the draft
        lacks."""
        inside = tokens < self.draft_vocab_size
        logits = self.lean.token_logits(hidden, tokens.clamp(max=self.draft_vocab_size - 1))
        return logits.masked_fill(~inside, float("-inf"))

    @torch.no_grad()
    def mean_log_likelihood(self, tokens: Sequence[int]) -> float:
        """Mean log q(t[i + 1] | t[..i]) over ``tokens`` (target ids, at least 2): how well this draft
        predicts a text, for routing a request to the draft that fits its prompt
        (:class:`~vllm_specplugin.proposers.ensemble.EnsembleProposer`'s ``route``). One forward of
        ``tokens`` alone through the checkpoint's own model: no request's cache is read or written.
        A token the draft lacks counts as log 1e-12."""
        if len(tokens) < 2:
            raise ValueError(f"need at least 2 tokens to score, got {len(tokens)}")
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        inputs = ids.masked_fill(ids >= self.draft_vocab_size, 0)[None, :-1]
        logits = self.model(input_ids=inputs, use_cache=False).logits[0].float()  # [n - 1, draft V]
        targets = ids[1:]
        inside = targets < self.draft_vocab_size
        chosen = logits.log_softmax(-1).gather(-1, targets.clamp(max=self.draft_vocab_size - 1)[:, None])[:, 0]
        return float(chosen.masked_fill(~inside, LOG_FLOOR).clamp_min(LOG_FLOOR).mean())

    @torch.no_grad()
    def _prefill_alone(self, cache: _RequestCache, tokens: list[int]) -> None:
        """Forward ``tokens`` for one request outside the batch (long prompts)."""
        length = len(cache.cached_tokens)
        self._run([_Row(cache, prefix=length, position=length)], [tokens], need_logits=False)
        cache.cached_tokens.extend(tokens)

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
            token = int(probs.argmax()) if params.greedy else int(sample(probs, generator))
            tokens.append(token)
            rows.append(probs)
            if step + 1 < gamma:
                logits = batch.extend([token])[0]
        batch.close()
        return Draft(tokens, torch.stack(rows))


class DraftBatch:
    """The requests drafting this step on one draft model, forwarded together.

    ``logits`` [len(rows), vocab_size] float32 and ``hidden`` ([len(rows), hidden] in the model
    dtype; None on the transformers path) belong to the last forward, whose rows (indices into
    the batch) are ``rows``: every row at first, the rows :meth:`extend` was given after that.
    """

    def __init__(self, runtime: DraftRuntime, request_ids: list[str], contexts: list[list[int]]):
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("a request can be in a batch only once")
        rows, new_tokens = [], []
        for request_id, context in zip(request_ids, contexts):
            if not context:
                raise ValueError("cannot draft after an empty context")
            cache = runtime._take_cache(request_id)
            _rollback(cache, context)
            if not cache.cached_tokens:
                runtime._unshare(cache)
                runtime._start_from_shared_prefix(cache, context)
            if not cache.prompt_length:
                cache.prompt_length = len(context)
            pending = context[len(cache.cached_tokens):]
            if len(pending) > runtime.solo_prefill_threshold:
                runtime._prefill_alone(cache, pending[:-1])
                runtime._share(cache)
                pending = pending[-1:]
            length = len(cache.cached_tokens)
            rows.append(_Row(cache, prefix=length, position=length))
            new_tokens.append(pending)
        self._setup(runtime, request_ids, rows, writable=True)
        self._forward(list(range(len(rows))), new_tokens)

    @classmethod
    def branches(cls, runtime: DraftRuntime, request_id: str, context: list[int], paths: list[list[int]]) -> DraftBatch:
        """One row per path: ``context + path``, on top of the request's cache (for token trees).

        Read-only: ``close()`` leaves the request's cache holding exactly ``context``. The paths'
        K/V go to scratch entries of the request's buffer past the context, each row masked to
        its own.
        """
        return cls.branches_of(runtime, [(request_id, context, paths)])

    @classmethod
    def branches_of(cls, runtime: DraftRuntime,
                    items: Sequence[tuple[str, list[int], list[list[int]]]]) -> DraftBatch:
        """:meth:`branches` for several requests in one forward: ``items`` are (request id,
        context, paths), each request at most once; the rows are items[0]'s paths in order, then
        items[1]'s, and so on.

        A path whose ancestors were computed by an earlier call on the same context (the waves of
        one tree's growth) forwards only its new tokens, attending to those ancestors' scratch
        entries: a tree grown one level per call costs one token per node, as a chain does, not
        its depth in tokens."""
        request_ids = [request_id for request_id, _, _ in items]
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("a request can be in a batch only once")
        rows, row_ids, row_new, recorded = [], [], [], []
        for request_id, context, paths in items:
            if not context or not paths or not all(paths):
                raise ValueError("branches need a context and non-empty paths")
            cache = runtime._take_cache(request_id)
            _rollback(cache, context, keep_last_uncached=False)
            if len(cache.cached_tokens) < len(context):
                runtime._prefill_alone(cache, context[len(cache.cached_tokens):])
            length = len(cache.cached_tokens)
            if cache.tree_version != cache.version or cache.tree_base != length:
                cache.tree_nodes, cache.tree_version, cache.tree_base, cache.tree_end = {}, cache.version, length, length
            scratch = [cache.tree_end]  # shared by the request's rows: each writes past the previous
            for path in paths:
                path = tuple(path)
                known = len(path) - 1  # the longest computed proper prefix (its last token is always forwarded)
                while known and path[:known] not in cache.tree_nodes:
                    known -= 1
                ancestors = [cache.tree_nodes[path[:j]] for j in range(1, known + 1)]
                rows.append(_Row(cache, prefix=length, position=length + known, scratch=scratch, extra=ancestors))
                row_new.append(list(path[known:]))
                recorded.append((cache, path, known))
            row_ids += [request_id] * len(paths)
        batch = cls.__new__(cls)
        batch._setup(runtime, row_ids, rows, writable=False)
        batch._forward(list(range(len(rows))), row_new)
        for row, (cache, path, known) in zip(rows, recorded):
            for depth, entry in enumerate(row.extra[known:], start=known + 1):
                cache.tree_nodes[path[:depth]] = entry
            cache.tree_end = max(cache.tree_end, row.scratch[0])
        return batch

    def _setup(self, runtime: DraftRuntime, request_ids: list[str], rows: list[_Row], writable: bool) -> None:
        self.runtime = runtime
        self.request_ids = request_ids
        self.writable = writable
        self._rows = rows

    def _forward(self, rows: list[int], tokens: list[list[int]]) -> None:
        self.logits, self.hidden = self.runtime._run([self._rows[i] for i in rows], tokens)
        self.rows = rows

    def extend(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> torch.Tensor:
        """Append one token to each of ``rows`` (default: every row; others stay where they are);
        returns their next-token logits [len(rows), vocab_size]."""
        rows = list(range(len(self._rows))) if rows is None else list(rows)
        if len(tokens) != len(rows):
            raise ValueError(f"{len(tokens)} tokens for {len(rows)} rows")
        self._forward(rows, [[int(t)] for t in tokens])
        return self.logits

    def close(self) -> None:
        """Commit the rows' tokens to their requests' caches (their K/V are in place already)
        and apply the memory budget. A batch never closed leaves the caches as they were."""
        if self.writable:
            for row in self._rows:
                row.cache.cached_tokens.extend(row.added)
                self.runtime._share(row.cache)
        self._rows = []
        self.runtime._enforce_budget()


def _rollback(cache: _RequestCache, context: list[int], keep_last_uncached: bool = True) -> None:
    """Cut the cache to the prefix it shares with ``context`` (its buffer stays, entries past the
    new length are just unused); by default the last context token stays uncached, since its
    logits are needed."""
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
    if common < len(cached):
        cache.version += 1
    del cache.cached_tokens[common:]
