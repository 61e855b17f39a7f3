#!/usr/bin/env bash
# The whole suite, in tiers: fast unit tests first, then the engine / server / statistical tiers.
# Then the short benchmark tier (`make bench` runs all benchmarks).
set -uo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
PY=.venv/bin/python
start=$(date +%s)
# Without arguments (make test): everything but the extended tier (make test-extended).
if [ "$#" -eq 0 ]; then set -- -m "not extended"; default_run=1; else default_run=0; fi
# Two workers (pytest-xdist), whole modules each (module fixtures start one engine; the statistical
# module's Holm decision needs all its cases in one process); tests/conftest.py orders the longest
# modules first and gives each worker's engines a core of their own. SPECPLUGIN_TEST_WORKERS=0: serial.
WORKERS=${SPECPLUGIN_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); else PARALLEL=(); fi
$PY -m pytest tests -q -p no:cacheprovider --benchmark-disable --ignore=tests/benchmarks --timeout=1800 \
  --durations=25 "${PARALLEL[@]}" "$@"
rc=$?
if [ "$rc" -eq 0 ] && [ -z "${SPECPLUGIN_SKIP_BENCH:-}" ] && [ "$default_run" -eq 1 ]; then
  # The short benchmark tier: records throughput (runs/benchmarks/ci-short.json); it fails only
  # when a benchmark itself fails (a server error, lost tokens), never on time.
  mkdir -p runs/benchmarks
  BENCH_ROUNDS=1 $PY -m pytest tests/benchmarks -q -p no:cacheprovider -m short -k batch1-T0 \
    --benchmark-json=runs/benchmarks/ci-short.json --timeout=1800
  rc=$?
fi
echo "suite wall time: $(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
