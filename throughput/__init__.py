"""Throughput tracking and the demo (installed as ``vllm_specplugin.throughput``).

``bench``: served configurations and workload timing for pytest-benchmark; ``bench_history``:
saved runs, the speedup table and the regression gate; ``workloads``: prompts; ``demo``:
``make demo``; ``repair_demo``: ``make demo-repair``; ``soak``: ``make soak``, the server under a
long mixed load. The exactness harness is in
``vllm_specplugin.verification``.
"""
