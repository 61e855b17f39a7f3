"""The plugin's series reach the registry vLLM serves at /metrics, with one API server or several
(issue 32 item 7; the server test is tests/server/test_http_metrics_multiprocess.py)."""

from __future__ import annotations

import json
import os

import pytest

from vllm_specplugin import metrics


@pytest.fixture
def fresh_metrics(monkeypatch, tmp_path):
    """prepare_metrics_dir as in a new front-end process: no collector yet, no inherited directory
    (the collector it registers in the default registry is taken out again afterwards)."""
    from prometheus_client import REGISTRY

    monkeypatch.setattr(metrics, "_collector_registered", False)
    monkeypatch.delenv(metrics.METRICS_DIR_ENV, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    # An engine built earlier in this process (another test module) registered its collector.
    earlier = [c for c in list(REGISTRY._collector_to_names) if isinstance(c, metrics.SnapshotCollector)]
    for collector in earlier:
        REGISTRY.unregister(collector)
    before = set(REGISTRY._collector_to_names)
    yield tmp_path
    for collector in set(REGISTRY._collector_to_names) - before:
        REGISTRY.unregister(collector)
    for collector in earlier:
        REGISTRY.register(collector)


def write_snapshot(directory: str, **values) -> None:
    with open(os.path.join(directory, f"worker-{os.getpid()}.json"), "w") as f:
        json.dump({"label": "test", **values}, f)


def served(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def served_by_the_instrumentator() -> str:
    """What /metrics returns in multiprocess mode: vLLM's route is prometheus_fastapi_instrumentator's
    ``expose``, which builds this registry at each scrape (its ``registry`` argument unused)."""
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return served(registry)


def test_one_api_server_serves_the_snapshots_from_the_default_registry(fresh_metrics):
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    metrics.prepare_metrics_dir()
    write_snapshot(os.environ[metrics.METRICS_DIR_ENV], propose_calls=5)
    assert "specplugin:propose_calls_total 5.0" in served(get_prometheus_registry())


def test_api_servers_of_several_read_the_parents_directory_through_the_multiprocess_registry(
        fresh_metrics, monkeypatch):
    """--api-server-count 2: the parent (rank -1) makes the directory the engine inherits; each API
    server (rank 0, 1) builds the config again and must read that directory, and vLLM serves them a
    registry holding only the multiprocess collector."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    multiproc = fresh_metrics / "prometheus"
    multiproc.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))  # what run_multi_api_server sets
    metrics.prepare_metrics_dir(api_process_count=2, api_process_rank=-1)  # the parent
    parents = os.environ[metrics.METRICS_DIR_ENV]
    write_snapshot(parents, propose_calls=7)  # the worker, started by the parent
    metrics.prepare_metrics_dir(api_process_count=2, api_process_rank=1)
    assert os.environ[metrics.METRICS_DIR_ENV] == parents
    assert "specplugin:propose_calls_total 7.0" in served_by_the_instrumentator()
    assert "specplugin:propose_calls_total 7.0" in served(get_prometheus_registry())


def test_a_new_engine_in_the_same_process_gets_a_fresh_directory(fresh_metrics):
    metrics.prepare_metrics_dir()
    first = os.environ[metrics.METRICS_DIR_ENV]
    metrics.prepare_metrics_dir()  # e.g. a second LLM(...) in one script: its own counters
    assert os.environ[metrics.METRICS_DIR_ENV] != first
