#!/usr/bin/env bash
# Installs AIPerf (NVIDIA's load-testing tool, genai-perf's successor) into its own virtual
# environment, once per machine. AIPerf is a test and bench dependency only: kvtax annotates its
# reports but never imports it, so it stays out of kvtax's own environment and image (like
# scripts/setup-guidellm.sh and scripts/setup-vllm.sh).
#
# Idempotent. Progress goes to stderr; the last line on stdout is the venv path.
# Env: KVTAX_CACHE (default ~/.cache/kvtax), KVTAX_AIPERF_VENV (default
# $KVTAX_CACHE/aiperf-venv).
set -euo pipefail
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_AIPERF_VENV:-$cache/aiperf-venv}
version=0.13.0
stamp="$venv/.kvtax-ready-$version"

if [ -f "$stamp" ]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
echo "kvtax: installing aiperf==$version into $venv (once per machine)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip >&2
"$venv/bin/pip" install --quiet "aiperf==$version" >&2
# Fail here rather than at the first benchmark if the install is unusable.
"$venv/bin/aiperf" --help >/dev/null
touch "$stamp"
echo "$venv"
