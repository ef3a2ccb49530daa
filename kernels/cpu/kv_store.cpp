// This step's keys and values into the paged cache: token t goes to slot slots[t] of the
// flattened [num_blocks * block_size, kv_heads, head_dim] cache; slot -1 is skipped.
#include <omp.h>

#include <cstring>

#include "vec.h"

namespace llmserve {
namespace {

template <typename T>
void store_kv(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* k_cache, T* v_cache,
              const int64_t* slots, int64_t tokens, int64_t row, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(T));
    std::memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(T));
  }
}

}  // namespace
}  // namespace llmserve

extern "C" {

#define LLMSERVE_STORE_KV(suffix, T)                                                                               \
  void llmserve_store_kv_##suffix(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache, \
                                  void* v_cache, const int64_t* slots, int64_t tokens, int64_t row,             \
                                  int num_threads) {                                                            \
    llmserve::store_kv(static_cast<const T*>(k), k_stride, static_cast<const T*>(v), v_stride,                  \
                       static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots, tokens, row, num_threads);    \
  }

LLMSERVE_STORE_KV(f32, float)
LLMSERVE_STORE_KV(bf16, llmserve::bf16)

}  // extern "C"
