#!/bin/sh
# deploy/Containerfile's two images, build and serve, on BASE, tagged localhost/gemma4-pipeline-TARGET:TAG, and each
# target's image name printed on a line of its own ("build NAME", "serve NAME"). make test-container's tests build
# with this script, and so does make container-images: podman's layer cache makes a second build a lookup. Needs root
# and podman (make container-packages); the base from deploy/container-base.sh on these machines.
#   deploy/container-images.sh [BASE] [TAG]
# podman's own output goes to stderr. WHEELS: a folder of wheels pip may take torch from, mounted read-only for the
# build (default: this machine's /opt/wheels when it exists; elsewhere pip downloads torch's CPU build). PIP_CERT: a
# CA bundle pip trusts during the build, mounted and not kept in the image (default: the host's bundle, which is how
# these machines reach the package index through their proxy).
set -eu
base=${1:-localhost/gemma4-debian:bookworm}
tag=${2:-test}
cd "$(dirname "$0")/.."
wheels=${WHEELS:-/opt/wheels}
cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
set --
if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    set -- "$@" -v "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels
fi
if [ -n "$cert" ] && [ -f "$cert" ]; then
    set -- "$@" -v "$cert:/run/host-ca.crt:ro" --build-arg PIP_CERT_FILE=/run/host-ca.crt
fi
for target in build serve; do
    image="localhost/gemma4-pipeline-$target:$tag"
    # Docker's image format: an OCI image has no HEALTHCHECK (podman drops it, with a warning). Chroot isolation: no
    # OCI runtime starts a container on these machines (docs/containers.md).
    podman build --isolation chroot --format docker -f deploy/Containerfile --target "$target" \
        --build-arg "BASE=$base" "$@" -t "$image" . >&2
    echo "$target $image"
done
