#!/usr/bin/env bash
# Pin deploy/Dockerfile's base image to the digest its tag names today (`make pin-base-image`).
# A tag moves (python:3.11-slim takes every Debian security update and Python patch release); a
# digest does not, so the image is built from the base that was tested. Run this where a registry
# is reachable to take a newer base, then rebuild, run the tests and commit the Dockerfile.
# Resolves the multi-arch index digest (what `docker pull` prints as Digest) with crane, skopeo
# or docker buildx, whichever is installed. Usage: pin-base-image.sh [Dockerfile] (BASE_TAG=...).
set -euo pipefail

dockerfile="${1:-$(dirname "$0")/../Dockerfile}"
tag="${BASE_TAG:-python:3.11-slim}"

if command -v crane >/dev/null; then
  digest="$(crane digest "$tag")"
elif command -v skopeo >/dev/null; then
  # .Digest is the top-level one: the index, not this machine's platform's manifest.
  digest="$(skopeo inspect --format '{{.Digest}}' "docker://$tag")"
elif command -v docker >/dev/null; then
  digest="$(docker buildx imagetools inspect "$tag" --format '{{json .Manifest}}' |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["digest"])')"
else
  echo "error: crane, skopeo or docker (with buildx) is needed to resolve $tag" >&2
  exit 1
fi
if [[ ! "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
  echo "error: $tag resolved to '$digest', not a sha256 digest" >&2
  exit 1
fi

pattern="$(printf '%s' "$tag" | sed 's/[.]/\\./g')"
sed -i -E "s#^FROM ${pattern}(@sha256:[0-9a-f]{64})?( |\$)#FROM ${tag}@${digest}\\2#" "$dockerfile"
if ! grep -q "^FROM ${tag}@${digest}" "$dockerfile"; then
  echo "error: no FROM ${tag} line in $dockerfile" >&2
  exit 1
fi
grep '^FROM' "$dockerfile"
