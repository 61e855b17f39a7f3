"""Pure statistics for testing speculative-decoding exactness and speed.

numpy/scipy only. Functions return frozen result objects in the style of
``scipy.stats`` (``statistic``, ``pvalue`` and more fields).
"""

from .chain import ChainResult, NodeResult, chain_test, combine_chain_results
from .gof import (Binning, GofResult, counts_from_samples, gof_test, probability_bins,
                  williams_q)
from .homogeneity import HomogeneityResult, homogeneity_test
from .multitest import holm, holm_reject
from .power import (chain_power, chain_power_for_tv, chisquare_power, cohens_w,
                    min_detectable_tv, power_for_tv, sample_size_for_tv)
from .speedup import (AcceptanceResult, acceptance_rate, empirical_acceptance,
                      expected_speedup, expected_tokens_by_position, expected_tokens_per_step,
                      optimal_gamma)
from .tv import TvResult, tv_distance, tv_estimate

__all__ = [
    "AcceptanceResult", "Binning", "ChainResult", "GofResult", "HomogeneityResult",
    "NodeResult", "TvResult",
    "acceptance_rate", "chain_power", "chain_power_for_tv", "chain_test", "chisquare_power", "cohens_w",
    "combine_chain_results", "counts_from_samples", "empirical_acceptance",
    "expected_speedup", "expected_tokens_by_position", "expected_tokens_per_step", "gof_test", "holm",
    "holm_reject", "homogeneity_test", "min_detectable_tv", "optimal_gamma",
    "power_for_tv", "probability_bins", "sample_size_for_tv", "tv_distance",
    "tv_estimate", "williams_q",
]
