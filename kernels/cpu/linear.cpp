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

#include "vec.h"

namespace llmserve {
namespace {

constexpr int PANEL = 64;  // output columns of a packed panel
constexpr int MR = 6;      // rows of the register tile

#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)

inline int64_t panel_elems(int k) { return static_cast<int64_t>(k / 2) * PANEL * 2; }

// One tile: rows [0, R) of a (row stride lda) times one panel, into c (row stride ldc), n of
// the panel's columns stored.
template <int R>
inline void tile(const bf16* a, int64_t lda, const bf16* panel, int k2, const float* bias, bf16* c, int64_t ldc,
                 int n, const char* ahead, int64_t ahead_bytes) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint32_t*>(a + r * lda);
  // The prefetch of the next panel, spread over this tile's k loop: one line every other k.
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
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      const int lanes = std::min(16, n - 16 * j);
      if (lanes <= 0) break;
      V16 v{acc[r][j]};
      if (bias != nullptr) v = v + vload(bias + 16 * j, lanes);
      vstore(c + r * ldc + 16 * j, v, lanes);
    }
}

// Rows [m0, m1) of one panel, tiles of MR rows and then what is left.
inline void panel_rows(const bf16* a, int64_t lda, int m0, int m1, const bf16* panel, int k2, const float* bias,
                       bf16* c, int64_t ldc, int n, const char* ahead, int64_t ahead_bytes) {
  const int tiles = (m1 - m0 + MR - 1) / MR;
  const int64_t share = ahead != nullptr ? (ahead_bytes + tiles - 1) / tiles : 0;
  int m = m0;
  for (int t = 0; m < m1; ++t) {
    const char* pf = ahead != nullptr && t * share < ahead_bytes ? ahead + t * share : nullptr;
    const int64_t pf_bytes = std::min(share, ahead_bytes - t * share);
    const bf16* ar = a + m * lda;
    bf16* cr = c + m * ldc;
    switch (std::min(MR, m1 - m)) {
      case 6: tile<6>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
      case 5: tile<5>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
      case 4: tile<4>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
      case 3: tile<3>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
      case 2: tile<2>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
      default: tile<1>(ar, lda, panel, k2, bias, cr, ldc, n, pf, pf_bytes); break;
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
// columns past n are zeros. Returns -1 without AVX512-BF16 or for an odd k.
int llmserve_pack_linear_bf16(const void* w, int64_t ldw, int n, int k, void* packed) {
#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
  using llmserve::PANEL;
  if (k % 2 != 0) return -1;
  const auto* src = static_cast<const uint16_t*>(w);
  auto* dst = static_cast<uint16_t*>(packed);
  const int panels = (n + PANEL - 1) / PANEL;
  for (int p = 0; p < panels; ++p)
    for (int k2 = 0; k2 < k / 2; ++k2)
      for (int col = 0; col < PANEL; ++col) {
        const int row = p * PANEL + col;
        for (int t = 0; t < 2; ++t)
          dst[((static_cast<int64_t>(p) * (k / 2) + k2) * PANEL + col) * 2 + t] =
              row < n ? src[row * ldw + 2 * k2 + t] : 0;
      }
  return 0;
#else
  (void)w, (void)ldw, (void)n, (void)k, (void)packed;
  return -1;
#endif
}

// out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ W^T + bias (float32, or null),
// W packed by llmserve_pack_linear_bf16. Threads share the panels x rows evenly, in panel
// order, so an uneven panel count costs no thread a whole extra panel. Returns -1 without
// AVX512-BF16.
int llmserve_linear_bf16(const void* x, int64_t ldx, int m, int k, const void* packed, int n, const float* bias,
                         void* out, int64_t ldo, int num_threads) {
#if defined(LLMSERVE_AVX512) && defined(__AVX512BF16__)
  using namespace llmserve;
  if (k % 2 != 0) return -1;
  const auto* a = static_cast<const bf16*>(x);
  const auto* w = static_cast<const bf16*>(packed);
  auto* c = static_cast<bf16*>(out);
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
      panel_rows(a, ldx, m0, m1, w + p * pelems, k / 2, bias != nullptr ? bias + p * PANEL : nullptr,
                 c + p * PANEL, ldo, std::min(PANEL, n - p * PANEL), ahead, pbytes);
      at += m1 - m0;
    }
  }
  return 0;
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)ldo, (void)num_threads;
  return -1;
#endif
}

}  // extern "C"
