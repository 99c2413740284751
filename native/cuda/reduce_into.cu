// CUDA variant of chaos reduce_into: acc[i] += float(src[i]) * scale, product rounded before the
// add (explicit __fmul_rn/__fadd_rn, so no FMA), matching the CPU op and the torch fallback.
//
// Plain CUDA with extern "C" launchers over raw pointers: it compiles with only the CUDA runtime
// headers (CI runs `nvcc -c` on it; there is no GPU here, so it is never run in this project's CI).
// native/cuda_binding.cpp wraps the launchers for torch tensors on CUDA builds of torch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename S>
__global__ void reduce_into_kernel(float* __restrict__ acc, const S* __restrict__ src, int64_t n,
                                   float scale, bool unit) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float x = to_float(src[i]);
    acc[i] = __fadd_rn(acc[i], unit ? x : __fmul_rn(x, scale));
  }
}

template <typename S>
cudaError_t launch(float* acc, const S* src, int64_t n, float scale, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  reduce_into_kernel<S><<<blocks, kThreads, 0, stream>>>(acc, src, n, scale, scale == 1.0f);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

cudaError_t chaos_cuda_reduce_into_f32(float* acc, const float* src, int64_t n, float scale,
                                       cudaStream_t stream) {
  return launch<float>(acc, src, n, scale, stream);
}

cudaError_t chaos_cuda_reduce_into_f16(float* acc, const void* src, int64_t n, float scale,
                                       cudaStream_t stream) {
  return launch<__half>(acc, static_cast<const __half*>(src), n, scale, stream);
}

cudaError_t chaos_cuda_reduce_into_bf16(float* acc, const void* src, int64_t n, float scale,
                                        cudaStream_t stream) {
  return launch<__nv_bfloat16>(acc, static_cast<const __nv_bfloat16*>(src), n, scale, stream);
}

}  // extern "C"
