#!/usr/bin/env bash
# Installs LiteLLM's proxy (an OpenAI-compatible gateway) into its own virtual environment, once
# per machine. LiteLLM is a bench dependency only: kvtax reads its Prometheus counter through
# --gateway.url but never imports it, so it stays out of kvtax's own environment and image (like
# scripts/setup-guidellm.sh, scripts/setup-aiperf.sh and scripts/setup-vllm.sh).
#
# The proxy extra brings the server (uvicorn, fastapi, ...); prometheus-client is named as well
# because LiteLLM's Prometheus callback imports it and 1.108.7's proxy extra does not include it.
# 1.108.7 is the newest release whose proxy extra installs from the registry (newer ones pin
# litellm-proxy / litellm-proxy-extras releases it lacks); 1.107.* is avoided, see
# bench/results/gateway-litellm.md.
#
# Idempotent. Progress goes to stderr; the last line on stdout is the venv path.
# Env: KVTAX_CACHE (default ~/.cache/kvtax), KVTAX_LITELLM_VENV (default
# $KVTAX_CACHE/litellm-venv).
set -euo pipefail
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
venv=${KVTAX_LITELLM_VENV:-$cache/litellm-venv}
version=1.108.7
stamp="$venv/.kvtax-ready-$version"

if [ -f "$stamp" ]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
echo "kvtax: installing litellm[proxy]==$version into $venv (once per machine)" >&2
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip >&2
"$venv/bin/pip" install --quiet "litellm[proxy]==$version" prometheus-client >&2
# Fail here rather than at the first bench run if the install is unusable.
"$venv/bin/litellm" --help >/dev/null
# The bundled cost map: LiteLLM would otherwise try to download it on import.
LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c "import litellm.integrations.prometheus" >&2
touch "$stamp"
echo "$venv"
