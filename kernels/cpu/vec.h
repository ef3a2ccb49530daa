// Sixteen floats at a time, and the two element types the CPU kernels read and write.
//
// Every kernel is written once against V16: with AVX-512 it is one __m512 register, without it
// (another x86 level, or another architecture) a plain array the compiler vectorizes as it can.
// Building with LLMSERVE_PORTABLE forces the array form, so the tests check both on one machine.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(LLMSERVE_PORTABLE)
#define LLMSERVE_AVX512 1
#include <immintrin.h>
#endif

namespace llmserve {

// bfloat16 is the high half of a float32; conversion to it rounds to nearest even, as torch does.
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16 from_float<bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// A value rounded to T and back: how a torch op in dtype T leaves an intermediate result.
template <typename T> inline float round_to(float f) { return to_float(from_float<T>(f)); }

#ifdef LLMSERVE_AVX512

struct V16 {
  __m512 v;
};

inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset(float x) { return {_mm512_set1_ps(x)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxall(V16 a) { return _mm512_reduce_max_ps(a.v); }

// Lane j of the result is the sum of the 16 lanes of v[j]: sixteen reductions at the cost of
// about three vector ops each, where one at a time would wait on a chain of shuffles.
inline V16 vsum16(const V16* v) {
  __m512 a[8], b[4], e[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))));
  // f holds the sum of v[k + 4m] in lane 4k + m; put it in lane k + 4m.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, f)};
}

inline __mmask16 tail_mask(int n) { return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u); }

// Lanes at or past n read as `fill` (loads) or are left untouched (stores).
inline V16 vload(const float* p, int n = 16, float fill = 0.0f) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), tail_mask(n), p)};
}
inline V16 vload(const bf16* p, int n = 16, float fill = 0.0f) {
  __m256i h = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return {_mm512_mask_blend_ps(tail_mask(n), _mm512_set1_ps(fill), f)};
}
inline void vstore(float* p, V16 a, int n = 16) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }
#ifdef __AVX512BF16__
// One instruction: round to nearest even, NaN kept quiet.
inline __m256i bf16_half(V16 a) { return (__m256i)_mm512_cvtneps_pbh(a.v); }
#else
inline __m256i bf16_half(V16 a) {
  __m512i u = _mm512_castps_si512(a.v);
  __m512i rounded = _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  __m512i bits = _mm512_srli_epi32(rounded, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  bits = _mm512_mask_mov_epi32(bits, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(bits);
}
#endif
inline void vstore(bf16* p, V16 a, int n = 16) { _mm256_mask_storeu_epi16(p, tail_mask(n), bf16_half(a)); }
// Rounded to T and widened again, lane by lane (see round_to).
template <typename T> inline V16 vround(V16 a);
template <> inline V16 vround<float>(V16 a) { return a; }
template <> inline V16 vround<bf16>(V16 a) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_half(a)), 16))};
}

// Lanes outside [lo, hi) become `fill`.
inline V16 vkeep(V16 a, int lo, int hi, float fill) {
  const __mmask16 keep = static_cast<__mmask16>(tail_mask(hi) & ~tail_mask(lo > 0 ? lo : 0));
  return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), a.v)};
}

// 1 / a to within 2 ulp of float: a 14-bit estimate refined by one Newton step, several times
// the throughput of a division. 1 / inf = 0 and 1 / 0 = inf, as a division gives them (the
// Newton step would turn both into NaN).
inline V16 vrcp(V16 a) {
  const __m512 r = _mm512_rcp14_ps(a.v);
  const __m512 refined = _mm512_mul_ps(r, _mm512_fnmadd_ps(a.v, r, _mm512_set1_ps(2.0f)));
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0x7fffffff)));
  const __mmask16 exact = _mm512_cmp_ps_mask(magnitude, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                          _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
  return {_mm512_mask_blend_ps(exact, refined, r)};
}

// exp(x) to ~1 ulp of float for x in [-87, 88]; below that it flushes to 0, -inf included,
// and above ~88.7 it overflows to +inf, as expf does.
inline V16 vexp(V16 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(89.0f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
  __m512 c = _mm512_min_ps(_mm512_max_ps(x.v, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n))};
}

#else  // portable: the same operations lane by lane

struct V16 {
  float v[16];
};

#define LLMSERVE_LANES(expr) \
  V16 r;                     \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr);  \
  return r

inline V16 vzero() { LLMSERVE_LANES(0.0f); }
inline V16 vset(float x) { LLMSERVE_LANES(x); }
inline V16 operator+(V16 a, V16 b) { LLMSERVE_LANES(a.v[i] + b.v[i]); }
inline V16 operator-(V16 a, V16 b) { LLMSERVE_LANES(a.v[i] - b.v[i]); }
inline V16 operator*(V16 a, V16 b) { LLMSERVE_LANES(a.v[i] * b.v[i]); }
inline V16 operator/(V16 a, V16 b) { LLMSERVE_LANES(a.v[i] / b.v[i]); }
inline V16 vfma(V16 a, V16 b, V16 c) { LLMSERVE_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
inline V16 vmax(V16 a, V16 b) { LLMSERVE_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline float vsum(V16 a) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
inline float vmaxall(V16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline V16 vsum16(const V16* v) { LLMSERVE_LANES(vsum(v[i])); }
template <typename T> inline V16 vload(const T* p, int n = 16, float fill = 0.0f) { LLMSERVE_LANES(i < n ? to_float(p[i]) : fill); }
template <typename T> inline void vstore(T* p, V16 a, int n = 16) {
  for (int i = 0; i < n && i < 16; ++i) p[i] = from_float<T>(a.v[i]);
}
template <typename T> inline V16 vround(V16 a) { LLMSERVE_LANES(round_to<T>(a.v[i])); }
inline V16 vkeep(V16 a, int lo, int hi, float fill) { LLMSERVE_LANES(i >= lo && i < hi ? a.v[i] : fill); }
inline V16 vrcp(V16 a) { LLMSERVE_LANES(1.0f / a.v[i]); }
inline V16 vexp(V16 x) { LLMSERVE_LANES(x.v[i] < -87.3f ? 0.0f : std::exp(x.v[i])); }

#undef LLMSERVE_LANES
#endif

// tanh lane by lane: only soft-capped attention (Gemma 2) pays for it.
inline V16 vtanh(V16 a) {
  float t[16];
  vstore(t, a);
  for (int i = 0; i < 16; ++i) t[i] = std::tanh(t[i]);
  return vload(t);
}

}  // namespace llmserve
