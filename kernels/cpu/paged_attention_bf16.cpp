// paged_attention.h for bfloat16 tensors.
#include "paged_attention.h"

extern "C" {

// Returns 0, or -1 for a head size without a kernel (64, 80, 96, 128 and 256 have one).
#define LLMSERVE_PAGED_ATTENTION(suffix, T)                                                                       \
  int llmserve_paged_attention_##suffix(                                                                          \
      const void* q, int64_t q_stride, const void* k_cache, const void* v_cache, const int32_t* block_tables,     \
      int64_t table_stride, const int32_t* query_start, const int32_t* query_lens, const int32_t* seq_lens,       \
      int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,       \
      float softcap, void* out, int64_t out_stride, int num_threads) {                                            \
    return llmserve::paged::paged_attention(static_cast<const T*>(q), q_stride, static_cast<const T*>(k_cache),   \
                                            static_cast<const T*>(v_cache), block_tables, table_stride,           \
                                            query_start, query_lens, seq_lens, num_seqs, num_heads, num_kv_heads, \
                                            head_dim, block_size, scale, window, softcap, static_cast<T*>(out),   \
                                            out_stride, num_threads);                                             \
  }

LLMSERVE_PAGED_ATTENTION(bf16, llmserve::bf16)

}  // extern "C"
