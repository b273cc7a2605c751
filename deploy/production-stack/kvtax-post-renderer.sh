#!/usr/bin/env bash
# A Helm post-renderer for production-stack: reads the rendered manifests on stdin and writes
# them back with the kvtax sidecar (sidecar.yaml) added to every engine Deployment
# (*-deployment-vllm). Nothing else changes. Needs kubectl (its built-in kustomize).
#   helm upgrade --install vllm vllm/vllm-stack ... --post-renderer deploy/production-stack/kvtax-post-renderer.sh
# Env: KVTAX_IMAGE (default registry.example.com/kvtax:0.2.0), KUBECTL (default kubectl).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
image=${KVTAX_IMAGE:-registry.example.com/kvtax:0.2.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtax-post-render.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/rendered.yaml"
sed "s|^\( *image:\) kvtax\$|\1 $image|" "$here/sidecar.yaml" >"$work/sidecar.yaml"
cat >"$work/kustomization.yaml" <<'KUSTOMIZATION'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - rendered.yaml
patches:
  - path: sidecar.yaml
    target:
      group: apps
      kind: Deployment
      name: .*-deployment-vllm
KUSTOMIZATION
"${KUBECTL:-kubectl}" kustomize "$work"
