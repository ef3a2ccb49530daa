// silu(gate) * up on 16 lanes, rounded to T after the silu as the reference's two torch ops
// round (the product is rounded where it is stored). silu(g) = g / (1 + exp(-g)) with a refined
// reciprocal instead of a division: in bfloat16 the same bits but for a float ulp at a rounding
// boundary, now and then. Shared by activation.cpp and the GEMM's gated epilogue (linear.cpp),
// which must give the same bits.
#pragma once

#include "vec.h"

namespace llmserve {

template <typename T>
inline V16 silu_times(V16 gate, V16 up) {
  return vround<T>(gate * vrcp(vset(1.0f) + vexp(vzero() - gate))) * up;
}

}  // namespace llmserve
