#!/usr/bin/env bash
# The whole suite, in tiers: fast unit tests first, then the engine / server / statistical tiers.
# Throughput benchmarks are not tests: `make bench` runs them.
set -uo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
PY=.venv/bin/python
start=$(date +%s)
$PY -m pytest tests -q -p no:cacheprovider --benchmark-disable --ignore=tests/benchmarks --timeout=1800 "$@"
rc=$?
echo "suite wall time: $(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
