// RMSNorm with the residual add fused, rounding where the torch reference rounds:
//
//     r   = x + residual              (in T; written back into residual)
//     out = weight * T(r * rsqrt(mean(r^2) + eps))   (the norm in float, the scale in T)
//
// so that in bfloat16 it gives the reference's bits, up to the order of the sum of squares.
#include <omp.h>

#include "vec.h"

namespace llmserve {
namespace {

template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, float eps, T* out,
              int64_t out_stride, int64_t rows, int hidden, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * x_stride;
    T* rr = residual != nullptr ? residual + t * res_stride : nullptr;
    T* orow = out + t * out_stride;
    V16 ss = vzero();
    for (int c = 0; c < hidden; c += 16) {
      const int n = hidden - c < 16 ? hidden - c : 16;
      V16 v = vload(xr + c, n);
      if (rr != nullptr) {
        v = vround<T>(v + vload(rr + c, n));
        vstore(rr + c, v, n);
      }
      ss = vfma(v, v, ss);
    }
    const V16 inv = vset(1.0f / std::sqrt(vsum(ss) / static_cast<float>(hidden) + eps));
    for (int c = 0; c < hidden; c += 16) {
      const int n = hidden - c < 16 ? hidden - c : 16;
      const V16 v = rr != nullptr ? vload(rr + c, n) : vload(xr + c, n);
      vstore(orow + c, vround<T>(v * inv) * vload(weight + c, n), n);
    }
  }
}

}  // namespace
}  // namespace llmserve

extern "C" {

#define LLMSERVE_RMS_NORM(suffix, T)                                                                                  \
  void llmserve_rms_norm_##suffix(const void* x, int64_t x_stride, void* residual, int64_t res_stride,              \
                                  const void* weight, float eps, void* out, int64_t out_stride, int64_t rows,       \
                                  int hidden, int num_threads) {                                                     \
    llmserve::rms_norm(static_cast<const T*>(x), x_stride, static_cast<T*>(residual), res_stride,                    \
                       static_cast<const T*>(weight), eps, static_cast<T*>(out), out_stride, rows, hidden,           \
                       num_threads);                                                                                 \
  }

LLMSERVE_RMS_NORM(f32, float)
LLMSERVE_RMS_NORM(bf16, llmserve::bf16)

}  // extern "C"
