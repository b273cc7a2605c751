#!/usr/bin/env bash
# promtool and amtool, which the unit tests run (rules, rule tests, the Alertmanager example,
# kvtax's own /metrics), and the servers they come with, which the end-to-end tests and the
# demo start: Debian's prometheus and prometheus-alertmanager packages. Idempotent: a tool
# already on PATH is not installed again, and apt is not run at all when both are there.
# Both test paths of scripts/test call this; scripts/setup-system.sh does too.
set -euo pipefail
here=$(dirname "$0")
have() { command -v "$1" >/dev/null; }
need=()
have promtool || need+=(prometheus)
have amtool || need+=(prometheus-alertmanager)
[ ${#need[@]} -eq 0 ] && exit 0
"$here/apt-install.sh" "${need[@]}"
for tool in promtool amtool; do
  have "$tool" || { echo "kvtax: $tool still missing after installing ${need[*]}" >&2; exit 1; }
done
