#!/usr/bin/env python3
"""The peer's attention kernels on the shapes that memtune's GPU tests time (the TIMING lines of
CudaAttentionTest.TimingPrintFlashVsEager and CudnnAttentionTest.TimingPrintCudnnVsFlash): causal,
32 query / 8 kv heads, bf16, at batch 8 x seq 2048 (head_dim 128 and 64), 2 x 8192 and 1 x 32768. Reports forward, backward and forward+backward TFLOP/s for PyTorch SDPA's
flash backend and its cuDNN backend, counted the same way as memtune (causal: half of
4*b*h*s*s*d forward, 2.5x that for the backward)."""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, repeats=7):
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def time_shape(b, s, h, kv, d):
    forward_flops = 4 * b * h * s * s * d / 2
    backward_flops = 2.5 * forward_flops
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    print(f"peer attention b{b} s{s} h{h}/{kv} d{d} bf16 causal (torch {torch.__version__}, median of 7):")
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                # The flash backend takes GQA natively (enable_gqa); cuDNN gets repeated K/V if not.
                def forward():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                out = forward()
                fwd = time_ms(lambda: forward())

                def forward_backward():
                    o = forward()
                    o.backward(grad)

                both = time_ms(forward_backward)
            bwd = both - fwd
            print(f"  {name:11s} fwd {fwd:7.3f} ms {forward_flops / fwd / 1e9:6.1f} TFLOP/s | "
                  f"bwd {bwd:7.3f} ms {backward_flops / bwd / 1e9:6.1f} TFLOP/s | "
                  f"fwd+bwd {(forward_flops + backward_flops) / both / 1e9:6.1f} TFLOP/s")
            del out
        except RuntimeError as error:
            print(f"  {name:11s} unavailable: {str(error).splitlines()[0]}")


def main():
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    for b, s, d in ((8, 2048, 128), (2, 8192, 128), (1, 32768, 128), (8, 2048, 64)):
        time_shape(b, s, 32, 8, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
