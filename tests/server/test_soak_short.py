"""The soak's short tier (issue 14 items 1 and 2; `make soak` runs the full one): the server with
the plugin (every strategy on) under about a minute of mixed load, 1 to 64 clients, completions
and chat, streaming and not, greedy / sampled / seeded, n > 1, stop strings and client
disconnects. Every request not aborted returns what it asked for, the server stays up, the
worker's RSS does not climb (a looser bound than the full run's: a minute is short to fit),
tracked_requests returns to 0 (bar one probe request, see soak.check_tracked), greedy outputs
equal a plain server's up to near-ties, seeded requests sent twice agree."""

from __future__ import annotations

import os

import pytest

from vllm_specplugin.paths import CHECKOUT_ROOT
from vllm_specplugin.throughput import soak

pytestmark = pytest.mark.server


def test_short_soak():
    cfg = soak.short_config(out_dir=os.path.join(CHECKOUT_ROOT, "runs", "soak"), tag="short", progress=False)
    report = soak.run_soak(cfg)
    summary = soak.format_summary(report)
    print("\n" + summary)
    assert report["passed"], summary
    load = report["load"]
    assert load["requests"] >= cfg.min_requests and load["completed"] > 0.8 * load["requests"]
    assert load["in_flight_max"] >= 48 and load["in_flight_min"] <= 1
    assert report["greedy"]["tokens_compared"] > 0
