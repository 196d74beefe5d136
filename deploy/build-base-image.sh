#!/usr/bin/env bash
# Build the base image that deploy/Dockerfile starts FROM, out of Debian packages, for machines
# that reach no image registry (ENVIRONMENT.md): debootstrap a minimal bookworm (its python3 is 3.11)
# and `docker import` it under the exact name the Dockerfile's FROM uses, so docker builds the same
# Dockerfile unchanged and pulls nothing. On a machine with a registry, `docker pull debian:bookworm-slim`
# plus python3 would do the same; this script is the registry-free path.
#
#   deploy/build-base-image.sh [NAME:TAG]        (default: specdec-base:bookworm; FORCE=1 rebuilds)
#
# Needs root, debootstrap and a running docker daemon. About 4 minutes and ~300 MB.
set -euo pipefail

IMAGE="${1:-specdec-base:bookworm}"
if [ "${FORCE:-0}" != 1 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE already present (FORCE=1 rebuilds)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }

# The mirror this machine's apt already uses (deb822 sources first, then the one-line format), so the
# build reaches only what apt reaches; MIRROR=... overrides.
mirror="${MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
fi
if [ -z "$mirror" ]; then
  mirror=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' \
    | grep -v security | head -n1 || true)
fi
mirror="${mirror:-http://deb.debian.org/debian}"

rootfs=$(mktemp -d /tmp/specdec-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm from $mirror into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$rootfs" "$mirror"
# apt's package lists and caches are not needed in an image (the Dockerfile installs with pip only).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' - "$IMAGE"
docker image ls "$IMAGE"
