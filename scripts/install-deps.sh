#!/usr/bin/env bash
# Installs the Debian packages memtune builds with, where they are missing.
set -euo pipefail
packages=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libyaml-cpp-dev libfmt-dev
          libpcre2-dev libgtest-dev python3
          clang libclang-rt-dev)  # clang + its libFuzzer runtime: the fuzz targets (scripts/fuzz.sh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The cuDNN frontend headers (cuDNN attention backend); a failed fetch only warns.
bash scripts/fetch-cudnn-frontend.sh || echo "warning: cudnn frontend fetch failed; building without it" >&2
