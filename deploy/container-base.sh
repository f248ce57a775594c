#!/bin/sh
# A plain Debian bookworm base image for deploy/Containerfile's cpu profile, made from Debian's own packages (no
# container registry needed): debootstrap a minimal bookworm with python3, python3-venv, git and ca-certificates, then
# `podman import` it as IMAGE. Needs root, debootstrap and podman (make container-packages). Does nothing when IMAGE
# exists already.
#   deploy/container-base.sh [IMAGE] [MIRROR]
set -eu
image=${1:-localhost/gemma4-debian:bookworm}
mirror=${2:-http://deb.debian.org/debian}
if podman image exists "$image"; then
    echo "container-base: $image exists"
    exit 0
fi
rootfs=$(mktemp -d "${TMPDIR:-/tmp}/gemma4-rootfs-XXXXXX")
trap 'rm -rf "$rootfs"' EXIT INT TERM
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git bookworm "$rootfs" "$mirror" >/dev/null
# No package lists or caches in the image: the Containerfile installs with pip, not apt.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*
tar -C "$rootfs" -c . | podman import - "$image" >/dev/null
echo "container-base: made $image from Debian's packages"
