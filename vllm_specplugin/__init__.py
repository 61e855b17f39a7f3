"""vLLM plugin: speculative-decoding proposers and the runtime repairs they need.

This is the only package of the project that imports vLLM internals. ``register`` is the
``vllm.general_plugins`` entry point; vLLM calls it in every process, possibly more than once.
"""

from __future__ import annotations

__all__ = ["__version__", "register"]

# Kept equal to [project] version in pyproject.toml (tests/test_metadata.py checks it).
__version__ = "0.1.0"


def register() -> None:
    """Entry point for ``vllm.general_plugins``. Idempotent."""
    from vllm_specplugin import install

    install.install()
