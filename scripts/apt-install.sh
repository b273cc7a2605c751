#!/usr/bin/env bash
# Install Debian packages non-interactively, as root or through sudo, and stop any daemon their
# postinst started (where systemd runs): the tests and the demo start their own on loopback.
# Usage: scripts/apt-install.sh PACKAGE...   (used by setup-prometheus.sh and setup-system.sh)
set -euo pipefail
[ $# -gt 0 ] || exit 0
echo "kvtax: installing $*" >&2
if [ "$(id -u)" != 0 ]; then sudo=sudo; else sudo=; fi
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >&2
for svc in prometheus prometheus-alertmanager prometheus-node-exporter nginx; do
  $sudo systemctl stop "$svc" >/dev/null 2>&1 || true
done
