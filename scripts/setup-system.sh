#!/usr/bin/env bash
# Debian packages the end-to-end tests and the demo use: Prometheus (with promtool),
# Alertmanager (with amtool), through setup-prometheus.sh, and nginx (the reference proxy of
# the relay benchmark). The packages install no running daemon here; the tests start their own
# on loopback.
set -euo pipefail
here=$(dirname "$0")
"$here/setup-prometheus.sh"
command -v nginx >/dev/null || "$here/apt-install.sh" nginx-light
