// Chaos native data-plane ops (CPU). Built just in time by chaos._native.load().
//
// Every op here has a pure-torch twin in chaos/ops.py and must give bitwise equal results:
//   reduce_into(acc, src, scale): acc += float(src) * scale, product rounded before the add
//                                 (built with -ffp-contract=off so no FMA is formed);
//   pack(tensors, out) / unpack(flat, tensors): memcpy of contiguous tensors in order;
//   checksum(u8): the position-weighted two-sum checksum defined in chaos/ops.py.
// The Python facade validates arguments; the checks here guard against misuse of the raw module.
// All ops release the GIL (see the bindings at the bottom).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "chaos native ops assume little-endian");

constexpr int64_t kGrain = 1 << 15;        // elements per parallel task
constexpr int64_t kBlock = 512;            // conversion buffer (elements)
constexpr uint64_t kPrime = 4294967291ULL;  // 2**32 - 5
constexpr int64_t kRow = 1 << 15;          // checksum blocks per row; divides 2**31
constexpr uint64_t kWeightPeriod = 1ULL << 31;

// ---------------------------------------------------------------------------------------------
// reduce_into

template <typename S, typename A>
inline void convert(const S* src, A* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(static_cast<float>(src[i]));
}

template <>
inline void convert<c10::BFloat16, float>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the high half of a float32: widening is a 16-bit shift.
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

#if defined(__F16C__)
template <>
inline void convert<c10::Half, float>(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

template <typename A>
inline void axpy(A* __restrict acc, const A* __restrict x, int64_t n, A scale, bool unit) {
  if (unit) {
    for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const A p = x[i] * scale;  // rounded product: matches torch's mul_ then add_
      acc[i] += p;
    }
  }
}

template <typename S, typename A>
void reduce_typed(A* acc, const S* src, int64_t n, double scale_d) {
  const A scale = static_cast<A>(scale_d);
  const bool unit = scale_d == 1.0;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<S, A>) {
      axpy<A>(acc + begin, src + begin, end - begin, scale, unit);
    } else {
      A buf[kBlock];
      for (int64_t i = begin; i < end; i += kBlock) {
        const int64_t m = std::min<int64_t>(kBlock, end - i);
        convert<S, A>(src + i, buf, m);
        axpy<A>(acc + i, buf, m, scale, unit);
      }
    }
  });
}

void reduce_into(at::Tensor acc, const at::Tensor& src, double scale) {
  TORCH_CHECK_VALUE(acc.device().is_cpu() && src.device().is_cpu(), "reduce_into: CPU tensors only");
  TORCH_CHECK_VALUE(acc.is_contiguous() && src.is_contiguous(), "reduce_into: contiguous tensors only");
  TORCH_CHECK_VALUE(acc.numel() == src.numel(), "reduce_into: size mismatch ", acc.numel(), " vs ",
                    src.numel());
  const int64_t n = acc.numel();
  if (n == 0) return;
  const auto st = src.scalar_type();
  if (acc.scalar_type() == at::kFloat) {
    float* a = acc.data_ptr<float>();
    if (st == at::kFloat) return reduce_typed<float, float>(a, src.data_ptr<float>(), n, scale);
    if (st == at::kHalf) return reduce_typed<c10::Half, float>(a, src.data_ptr<c10::Half>(), n, scale);
    if (st == at::kBFloat16)
      return reduce_typed<c10::BFloat16, float>(a, src.data_ptr<c10::BFloat16>(), n, scale);
  } else if (acc.scalar_type() == at::kDouble) {
    double* a = acc.data_ptr<double>();
    if (st == at::kDouble) return reduce_typed<double, double>(a, src.data_ptr<double>(), n, scale);
    if (st == at::kFloat) return reduce_typed<float, double>(a, src.data_ptr<float>(), n, scale);
    if (st == at::kHalf) return reduce_typed<c10::Half, double>(a, src.data_ptr<c10::Half>(), n, scale);
    if (st == at::kBFloat16)
      return reduce_typed<c10::BFloat16, double>(a, src.data_ptr<c10::BFloat16>(), n, scale);
  }
  TORCH_CHECK_TYPE(false, "reduce_into: unsupported dtypes acc=", acc.scalar_type(),
                   " src=", st);
}

// ---------------------------------------------------------------------------------------------
// pack / unpack

struct Span {
  char* dst;
  const char* src;
  int64_t nbytes;
};

// Copies every span, splitting large ones so that all threads share the work.
void copy_spans(const std::vector<Span>& spans) {
  constexpr int64_t kChunk = 1 << 20;  // bytes per task
  std::vector<Span> tasks;
  for (const auto& s : spans) {
    for (int64_t off = 0; off < s.nbytes; off += kChunk) {
      tasks.push_back({s.dst + off, s.src + off, std::min(kChunk, s.nbytes - off)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(tasks[i].dst, tasks[i].src, tasks[i].nbytes);
  });
}

int64_t check_list(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, const char* op) {
  TORCH_CHECK_VALUE(flat.device().is_cpu() && flat.is_contiguous() && flat.dim() == 1, op,
                    ": the flat buffer must be a 1-D contiguous CPU tensor");
  int64_t total = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), op,
                      ": tensors must be contiguous CPU tensors");
    TORCH_CHECK_VALUE(t.scalar_type() == flat.scalar_type(), op, ": dtype mismatch ",
                      t.scalar_type(), " vs ", flat.scalar_type());
    total += t.numel();
  }
  return total;
}

void pack(const std::vector<at::Tensor>& tensors, at::Tensor out) {
  const int64_t total = check_list(tensors, out, "pack");
  TORCH_CHECK_VALUE(out.numel() >= total, "pack: out holds ", out.numel(), " elements, ", total,
                    " needed");
  const int64_t item = static_cast<int64_t>(out.element_size());
  std::vector<Span> spans;
  char* dst = static_cast<char*>(out.data_ptr());
  for (const auto& t : tensors) {
    const int64_t nb = t.numel() * item;
    if (nb) spans.push_back({dst, static_cast<const char*>(t.data_ptr()), nb});
    dst += nb;
  }
  copy_spans(spans);
}

void unpack(const at::Tensor& flat, std::vector<at::Tensor> tensors) {
  const int64_t total = check_list(tensors, flat, "unpack");
  TORCH_CHECK_VALUE(flat.numel() == total, "unpack: flat has ", flat.numel(), " elements, ", total,
                    " needed");
  const int64_t item = static_cast<int64_t>(flat.element_size());
  std::vector<Span> spans;
  const char* src = static_cast<const char*>(flat.data_ptr());
  for (auto& t : tensors) {
    const int64_t nb = t.numel() * item;
    if (nb) spans.push_back({static_cast<char*>(t.data_ptr()), src, nb});
    src += nb;
  }
  copy_spans(spans);
}

// ---------------------------------------------------------------------------------------------
// checksum

inline uint64_t load_block(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// (sum W_j lo_j mod P, sum W_j hi_j mod P) over the row of blocks starting at block index `first`
// (a multiple of kRow): W_j = first mod 2**31 + 1 + t.
inline void checksum_row(const uint8_t* data, int64_t first, int64_t count, uint64_t* a,
                         uint64_t* b) {
  uint64_t s1a = 0, s2a = 0, s1b = 0, s2b = 0;  // s1 < 2**47, s2 < 2**62
  for (int64_t t = 0; t < count; ++t) {
    const uint64_t v = load_block(data + 8 * t);
    const uint64_t lo = v & 0xFFFFFFFFULL, hi = v >> 32;
    const uint64_t tt = static_cast<uint32_t>(t);
    s1a += lo;
    s2a += tt * lo;
    s1b += hi;
    s2b += tt * hi;
  }
  const uint64_t base = static_cast<uint64_t>(first) % kWeightPeriod + 1;  // <= 2**31
  *a = (base * (s1a % kPrime) + s2a % kPrime) % kPrime;
  *b = (base * (s1b % kPrime) + s2b % kPrime) % kPrime;
}

uint64_t checksum_bytes(const uint8_t* data, int64_t n) {
  const int64_t nfull = n / 8;
  const int64_t nrows = (nfull + kRow - 1) / kRow;
  std::vector<uint64_t> ra(nrows), rb(nrows);
  at::parallel_for(0, nrows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t first = r * kRow;
      checksum_row(data + 8 * first, first, std::min(kRow, nfull - first), &ra[r], &rb[r]);
    }
  });
  uint64_t a = static_cast<uint64_t>(n) % kPrime, b = 0;
  for (int64_t r = 0; r < nrows; ++r) {
    a = (a + ra[r]) % kPrime;
    b = (b + rb[r]) % kPrime;
  }
  if (n % 8) {
    uint8_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, data + 8 * nfull, n % 8);
    const uint64_t v = load_block(tail);
    const uint64_t w = static_cast<uint64_t>(nfull) % kWeightPeriod + 1;
    a = (a + w * (v & 0xFFFFFFFFULL) % kPrime) % kPrime;
    b = (b + w * (v >> 32) % kPrime) % kPrime;
  }
  return (a << 32) | b;
}

uint64_t checksum(const at::Tensor& u8) {
  TORCH_CHECK_VALUE(u8.device().is_cpu() && u8.is_contiguous() && u8.scalar_type() == at::kByte,
                    "checksum: expects a contiguous uint8 CPU tensor");
  return checksum_bytes(u8.data_ptr<uint8_t>(), u8.numel());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Chaos native data-plane ops (CPU)";
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("reduce_into", &reduce_into, "acc += float(src) * scale, in place", py::arg("acc"),
        py::arg("src"), py::arg("scale"), release());
  m.def("pack", &pack, "copy contiguous tensors, in order, into out", py::arg("tensors"),
        py::arg("out"), release());
  m.def("unpack", &unpack, "copy flat back into contiguous tensors", py::arg("flat"),
        py::arg("tensors"), release());
  m.def("checksum", &checksum, "64-bit checksum of a uint8 tensor", py::arg("u8"), release());
}
