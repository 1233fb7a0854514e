#!/usr/bin/env python3
"""Repack a wheel smaller, as a valid wheel: some entries dropped, RECORD rewritten (sha256, size)
and a build tag added to the file name and to WHEEL, so that the result is never mistaken for the
original. bench/install_peer_wheels.sh uses it for the two wheels too large to carry to the device:

  repack_wheel.py bitsandbytes SRC_DIR OUT_DIR CUDA   keep only libbitsandbytes_cuda<CUDA>.so and the
                                                      CPU library of the native libraries
  repack_wheel.py unsloth SRC_DIR OUT_DIR             drop the top-level studio/ folder (a web UI:
                                                      82 MB unpacked, never imported by training)
"""
import base64
import glob
import hashlib
import os
import sys
import zipfile


def repack(src, out_dir, build, drop, edit=lambda filename, data: data):
    """Writes SRC repacked into OUT_DIR (atomically; older repacks of the same name removed) and
    returns (path, dropped entries, kept entries with their sizes). drop(filename) -> bool;
    edit(filename, data) -> data, for the entries kept."""
    name, version, *rest = os.path.basename(src)[:-4].split("-")
    out = os.path.join(out_dir, "-".join([name, version, build, *rest[-3:]]) + ".whl")
    for old in glob.glob(os.path.join(out_dir, f"{name}-*.whl")):
        os.remove(old)
    dropped, kept, records = [], [], []
    with zipfile.ZipFile(src) as zin:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        tmp_out = out + ".tmp"
        with zipfile.ZipFile(tmp_out, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename == record_name:
                    continue
                if drop(info.filename):
                    dropped.append(info.filename)
                    continue
                data = edit(info.filename, zin.read(info))
                if info.filename.endswith(".dist-info/WHEEL"):
                    text = data.decode()
                    if "\nBuild:" not in text:
                        text = text.rstrip("\n") + f"\nBuild: {build}\n"
                    data = text.encode()
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                records.append(f"{info.filename},sha256={digest},{len(data)}")
                zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(zi, data)
                kept.append((info.filename, len(data)))
            records.append(f"{record_name},,")
            zout.writestr(record_name, "\n".join(records) + "\n")
        os.replace(tmp_out, out)
    return out, dropped, kept


def only_wheel(src_dir, name):
    (src,) = glob.glob(os.path.join(src_dir, f"{name}-*.whl"))
    return src


def repack_bitsandbytes(src_dir, out_dir, cuda):
    src = only_wheel(src_dir, "bitsandbytes")
    keep_libs = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
    if f"bitsandbytes/libbitsandbytes_cuda{cuda}.so" not in names:
        avail = sorted(n.split("/")[-1] for n in names if "libbitsandbytes_cuda" in n)
        sys.exit(f"no libbitsandbytes_cuda{cuda}.so in {src}; it ships: {avail}")
    base = lambda filename: filename.split("/")[-1]
    out, dropped, kept = repack(src, out_dir, f"1cu{cuda}",
                                drop=lambda f: base(f).startswith("libbitsandbytes_") and base(f) not in keep_libs)
    print(f"install_peer_wheels: wrote {out} ({os.path.getsize(out)} bytes; original {os.path.getsize(src)} bytes)")
    print(f"  kept:    {', '.join(f'{base(f)} ({n} bytes)' for f, n in kept if base(f).startswith('libbitsandbytes_'))}")
    print(f"  dropped: {', '.join(sorted(base(f) for f in dropped))}")


def repack_unsloth(src_dir, out_dir):
    src = only_wheel(src_dir, "unsloth")

    def without_studio(filename, data):
        if filename.endswith(".dist-info/top_level.txt"):
            return "".join(line + "\n" for line in data.decode().split() if line != "studio").encode()
        return data

    out, dropped, _ = repack(src, out_dir, "1nostudio", drop=lambda f: f.split("/")[0] == "studio",
                             edit=without_studio)
    print(f"install_peer_wheels: wrote {out} ({os.path.getsize(out)} bytes; original {os.path.getsize(src)} bytes; "
          f"{len(dropped)} studio/ entries dropped)")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "bitsandbytes":
        repack_bitsandbytes(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 4 and sys.argv[1] == "unsloth":
        repack_unsloth(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
