#!/usr/bin/env bash
# Build the service image and run it without a Docker engine (podman from Debian's packages, as root),
# then check /healthz and solve one posted graph through the running container.
# Follows ../shared/tools/oci-smoke.sh: needs only Debian's and Python's package registries.
# usage: .ci/image-smoke.sh [IMAGE_TAG] [PORT]      (BUILD_ARGS="--build-arg WITH_TORCH=1" to add torch)
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/planner-service:ci}; PORT=${2:-18000}
WORK=${WORK:-${TMPDIR:-/tmp}/planner-image-smoke}; mkdir -p "$WORK"
NAME=planner-smoke
export DEBIAN_FRONTEND=noninteractive
started=$(date +%s)

command -v podman >/dev/null && command -v runc >/dev/null && command -v mmdebstrap >/dev/null \
  && command -v curl >/dev/null || {
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends podman runc containernetworking-plugins \
      catatonit slirp4netns uidmap fuse-overlayfs mmdebstrap curl ca-certificates >/dev/null
}
# podman settings this machine needs: no CAP_SYS_RESOURCE, hybrid cgroups, and the host CA bundle for pip
cat > "$WORK/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
volumes = ["/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$WORK/containers.conf"

# Docker Hub is not reachable: a local stand-in for python:3.11-slim (Debian bookworm + python3.11 + pip)
if ! podman image exists docker.io/library/python:3.11-slim; then
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED' \
    --customize-hook='ln -sf /usr/bin/python3 "$1"/usr/local/bin/python; ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip' \
    bookworm "$WORK/rootfs.tar"
  podman import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' "$WORK/rootfs.tar" \
    docker.io/library/python:3.11-slim
fi
# --format docker keeps HEALTHCHECK (the OCI format has no field for it)
podman build --pull=never --format docker ${BUILD_ARGS:-} -t "$TAG" .

podman rm -f "$NAME" >/dev/null 2>&1 || true
cleanup() { podman logs "$NAME" 2>&1 | tail -5 || true; podman rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
# The health check's timer needs systemd, which this machine may lack (podman logs that it cannot reach
# it, harmlessly): disable the timer and run the check by hand below.
podman run -d --name "$NAME" --health-interval=disable -p "127.0.0.1:$PORT:8000" "$TAG" >/dev/null

healthy=1
for _ in $(seq 1 150); do
  curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && { healthy=0; break; }
  sleep 0.2
done
[ "$healthy" = 0 ] || { echo "image-smoke: /healthz did not answer within 30 s" >&2; exit 1; }
echo "image-smoke: /healthz answers"
podman healthcheck run "$NAME" || { echo "image-smoke: the image's HEALTHCHECK fails" >&2; exit 1; }
echo "image-smoke: the image's HEALTHCHECK passes"

[ "$(podman exec "$NAME" id -u)" != 0 ] || { echo "image-smoke: the service runs as root" >&2; exit 1; }
if [ -z "${BUILD_ARGS:-}" ]; then
  podman exec "$NAME" python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    || { echo "image-smoke: torch is installed in an image built without WITH_TORCH=1" >&2; exit 1; }
fi
# What pip installed, seen from outside /app (whose copied sources python -c would find first)
podman exec -w / "$NAME" python -c "import importlib.util as u, sys; sys.exit(u.find_spec('api') is not None or u.find_spec('planner_service') is None)" \
  || { echo "image-smoke: the image installs a top-level api, or no planner_service" >&2; exit 1; }

# One plan, posted from outside: a 41-node graph with a budget halfway between its lowest and baseline peaks.
podman exec "$NAME" python -c "
import json
from planner.serialize import graph_to_dict
from planner.simulation.step import simulate, store_everything
from planner.solvers import lowest_peak
from planner.testing.synthetic_graphs import residual_graph
graph = residual_graph(node_count=41, nodes_per_block=10)
budget = (lowest_peak(graph)[1].peak_bytes + simulate(graph, store_everything(graph)).peak_bytes) // 2
print(json.dumps({'graph': graph_to_dict(graph), 'budget_bytes': budget, 'solver': 'dp', 'wait_s': 60}))
" > "$WORK/request.json"
status=$(curl -sS -o "$WORK/answer.json" -w '%{http_code}' -H 'Content-Type: application/json' \
  --data-binary "@$WORK/request.json" "http://127.0.0.1:$PORT/v1/plans")
if [ "$status" != 200 ] || ! grep -Eq '"status": ?"done"' "$WORK/answer.json" \
   || ! grep -Eq '"schema": ?"planner.plan/v1"' "$WORK/answer.json" \
   || ! grep -Eq '"policy": ?"checkpoint"' "$WORK/answer.json"; then
  echo "image-smoke: POST /v1/plans answered $status: $(head -c 600 "$WORK/answer.json")" >&2
  exit 1
fi
echo "image-smoke: solved a posted graph through the container (HTTP $status, a checkpointed plan)"
echo "image-smoke: passed in $(( $(date +%s) - started )) s"
