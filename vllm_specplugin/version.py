"""Which vLLM versions the plugin's runtime patches were written against.

The proposers themselves only use vLLM's public ``custom_class`` interface. The runtime
patches (the CPU sampler repair, the runner shim) touch internals, so they are applied
only on versions listed here; on any other version the plugin says so once and skips them.
"""

from __future__ import annotations

import re

# Versions whose internals the patches were read against and tested on.
TESTED_VLLM_SERIES = ("0.32",)
# Versions whose CPU build ships the broken expand_kernel fallback (vllm-project/vllm#55005).
CPU_EXPAND_BUG_VERSIONS = ("0.32.0",)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _release(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0'."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version


def is_tested_version(version: str | None = None) -> bool:
    release = _release(version or vllm_version())
    return any(release == s or release.startswith(s + ".") for s in TESTED_VLLM_SERIES)


def has_known_cpu_expand_bug(version: str | None = None) -> bool:
    return _release(version or vllm_version()) in CPU_EXPAND_BUG_VERSIONS
