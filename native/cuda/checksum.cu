// CUDA variant of the chaos checksum (definition in chaos/ops.py): 8-byte little-endian blocks j,
// weights W_j = (j mod 2**31) + 1, P = 2**32 - 5, A = (n + sum W_j lo_j) mod P,
// B = (sum W_j hi_j) mod P, result A * 2**32 + B. Exact integer arithmetic, so it equals the CPU op.
//
// Plain CUDA with extern "C" launchers over raw pointers: it compiles with only the CUDA runtime
// headers (CI runs `nvcc -c` on it; there is no GPU here, so it is never run in this project's CI).

#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr uint64_t kPrime = 4294967291ULL;  // 2**32 - 5
constexpr int64_t kRow = 1 << 15;           // blocks per row; divides 2**31
constexpr uint64_t kWeightPeriod = 1ULL << 31;
constexpr int kThreads = 256;

template <bool kAligned>
__device__ __forceinline__ uint64_t load_block(const uint8_t* p) {
  if (kAligned) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

// One CUDA block per row: row_a[r], row_b[r] = that row's (sum W lo, sum W hi) mod P.
template <bool kAligned>
__global__ void checksum_rows_kernel(const uint8_t* __restrict__ data, int64_t nfull,
                                     uint64_t* __restrict__ row_a, uint64_t* __restrict__ row_b) {
  __shared__ uint64_t sh[4][kThreads];
  const int64_t r = blockIdx.x;
  const int64_t first = r * kRow;
  const int64_t count = nfull - first < kRow ? nfull - first : kRow;
  uint64_t s1a = 0, s2a = 0, s1b = 0, s2b = 0;  // whole-row bounds: s1 < 2**47, s2 < 2**62
  for (int64_t t = threadIdx.x; t < count; t += kThreads) {
    const uint64_t v = load_block<kAligned>(data + 8 * (first + t));
    const uint64_t lo = v & 0xFFFFFFFFULL, hi = v >> 32;
    s1a += lo;
    s2a += static_cast<uint64_t>(t) * lo;
    s1b += hi;
    s2b += static_cast<uint64_t>(t) * hi;
  }
  sh[0][threadIdx.x] = s1a;
  sh[1][threadIdx.x] = s2a;
  sh[2][threadIdx.x] = s1b;
  sh[3][threadIdx.x] = s2b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      for (int k = 0; k < 4; ++k) sh[k][threadIdx.x] += sh[k][threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const uint64_t base = static_cast<uint64_t>(first) % kWeightPeriod + 1;  // <= 2**31
    row_a[r] = (base * (sh[0][0] % kPrime) + sh[1][0] % kPrime) % kPrime;
    row_b[r] = (base * (sh[2][0] % kPrime) + sh[3][0] % kPrime) % kPrime;
  }
}

// One CUDA block: folds the row results, the length and the zero-padded tail into *out.
__global__ void checksum_finish_kernel(const uint8_t* __restrict__ data, int64_t n, int64_t nrows,
                                       const uint64_t* __restrict__ row_a,
                                       const uint64_t* __restrict__ row_b, uint64_t* out) {
  __shared__ uint64_t sh[2][kThreads];
  uint64_t a = 0, b = 0;
  for (int64_t r = threadIdx.x; r < nrows; r += kThreads) {
    a = (a + row_a[r]) % kPrime;
    b = (b + row_b[r]) % kPrime;
  }
  sh[0][threadIdx.x] = a;
  sh[1][threadIdx.x] = b;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sh[0][threadIdx.x] = (sh[0][threadIdx.x] + sh[0][threadIdx.x + half]) % kPrime;
      sh[1][threadIdx.x] = (sh[1][threadIdx.x] + sh[1][threadIdx.x + half]) % kPrime;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    a = (sh[0][0] + static_cast<uint64_t>(n) % kPrime) % kPrime;
    b = sh[1][0];
    const int64_t nfull = n / 8;
    const int64_t rem = n % 8;
    if (rem) {
      uint64_t v = 0;
      for (int64_t k = rem - 1; k >= 0; --k) v = (v << 8) | data[8 * nfull + k];
      const uint64_t w = static_cast<uint64_t>(nfull) % kWeightPeriod + 1;
      a = (a + w * (v & 0xFFFFFFFFULL) % kPrime) % kPrime;
      b = (b + w * (v >> 32) % kPrime) % kPrime;
    }
    *out = (a << 32) | b;
  }
}

}  // namespace

extern "C" {

// Number of uint64 values of device workspace chaos_cuda_checksum needs for n bytes.
int64_t chaos_cuda_checksum_workspace(int64_t n) {
  const int64_t nrows = (n / 8 + kRow - 1) / kRow;
  return 2 * (nrows > 0 ? nrows : 1);
}

// Checksum of n device bytes at data into the device uint64 *out (asynchronous on stream).
cudaError_t chaos_cuda_checksum(const uint8_t* data, int64_t n, uint64_t* workspace, uint64_t* out,
                                cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  const int64_t nfull = n / 8;
  const int64_t nrows = (nfull + kRow - 1) / kRow;
  uint64_t* row_a = workspace;
  uint64_t* row_b = workspace + (nrows > 0 ? nrows : 1);
  if (nrows > 0) {
    if (reinterpret_cast<uintptr_t>(data) % 8 == 0) {
      checksum_rows_kernel<true><<<static_cast<unsigned>(nrows), kThreads, 0, stream>>>(
          data, nfull, row_a, row_b);
    } else {
      checksum_rows_kernel<false><<<static_cast<unsigned>(nrows), kThreads, 0, stream>>>(
          data, nfull, row_a, row_b);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  checksum_finish_kernel<<<1, kThreads, 0, stream>>>(data, n, nrows, row_a, row_b, out);
  return cudaGetLastError();
}

}  // extern "C"
