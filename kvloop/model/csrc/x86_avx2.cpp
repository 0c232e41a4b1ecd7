// The AVX2 + FMA variant (x86-64-v3: Haswell and later, AMD Zen 1-3): the kernels of
// x86_avx2_kernels.h built for that target; the rest of the table is generic.
#include "isa.h"
#include "kernels.h"

#ifdef KVLOOP_X86
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

KVLOOP_TARGET_BEGIN("avx2,fma")
namespace kvloop::avx2 {

#include "x86_avx2_kernels.h"
#include "x86_prefill.h"

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

// --- prefill attention: one key block of a tile (PrefillBlockFn, x86_prefill.h) -----------
// The lanes of keys [first, last) among the 8 from key c0, as a compare's all-ones lanes.
inline __m256 key_lanes(int64_t first, int64_t last, int64_t c0) {
  const __m256i key = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(c0)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i from = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(first) - 1));
  const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(last)), key);
  return _mm256_castsi256_ps(_mm256_and_si256(from, below));
}

// 8 fp32 lanes for the prefill block kernel: 3 rows x 4 vectors (32 keys or 32 dims) per
// pass, 12 accumulators of the 16 registers. Measured on Zen 4 running this variant, one
// thread, 512 fresh tokens of SmolLM2's shape: 4.2-4.3 ms; 4 rows x 3 key vectors and x 2
// output vectors 4.4 (and no faster elsewhere); 2 rows x 4 and 4 slower at every length.
struct F32x8 {
  using Reg = __m256;
  using Mask = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRows = 3, kScoreVecs = 4, kValueVecs = 4;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg exp(Reg x) { return exp8(x); }
  static Mask lanes(int64_t first, int64_t last, int64_t c0) {
    return key_lanes(first, last, c0);
  }
  static Reg max_in(Reg top, Mask m, Reg x) {
    return _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, m));
  }
  static Reg keep(Mask m, Reg x) { return _mm256_and_ps(m, x); }
  static float reduce_max(Reg v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  static float reduce_add(Reg v) { return hsum(v); }
};

// The 8-bit kernel on W in column blocks (kernels.h): a block's 16 columns in the lanes of
// two registers (columns 0-7, 8-15), a pair of k per register pair (32 bytes widened to
// 16-bit), x's pair at that k broadcast, one `madd` and one `add` per 8 columns into their
// int32 sums; per group those are converted once and added times the columns' scales times
// x's. MB rows (1-3: the 16 registers) per tile. Same sums as generic_q8_columns.
inline __m256i pair_at(const int16_t* x) {   // x[0], x[1] as one int32, in every lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm256_set1_epi32(v);
}

template <int MB>
inline void q8_tile(const QuantMatmul& mm, int64_t r0, int64_t b, float* out,
                    int64_t out_stride, int64_t count) {
  const int64_t groups = mm.groups;
  const int8_t* w = reinterpret_cast<const int8_t*>(mm.qs) + b * groups * 32 * kQ8Columns;
  const float* sc = mm.scale + b * groups * kQ8Columns;
  const int16_t* x[MB];
  const float* dx[MB];
  for (int m = 0; m < MB; ++m) {
    x[m] = mm.xq->q.data() + (r0 + m) * mm.k_in;
    dx[m] = mm.xq->d.data() + (r0 + m) * groups;
  }
  __m256 acc[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MB; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += 32 * kQ8Columns, sc += kQ8Columns) {
    __m256i dot[2][MB];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MB; ++m) dot[h][m] = _mm256_setzero_si256();
    for (int p = 0; p < 16; ++p) {
      const int8_t* wp = w + p * 2 * kQ8Columns;
      const __m256i wv[2] = {
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)))};
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = pair_at(x[m] + g * 32 + 2 * p);
        for (int h = 0; h < 2; ++h)
          dot[h][m] = _mm256_add_epi32(dot[h][m], _mm256_madd_epi16(wv[h], xv));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scales = _mm256_loadu_ps(sc + 8 * h);
      for (int m = 0; m < MB; ++m)
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][m]),
                                    _mm256_mul_ps(scales, _mm256_set1_ps(dx[m][g])), acc[h][m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float y[kQ8Columns];
    _mm256_store_ps(y, acc[0][m]);
    _mm256_store_ps(y + 8, acc[1][m]);
    std::copy(y, y + std::min(kQ8Columns, count), out + m * out_stride);
  }
}

template <int MB>
void q8_rows(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
             int64_t out_stride) {
  for (int64_t n = begin; n < end; n += kQ8Columns)
    q8_tile<MB>(mm, r0, n / kQ8Columns, out + (n - begin), out_stride, end - n);
}

// ColumnsFn: rows in tiles of 3, the 1-2 left in one more.
void q8_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                float* out, int64_t out_stride) {
  for (int64_t m = 0; m < rows; m += 3) {
    float* o = out + m * out_stride;
    switch (std::min<int64_t>(3, rows - m)) {
      case 1: q8_rows<1>(mm, r0 + m, begin, end, o, out_stride); break;
      case 2: q8_rows<2>(mm, r0 + m, begin, end, o, out_stride); break;
      default: q8_rows<3>(mm, r0 + m, begin, end, o, out_stride); break;
    }
  }
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
    k.prefill_block = avx2::prefill_rows_block<avx2::F32x8>;
    k.silu_mul_f32 = avx2::silu_mul_f32;
    k.round_bf16 = avx2::round_bf16;
    k.quantize_row = avx2::quantize_row;
    k.int_columns = avx2::int_columns;
    k.q8_columns = avx2::q8_columns;
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
