// paged_attention.h for bfloat16 tensors.
#include "paged_attention.h"

extern "C" {

LLMSERVE_PAGED_ATTENTION(bf16, llmserve::bf16)

}  // extern "C"
