#!/usr/bin/env bash
# Debian packages the end-to-end tests and the demo use: Prometheus (with promtool),
# Alertmanager (with amtool) and nginx (the reference proxy of the relay benchmark).
# The packages install no running daemon here; the tests start their own on loopback.
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v nginx >/dev/null || need+=(nginx-light)
[ ${#need[@]} -eq 0 ] && exit 0
echo "kvtax: installing ${need[*]}" >&2
if [ "$(id -u)" != 0 ]; then sudo=sudo; else sudo=; fi
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
# Debian's postinst may start daemons where systemd runs; the tests want their own instances.
for svc in prometheus prometheus-alertmanager prometheus-node-exporter nginx; do
  $sudo systemctl stop "$svc" >/dev/null 2>&1 || true
done
