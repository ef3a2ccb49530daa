// Causal attention of a mixed batch straight from the paged KV cache, on the CPU.
// (Instantiated per dtype by paged_attention_f32.cpp and paged_attention_bf16.cpp, which
// then compile in parallel.)
//
// Sequence s has q_len = query_lens[s] query rows, rows query_start[s] .. + q_len - 1 of q, at
// positions [seq_len - q_len, seq_len); its keys and values live in the blocks
// block_ids[block_offsets[s] ..], its own row of the ragged tables (common/block_tables.py), at
// least ceil(seq_len / block_size) long: no row is padded to another's width, so one long
// sequence costs the others nothing. A sequence with no rows is skipped (the caller attends to
// it otherwise).
// Nothing is gathered into a contiguous copy. A work item is one sequence, a tile of up to
// TILE query rows and a range of KV heads (all of them unless the batch is too small to keep
// the threads busy: a cache row holds every KV head of a token, and reading it whole is what
// the memory system does best). It walks the sequence's keys sixteen at a time, reading them
// where they lie, with the streaming (online) softmax of flash attention:
//
//     for each chunk of 16 keys:  s = q . k * scale        (masked past each row's position)
//                                 m' = max(m, max s);  c = exp(m - m')
//                                 l  = l * c + sum exp(s - m');  acc = acc * c + exp(s - m') @ V
//     out = acc / l
//
// The query heads that share a KV head (a GQA group) go through each key and value row
// together, GB heads at a time, so a row is loaded and widened once for all of them. With
// AVX512-BF16 the q . k products of bfloat16 data are dpbf16 instructions on the raw bits
// (exact products, float32 sums); otherwise rows are widened to float32 and multiplied there.
// Values are always accumulated in float32.
#pragma once

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace llmserve {
namespace paged {

constexpr int TILE = 8;    // query rows per work item
constexpr int CHUNK = 16;  // keys per step of the streaming softmax (one V16 of scores)

struct Item {
  int seq, row_begin, row_end;  // rows relative to the sequence's first query token
  int head_begin, head_end;     // KV heads
  bool paired;                  // values paired for dpbf16 (bfloat16 with AVX512-BF16 only)
};

// A query of at least this many rows is a prompt or a chunk of one, and pairs values (attend).
// A shorter one may be a speculative step's verification of K drafts (K + 1 rows), whose rows
// must round exactly as the decodes they stand for, so that greedy outputs with and without
// drafts agree: it reads values as a decode does.
constexpr int PAIRED_MIN_QUERY = 33;

struct Shape {
  int num_kv_heads, group, block_size;
  int64_t q_stride, out_stride;
  float scale;
  int window;     // a query sees its last `window` positions (itself included); 0: all before it
  float softcap;  // scores become softcap * tanh(score / softcap); 0: as they are
};

// Scores of GB query heads (q: GB consecutive heads of one row) against 16 keys of one KV
// head: lane j of out[g] is scale * (q_g . keys[j]).
template <typename T, int DV, int GB>
inline void head_scores(const T* q, const T* const* keys, float scale, V16* out) {
  constexpr int HD = DV * 16;
  V16 part[GB][CHUNK];  // lane sums of each product, reduced 16 at a time below
#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && DV % 2 == 0) {
    __m512bh qb[GB][DV / 2];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DV / 2; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + g * HD + 32 * c);
    for (int j = 0; j < CHUNK; ++j) {
      __m512 d[GB];
      for (int g = 0; g < GB; ++g) d[g] = _mm512_setzero_ps();
      for (int c = 0; c < DV / 2; ++c) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c);
        for (int g = 0; g < GB; ++g) d[g] = _mm512_dpbf16_ps(d[g], qb[g][c], k);
      }
      for (int g = 0; g < GB; ++g) part[g][j] = {d[g]};
    }
  } else
#endif
  {
    V16 qv[GB][DV];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DV; ++c) qv[g][c] = vload(q + g * HD + 16 * c);
    for (int j = 0; j < CHUNK; ++j) {
      V16 k[DV];
      for (int c = 0; c < DV; ++c) k[c] = vload(keys[j] + 16 * c);
      for (int g = 0; g < GB; ++g) {
        V16 d = vzero();
        for (int c = 0; c < DV; ++c) d = vfma(qv[g][c], k[c], d);
        part[g][j] = d;
      }
    }
  }
  for (int g = 0; g < GB; ++g) out[g] = vsum16(part[g]) * vset(scale);
}

#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
#define LLMSERVE_PAIRED_VALUES 1
// Word indices that interleave two rows of 32 bfloat16 values a and b: (a0, b0, a1, b1, ...)
// over their first 16 columns (lo) or their last 16 (hi).
inline __m512i pair_lo() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35,
                          3, 34, 2, 33, 1, 32, 0);
}
inline __m512i pair_hi() {
  return _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22, 53, 21, 52,
                          20, 51, 19, 50, 18, 49, 17, 48, 16);
}
#else
#define LLMSERVE_PAIRED_VALUES 0
#endif

// head_dim = 16 * DV; GB query heads at a time, GB dividing the group size.
template <typename T, int DV, int GB>
void attend(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table, int q_start, int context,
            const Item& it, const Shape& sh, T* out, float* scratch) {
  constexpr int HD = DV * 16;
  const int rows = it.row_end - it.row_begin;
  const int heads = it.head_end - it.head_begin;  // KV heads of this item
  const int per_row = heads * sh.group;           // query vectors per row
  const int nq = rows * per_row;                  // row-major, then KV head, then head of the group
  float* acc = scratch;                           // [nq, HD]
  float* m = acc + nq * HD;                       // [nq] running max
  float* l = m + nq;                              // [nq] running sum
  for (int i = 0; i < nq; ++i) {
    for (int c = 0; c < DV; ++c) vstore(acc + i * HD + 16 * c, vzero());
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  const int first_q_head = it.head_begin * sh.group;
  const int64_t row_stride = static_cast<int64_t>(sh.num_kv_heads) * HD;
  const T* kbase[CHUNK];  // this chunk's cache rows, at the item's first KV head
  const T* vbase[CHUNK];
  const T* kj[CHUNK];  // the same rows at one KV head
  const char* knext[CHUNK];  // the next chunk's rows, at the item's first KV head
  const char* vnext[CHUNK];
  const bool spread = heads > 1;
  constexpr int64_t head_bytes = HD * sizeof(T);
  const bool paired = LLMSERVE_PAIRED_VALUES && std::is_same_v<T, bf16> && DV % 2 == 0 && it.paired && rows > 1;
  auto prefetch_row = [&](const char* k, const char* v) {  // one head of a key's row (the item's, unless spread)
    for (int64_t b = 0; b < (spread ? 1 : heads) * head_bytes; b += 64) {
      __builtin_prefetch(k + b, 0, 2);
      __builtin_prefetch(v + b, 0, 2);
    }
  };
  // Row r sees keys [first_key(r), context + row_begin + r]; the tile's last row sees the
  // most, its first row the earliest.
  auto first_key = [&](int r) { return sh.window > 0 ? std::max(0, context + it.row_begin + r + 1 - sh.window) : 0; };
  const int num_keys = context + it.row_end;
  for (int c0 = first_key(0); c0 < num_keys; c0 += CHUNK) {
    const int n = std::min(CHUNK, num_keys - c0);
    for (int j = 0; j < CHUNK; ++j) {
      // Lanes past the last key repeat it: read, then masked out.
      const int key = c0 + std::min(j, n - 1);
      const int64_t slot = static_cast<int64_t>(block_table[key / sh.block_size]) * sh.block_size + key % sh.block_size;
      kbase[j] = k_cache + slot * row_stride + static_cast<int64_t>(it.head_begin) * HD;
      vbase[j] = v_cache + slot * row_stride + static_cast<int64_t>(it.head_begin) * HD;
    }
    // The next chunk's rows lie in another block, wherever the allocator put it: ask for them
    // into L2 while this chunk computes. An item of every KV head spreads the requests over
    // its value loops below, a few lines per key and head: asked all at once they fill the
    // core's miss buffers and stall its loads (decode read 1.8x faster spread, on a Zen 5
    // CPU, benchmarks/cpu_attention_bench.py). An item of one head computes too little for
    // that to start the requests early enough: it asks at once, here.
    const int next_n = std::max(0, std::min(CHUNK, num_keys - c0 - CHUNK));
    for (int j = 0; j < next_n; ++j) {
      const int key = c0 + CHUNK + j;
      const int64_t slot = static_cast<int64_t>(block_table[key / sh.block_size]) * sh.block_size + key % sh.block_size;
      knext[j] = reinterpret_cast<const char*>(k_cache + slot * row_stride + static_cast<int64_t>(it.head_begin) * HD);
      vnext[j] = reinterpret_cast<const char*>(v_cache + slot * row_stride + static_cast<int64_t>(it.head_begin) * HD);
      if (!spread) prefetch_row(knext[j], vnext[j]);
    }
    for (int kv = 0; kv < heads; ++kv) {
      for (int j = 0; j < CHUNK; ++j) kj[j] = kbase[j] + kv * HD;
#if LLMSERVE_PAIRED_VALUES
      // This head's values, two keys interleaved per 32-bit lane (once for every row of the
      // tile): p . V becomes dpbf16 instructions on bfloat16 probabilities, as GPU flash
      // attention multiplies them, instead of widening every value row to float32 for each
      // query row.
      __m512i vp[CHUNK / 2][DV];
      if (paired) {
        for (int jp = 0; jp < CHUNK / 2; ++jp) {
          const T* va = vbase[2 * jp] + kv * HD;
          const T* vb = vbase[2 * jp + 1] + kv * HD;
          for (int c2 = 0; c2 < DV / 2; ++c2) {
            const __m512i ra = _mm512_loadu_si512(va + 32 * c2), rb = _mm512_loadu_si512(vb + 32 * c2);
            vp[jp][2 * c2] = _mm512_permutex2var_epi16(ra, pair_lo(), rb);
            vp[jp][2 * c2 + 1] = _mm512_permutex2var_epi16(ra, pair_hi(), rb);
          }
          for (int j = 2 * jp; j < 2 * jp + 2 && spread; ++j)
            if (j < next_n) prefetch_row(knext[j] + head_bytes * kv, vnext[j] + head_bytes * kv);
        }
      }
#endif
      for (int r = 0; r < rows; ++r) {
        // Row r sees lanes [skip, visible) of the chunk.
        const int visible = std::min(n, context + it.row_begin + r + 1 - c0);
        const int skip = std::max(0, first_key(r) - c0);
        if (visible <= skip) continue;
        const T* qrow = q + static_cast<int64_t>(q_start + it.row_begin + r) * sh.q_stride + first_q_head * HD;
        for (int g0 = 0; g0 < sh.group; g0 += GB) {
          const int h = kv * sh.group + g0;  // first of the GB heads, within the row
          const int i0 = r * per_row + h;
          V16 scores[GB];
          head_scores<T, DV, GB>(qrow + h * HD, kj, sh.scale, scores);
          float p[GB][CHUNK];
          float correction[GB];
          for (int g = 0; g < GB; ++g) {
            if (sh.softcap > 0.0f) scores[g] = vset(sh.softcap) * vtanh(scores[g] * vset(1.0f / sh.softcap));
            const V16 sv = vkeep(scores[g], skip, visible, -INFINITY);
            const float m_new = std::max(m[i0 + g], vmaxall(sv));
            // exp(-inf) = 0 on the first chunk. Once the running max settles it rarely moves,
            // and exp(0) is exactly 1: skipping the call changes no bit and saves a libm
            // call per head and chunk, a good part of a decode's arithmetic.
            correction[g] = m_new == m[i0 + g] ? 1.0f : std::exp(m[i0 + g] - m_new);
            const V16 pv = vexp(sv - vset(m_new));
            vstore(p[g], pv);
            l[i0 + g] = l[i0 + g] * correction[g] + vsum(pv);
            m[i0 + g] = m_new;
          }
          V16 a[GB][DV];
          for (int g = 0; g < GB; ++g)
            for (int c = 0; c < DV; ++c) a[g][c] = vload(acc + (i0 + g) * HD + 16 * c) * vset(correction[g]);
#if LLMSERVE_PAIRED_VALUES
          if (paired) {
            // Lanes outside [skip, visible) have p = 0 exactly, so every pair can be added.
            alignas(32) uint32_t pp[GB][CHUNK / 2];
            for (int g = 0; g < GB; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), bf16_half(vload(p[g])));
            for (int jp = 0; jp < CHUNK / 2; ++jp)
              for (int c = 0; c < DV; ++c)
                for (int g = 0; g < GB; ++g)
                  a[g][c].v = _mm512_dpbf16_ps(a[g][c].v, (__m512bh)_mm512_set1_epi32(pp[g][jp]), (__m512bh)vp[jp][c]);
          } else
#endif
          {
            for (int j = skip; j < visible; ++j) {
              if (spread && r == 0 && g0 == 0 && j < next_n) prefetch_row(knext[j] + head_bytes * kv, vnext[j] + head_bytes * kv);
              const T* vrow = vbase[j] + kv * HD;
              for (int c = 0; c < DV; ++c) {
                const V16 v = vload(vrow + 16 * c);
                for (int g = 0; g < GB; ++g) a[g][c] = vfma(vset(p[g][j]), v, a[g][c]);
              }
            }
          }
          for (int g = 0; g < GB; ++g)
            for (int c = 0; c < DV; ++c) vstore(acc + (i0 + g) * HD + 16 * c, a[g][c]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    T* orow = out + static_cast<int64_t>(q_start + it.row_begin + r) * sh.out_stride + first_q_head * HD;
    for (int h = 0; h < per_row; ++h) {
      const int i = r * per_row + h;
      const V16 inv = vset(1.0f / l[i]);
      for (int c = 0; c < DV; ++c) vstore(orow + h * HD + 16 * c, vload(acc + i * HD + 16 * c) * inv);
    }
  }
}

using AttendFn = void (*)(const void*, const void*, const void*, const int32_t*, int, int, const Item&, const Shape&,
                          void*, float*);

template <typename T, int DV, int GB>
void attend_erased(const void* q, const void* k, const void* v, const int32_t* table, int q_start, int context,
                   const Item& it, const Shape& sh, void* out, float* scratch) {
  attend<T, DV, GB>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), table, q_start,
                    context, it, sh, static_cast<T*>(out), scratch);
}

// The largest run of a group's heads whose accumulators fit the registers: 4 for heads of up
// to 96, 2 for 128, 1 beyond.
template <typename T, int DV>
AttendFn pick_group_run(int group) {
  constexpr int most = DV <= 6 ? 4 : DV <= 8 ? 2 : 1;
  if (most >= 4 && group % 4 == 0) return attend_erased<T, DV, (most >= 4 ? 4 : 1)>;
  if (most >= 3 && group % 3 == 0) return attend_erased<T, DV, (most >= 3 ? 3 : 1)>;
  if (most >= 2 && group % 2 == 0) return attend_erased<T, DV, (most >= 2 ? 2 : 1)>;
  return attend_erased<T, DV, 1>;
}

template <typename T>
AttendFn pick(int head_dim, int group) {
  switch (head_dim) {
    case 64: return pick_group_run<T, 4>(group);
    case 80: return pick_group_run<T, 5>(group);
    case 96: return pick_group_run<T, 6>(group);
    case 128: return pick_group_run<T, 8>(group);
    case 256: return pick_group_run<T, 16>(group);
    default: return nullptr;
  }
}

template <typename T>
int paged_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int32_t* block_ids,
                    const int32_t* block_offsets, const int32_t* query_start, const int32_t* query_lens,
                    const int32_t* seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, float scale, int window, float softcap, T* out, int64_t out_stride,
                    int num_threads) {
  const Shape sh{num_kv_heads, num_heads / num_kv_heads, block_size, q_stride, out_stride, scale, window, softcap};
  const AttendFn fn = pick<T>(head_dim, sh.group);
  if (fn == nullptr) return -1;
  int tiles = 0;
  for (int s = 0; s < num_seqs; ++s) tiles += (query_lens[s] + TILE - 1) / TILE;
  // Whole rows of the cache per item, unless that leaves too few items to share out.
  const int heads_per_item = tiles >= 4 * num_threads ? num_kv_heads : 1;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(tiles) * (num_kv_heads / heads_per_item));
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = query_lens[s];
    for (int r = 0; r < q_len; r += TILE)
      for (int h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({s, r, std::min(q_len, r + TILE), h, h + heads_per_item, q_len >= PAIRED_MIN_QUERY});
  }
  const int64_t scratch_floats = static_cast<int64_t>(TILE) * heads_per_item * sh.group * (head_dim + 2);
  const int count = static_cast<int>(items.size());
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch(scratch_floats);
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < count; ++w) {
      const Item& it = items[w];
      fn(q, k_cache, v_cache, block_ids + block_offsets[it.seq], query_start[it.seq],
         seq_lens[it.seq] - query_lens[it.seq], it, sh, out, scratch.data());
    }
  }
  return 0;
}

}  // namespace paged
}  // namespace llmserve

// The C entry point of one dtype (paged_attention_f32.cpp, paged_attention_bf16.cpp).
// Returns 0, or -1 for a head size without a kernel (64, 80, 96, 128 and 256 have one).
#define LLMSERVE_PAGED_ATTENTION(suffix, T)                                                                         \
  int llmserve_paged_attention_##suffix(                                                                            \
      const void* q, int64_t q_stride, const void* k_cache, const void* v_cache, const int32_t* block_ids,          \
      const int32_t* block_offsets, const int32_t* query_start, const int32_t* query_lens, const int32_t* seq_lens, \
      int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,         \
      float softcap, void* out, int64_t out_stride, int num_threads) {                                              \
    return llmserve::paged::paged_attention(static_cast<const T*>(q), q_stride, static_cast<const T*>(k_cache),     \
                                            static_cast<const T*>(v_cache), block_ids, block_offsets,               \
                                            query_start, query_lens, seq_lens, num_seqs, num_heads, num_kv_heads,   \
                                            head_dim, block_size, scale, window, softcap, static_cast<T*>(out),     \
                                            out_stride, num_threads);                                               \
  }
