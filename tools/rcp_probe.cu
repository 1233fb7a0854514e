// Which reciprocals does the GPU's approximate reciprocal (rcp.approx.ftz.f32, what `1.0f / x`
// compiles to under nvcc --use_fast_math) round differently from IEEE 1/x? bitsandbytes builds its
// kernels with --use_fast_math and scales each block by 1.0f / absmax, so its 4-bit codes follow
// that instruction. This probe lists, for every mantissa of a bf16 and an f16 absmax (the inputs
// of real checkpoints) and for all 2^23 f32 mantissas, where the two differ, and checks that the
// result does not depend on the exponent.
//
//   nvcc -O2 -arch=sm_90 -o rcp_probe tools/rcp_probe.cu && ./rcp_probe
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

__global__ void reciprocals(const float* x, float* approx, float* exact, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float a;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(a) : "f"(x[i]));
  approx[i] = a;
  exact[i] = __frcp_rn(x[i]);
}

static float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Runs the kernel over values 1.m * 2^(exponent - 127) for mantissas m = i << (23 - bits).
static std::vector<int> mismatches(int mantissa_bits, int exponent, std::vector<int>* signed_ulps) {
  const int n = 1 << mantissa_bits;
  std::vector<float> x(n), approx(n), exact(n);
  for (int i = 0; i < n; ++i) x[i] = from_bits((uint32_t(exponent) << 23) | (uint32_t(i) << (23 - mantissa_bits)));
  float *dx, *da, *de;
  cudaMalloc(&dx, n * 4);
  cudaMalloc(&da, n * 4);
  cudaMalloc(&de, n * 4);
  cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice);
  reciprocals<<<(n + 255) / 256, 256>>>(dx, da, de, n);
  cudaMemcpy(approx.data(), da, n * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(exact.data(), de, n * 4, cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(da);
  cudaFree(de);
  std::vector<int> out;
  for (int i = 0; i < n; ++i)
    if (bits_of(approx[i]) != bits_of(exact[i])) {
      out.push_back(i);
      if (signed_ulps) signed_ulps->push_back(int(int64_t(bits_of(approx[i])) - int64_t(bits_of(exact[i]))));
    }
  return out;
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  for (int bits : {7, 10}) {
    std::vector<int> ulps;
    const std::vector<int> base = mismatches(bits, 127, &ulps);
    bool same = true;
    for (int e : {100, 120, 126, 128, 140, 150})
      same = same && mismatches(bits, e, nullptr) == base;
    std::printf("%s mantissas (%d): %zu differ from IEEE 1/x; independent of the exponent: %s\n",
                bits == 7 ? "bf16" : "f16", 1 << bits, base.size(), same ? "yes" : "NO");
    std::printf("  mantissa(ulp):");
    for (size_t k = 0; k < base.size(); ++k) std::printf(" %d(%+d)", base[k], ulps[k]);
    std::printf("\n");
  }
  std::vector<int> ulps;
  const std::vector<int> all = mismatches(23, 127, &ulps);
  int plus = 0;
  for (int u : ulps) plus += u > 0;
  std::printf("f32 mantissas (8388608): %zu differ (%d one ulp above, %zu below)\n", all.size(), plus,
              all.size() - plus);
  return 0;
}
