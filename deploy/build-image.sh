#!/usr/bin/env bash
# Build deploy/Dockerfile from the repository root:
#   deploy/build-image.sh [--tag NAME:TAG] [--variant cpu|cuda] [extra docker build args...]
# Stages what the build needs but git must not hold in deploy/.build/ (ignored): the CPU torch wheel
# from $SPECDEC_WHEELS or $PIP_FIND_LINKS (PyPI's torch is the multi-GB CUDA build; both variants export
# with it, and neither image keeps it), and the CA bundle
# that $PIP_CERT names (pip behind a TLS proxy). The CA stays in the build stage, never in the image.
# Builds the base image first when it is missing (deploy/build-base-image.sh) — no registry needed.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=specdec:latest
variant=cpu
base=specdec-base:bookworm
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --variant) variant=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    *) break ;;
  esac
done

stage=deploy/.build
rm -rf "$stage" && mkdir -p "$stage/wheels"
wheels="${SPECDEC_WHEELS:-${PIP_FIND_LINKS:-}}"
case "$variant" in cpu|cuda) ;; *) echo "--variant must be cpu or cuda, not $variant" >&2; exit 1 ;; esac
# Both variants: the build stage exports the graphs with the CPU torch (the runtime has no torch).
[ -n "$wheels" ] && ls "$wheels"/torch-*+cpu-*.whl >/dev/null 2>&1 || {
  echo "the build stage needs a torch CPU wheel: set SPECDEC_WHEELS (or PIP_FIND_LINKS) to its directory" >&2
  exit 1
}
cp "$wheels"/torch-*+cpu-*.whl "$stage/wheels/"
if [ -n "${PIP_CERT:-}" ] && [ -s "$PIP_CERT" ]; then
  cp "$PIP_CERT" "$stage/ca.pem"
fi

if [ "$base" = specdec-base:bookworm ]; then
  deploy/build-base-image.sh "$base"
fi
# Every stage gets a tag of its own (build is the same for both variants), so that a rebuild leaves
# the images it replaces untagged and this script can remove them: docker's classic builder keeps each
# stage's image, and untagged ones piled up at ~5 GB per cpu+cuda rebuild until a CI disk filled. The
# tagged stages stay as the next build's layer cache.
repo=${tag%:*}
stage_tags=("$repo-stage:build" "$repo-stage:serve-env-$variant")
replaced=()
for t in "${stage_tags[@]}" "$tag"; do
  id=$(docker image inspect --format '{{.Id}}' "$t" 2>/dev/null || true)
  [ -n "$id" ] && replaced+=("$id")
done
# --network host: the build's pip reaches PyPI the way the host does (no bridge networks here).
# The later builds reuse the earlier ones' layers (same arguments), so the stages are built once.
build() {
  docker build --network host -f deploy/Dockerfile --build-arg "BASE_IMAGE=$base" --build-arg "VARIANT=$variant" "$@"
}
build --target build -t "${stage_tags[0]}" "$@" .
build --target serve-env -t "${stage_tags[1]}" "$@" .
build -t "$tag" "$@" .
for id in "${replaced[@]}"; do
  # Only images no tag names any more (a stage the rebuild reused keeps its tag and stays).
  if [ "$(docker image inspect --format '{{len .RepoTags}}' "$id" 2>/dev/null || echo 1)" = 0 ]; then
    docker image rm "$id" >/dev/null 2>&1 || true
  fi
done
docker image ls --filter "reference=$repo" --filter "reference=$repo-stage"
