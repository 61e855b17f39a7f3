"""One logger for the plugin, printed in vLLM's format, with once-per-process messages."""

from __future__ import annotations

import logging

_seen: set[str] = set()


def get_logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.specplugin")
    except ImportError:  # vLLM missing: plain logging
        return logging.getLogger("vllm.specplugin")


def log_once(level: str, message: str) -> None:
    """Log ``message`` at most once per process (plugins run in every vLLM process)."""
    if message in _seen:
        return
    _seen.add(message)
    getattr(get_logger(), level)(message)
