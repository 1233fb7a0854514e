#!/usr/bin/env bash
# Wheels for the Hugging Face peer (bench/peer_hf.py) on a machine with no package index.
#
#   bash bench/install_peer_wheels.sh                 install every wheel in .whl/ (none: says so, exits 0)
#   source bench/install_peer_wheels.sh               the same; if it had to fall back to a --target
#                                                     folder, PYTHONPATH is exported in your shell too
#   bash bench/install_peer_wheels.sh --prepare-bnb [VERSION]
#                                                     (on a machine that reaches PyPI) download the
#                                                     bitsandbytes wheel, keep only the CUDA build the
#                                                     device needs (+ the tiny CPU one), repack it as a
#                                                     valid wheel into .whl/
#   bash bench/install_peer_wheels.sh --prepare-unsloth
#                                                     (PyPI) the wheels bench/peer_unsloth.py needs that
#                                                     the device lacks: unsloth repacked without its
#                                                     top-level studio/ (a web UI training never imports),
#                                                     unsloth_zoo, trl, datasets, torchao and the small
#                                                     pure-Python needs (UNSLOTH_WHEELS below); then the
#                                                     Requires-Dist check and the total size
#   bash bench/install_peer_wheels.sh --prepare-liger  (PyPI) liger-kernel (needs only torch + triton)
#   bash bench/install_peer_wheels.sh --check          each wheel's Requires-Dist against the device's
#                                                     package list and .whl/ (PEER_DEVICE_PACKAGES: a
#                                                     file holding KINDS.md's "Packages:" line)
#
# Install: `pip install --no-deps --no-index --no-cache-dir` into the running Python's environment
# (with --break-system-packages where pip knows the flag). If pip refuses (read-only or externally
# managed site-packages), it installs with --target "$PEER_WHEEL_TARGET" (default /tmp/peer_site)
# and exports PYTHONPATH; when the script is run rather than sourced, use the printed export line.
# Set PEER_WHEEL_TARGET to go straight to a --target install.
#
# Environment: PYTHON (default python3), PEER_WHEEL_DIR (default <repo>/.whl), PEER_WHEEL_TARGET,
# BNB_CUDA (the CUDA build to keep with --prepare-bnb, default 130 = CUDA 13.0), UNSLOTH_VERSION
# (default 2026.10.9: unsloth and unsloth_zoo), LIGER_VERSION (default 0.8.5), PEER_DEVICE_PACKAGES.

_peer_wheels_main() {
  local here repo py dir
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  repo="$(cd "$here/.." && pwd)"
  py="${PYTHON:-python3}"
  dir="${PEER_WHEEL_DIR:-$repo/.whl}"

  if [ "${1:-}" = "--prepare-bnb" ]; then
    _peer_prepare_bnb "$py" "$dir" "${2:-0.50.2}" "${BNB_CUDA:-130}" || return $?
    _peer_check "$py" "$dir"
    return $?
  fi
  if [ "${1:-}" = "--prepare-unsloth" ]; then
    _peer_prepare_unsloth "$py" "$dir" || return $?
    _peer_check "$py" "$dir"
    return $?
  fi
  if [ "${1:-}" = "--prepare-liger" ]; then
    _peer_download "$py" "$dir" "liger_kernel==${LIGER_VERSION:-0.8.5}" || return $?
    _peer_check "$py" "$dir"
    return $?
  fi
  if [ "${1:-}" = "--check" ]; then
    _peer_check "$py" "$dir"
    return $?
  fi
  if [ $# -gt 0 ]; then
    echo "install_peer_wheels: unknown argument '$1' (see the header of ${BASH_SOURCE[0]})" >&2
    return 2
  fi

  local wheels=() w
  for w in "$dir"/*.whl; do [ -f "$w" ] && wheels+=("$w"); done
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "install_peer_wheels: no wheels in $dir: nothing to install"
    return 0
  fi
  echo "install_peer_wheels: ${#wheels[@]} wheel(s) in $dir:"
  for w in "${wheels[@]}"; do echo "  $(basename "$w") ($(du -k "$w" | cut -f1) KiB)"; done
  if [ -n "${BNB_CUDA_VERSION:-}" ]; then
    echo "install_peer_wheels: note: BNB_CUDA_VERSION=$BNB_CUDA_VERSION is set; bitsandbytes then loads" \
         "libbitsandbytes_cuda$BNB_CUDA_VERSION.so and nothing else" >&2
  fi

  local pip_flags=(--no-deps --no-index --no-cache-dir --no-compile --disable-pip-version-check)
  local mode="" target="${PEER_WHEEL_TARGET:-}"
  if [ -z "$target" ]; then
    local extra=()
    if "$py" -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
      extra=(--break-system-packages)
    fi
    if "$py" -m pip install -q "${pip_flags[@]}" "${extra[@]}" "${wheels[@]}"; then
      mode="environment of $("$py" -c 'import sys; print(sys.prefix)')"
    else
      echo "install_peer_wheels: pip refused the environment install; falling back to --target" >&2
      target=/tmp/peer_site
    fi
  fi
  if [ -z "$mode" ]; then
    mkdir -p "$target" || return 1
    if ! "$py" -m pip install -q "${pip_flags[@]}" --upgrade --target "$target" "${wheels[@]}"; then
      echo "install_peer_wheels: pip install --target $target failed" >&2
      return 1
    fi
    case ":${PYTHONPATH:-}:" in
      *":$target:"*) ;;
      *) export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    mode="--target $target"
    echo "install_peer_wheels: installed into $target; in a shell that did not source this script run:"
    echo "  export PYTHONPATH=$PYTHONPATH"
  fi

  echo "install_peer_wheels: installed ($mode):"
  local name
  for w in "${wheels[@]}"; do
    name="$(basename "$w" | cut -d- -f1)"
    "$py" - "$name" <<'EOF'
import importlib.metadata as md, sys
name = sys.argv[1]
try:
    dist = md.distribution(name)
    where = dist.locate_file("")
    print(f"  {name} {dist.version} at {where}")
except md.PackageNotFoundError:
    print(f"  {name}: NOT importable from this Python after the install", file=sys.stderr)
    sys.exit(1)
EOF
  done
  return 0
}

# One wheel (no dependencies) for the device's Python: CPython 3.12 on x86_64 Linux, any manylinux.
_peer_pip_download() {
  local py="$1" dest="$2" spec="$3"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dest" "$spec"
}

_peer_prepare_bnb() {
  local py="$1" dir="$2" version="$3" cuda="$4" tmp
  tmp="$(mktemp -d)" || return 1
  echo "install_peer_wheels: downloading bitsandbytes==$version (manylinux x86_64, cp312)"
  if ! _peer_pip_download "$py" "$tmp" "bitsandbytes==$version"; then
    echo "install_peer_wheels: pip download failed" >&2
    rm -rf "$tmp"
    return 1
  fi
  mkdir -p "$dir" || return 1
  "$py" "$(dirname "${BASH_SOURCE[0]}")/repack_wheel.py" bitsandbytes "$tmp" "$dir" "$cuda"
  local rc=$?
  rm -rf "$tmp"
  return $rc
}

# What bench/peer_unsloth.py needs beyond the device's image (KINDS.md lists it: torch, triton,
# transformers, peft, accelerate, xxhash, einops, ... are there). Pinned: the versions issue 21 ran.
UNSLOTH_VERSION=${UNSLOTH_VERSION:-2026.10.9}
UNSLOTH_WHEELS=(
  "unsloth_zoo==$UNSLOTH_VERSION" trl==1.15.0 datasets==4.8.5 torchao==0.18.0
  dill==0.4.1 multiprocess==0.70.19                          # datasets
  tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1     # unsloth, unsloth_zoo (tyro)
  msgspec==0.23.0 cut_cross_entropy==25.1.1                  # unsloth_zoo
  json5==0.17.3 structlog==26.1.0 nest_asyncio==1.6.0        # unsloth
)

# pip download --no-deps of each NAME==VERSION into DIR (cp312, manylinux x86_64 or pure Python);
# an older file of the same distribution is removed first, so one version of each stays.
_peer_download() {
  local py="$1" dir="$2" spec name tmp f
  shift 2
  mkdir -p "$dir" || return 1
  tmp="$(mktemp -d)" || return 1
  for spec in "$@"; do
    echo "install_peer_wheels: downloading $spec"
    if ! _peer_pip_download "$py" "$tmp" "$spec"; then
      echo "install_peer_wheels: pip download $spec failed" >&2
      rm -rf "$tmp"
      return 1
    fi
  done
  for f in "$tmp"/*.whl; do
    name="$(basename "$f" | cut -d- -f1)"
    rm -f "$dir/$name"-*.whl
    mv "$f" "$dir/"
  done
  rm -rf "$tmp"
}

_peer_prepare_unsloth() {
  local py="$1" dir="$2" tmp
  _peer_download "$py" "$dir" "${UNSLOTH_WHEELS[@]}" || return 1
  tmp="$(mktemp -d)" || return 1
  echo "install_peer_wheels: downloading unsloth==$UNSLOTH_VERSION (to repack without studio/)"
  if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform any -d "$tmp" "unsloth==$UNSLOTH_VERSION"; then
    echo "install_peer_wheels: pip download unsloth failed" >&2
    rm -rf "$tmp"
    return 1
  fi
  "$py" "$(dirname "${BASH_SOURCE[0]}")/repack_wheel.py" unsloth "$tmp" "$dir"
  local rc=$?
  rm -rf "$tmp"
  return $rc
}

# Each wheel's Requires-Dist (markers evaluated for Linux x86_64, CPython 3.12; extras skipped)
# against the device's package list and the wheels in DIR; then every file with its size and the
# total, which counts against the 64 MiB a device call carries.
_peer_check() {
  local py="$1" dir="$2"
  "$py" - "$dir" "${PEER_DEVICE_PACKAGES:-/work/.library/device/KINDS.md}" <<'PYEOF'
import glob, os, re, sys, zipfile
wheel_dir, packages_file = sys.argv[1], sys.argv[2]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
device = set()
try:
    text = open(packages_file).read()
    m = re.search(r"Packages:\s*(.*?)\.\s*$", text, re.M | re.S)
    if m:
        device = {norm(x.strip()) for x in m.group(1).split(",") if x.strip()}
except OSError:
    pass
wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
have = {norm(os.path.basename(w).split("-")[0]) for w in wheels}
try:
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None
env = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
       "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
# Needs that the peers run without (issue 21 ran without them): listed as optional, not missing.
optional = {"xformers", "hf-transfer", "diffusers", "torchvision", "pydantic", "triton-windows", "mlx", "mlx-lm",
            "mlx-vlm", "eval-type-backport"}
missing = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode("utf-8", "replace").splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            spec = line.split(":", 1)[1].strip()
            if Requirement:
                req = Requirement(spec)
                if req.marker and not req.marker.evaluate(env):
                    continue
                name = norm(req.name)
            else:
                if "extra ==" in spec:
                    continue
                name = norm(re.split(r"[ ;<>=!~\[(]", spec, maxsplit=1)[0])
            if name not in device and name not in have:
                missing.setdefault(name, []).append(os.path.basename(w).split("-")[0])
if not device:
    print(f"install_peer_wheels: no device package list at {packages_file}: every need not in .whl/ is listed")
for name, by in sorted(missing.items()):
    tag = "optional" if name in optional else "MISSING"
    print(f"  {tag}: {name} (needed by {', '.join(sorted(set(by)))})")
if device and not any(n not in optional for n in missing):
    print("install_peer_wheels: every required dependency is on the device or in " + wheel_dir)
total = 0
for w in wheels:
    size = os.path.getsize(w)
    total += size
    print(f"  {os.path.basename(w)}  {size / 2**20:.2f} MiB")
print(f"install_peer_wheels: {len(wheels)} wheels, {total / 2**20:.2f} MiB in all")
PYEOF
}

_peer_wheels_main "$@"
_peer_wheels_rc=$?
unset -f _peer_wheels_main _peer_prepare_bnb _peer_prepare_unsloth _peer_download _peer_check
unset UNSLOTH_WHEELS
# Sourced: return to the caller's shell without exiting it; run: exit with the status.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  return "$_peer_wheels_rc"
fi
exit "$_peer_wheels_rc"
