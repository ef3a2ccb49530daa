// paged_attention.h for float32 tensors.
#include "paged_attention.h"

extern "C" {

LLMSERVE_PAGED_ATTENTION(f32, float)

}  // extern "C"
