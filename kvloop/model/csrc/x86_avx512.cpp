// The AVX-512 variant (F, BW, VL and VNNI: Ice Lake, Sapphire Rapids and later Xeons, AMD
// Zen 4 and 5): the AVX2 kernels rebuilt with 32 vector registers, which lets a KV head's
// 2-4 query heads share each key's load, and the integer matmul on `vpdpwssd`.
#include "isa.h"
#include "kernels.h"

#ifdef KVLOOP_X86
#include <immintrin.h>

#include <algorithm>
#include <cmath>

KVLOOP_TARGET_BEGIN("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace kvloop::avx512 {

#include "x86_avx2_kernels.h"
#include "x86_avx512_kernels.h"

// A KV head's `group` query heads: together where the 8 x G accumulators fit in the 32
// vector registers (G 2-4), else one head at a time; other shapes as generic. q and out in
// T, the cache in C (AttendFn).
template <typename T, typename C = T>
void attend(const T* q, float scale, int64_t group, int64_t dim, const C* keys, const C* vals,
            const int64_t* slot, int64_t len, float* scores, T* out, int64_t out_stride) {
  if (dim % 64 != 0)
    return generic_attend<T, C>(q, scale, group, dim, keys, vals, slot, len, scores, out,
                                out_stride);
  const std::vector<float> q32 = scaled_query(q, group * dim, scale);
  const float* qf = q32.data();
  switch (group) {
    case 2: return attend_grouped<C, 2>(qf, dim, keys, vals, slot, len, scores, out, out_stride);
    case 3: return attend_grouped<C, 3>(qf, dim, keys, vals, slot, len, scores, out, out_stride);
    case 4: return attend_grouped<C, 4>(qf, dim, keys, vals, slot, len, scores, out, out_stride);
    default: return attend_heads<C>(qf, group, dim, keys, vals, slot, len, scores, out,
                                    out_stride);
  }
}

// The integer kernel on VNNI: `dpwssd` multiplies 32 int16 pairs and adds them into 16
// int32 lanes in one instruction, where AVX2 needs a `madd` and an `add` per 16. Two 4-bit
// groups fill one register: their 32 bytes widen to 32 16-bit lanes, whose low nibbles are
// weights 0-15 of both groups and whose high nibbles weights 16-31, so x is read in that
// order (`q4_pairs`: generic.cpp's pair_order). The products of a pair land in 16 lanes, 8
// per group: converted once and scaled by a vector holding each group's scale in its 8
// lanes (a permute of 16 groups' scales, loaded together). 8-bit groups are 32 signed
// bytes, one register each, in x's own order. Same integer sums as the AVX2 kernel; the
// float sums run in another order.
// acc += dot's sums times the scales that `pick` selects from sd (one per lane).
inline __m512 add_scaled(__m512 acc, __m512i dot, __m512i pick, __m512 sd) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, sd), acc);
}

inline __m512i load_epi16x16(const int16_t* p) {      // 16 values, the upper lanes zero
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One output column n for MB rows of x from r0.
template <int Bits, int MB>
inline void vnni_column(const QuantMatmul& mm, int64_t r0, int64_t n, float* out,
                        int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset ? mm.offset + n * groups : nullptr;
  __m512 acc[MB], tail[MB];
  for (int m = 0; m < MB; ++m) acc[m] = tail[m] = _mm512_setzero_ps();
  const int16_t* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = mm.xv + (r0 + m) * mm.k_in;
  for (int64_t g = 0; g < groups; g += 16) {
    const int64_t left = std::min<int64_t>(16, groups - g);
    const __mmask16 mask = first_lanes(left);
    const __m512 scales = _mm512_maskz_loadu_ps(mask, sc + g);
    __m512 sd[MB];
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      sd[m] = _mm512_mul_ps(scales, _mm512_maskz_loadu_ps(mask, xq.d.data() + r * groups + g));
      if (of)
        tail[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, of + g),
                                  _mm512_maskz_loadu_ps(mask, xq.s.data() + r * groups + g),
                                  tail[m]);
    }
    if constexpr (Bits == 4) {
      int64_t j = 0;
      for (; j + 2 <= left; j += 2) {
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g + j) * 16)));
        const __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
        const __m512i hi = _mm512_srli_epi16(bytes, 4);
        const __m512i pick = pair_pick(j);
        for (int m = 0; m < MB; ++m) {
          const int16_t* xg = xrow[m] + (g + j) * 32;
          __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xg));
          dot = _mm512_dpwssd_epi32(dot, hi, _mm512_loadu_si512(xg + 32));
          acc[m] = add_scaled(acc[m], dot, pick, sd[m]);
        }
      }
      if (j < left) {                     // an odd last group: 16 lanes, half of them zero
        const __m256i bytes = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (g + j) * 16)));
        const __m512i lo = _mm512_zextsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15)));
        const __m512i hi = _mm512_zextsi256_si512(_mm256_srli_epi16(bytes, 4));
        const __m512i pick = _mm512_set1_epi32(static_cast<int>(j));
        for (int m = 0; m < MB; ++m) {
          const int16_t* xg = xrow[m] + (g + j) * 32;
          __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, load_epi16x16(xg));
          dot = _mm512_dpwssd_epi32(dot, hi, load_epi16x16(xg + 16));
          acc[m] = add_scaled(acc[m], dot, pick, sd[m]);
        }
      }
    } else {
      for (int64_t j = 0; j < left; ++j) {
        const __m512i w = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g + j) * 32)));
        const __m512i pick = _mm512_set1_epi32(static_cast<int>(j));
        for (int m = 0; m < MB; ++m) {
          const __m512i dot = _mm512_dpwssd_epi32(
              _mm512_setzero_si512(), w, _mm512_loadu_si512(xrow[m] + (g + j) * 32));
          acc[m] = add_scaled(acc[m], dot, pick, sd[m]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    out[m * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], tail[m]));
}

template <int Bits, int MB>
void vnni_tile(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
               int64_t out_stride) {
  for (int64_t n = begin; n < end; ++n)
    vnni_column<Bits, MB>(mm, r0, n, out + (n - begin), out_stride);
}

template <int Bits>
void vnni_columns_bits(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                       int64_t end, float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return vnni_tile<Bits, 1>(mm, r0, begin, end, out, out_stride);
    case 2: return vnni_tile<Bits, 2>(mm, r0, begin, end, out, out_stride);
    case 3: return vnni_tile<Bits, 3>(mm, r0, begin, end, out, out_stride);
    default: return vnni_tile<Bits, 4>(mm, r0, begin, end, out, out_stride);
  }
}

void vnni_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                  float* out, int64_t out_stride) {
  if (mm.bits == 4) vnni_columns_bits<4>(mm, r0, rows, begin, end, out, out_stride);
  else vnni_columns_bits<8>(mm, r0, rows, begin, end, out, out_stride);
}

}  // namespace kvloop::avx512
KVLOOP_TARGET_END

namespace kvloop {

const Kernels* avx512_kernels() {
  static const Kernels table = [] {
    Kernels k = generic_kernels();
    k.name = "avx512";
    k.attend_f32 = avx512::attend<float>;
    k.attend_bf16 = avx512::attend<c10::BFloat16>;
    k.attend_f32_bf16 = avx512::attend<float, c10::BFloat16>;
    k.silu_mul_f32 = avx512::silu_mul_f32;
    k.round_bf16 = avx512::round_bf16_wide;
    k.quantize_row = avx512::quantize_row;
    k.int_columns = avx512::vnni_columns;
    k.fp_columns = avx512::fp_columns;
    k.q4_pairs = true;
    return k;
  }();
  return &table;
}

}  // namespace kvloop

#else

namespace kvloop {
const Kernels* avx512_kernels() { return nullptr; }
}  // namespace kvloop

#endif
