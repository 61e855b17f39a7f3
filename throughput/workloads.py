"""Workloads for benchmarks and the demo: held-out code prompts the demo models never trained on.

``heldout_prompts.json`` ships with the package so that every machine measures the same text;
:func:`make_heldout_prompts` is the recipe that made it (run from the repository root, it needs
``models/`` and the Python standard library the demo models were trained on).
"""

from __future__ import annotations

import json
import os
import random

PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout_prompts.json")


def heldout_prompts(count: int | None = None) -> list[str]:
    """The first ``count`` held-out prompts (all when None)."""
    with open(PROMPTS_FILE) as f:
        prompts = [p["prompt"] for p in json.load(f)["prompts"]]
    if count is not None and count > len(prompts):
        raise ValueError(f"only {len(prompts)} held-out prompts, asked for {count}")
    return prompts[:count]


def make_heldout_prompts(seed: int = 0, limit: int = 48) -> list[dict]:
    """6 lines before a ``def`` and 3 after, two per held-out file, 150–700 characters."""
    from vllm_specplugin.models import corpus

    rng = random.Random(seed)
    prompts = []
    for source in sorted(corpus.load("heldout"), key=lambda f: f.relpath):
        lines = source.text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        rng.shuffle(starts)
        for i in starts[:2]:
            text = "".join(lines[max(0, i - 6): i + 3])
            if 150 <= len(text) <= 700:
                prompts.append({"source": source.relpath, "line": i + 1, "prompt": text})
    return prompts[:limit]


def repetitive_code_prompts(count: int) -> list[str]:
    """Predictable text: a few lines of held-out code repeated, so the continuation repeats too."""
    prompts = []
    for text in heldout_prompts(count):
        lines = [line for line in text.splitlines(keepends=True) if line.strip()][:3]
        prompts.append("".join(lines) * 5)
    return prompts


def unpredictable_prompts(count: int, length: int = 48, vocab_size: int = 4096, seed: int = 0) -> list[list[int]]:
    """Random token ids as prompts. The small family's drafts agree with its target less after
    them; the memory-bound family's distilled draft does not (offline, γ 4, 48 tokens, 4 prompts:
    α 0.975 at T = 0 and 0.92 at T = 1, against 0.914 / 0.956 on held-out code), so on that pair
    they are not a low-acceptance workload."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, length).tolist() for _ in range(count)]


def shared_system_prompt_requests(count: int, system_tokens: int = 240) -> list[str]:
    """``count`` requests that start with one system prompt of about ``system_tokens`` demo tokens
    (held-out code, ~3.6 characters per token) and end with their own held-out prompt."""
    pool = heldout_prompts()
    system = ""
    index = 0
    while len(system) < system_tokens * 3.6:
        system += pool[index % len(pool)]
        index += 1
    system = system[: int(system_tokens * 3.6)]
    return [system + pool[(index + i) % len(pool)] for i in range(count)]
