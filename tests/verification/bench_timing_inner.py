"""Run by tests/verification/test_bench_timing.py in a pytest of its own (benchmarks enabled).

A real HTTP endpoint on 127.0.0.1 answers /v1/completions after GENERATION_S, and a server
object whose settled plugin counters take SETTLE_S to read (as the plugin's do: workers flush
every 0.5 s, vllm_specplugin/server.py waits until two reads agree)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_specplugin.throughput.bench import PLUGIN_PROPOSER, ServedConfig, benchmark_workload

GENERATION_S = 0.05
SETTLE_S = 0.6
SEEN_TEMPERATURES: list[float] = []


class _Completions(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN_TEMPERATURES.append(float(body["temperature"]))
        time.sleep(GENERATION_S)
        answer = json.dumps({
            "id": "x", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": "a" * body["max_tokens"], "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": body["max_tokens"], "total_tokens": 1 + body["max_tokens"]},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


class _Server:
    """What benchmark_workload reads of a VllmServer: base_url, model, metrics, settled_metrics."""

    def __init__(self, port: int):
        self.base_url, self.model = f"http://127.0.0.1:{port}", "m"
        self.counter = 0.0

    def metrics(self) -> dict:
        return {}

    def settled_metrics(self, prefix: str) -> dict:
        time.sleep(SETTLE_S)
        self.counter += 1.0
        return {"specplugin:propose_calls_total": self.counter}


def test_timed_body(benchmark):
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        config = ServedConfig("plugin", {"method": "custom_class", "model": PLUGIN_PROPOSER, "num_speculative_tokens": 2})
        results: list = []
        result = benchmark_workload(benchmark, results, (config, _Server(http.server_address[1])), ["p"] * 4, batch=1,
                                    temperature=[0.0, 1.0, 0.0, 1.3], max_tokens=8, rounds=2)
        benchmark.extra_info["best_wall_s"] = result.wall_s
        benchmark.extra_info["seen_temperatures"] = SEEN_TEMPERATURES
        benchmark.extra_info["temperature_label"] = result.temperature
    finally:
        http.shutdown()
