#!/usr/bin/env bash
# helm, for tests/unit/test_helm.py's `helm lint` and `helm template`: built once per machine from
# its Go module (helm.sh/helm/v3) with Debian's Go, into ${KVTAX_CACHE:-~/.cache/kvtax}/helm-VERSION/.
# No Debian or PyPI package ships the helm binary.
#
# Prints the binary's path and exits 0 when helm is there (built now or before). Exits 3, saying
# why on stderr, when it cannot be built here: no Go, or the Go module proxy unreachable. The
# chart tests then run Helm's own Go SDK from PyPI's helm-python-sdk (the dev extra) instead,
# which lints and renders offline with the same code; nothing is skipped either way.
#
# Usage: scripts/setup-helm.sh   Env: KVTAX_HELM_VERSION (default v3.11.3: Debian 12's Go is 1.19,
# and helm's later 3.x lines need a newer Go), KVTAX_CACHE, GOPROXY (the go command's own).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=${KVTAX_HELM_VERSION:-v3.11.3}
cache=${KVTAX_CACHE:-$HOME/.cache/kvtax}
dest="$cache/helm-$version"
unavailable() {
  echo "setup-helm: helm $version not built: $*" >&2
  echo "setup-helm: the chart tests use Helm's Go SDK from helm-python-sdk instead" >&2
  exit 3
}

if [ -x "$dest/helm" ]; then
  echo "$dest/helm"
  exit 0
fi
command -v go >/dev/null || "$here/apt-install.sh" golang-go >/dev/null ||
  unavailable "Debian's golang-go did not install"
command -v go >/dev/null || unavailable "no go command"

work=$(mktemp -d "${TMPDIR:-/tmp}/kvtax-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "setup-helm: building helm $version with $(go version) (once per machine)..." >&2
began=$(date +%s)
# A private module cache and GOPATH, so nothing outside $work and $dest is written.
if ! GOPATH="$work/gopath" GOMODCACHE="$work/gopath/pkg/mod" GOFLAGS=-modcacherw \
  GOBIN="$work/bin" CGO_ENABLED=0 \
  go install "helm.sh/helm/v3/cmd/helm@$version" 2>"$work/go.log"; then
  if grep -qE 'dial tcp|no such host|connection refused|i/o timeout|proxyconnect' "$work/go.log"; then
    unavailable "the Go module proxy is unreachable ($(grep -m1 -oE '(dial tcp|lookup) [^ ]+.*' "$work/go.log"))"
  fi
  cat "$work/go.log" >&2
  unavailable "go install failed (above)"
fi
mkdir -p "$dest"
mv "$work/bin/helm" "$dest/helm"
echo "setup-helm: built $dest/helm in $(( $(date +%s) - began )) s" >&2
"$dest/helm" version --short >&2
echo "$dest/helm"
