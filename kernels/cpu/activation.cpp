// SwiGLU's gate: x = [gate | up] per row, out = silu(gate) * up (silu.h has the roundings).
#include <omp.h>

#include "silu.h"

namespace llmserve {
namespace {

template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows, int d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < rows; ++t) {
    const T* gate = x + t * x_stride;
    const T* up = gate + d;
    T* o = out + t * out_stride;
    for (int c = 0; c < d; c += 16) {
      const int n = d - c < 16 ? d - c : 16;
      vstore(o + c, silu_times<T>(vload(gate + c, n), vload(up + c, n)), n);
    }
  }
}

}  // namespace
}  // namespace llmserve

extern "C" {

#define LLMSERVE_SILU_AND_MUL(suffix, T)                                                                          \
  void llmserve_silu_and_mul_##suffix(const void* x, int64_t x_stride, void* out, int64_t out_stride,           \
                                      int64_t rows, int d, int num_threads) {                                   \
    llmserve::silu_and_mul(static_cast<const T*>(x), x_stride, static_cast<T*>(out), out_stride, rows, d,       \
                           num_threads);                                                                        \
  }

LLMSERVE_SILU_AND_MUL(f32, float)
LLMSERVE_SILU_AND_MUL(bf16, llmserve::bf16)

}  // extern "C"
