"""Embedded demo model family for vllm-specplugin.

A small Llama target LM and three draft LMs trained reproducibly on CPU from
the Python standard library's source.  Rebuild with ``python -m models.build``
(run from the repo root); the checkpoints live in ``models/demo/<name>/``.
"""

from pathlib import Path

from vllm_specplugin.paths import demo_model

# In a checkout its models/demo; from a wheel $SPECPLUGIN_MODELS_DIR/demo or ./models/demo
# (vllm_specplugin/paths.py): never inside the installed package.
DEMO_DIR = Path(demo_model("demo"))
TARGET = "target"
DRAFTS = ("draft-small", "draft-distill", "draft-tiny")
ALL = (TARGET, *DRAFTS)


def checkpoint(name: str) -> Path:
    """Path of a demo checkpoint dir, e.g. ``checkpoint("target")``."""
    return DEMO_DIR / name
