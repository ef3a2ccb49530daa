// Neox-style rotary embedding in place on q and k, at each token's own position:
//
//     x = [x1 | x2] (halves of a head);  x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin
//
// Each product and sum is rounded to T as the torch reference's separate ops round it, so in
// bfloat16 this gives the reference's bits. cos/sin: [max_positions, head_dim / 2] in T.
#include <omp.h>

#include "vec.h"

namespace llmserve {
namespace {

template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int half) {
  for (int c = 0; c < half; c += 16) {
    const int n = half - c < 16 ? half - c : 16;
    const V16 x1 = vload(x + c, n), x2 = vload(x + half + c, n);
    const V16 co = vload(cos + c, n), si = vload(sin + c, n);
    const V16 y1 = vround<T>(vround<T>(x1 * co) - vround<T>(x2 * si));
    const V16 y2 = vround<T>(vround<T>(x2 * co) + vround<T>(x1 * si));
    vstore(x + c, y1, n);
    vstore(x + half + c, y2, n);
  }
}

template <typename T>
void rotary(T* q, int64_t q_stride, int num_heads, T* k, int64_t k_stride, int num_kv_heads, int head_dim,
            const int64_t* positions, const T* cos, const T* sin, int64_t tokens, int num_threads) {
  const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* co = cos + positions[t] * half;
    const T* si = sin + positions[t] * half;
    for (int h = 0; h < num_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, co, si, half);
    for (int h = 0; h < num_kv_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, co, si, half);
  }
}

}  // namespace
}  // namespace llmserve

extern "C" {

#define LLMSERVE_ROTARY(suffix, T)                                                                                 \
  void llmserve_rotary_##suffix(void* q, int64_t q_stride, int num_heads, void* k, int64_t k_stride,             \
                                int num_kv_heads, int head_dim, const int64_t* positions, const void* cos,      \
                                const void* sin, int64_t tokens, int num_threads) {                             \
    llmserve::rotary(static_cast<T*>(q), q_stride, num_heads, static_cast<T*>(k), k_stride, num_kv_heads,        \
                     head_dim, positions, static_cast<const T*>(cos), static_cast<const T*>(sin), tokens,       \
                     num_threads);                                                                              \
  }

LLMSERVE_ROTARY(f32, float)
LLMSERVE_ROTARY(bf16, llmserve::bf16)

}  // extern "C"
