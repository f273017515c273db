#!/usr/bin/env bash
# Builds the multi-arch images (linux/amd64, linux/arm64) of a release's
# services with docker buildx and deploy/release/Dockerfile, from the
# binaries `make release` left in DIR (run by `make release-images`):
#
#   deploy/release/images.sh --version X.Y.Z [--dir dist] [--registry R] [--push]
#
# Without --push the images are built and left in BuildKit's cache only (a
# multi-platform image cannot be loaded into the classic image store); with
# it they go to R/leasehold-SERVICE:X.Y.Z. Without a Docker engine and buildx
# it says so and exits 0: building images is optional, and CI needs none.
set -euo pipefail
cd "$(dirname "$0")/../.."

version="" dir=dist registry=ghcr.io/leasehold push=0
while [ $# -gt 0 ]; do
	case $1 in
	--version) version=$2; shift 2 ;;
	--dir) dir=$2; shift 2 ;;
	--registry) registry=$2; shift 2 ;;
	--push) push=1; shift ;;
	*) echo "images: unknown argument $1" >&2; exit 2 ;;
	esac
done
[ -n "$version" ] || { echo "images: VERSION is required: make release-images VERSION=x.y.z (after make release VERSION=x.y.z)" >&2; exit 1; }
docker=${DOCKER:-docker}
if ! command -v "$docker" >/dev/null 2>&1 || ! "$docker" buildx version >/dev/null 2>&1 || ! "$docker" info >/dev/null 2>&1; then
	echo "images: no Docker engine with buildx answers here: no image built (building images is optional)"
	exit 0
fi
for arch in amd64 arm64; do
	[ -x "$dir/leasehold_${version}_linux_$arch/leasehold-gateway" ] ||
		{ echo "images: $dir has no $version binaries for linux/$arch: make release VERSION=$version first" >&2; exit 1; }
done
output=(--output type=cacheonly)
[ $push = 1 ] && output=(--push)
for s in worker scheduler gateway api site-agent doctor; do
	tag=$registry/leasehold-$s:$version
	echo "== $tag (linux/amd64, linux/arm64)"
	"$docker" buildx build --platform linux/amd64,linux/arm64 -f deploy/release/Dockerfile \
		--build-arg SERVICE="$s" --build-arg VERSION="$version" -t "$tag" "${output[@]}" "$dir"
done
