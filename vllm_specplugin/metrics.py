"""The proposers' acceptance and timing, in the log and on vLLM's Prometheus ``/metrics``.

Proposers run in the worker process; ``/metrics`` is served by the front end. The front end
makes a fresh directory when it builds the engine config and names it in an environment
variable that the engine processes inherit; each worker writes a JSON snapshot there, and a
collector sums the snapshots at scrape time: in the front end's default registry, or, with
several API servers (``--api-server-count``), through the multiprocess collector each of them
serves /metrics from, all reading the one directory (:func:`prepare_metrics_dir`). The names start
with ``specplugin:``, next to vLLM's ``vllm:spec_decode_*``.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import tempfile
import threading
import time

from vllm_specplugin.proposers.metrics import DraftMetrics
from vllm_specplugin.logging_utils import get_logger

logger = get_logger()

METRICS_DIR_ENV = "SPECPLUGIN_METRICS_DIR"
WRITE_INTERVAL_S = 0.5
LOG_INTERVAL_S = 10.0
FAILURE_LOG_INTERVAL_S = 60.0

_collector_registered = False


def prepare_metrics_dir(api_process_count: int = 1, api_process_rank: int = 0) -> None:
    """In the front end, as it builds the engine config: the snapshot directory, and the collector.

    One API server (the default): a fresh directory, which the engine processes started next
    inherit. Several (``--api-server-count N``; vLLM's ``ParallelConfig._api_process_count`` /
    ``_api_process_rank``): vLLM builds the config in a parent process (rank -1), which starts the
    engine and then the N API server processes (ranks 0..N-1); each builds the config again. They
    read the parent's directory, which they inherited, since only that one is written to.
    """
    global _collector_registered
    inherited = os.environ.get(METRICS_DIR_ENV)
    if not (api_process_count > 1 and api_process_rank >= 0 and inherited and os.path.isdir(inherited)):
        directory = tempfile.mkdtemp(prefix="specplugin-metrics-")
        os.environ[METRICS_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    if not _collector_registered:
        from prometheus_client import REGISTRY

        REGISTRY.register(SnapshotCollector())
        _serve_through_multiprocess_collectors()
        _collector_registered = True


def _serve_through_multiprocess_collectors() -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for ``--api-server-count`` > 1), /metrics
    is served from a registry made at each scrape that holds only prometheus_client's
    ``MultiProcessCollector`` (prometheus_fastapi_instrumentator's ``expose``, which vLLM's
    ``attach_router`` calls; vLLM's own ``get_prometheus_registry`` does the same), never from the
    default registry the snapshot collector is in. So in this process every multiprocess collector
    also yields the snapshot families: files every API server reads, not per-process values to sum."""
    from prometheus_client import multiprocess

    from vllm_specplugin.patches import wrap_once

    def with_snapshots(original):
        def collect(self):
            yield from original(self)
            yield from SnapshotCollector().collect()

        return collect

    wrap_once(multiprocess.MultiProcessCollector, "collect", with_snapshots, mark="_specplugin_metrics")


class MetricsPublisher:
    """In the worker: write snapshots for the front end and log a summary now and then."""

    def __init__(self, metrics: DraftMetrics, label: str, prefix: str = "worker"):
        # prefix: the snapshot file's (worker-PID.json for the proposer's DraftMetrics; "lossy" for
        # lossy_acceptance.LossyCounters, which has snapshot(), verify_steps and summary() too)
        self.metrics = metrics
        self.label = label
        directory = os.environ.get(METRICS_DIR_ENV)
        self.path = os.path.join(directory, f"{prefix}-{os.getpid()}.json") if directory and os.path.isdir(directory) else None
        self._last_log = time.monotonic()
        self._last_written: dict | None = None  # the last snapshot written, without its time
        self.flush_failures = 0
        self._last_failure_log = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specplugin-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Flush every WRITE_INTERVAL_S until closed. Nothing a flush raises ends the thread: a
        dead publisher would freeze /metrics silently. The first failure is logged with its
        traceback, later ones at most once per FAILURE_LOG_INTERVAL_S with a count."""
        while not self._stop.wait(WRITE_INTERVAL_S):
            try:
                self.flush()
            except Exception:
                self.flush_failures += 1
                now = time.monotonic()
                if self.flush_failures == 1 or now - self._last_failure_log >= FAILURE_LOG_INTERVAL_S:
                    self._last_failure_log = now
                    logger.exception(
                        "specplugin: writing the metrics snapshot failed (%d time(s) so far); retrying in %.1f s",
                        self.flush_failures, WRITE_INTERVAL_S,
                    )

    def flush(self) -> None:
        metrics = self.metrics
        if self.path:
            snapshot = dict(metrics.snapshot(), label=self.label)
            unchanged = {k: v for k, v in snapshot.items() if k != "time"}
            if unchanged != self._last_written:
                temporary = f"{self.path}.tmp"
                try:
                    with open(temporary, "w") as f:
                        json.dump(snapshot, f)
                    os.replace(temporary, self.path)
                    self._last_written = unchanged
                except OSError:
                    self.path = None  # the front end has gone and removed the directory
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S and metrics.verify_steps:
            self._last_log = now
            logger.info("SpecPlugin %s: %s", self.label, metrics.summary())

    def close(self) -> None:
        self._stop.set()
        try:
            self.flush()
        except Exception:
            logger.exception("specplugin: writing the final metrics snapshot failed")


def read_snapshots(directory: str | None = None, prefix: str = "worker") -> list[dict]:
    directory = directory or os.environ.get(METRICS_DIR_ENV)
    if not directory:
        return []
    snapshots = []
    for path in sorted(glob.glob(os.path.join(directory, f"{prefix}-*.json"))):
        try:
            with open(path) as f:
                snapshots.append(json.load(f))
        except (OSError, ValueError):
            continue  # being replaced right now; the next scrape sees it
    return snapshots


class SnapshotCollector:
    """A prometheus_client collector over the workers' snapshots."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = read_snapshots()

        def total(key):
            return sum(s.get(key, 0) for s in snapshots)

        # Not here: drafted and accepted tokens, verify steps and accepted tokens by position, which vLLM
        # counts itself (vllm:spec_decode_*) from the rejection sampler (docs/observability.md).
        for key, doc in [
            ("propose_calls", "Calls of the proposer."),
            ("fallback_requests", "Times a request got no draft because of the draft model's length limit."),
            ("backoff_steps", "Steps in which adaptive gamma drafted nothing because the batch was large."),
            ("tokens_forwarded", "Tokens run through the draft models (all drafts together)."),
            ("prefix_hit_tokens", "Tokens whose draft KV came from the shared prefix tree."),
            ("trees", "Token trees built (tree drafting)."),
            ("tree_expected_best", "Sum over trees of the expected accepted length of the chosen path."),
            ("tree_expected_greedy", "Sum over trees of the expected accepted length of the greedy chain."),
            ("tree_chain_steps", "Dynamic trees expected to be the chain, drafted as a chain (request x step)."),
            ("tree_verify_steps", "Token trees verified as trees (request x step; tree_drafting.verify = tree)."),
            ("tree_nodes", "Draft nodes of the trees verified as trees."),
            ("tree_accepted_tokens", "Tree nodes accepted by tree verification."),
            ("tree_non_first_child_accepted", "Accepted tree nodes that were not their parent's first child."),
            ("tree_chain_fallbacks", "Requests x steps drafted as a chain because they need a chain-only feature."),
            ("tree_walk_failures", "Tree walks that raised: the request emitted one token that step (logged)."),
            ("tree_merged_steps", "Trees verified with several drafters' proposals merged (tree_drafting.merge)."),
            ("tree_zero_cost_accepted", "Merged-tree nodes accepted on a zero-cost drafter's (suffix, n-gram) proposal."),
            ("tree_model_accepted", "Merged-tree nodes accepted on the model drafter's proposal."),
            ("draft_failures", "Steps whose drafting raised; each decoded without drafts (no token lost)."),
            ("nonfinite_draft_rows", "Drafts dropped because their q was NaN, infinite, negative or not normalised."),
            ("suffix_drafted_tokens", "Draft tokens proposed by the suffix drafter and verified (drafter choice)."),
            ("suffix_accepted_tokens", "Suffix-drafter tokens the target accepted (drafter choice)."),
            ("draft_cache_evictions", "Per-request draft KV caches evicted by draft_memory_budget_mb (each re-prefills)."),
        ]:
            family = CounterMetricFamily(f"specplugin:{key}", doc)
            family.add_metric([], total(key))
            yield family
        for key, doc in [
            ("draft_time_seconds", "Time spent drafting."),
            ("step_time_seconds", "Time of the engine steps in which the proposer drafted."),
        ]:
            family = CounterMetricFamily(f"specplugin:{key}", doc)
            family.add_metric([], total(key.replace("_seconds", "_s")))
            yield family
        for key, doc in [
            ("drafted_per_position", "Draft tokens observed, by position in the draft."),
        ]:
            family = CounterMetricFamily(f"specplugin:{key}", doc, labels=["position"])
            counts: dict[int, int] = {}
            for s in snapshots:
                for position, count in enumerate(s.get(key, [])):
                    counts[position] = counts.get(position, 0) + count
            for position, count in sorted(counts.items()):
                family.add_metric([str(position)], count)
            yield family
        chosen = CounterMetricFamily(
            "specplugin:gamma_chosen", "Adaptive gamma: requests x steps drafted with this gamma.", labels=["gamma"]
        )
        gammas: dict[str, int] = {}
        for s in snapshots:
            for gamma, count in s.get("gamma_chosen", {}).items():
                gammas[gamma] = gammas.get(gamma, 0) + count
        for gamma, count in sorted(gammas.items(), key=lambda item: int(item[0])):
            chosen.add_metric([gamma], count)
        yield chosen
        drafters = CounterMetricFamily(
            "specplugin:drafter_chosen", "Drafter choice: requests x steps drafted by this drafter (suffix, model, none).",
            labels=["drafter"],
        )
        for drafter in ("suffix", "model", "none"):
            drafters.add_metric([drafter], total(f"choice_{drafter}_steps"))
        yield drafters
        agreement = CounterMetricFamily(
            "specplugin:draft_agreement", "Verified positions where this draft's top token was the target's token.",
            labels=["draft"],
        )
        verified = CounterMetricFamily(
            "specplugin:draft_verified_positions", "Verified positions seen by this draft.", labels=["draft"]
        )
        tracked = GaugeMetricFamily("specplugin:tracked_requests", "Requests whose draft state is held.")
        tracked.add_metric([], total("tracked_requests"))
        yield tracked
        disabled = GaugeMetricFamily(
            "specplugin:drafting_disabled",
            "1 when repeated consecutive drafting failures switched drafting off (plain decoding continues).",
        )
        disabled.add_metric([], max((s.get("drafting_disabled", 0) for s in snapshots), default=0))
        yield disabled
        buffer_bytes = GaugeMetricFamily(
            "specplugin:draft_probs_buffer_bytes",
            "Device memory of the preallocated draft-probability buffer (max_num_seqs x k x vocab x 4 bytes).",
        )
        buffer_bytes.add_metric([], total("draft_probs_buffer_bytes"))
        yield buffer_bytes
        weight = GaugeMetricFamily("specplugin:draft_weight", "Current mixture weight of this draft.", labels=["draft"])
        routed = CounterMetricFamily(
            "specplugin:draft_routed_requests", "Routing (draft_routing): requests drafted by this draft alone.",
            labels=["draft"],
        )
        for s in snapshots:
            for name, count in s.get("agreement", {}).items():
                agreement.add_metric([name], count)
                verified.add_metric([name], s.get("verified_positions", {}).get(name, 0))
            for name, count in s.get("routed", {}).items():
                routed.add_metric([name], count)
            for name, value in s.get("weights", {}).items():
                weight.add_metric([name], value)
        yield agreement
        yield verified
        yield routed
        yield weight
        yield from _lossy_families(read_snapshots(prefix="lossy"))


def _lossy_families(snapshots: list[dict]):
    """Tokens verified under an opt-in LOSSY acceptance mode (lossy_acceptance.py), by mode."""
    from prometheus_client.core import CounterMetricFamily

    for key, name, doc in [
        ("drafted", "lossy_drafted_tokens", "Draft tokens verified under a lossy acceptance mode."),
        ("accepted", "lossy_accepted_tokens", "Draft tokens accepted under a lossy acceptance mode."),
        ("lossy_only", "lossy_only_accepted_tokens",
         "Draft tokens accepted under a lossy mode that the exact rule, with the same uniform, would have rejected."),
    ]:
        family = CounterMetricFamily(f"specplugin:{name}", doc, labels=["mode"])
        totals: dict[str, int] = {}
        for s in snapshots:
            for mode, row in s.get("lossy", {}).items():
                totals[mode] = totals.get(mode, 0) + int(row.get(key, 0))
        for mode, count in sorted(totals.items()):
            family.add_metric([mode], count)
        yield family
