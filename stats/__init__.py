"""Pure statistics for testing speculative-decoding exactness and speed.

numpy/scipy only. Functions return frozen result objects in the style of
``scipy.stats`` (``statistic``, ``pvalue`` and more fields).

The names below load their module on first use (PEP 562): importing one module, such as
``vllm_specplugin.stats.speedup`` (numpy only, which the serving proposers use), does not import
scipy, which serving does not need (tests/test_serve_imports.py).
"""

from __future__ import annotations

import importlib

_NAMES = {
    "chain": ("ChainResult", "NodeResult", "chain_test", "combine_chain_results"),
    "gof": ("Binning", "GofResult", "counts_from_samples", "gof_test", "probability_bins", "williams_q"),
    "homogeneity": ("HomogeneityResult", "homogeneity_test"),
    "multitest": ("holm", "holm_reject"),
    "power": ("chain_power", "chain_power_for_tv", "chisquare_power", "cohens_w", "min_detectable_tv",
              "power_for_tv", "sample_size_for_tv"),
    "speedup": ("AcceptanceResult", "acceptance_rate", "empirical_acceptance", "expected_speedup",
                "expected_tokens_by_position", "expected_tokens_per_step", "optimal_gamma"),
    "tv": ("TvResult", "tv_distance", "tv_estimate"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
