// The AVX2 + FMA variant (x86-64-v3: Haswell and later, AMD Zen 1-3): the kernels of
// x86_avx2_kernels.h built for that target; the rest of the table is generic.
#include "isa.h"
#include "kernels.h"

#ifdef KVLOOP_X86
#include <immintrin.h>

#include <algorithm>
#include <cmath>

KVLOOP_TARGET_BEGIN("avx2,fma")
namespace kvloop::avx2 {

#include "x86_avx2_kernels.h"

// A KV head's query heads one at a time (16 vector registers); other shapes as generic.
// q and out in T, the cache in C (AttendFn).
template <typename T, typename C = T>
void attend(const T* q, float scale, int64_t group, int64_t dim, const C* keys, const C* vals,
            const int64_t* slot, int64_t len, float* scores, T* out, int64_t out_stride) {
  if (dim % 64 != 0)
    return generic_attend<T, C>(q, scale, group, dim, keys, vals, slot, len, scores, out,
                                out_stride);
  const std::vector<float> qf = scaled_query(q, group * dim, scale);
  attend_heads<C>(qf.data(), group, dim, keys, vals, slot, len, scores, out, out_stride);
}

}  // namespace kvloop::avx2
KVLOOP_TARGET_END

namespace kvloop {

const Kernels* avx2_kernels() {
  static const Kernels table = [] {
    Kernels k = generic_kernels();
    k.name = "avx2";
    k.attend_f32 = avx2::attend<float>;
    k.attend_bf16 = avx2::attend<c10::BFloat16>;
    k.attend_f32_bf16 = avx2::attend<float, c10::BFloat16>;
    k.silu_mul_f32 = avx2::silu_mul_f32;
    k.round_bf16 = avx2::round_bf16;
    k.quantize_row = avx2::quantize_row;
    k.int_columns = avx2::int_columns;
    k.fp_columns = avx2::fp_columns;
    return k;
  }();
  return &table;
}

}  // namespace kvloop

#else

namespace kvloop {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace kvloop

#endif
