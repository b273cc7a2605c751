# syntax=docker/dockerfile:1
# kvtax sidecar image: the `kvtax` console script and its four small runtime dependencies
# (aiohttp, apscheduler, prometheus-client, pyyaml) on a slim Python. No vLLM, no torch: the
# sidecar only talks HTTP to the vLLM container next to it. To add kvtax's stat-logger plugin
# to a vLLM image instead, see deploy/vllm-image/Dockerfile.plugin and docs/deploy.md.
#
# Build:  docker build -t kvtax:0.1.0 .
# Run:    docker run --rm -p 10059:10059 kvtax:0.1.0 serve --vllm.url=http://vllm:8000
#
# scripts/check-dockerfile-install.sh runs the same pip steps in a fresh venv (CI has no Docker
# engine), and tests/unit/test_dockerfile.py fails if the two drift apart.

# Builder: turn the source into wheels (kvtax and every dependency), so the final stage
# installs offline and carries no build tooling or source tree.
FROM python:3.11.14-slim-bookworm AS builder
WORKDIR /src
# .dockerignore admits only pyproject.toml, README.md and exporter/.
COPY . .
RUN python -m pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11.14-slim-bookworm
# The wheels are bind-mounted for this one step, so they never become a layer of the image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m venv /opt/kvtax \
    && /opt/kvtax/bin/pip install --no-cache-dir --no-index --find-links /wheels kvtax

ENV PATH="/opt/kvtax/bin:$PATH" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

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
