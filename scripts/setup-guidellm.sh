#!/usr/bin/env bash
# Installs guidellm (a load-testing tool) into its own virtual environment, once per machine.
# guidellm is a test and bench dependency only: kvtax annotates its reports but never imports
# it, so it stays out of kvtax's own environment and image (like scripts/setup-vllm.sh).
#
# Idempotent. Progress goes to stderr; the last line on stdout is the venv path.
# Env: KVTAX_CACHE (default ~/.cache/kvtax), KVTAX_GUIDELLM_VENV (default
# $KVTAX_CACHE/guidellm-venv).
set -euo pipefail
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_GUIDELLM_VENV:-$cache/guidellm-venv}
version=0.8.1
stamp="$venv/.kvtax-ready-$version"

if [ -f "$stamp" ]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
echo "kvtax: installing guidellm==$version into $venv (once per machine)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip >&2
"$venv/bin/pip" install --quiet "guidellm==$version" >&2
# Fail here rather than at the first benchmark if the install is unusable.
"$venv/bin/guidellm" --help >/dev/null
touch "$stamp"
echo "$venv"
