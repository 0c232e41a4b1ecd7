// The portable softmax of one row of attention scores, in place: the generic decode kernel
// (generic.cpp) and the quantized-KV one (attn_kvq.cpp) share it. Included only by code
// built for the baseline CPU (no target region), so no wide-vector copy of it exists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvloop {

inline void softmax_in_place(float* row, int64_t len) {
  const float top = *std::max_element(row, row + len);
  float total = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    row[t] = std::exp(row[t] - top);
    total += row[t];
  }
  const float inv = 1.f / total;
  for (int64_t t = 0; t < len; ++t) row[t] *= inv;
}

}  // namespace kvloop
