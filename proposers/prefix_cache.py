"""Draft KV shared across requests with a common token prefix: a radix tree over token blocks.

Each node holds one block of ``block_size`` tokens and its K/V ([layers, 2 (K, V), heads, block,
dim], the layout of a request's KV buffer in proposers/draft_runtime.py); a path from the root
spells a token prefix. A request whose cache is empty (new, evicted or rolled back to nothing)
starts from the longest chain of whole blocks matching its context, so a system prompt shared by
many requests is forwarded through the draft once. Live requests hold references to the nodes
they used; only unreferenced leaves are evicted, least recently used first, when the draft's
memory budget is exceeded. K/V are copied in and out, once per block: into the tree when a
prompt is first cached, into a request's buffer when it starts from a match. So a request's
buffer is always its own and sharing never changes its semantics (and exactness never depends
on it: q is still what was sampled from).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_SIZE = 16


@dataclass(eq=False)
class _Node:
    block: tuple[int, ...]
    parent: _Node | None
    kv: torch.Tensor | None  # [layers, 2, heads, block_size, dim]; None at the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    refcount: int = 0
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) [heads, block_size, dim] (views)."""
        return [] if self.kv is None else [(layer[0], layer[1]) for layer in self.kv]


class PrefixCache:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root = _Node((), None, None)
        self._clock = itertools.count(1)
        self.nbytes = 0
        self.num_blocks = 0
        self.hit_tokens = 0  # tokens served from the tree instead of forwarded
        self.evicted_blocks = 0

    def match(self, tokens: list[int]) -> list[_Node]:
        """The longest chain of whole blocks that starts ``tokens``."""
        node, chain, size = self._root, [], self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            child = node.children.get(tuple(tokens[start:start + size]))
            if child is None:
                break
            child.last_used = next(self._clock)
            chain.append(child)
            node = child
        return chain

    def load(self, chain: list[_Node]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Concatenated K/V of a matched chain (a copy: per layer [heads, len, dim])."""
        self.hit_tokens += len(chain) * self.block_size
        kv = torch.cat([n.kv for n in chain], 3)
        return [(layer[0], layer[1]) for layer in kv]

    def load_into(self, chain: list[_Node], kv: torch.Tensor) -> None:
        """Copy a matched chain's K/V into entries [0, len(chain) * block_size) of a request's
        buffer ``kv`` [layers, 2, heads, >= that, dim]."""
        self.hit_tokens += len(chain) * self.block_size
        size = self.block_size
        for index, node in enumerate(chain):
            kv[:, :, :, index * size:(index + 1) * size] = node.kv

    def insert(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[_Node]:
        """:meth:`insert_kv` with per-layer (K, V) [heads, >= len, dim]."""
        return self.insert_kv(tokens, torch.stack([torch.stack([k, v]) for k, v in layers]))

    def insert_kv(self, tokens: list[int], kv: torch.Tensor) -> list[_Node]:
        """Add the whole blocks of ``tokens`` (whose K/V are ``kv`` [layers, 2, heads, >= len, dim])
        that the tree lacks; returns the chain of nodes covering them."""
        node, chain, size = self._root, [], self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = tuple(tokens[start:start + size])
            child = node.children.get(block)
            if child is None:
                child = _Node(block, node, kv[:, :, :, start:start + size].clone())
                node.children[block] = child
                self.nbytes += child.nbytes
                self.num_blocks += 1
            child.last_used = next(self._clock)
            chain.append(child)
            node = child
        return chain

    @staticmethod
    def acquire(chain: list[_Node]) -> None:
        for node in chain:
            node.refcount += 1

    @staticmethod
    def release(chain: list[_Node]) -> None:
        for node in chain:
            node.refcount -= 1

    def evict(self, bytes_to_free: int) -> int:
        """Drop unreferenced leaves, least recently used first, until ``bytes_to_free`` are freed."""
        freed = 0
        while freed < bytes_to_free:
            leaves = [n for n in self._nodes() if not n.children and n.refcount == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.block]
            freed += victim.nbytes
            self.nbytes -= victim.nbytes
            self.num_blocks -= 1
            self.evicted_blocks += 1
        return freed

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
