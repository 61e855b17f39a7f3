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
    from models import corpus

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
