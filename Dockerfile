# syntax=docker/dockerfile:1
# kvtax's image. It holds two things:
#   /opt/kvtax         the sidecar: the `kvtax` console script and its small runtime dependencies
#                      (aiohttp, apscheduler, bcrypt, httptools, orjson, prometheus-client, pydantic,
#                      pyyaml, uvloop) in a venv;
#   /opt/kvtax-plugin  the vLLM plugin folder: kvtax alone, no dependencies (vLLM already ships
#                      prometheus-client), made by `pip install --no-deps --target`. An init
#                      container copies it into an emptyDir and vLLM gets PYTHONPATH pointing
#                      there (deploy/helm/kvtax, deploy/components/kvtax-sidecar, docs/plugin.md).
# No vLLM, no torch: the sidecar only talks HTTP to the vLLM container next to it.
#
# Build:  docker build -t kvtax:0.2.0 .
# Run:    docker run --rm -p 10059:10059 kvtax:0.2.0 serve --vllm.url=http://vllm:8000
#
# scripts/check-dockerfile-install.sh runs the same pip steps without Docker (CI has no Docker
# engine), and tests/unit/test_dockerfile.py fails if the two drift apart.

# python:3.11.14-slim-bookworm, pinned by the digest of its multi-architecture index as well as
# by tag: a rebuilt tag cannot change what this file builds. Bump both together.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# Builder: turn the source into wheels (kvtax and every dependency), so the final stage
# installs offline and carries no build tooling or source tree.
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
# .dockerignore admits only pyproject.toml, README.md, LICENSE and exporter/.
COPY . .
# A C compiler for kvtax's one C module, the relay's per-read scan (kvtax.delivery._eventscan);
# the final stage gets the built wheel, not the compiler. Not pinned: libc6-dev must match the
# libc6 of Debian's index at build time, and a pinned point release disappears from it; the
# compiler only builds, and nothing of it ships.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# kvtax's version (exporter/kvtax/__init__.py); tests/unit/test_dockerfile.py keeps them equal.
ARG KVTAX_VERSION=0.2.0
LABEL org.opencontainers.image.title="kvtax" \
      org.opencontainers.image.description="vLLM sidecar and stat-logger plugin that measure what KV-cache preemption costs" \
      org.opencontainers.image.version="${KVTAX_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.url="https://github.com/kvtax/kvtax" \
      org.opencontainers.image.source="https://github.com/kvtax/kvtax" \
      org.opencontainers.image.documentation="https://github.com/kvtax/kvtax/blob/main/docs/deploy.md" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
# The wheels are bind-mounted for this one step, so they never become a layer of the image.
# The offline tools (kvtax plan, loadtest, annotate: kvtax/tools) run on a workstation, not in the
# pod, so the image leaves them out; `pip install kvtax` still carries them. The mixin stays:
# `docker run kvtax rules --config ...` is one way users render their rules.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m venv /opt/kvtax \
    && /opt/kvtax/bin/pip install --no-cache-dir --no-index --find-links /wheels kvtax \
    && /opt/kvtax/bin/pip install --no-cache-dir --no-index --find-links /wheels --no-deps --target /opt/kvtax-plugin kvtax \
    && rm -rf /opt/kvtax/lib/python3.11/site-packages/kvtax/tools /opt/kvtax-plugin/kvtax/tools

# The port comes from here, not from the version's flag default, so the image, the chart
# (kvtax.port) and the kustomize Component agree whatever that default is.
ENV PATH="/opt/kvtax/bin:$PATH" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVTAX_WEB_LISTEN_ADDRESS=:10059

# A fixed numeric UID, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001

# 10059: /metrics, /healthz, /readyz (--web.listen-address). 8001: the OpenAI-compatible
# proxy in front of vLLM (--proxy.listen-address; off for observe-only).
EXPOSE 10059 8001

# /healthz answers while the process serves, whether or not vLLM is up (that is /readyz).
# Standard library only: the slim base has no curl. It follows KVTAX_WEB_LISTEN_ADDRESS's port;
# a port set with the --web.listen-address flag instead needs the same value in that variable.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; p = os.environ.get('KVTAX_WEB_LISTEN_ADDRESS', ':10059').rpartition(':')[2]; r.urlopen('http://127.0.0.1:' + p + '/healthz', timeout=4)"]

ENTRYPOINT ["kvtax"]
CMD ["serve"]
