#!/usr/bin/env bash
# Fetches NVIDIA's header-only cuDNN frontend (MIT) into build-deps/cudnn-frontend/include, from
# its PyPI wheel: the headers are a dependency, not part of this repo. CMake finds them there
# (or wherever MEMTUNE_CUDNN_FRONTEND_DIR points) and builds the cuDNN attention backend. A
# failed fetch only warns: memtune then builds without that backend.
set -uo pipefail
cd "$(dirname "$0")/.."
version=1.32.0
dest=build-deps/cudnn-frontend
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download -q --no-deps "nvidia-cudnn-frontend==$version" -d "$tmp" >"$tmp/log" 2>&1; then
  echo "warning: could not fetch nvidia-cudnn-frontend==$version; building without cuDNN attention" >&2
  tail -3 "$tmp/log" >&2
  exit 0
fi
wheel=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ] || ! python3 - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    if not names:
        sys.exit(1)
    z.extractall(sys.argv[2], names)
PY
then
  echo "warning: nvidia-cudnn-frontend wheel has no include/; building without cuDNN attention" >&2
  exit 0
fi
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/x/include" "$dest/include"
echo "$version" >"$dest/VERSION"
echo "cudnn frontend $version headers in $dest/include"
