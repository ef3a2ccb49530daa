// y = x @ W^T (+ bias) for bfloat16 activations and weights, with float32 sums: the GEMM of a
// decode step's linears, where few rows meet a weight that streams from memory.
//
// oneDNN's packed GEMM reaches the cores' peak on a prompt's thousands of rows, but on a
// decode's tens of rows it ran its linears at 60-80% of it (Zen 5, SmolLM2's shapes). Here the
// weight is packed once into panels of 64 output columns, each laid out as [K/2][64][2]: one
// 64-byte load holds two k of 16 columns, which is what vdpbf16ps multiplies against a
// broadcast pair of an activation row. A register tile of 6 rows x 64 columns (24 float32
// accumulators) walks the panel's K once per 6 rows, and the panel the thread takes next is
// asked for into L2 while this one computes.
//
// A gate_up weight ([gate | up], each `half` rows) can be packed in halves: panel p holds gate
// rows [32p, 32p + 32) and up rows [32p, 32p + 32), so that a tile holds both factors of 32
// outputs of silu(gate) * up and the activation runs on the accumulators (silu.h, rounding as
// the GEMM's store and activation.cpp's would: the same bits), never storing gate and up. The
// same packing still gives [gate | up] unactivated, for a step whose LoRA adds to them.
//
// Every output is the same sum in the same order (k pairs in ascending order, one accumulator)
// whatever M, the row's place in its tile and the split among threads: a row's result does not
// depend on the rest of the batch, so a speculative step's verification rows round exactly as
// the decodes they stand for.
//
// Only built with AVX512-BF16; elsewhere the entry points report that they have no kernel
// (-1) and the caller keeps oneDNN.
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "silu.h"

namespace llmserve {
namespace {

constexpr int PANEL = 64;  // output columns of a packed panel
constexpr int MR = 6;      // rows of the register tile

#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)

inline int64_t panel_elems(int k) { return static_cast<int64_t>(k / 2) * PANEL * 2; }

// Where a panel's 64 sums go: columns [64p, 64p + 64) of out (plain), or, packed in halves,
// gate and up columns [32p, 32p + 32) and [half + 32p, ...), or their activation at [32p, ...).
struct Out {
  bf16* c;
  int64_t ldc;
  const float* bias;  // [n] float32 (the checkpoint's order), or null
  int n;              // output columns of the weight
  int half;           // 0: plain packing; else gate rows per half (packed in halves)
  bool activate;      // halves only: store silu(gate) * up
};

template <int R>
inline void store(const __m512 (&acc)[R][4], int m, int p, const Out& o) {
  for (int r = 0; r < R; ++r) {
    bf16* row = o.c + (m + r) * o.ldc;
    if (o.half == 0) {
      for (int j = 0; j < 4; ++j) {
        const int col = PANEL * p + 16 * j, lanes = std::min(16, o.n - col);
        if (lanes <= 0) break;
        V16 v{acc[r][j]};
        if (o.bias != nullptr) v = v + vload(o.bias + col, lanes);
        vstore(row + col, v, lanes);
      }
      continue;
    }
    for (int j = 0; j < 2; ++j) {
      const int gate_col = 32 * p + 16 * j, up_col = o.half + gate_col;
      V16 g{acc[r][j]}, u{acc[r][j + 2]};
      if (o.bias != nullptr) g = g + vload(o.bias + gate_col), u = u + vload(o.bias + up_col);
      if (o.activate) {
        vstore(row + gate_col, silu_times<bf16>(vround<bf16>(g), vround<bf16>(u)));
      } else {
        vstore(row + gate_col, g);
        vstore(row + up_col, u);
      }
    }
  }
}

// One tile: rows [m, m + R) of a (row stride lda) times panel p.
template <int R>
inline void tile(const bf16* a, int64_t lda, int m, int p, const bf16* panel, int k2, const Out& o, const char* ahead,
                 int64_t ahead_bytes) {
  a += m * lda;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint32_t*>(a + r * lda);
  // The prefetch of the next panel, spread over this tile's k loop: one line every other k,
  // at even steps across the tile's share. With few tiles that touches one line in several and
  // the hardware prefetcher streams the rest; asking for every line measured slower at 2-16
  // rows (78-496 against 92-521 GFLOP/s) and no faster at 96 or 2,048.
  const int64_t step = ahead != nullptr ? (ahead_bytes + k2 - 1) / k2 * 2 : 0;
  for (int k = 0; k < k2; ++k) {
    const __m512i* w = reinterpret_cast<const __m512i*>(panel + static_cast<int64_t>(k) * PANEL * 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2), w3 = (__m512bh)_mm512_loadu_si512(w + 3);
    if (ahead != nullptr && (k & 1) == 0 && (k / 2) * step < ahead_bytes) _mm_prefetch(ahead + (k / 2) * step, _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[r][k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, w3);
    }
  }
  store<R>(acc, m, p, o);
}

// Rows [m0, m1) of panel p, tiles of MR rows and then what is left.
inline void panel_rows(const bf16* a, int64_t lda, int m0, int m1, int p, const bf16* panel, int k2, const Out& o,
                       const char* ahead, int64_t ahead_bytes) {
  const int tiles = (m1 - m0 + MR - 1) / MR;
  const int64_t share = ahead != nullptr ? (ahead_bytes + tiles - 1) / tiles : 0;
  int m = m0;
  for (int t = 0; m < m1; ++t) {
    const char* pf = ahead != nullptr && t * share < ahead_bytes ? ahead + t * share : nullptr;
    const int64_t pf_bytes = std::min(share, ahead_bytes - t * share);
    switch (std::min(MR, m1 - m)) {
      case 6: tile<6>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
      case 5: tile<5>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
      case 4: tile<4>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
      case 3: tile<3>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
      case 2: tile<2>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
      default: tile<1>(a, lda, m, p, panel, k2, o, pf, pf_bytes); break;
    }
    m += std::min(MR, m1 - m);
  }
}

#endif

}  // namespace
}  // namespace llmserve

extern "C" {

// Bfloat16 elements of the packed form of an [n, k] weight (n rounded up to whole panels).
int64_t llmserve_packed_linear_elems(int n, int k) {
  return static_cast<int64_t>((n + llmserve::PANEL - 1) / llmserve::PANEL) * llmserve::PANEL * (k / 2) * 2;
}

// Packs w [n, k] (row stride ldw) into `packed` (llmserve_packed_linear_elems long); the
// columns past n are zeros. In halves (a [gate | up] weight): n / 2 must be a multiple of 32.
// Returns -1 without AVX512-BF16, for an odd k or for halves that do not fit.
int llmserve_pack_linear_bf16(const void* w, int64_t ldw, int n, int k, int halves, void* packed) {
#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
  using llmserve::PANEL;
  if (k % 2 != 0 || (halves && n % 64 != 0)) return -1;
  const auto* src = static_cast<const uint16_t*>(w);
  auto* dst = static_cast<uint16_t*>(packed);
  const int panels = (n + PANEL - 1) / PANEL;
  for (int p = 0; p < panels; ++p)
    for (int k2 = 0; k2 < k / 2; ++k2)
      for (int col = 0; col < PANEL; ++col) {
        const int row = !halves ? p * PANEL + col : col < 32 ? 32 * p + col : n / 2 + 32 * p + col - 32;
        for (int t = 0; t < 2; ++t)
          dst[((static_cast<int64_t>(p) * (k / 2) + k2) * PANEL + col) * 2 + t] =
              row < n ? src[row * ldw + 2 * k2 + t] : 0;
      }
  return 0;
#else
  (void)w, (void)ldw, (void)n, (void)k, (void)halves, (void)packed;
  return -1;
#endif
}

// out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ W^T + bias (float32, or null),
// W packed by llmserve_pack_linear_bf16 (`halves` as packed); with `activate` (halves only)
// out is [m, n / 2] = silu(gate) * up. Threads share the panels x rows evenly, in panel
// order, so an uneven panel count costs no thread a whole extra panel. Returns -1 without
// AVX512-BF16.
int llmserve_linear_bf16(const void* x, int64_t ldx, int m, int k, const void* packed, int n, const float* bias,
                         void* out, int64_t ldo, int halves, int activate, int num_threads) {
#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
  using namespace llmserve;
  if (k % 2 != 0) return -1;
  const auto* a = static_cast<const bf16*>(x);
  const auto* w = static_cast<const bf16*>(packed);
  const Out o{static_cast<bf16*>(out), ldo, bias, n, halves ? n / 2 : 0, halves && activate};
  const int panels = (n + PANEL - 1) / PANEL;
  const int64_t pelems = panel_elems(k);
  const int64_t pbytes = pelems * 2;
  const int64_t work = static_cast<int64_t>(panels) * m;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels * ((m + MR - 1) / MR))));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = work * t / nt, end = work * (t + 1) / nt;
    for (int64_t at = begin; at < end;) {
      const int p = static_cast<int>(at / m);
      const int m0 = static_cast<int>(at % m);
      const int m1 = static_cast<int>(std::min<int64_t>(m, m0 + (end - at)));
      const bool more = (static_cast<int64_t>(p) + 1) * m < end;
      const char* ahead = more ? reinterpret_cast<const char*>(w + (p + 1) * pelems) : nullptr;
      panel_rows(a, ldx, m0, m1, p, w + p * pelems, k / 2, o, ahead, pbytes);
      at += m1 - m0;
    }
  }
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)ldo, (void)halves,
      (void)activate, (void)num_threads;
  return -1;
#endif
}

}  // extern "C"
