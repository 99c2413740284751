// Torch bindings of the CUDA kernels in native/cuda/ (chaos._native.load_cuda).
//
// Built only on CUDA builds of torch with a GPU present; this project's machines have neither,
// so this file is never compiled or run here (the .cu kernels are compiled by `nvcc -c` in CI).

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

extern "C" {
cudaError_t chaos_cuda_reduce_into_f32(float*, const float*, int64_t, float, cudaStream_t);
cudaError_t chaos_cuda_reduce_into_f16(float*, const void*, int64_t, float, cudaStream_t);
cudaError_t chaos_cuda_reduce_into_bf16(float*, const void*, int64_t, float, cudaStream_t);
int64_t chaos_cuda_checksum_workspace(int64_t);
cudaError_t chaos_cuda_checksum(const uint8_t*, int64_t, uint64_t*, uint64_t*, cudaStream_t);
}

namespace {

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", cudaGetErrorString(err));
}

void reduce_into(at::Tensor acc, const at::Tensor& src, double scale) {
  TORCH_CHECK_VALUE(acc.is_cuda() && src.is_cuda() && acc.device() == src.device(),
                    "reduce_into: tensors must be on one CUDA device");
  TORCH_CHECK_VALUE(acc.is_contiguous() && src.is_contiguous() && acc.numel() == src.numel(),
                    "reduce_into: contiguous tensors of equal size");
  TORCH_CHECK_TYPE(acc.scalar_type() == at::kFloat, "reduce_into (CUDA): float32 acc only");
  const auto stream = at::cuda::getCurrentCUDAStream(acc.device().index()).stream();
  const int64_t n = acc.numel();
  const float s = static_cast<float>(scale);
  float* a = acc.data_ptr<float>();
  switch (src.scalar_type()) {
    case at::kFloat:
      return check(chaos_cuda_reduce_into_f32(a, src.data_ptr<float>(), n, s, stream), "reduce_into");
    case at::kHalf:
      return check(chaos_cuda_reduce_into_f16(a, src.data_ptr(), n, s, stream), "reduce_into");
    case at::kBFloat16:
      return check(chaos_cuda_reduce_into_bf16(a, src.data_ptr(), n, s, stream), "reduce_into");
    default:
      TORCH_CHECK_TYPE(false, "reduce_into (CUDA): unsupported src dtype ", src.scalar_type());
  }
}

uint64_t checksum(const at::Tensor& u8) {
  TORCH_CHECK_VALUE(u8.is_cuda() && u8.is_contiguous() && u8.scalar_type() == at::kByte,
                    "checksum (CUDA): expects a contiguous uint8 CUDA tensor");
  const int64_t n = u8.numel();
  const auto stream = at::cuda::getCurrentCUDAStream(u8.device().index()).stream();
  auto opts = u8.options().dtype(at::kLong);
  auto work = at::empty({chaos_cuda_checksum_workspace(n) + 1}, opts);
  auto* w = reinterpret_cast<uint64_t*>(work.data_ptr<int64_t>());
  check(chaos_cuda_checksum(u8.data_ptr<uint8_t>(), n, w + 1, w, stream), "checksum");
  const int64_t result = work[0].item<int64_t>();  // synchronizes with the stream
  uint64_t out;
  std::memcpy(&out, &result, sizeof(out));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Chaos native data-plane ops (CUDA)";
  m.def("reduce_into", &reduce_into, py::arg("acc"), py::arg("src"), py::arg("scale"));
  m.def("checksum", &checksum, py::arg("u8"));
}
