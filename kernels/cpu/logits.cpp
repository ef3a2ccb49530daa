// Per row of logits [rows, vocab]: the most likely token and the log of the softmax's
// denominator, in one read of the model-dtype logits:
//
//     argmax[r] = first index of max(x[r])      lse[r] = max + log(sum exp(x[r] - max))
//
// so a greedy token, and any token's log-probability x[r, t] - lse[r], need no float32 copy
// of the [rows, vocab] logits and no log_softmax over them.
#include <omp.h>

#include <cstdint>

#include "vec.h"

namespace llmserve {
namespace {

template <typename T>
void logits_stats(const T* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* argmax, float* lse,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * stride;
    V16 mv = vset(-INFINITY);
    for (int64_t c = 0; c < vocab; c += 16) mv = vmax(mv, vload(x + c, static_cast<int>(vocab - c < 16 ? vocab - c : 16), -INFINITY));
    const float m = vmaxall(mv);
    int64_t best = 0;
    for (int64_t c = 0; c < vocab; c += 16) {  // the first chunk holding the maximum, then its lane
      const int n = static_cast<int>(vocab - c < 16 ? vocab - c : 16);
      if (vmaxall(vload(x + c, n, -INFINITY)) != m) continue;
      while (to_float(x[c]) != m) ++c;
      best = c;
      break;
    }
    V16 sum = vzero();
    const V16 mm = vset(m);
    for (int64_t c = 0; c < vocab; c += 16) {
      const int n = static_cast<int>(vocab - c < 16 ? vocab - c : 16);
      sum = sum + vexp(vload(x + c, n, -INFINITY) - mm);
    }
    argmax[r] = best;
    lse[r] = m + std::log(vsum(sum));
  }
}

}  // namespace
}  // namespace llmserve

extern "C" {

#define LLMSERVE_LOGITS_STATS(suffix, T)                                                                         \
  void llmserve_logits_stats_##suffix(const void* logits, int64_t stride, int64_t rows, int64_t vocab,         \
                                      int64_t* argmax, float* lse, int num_threads) {                          \
    llmserve::logits_stats(static_cast<const T*>(logits), stride, rows, vocab, argmax, lse, num_threads);      \
  }

LLMSERVE_LOGITS_STATS(f32, float)
LLMSERVE_LOGITS_STATS(bf16, llmserve::bf16)

}  // extern "C"
