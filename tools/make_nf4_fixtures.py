#!/usr/bin/env python3
"""Reference fixtures for memtune's 4-bit quantizer, made with the real bitsandbytes.

    python3 tools/make_nf4_fixtures.py --device cuda --out tests/fixtures/nf4/cuda
    python3 tools/make_nf4_fixtures.py --device cpu  --out tests/fixtures/nf4/cpu

--device cuda runs bitsandbytes' CUDA kernels (the path memtune follows); --device cpu runs its
CPU backend (torch.bucketize for the 4-bit codes, a C++ binary search for the 8-bit nested codes).

Output: index.json (what each case is, and where its arrays are) and data.bin (all arrays,
little-endian, back to back). Each array reference is
{"offset": bytes into data.bin, "nbytes": ..., "dtype": "f32"|"bf16"|"u8", "shape": [...]}.
Everything is seeded; the inputs are generated on the CPU so both devices see the same numbers.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

import bitsandbytes
import bitsandbytes.functional as F


class Blob:
    def __init__(self):
        self.parts = []
        self.size = 0

    def add(self, tensor):
        tensor = tensor.detach().cpu().contiguous()
        dtype = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16",
                 torch.uint8: "u8"}[tensor.dtype]
        if tensor.dtype in (torch.bfloat16, torch.float16):
            raw = tensor.view(torch.int16).numpy().tobytes()
        else:
            raw = tensor.numpy().tobytes()
        ref = {"offset": self.size, "nbytes": len(raw), "dtype": dtype,
               "shape": list(tensor.shape)}
        self.parts.append(raw)
        self.size += len(raw)
        return ref


NF4_THRESHOLDS = [-0.8480964004993439, -0.6106329262256622, -0.4599952697753906,
                  -0.33967943489551544, -0.23460740596055984, -0.13791173323988914,
                  -0.045525018125772476, 0.03979014977812767, 0.1202552504837513,
                  0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
                  0.5016634166240692, 0.6427869200706482, 0.8614784181118011]
FP4_THRESHOLDS = [0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333]


def f32(x):
    return np.float32(x)


def next_up(x):
    return np.nextafter(f32(x), f32(np.inf))


def next_down(x):
    return np.nextafter(f32(x), f32(-np.inf))


def adversarial_rows(gen):
    """[11, 64] float32, one 64-element block per row (blocksize 64)."""
    rows = []
    rows.append(np.zeros(64, np.float32))                              # 0 all zero
    rows.append(np.full(64, 0.37, np.float32))                         # 1 constant
    rows.append(np.full(64, -0.37, np.float32))                        # 2 negative constant
    r = (torch.randn(64, generator=gen) * 0.02).numpy().astype(np.float32)
    r[5] = 1e30                                                        # 3 one huge outlier
    rows.append(r)
    signs = np.where(torch.rand(64, generator=gen).numpy() < 0.5, -1.0, 1.0)
    rows.append((signs * np.linspace(1e-41, 1e-39, 64)).astype(np.float32))  # 4 all subnormal
    r = (signs * np.linspace(1e-41, 1e-39, 64)).astype(np.float32)     # 5 subnormal + tiny normal
    r[0] = f32(2e-38)
    r[1] = f32(-1.5e-38)
    rows.append(r)
    r = np.where(np.arange(64) % 2 == 0, f32(-0.0), f32(0.0)).astype(np.float32)
    r[63] = 1.0                                                        # 6 signed zeros
    rows.append(r)
    r = np.zeros(64, np.float32)                                       # 7 NF4 exact midpoints
    vals = [1.0, -1.0] + [f32(t) for t in NF4_THRESHOLDS] + [next_up(t) for t in NF4_THRESHOLDS]
    r[: len(vals)] = vals
    rows.append(r)
    r = np.zeros(64, np.float32)                                       # 8 FP4 exact midpoints
    vals = [1.0]
    for t in FP4_THRESHOLDS:
        vals += [f32(t), -f32(t), next_up(t), -next_up(t)]
    r[: len(vals)] = vals
    rows.append(r)
    r = np.zeros(64, np.float32)                                       # 9 near-midpoints, absmax 3.7
    scale = f32(3.7)
    vals = [scale]
    for t in NF4_THRESHOLDS:
        x = f32(f32(t) * scale)
        vals += [next_down(x), x, next_up(x)]
    r[: len(vals)] = vals
    rows.append(r)
    r = np.zeros(64, np.float32)                                       # 10 same for FP4, absmax 0.9
    scale = f32(0.9)
    vals = [scale]
    for t in FP4_THRESHOLDS:
        x = f32(f32(t) * scale)
        vals += [next_down(x), x, next_up(x), -x]
    r[: len(vals)] = vals
    rows.append(r)
    return torch.from_numpy(np.stack(rows))


def blockwise8_input(code):
    """[3, 256] float32 for quantize_blockwise(blocksize=256): block 0 holds every code value and
    every fp32 midpoint (a + b) * 0.5f, block 1 one ulp either side of the midpoints, block 2 noise."""
    c = code.cpu().numpy().astype(np.float32)
    mids = ((c[:-1] + c[1:]) * f32(0.5)).astype(np.float32)
    b0 = np.concatenate([c[::2], mids[::2]])[:256]
    b0[0] = 1.0
    b1 = np.zeros(256, np.float32)
    near = np.concatenate([next_down(mids[1::2]), next_up(mids[::2])])
    b1[1 : 1 + min(255, near.size)] = near[:255]
    b1[0] = 1.0
    gen = torch.Generator().manual_seed(7)
    b2 = torch.randn(256, generator=gen).numpy().astype(np.float32)
    return torch.from_numpy(np.stack([b0, b1, b2]).astype(np.float32))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"

    blob = Blob()
    gen = torch.Generator().manual_seed(1234)
    inputs = {}
    for rows, cols in [(64, 96), (33, 70), (5, 7), (128, 256)]:
        base = torch.randn(rows, cols, generator=gen) * 0.05
        inputs[f"w{rows}x{cols}_f32"] = base.float()
        inputs[f"w{rows}x{cols}_bf16"] = base.bfloat16()
    inputs["adversarial_f32"] = adversarial_rows(gen)

    cases = []

    def add_case(input_name, quant_type, double_quant, blocksize):
        a_cpu = inputs[input_name]
        a = a_cpu.to(device)
        packed, state = F.quantize_4bit(a, blocksize=blocksize, compress_statistics=double_quant,
                                        quant_type=quant_type)
        dq = F.dequantize_4bit(packed, state)
        saved = state.as_dict(packed=True)
        qs_key = f"quant_state.bitsandbytes__{quant_type}"
        case = {
            "name": f"{input_name}_{quant_type}_{'dq' if double_quant else 'nodq'}_bs{blocksize}",
            "input": input_name,
            "quant_type": quant_type,
            "double_quant": double_quant,
            "blocksize": blocksize,
            "packed": blob.add(packed),
            "absmax": blob.add(saved["absmax"]),
            "quant_map": blob.add(saved["quant_map"]),
            "quant_state_json": bytes(saved[qs_key].cpu().numpy()).decode("utf-8"),
            "dequant": blob.add(dq),
        }
        if double_quant:
            case["nested_absmax"] = blob.add(saved["nested_absmax"])
            case["nested_quant_map"] = blob.add(saved["nested_quant_map"])
            case["nested_offset"] = float(state.offset.item())
            # The fp32 absmax before double quantization, for the offset / nested-code checks.
            _, plain = F.quantize_4bit(a, blocksize=blocksize, compress_statistics=False,
                                       quant_type=quant_type)
            case["plain_absmax"] = blob.add(plain.absmax)
            # Dequantized absmax as bitsandbytes computes it (dequantize_blockwise + offset).
            deq = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
            case["dequant_absmax"] = blob.add(deq.float())
        cases.append(case)

    for name in ["w64x96_f32", "w64x96_bf16", "w33x70_f32", "w33x70_bf16"]:
        for quant_type in ["nf4", "fp4"]:
            for double_quant in [False, True]:
                add_case(name, quant_type, double_quant, 64)
    add_case("w64x96_bf16", "nf4", True, 32)
    add_case("w64x96_bf16", "nf4", True, 128)
    add_case("w5x7_f32", "nf4", False, 32)
    add_case("w5x7_f32", "fp4", False, 32)
    add_case("w128x256_bf16", "nf4", True, 64)
    add_case("w128x256_f32", "fp4", True, 64)
    add_case("adversarial_f32", "nf4", False, 64)
    add_case("adversarial_f32", "fp4", False, 64)
    add_case("adversarial_f32", "nf4", True, 64)

    dynamic = F.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)
    blockwise = []
    bw_in = blockwise8_input(dynamic)
    code = dynamic.clone().to(device)  # the CPU kernel writes code[0] = -1 into its argument
    codes8, bw_state = F.quantize_blockwise(bw_in.to(device), code=code, blocksize=256)
    blockwise.append({"name": "dynamic_map_ties", "input": blob.add(bw_in),
                      "codes": blob.add(codes8), "absmax": blob.add(bw_state.absmax),
                      "code_after_call": blob.add(code)})

    index = {
        "generator": {
            "script": "tools/make_nf4_fixtures.py",
            "bitsandbytes": bitsandbytes.__version__,
            "torch": torch.__version__,
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "code_path": ("bitsandbytes CUDA kernels (kQuantizeBlockwise NF4/FP4/General8bit)"
                          if args.device == "cuda" else
                          "bitsandbytes CPU backend: default quantize_4bit (torch.bucketize), "
                          "C++ quantize_blockwise_cpu for the nested codes"),
        },
        "dynamic_map": blob.add(dynamic),
        "quant_maps": {t: blob.add(F.get_4bit_type(t, device="cpu")) for t in ["nf4", "fp4"]},
        "inputs": {name: blob.add(t) for name, t in inputs.items()},
        "cases": cases,
        "blockwise8": blockwise,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "data.bin"), "wb") as f:
        for part in blob.parts:
            f.write(part)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases, {blob.size} bytes, to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
