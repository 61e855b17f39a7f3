#!/usr/bin/env bash
# vLLM's `suffix` speculative method needs arctic-inference (its SuffixDecodingCache), which the
# package registry has only as a source distribution. This builds it against the venv's Python
# and installs it into a folder of its own (default runs/arctic-site), NOT into the venv: the
# package registers a vLLM general plugin that would then load into every engine of the test suite.
# Use it per command: PYTHONPATH=runs/arctic-site <command> (tests/benchmarks/test_bench_baseline.py).
#
# Why CMAKE_ARGS: its CMakeLists finds Python with FindPython, which does not find the headers of a
# pyenv interpreter by itself ("Could NOT find Python (missing: Python_INCLUDE_DIRS
# Development.Module)"); pointing it at the interpreter's include folder is enough. Python_EXECUTABLE
# is the venv's own path, not the interpreter it links to: pip's isolated build environment (with
# nanobind) is on that interpreter's path only when it is started through the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VERSION=${ARCTIC_INFERENCE_VERSION:-0.3.0}
TARGET=${1:-runs/arctic-site}
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
INCLUDE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/$PY -DPython_INCLUDE_DIR=$INCLUDE" \
  $PY -m pip wheel -q --no-deps "arctic-inference==$VERSION" -w "$WHEELS"
$PY -m pip install -q --no-deps --upgrade --target "$TARGET" "$WHEELS"/arctic_inference-*.whl
PYTHONPATH="$TARGET" $PY -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('arctic-inference $VERSION in $TARGET: SuffixDecodingCache imports')"
