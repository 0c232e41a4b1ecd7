// The AVX-512 variant (F, BW, VL and VNNI: Ice Lake, Sapphire Rapids and later Xeons, AMD
// Zen 4 and 5): the AVX2 kernels rebuilt with 32 vector registers, which lets a KV head's
// 2-4 query heads share each key's load, the integer matmul on `vpdpwssd` and the 4-bit
// matmul with 16 and more fp32 rows in vector lanes (`lane_columns`).
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
#include "x86_prefill.h"

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

// --- prefill attention: one key block of a tile (PrefillBlockFn, x86_prefill.h) -----------
// exp(x), 16 at a time (ExpRecipe, x86_avx2_kernels.h).
inline __m512 exp16(__m512 x) {
  using R = ExpRecipe;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(R::kLow)), _mm512_set1_ps(R::kHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(R::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(R::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(R::kLn2Lo), r);
  __m512 e = _mm512_set1_ps(R::kInvFactorial[0]);
  for (int i = 1; i < R::kTerms; ++i)
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(R::kInvFactorial[i]));
  const __m512i two_n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(two_n));
}

// The lanes of keys [first, last) among the 16 from key c0.
inline __mmask16 key_lanes(int64_t first, int64_t last, int64_t c0) {
  const int64_t a = std::clamp<int64_t>(first - c0, 0, 16);
  const int64_t b = std::clamp<int64_t>(last - c0, 0, 16);
  return static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
}

// 16 fp32 lanes for the prefill block kernel (x86_prefill.h): 6 rows x 4 vectors (64 keys
// or 64 dims) per pass, 24 accumulators of the 32 registers.
struct F32x16 {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static constexpr int kRows = 6, kScoreVecs = 4, kValueVecs = 4;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg exp(Reg x) { return exp16(x); }
  static Mask lanes(int64_t first, int64_t last, int64_t c0) {
    return key_lanes(first, last, c0);
  }
  static Reg max_in(Reg top, Mask m, Reg x) { return _mm512_mask_max_ps(top, m, top, x); }
  static Reg keep(Mask m, Reg x) { return _mm512_maskz_mov_ps(m, x); }
  static float reduce_max(Reg v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
};

// The integer kernel on VNNI: `dpwssd` multiplies 32 int16 pairs and adds them into 16
// int32 lanes in one instruction, where AVX2 needs a `madd` and an `add` per 16. Two 4-bit
// groups fill one register: their 32 bytes widen to 32 16-bit lanes, whose low nibbles are
// weights 0-15 of both groups and whose high nibbles weights 16-31, so x is read in that
// order (`q4_pairs`: generic.cpp's pair_order). The products of a pair land in 16 lanes, 8
// per group: converted once and scaled by a vector holding each group's scale in its 8
// lanes (a permute of 16 groups' scales, loaded together). Same integer sums as the AVX2
// kernel; the float sums run in another order. (8-bit weights: q8_columns.)
// acc += dot's sums times the scales that `pick` selects from sd (one per lane).
inline __m512 add_scaled(__m512 acc, __m512i dot, __m512i pick, __m512 sd) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, sd), acc);
}

inline __m512i load_epi16x16(const int16_t* p) {      // 16 values, the upper lanes zero
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One output column n of 4-bit W for MB rows of x from r0.
template <int MB>
inline void vnni_column(const QuantMatmul& mm, int64_t r0, int64_t n, float* out,
                        int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset + n * groups;
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
      tail[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, of + g),
                                _mm512_maskz_loadu_ps(mask, xq.s.data() + r * groups + g),
                                tail[m]);
    }
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
  }
  for (int m = 0; m < MB; ++m)
    out[m * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], tail[m]));
}

template <int MB>
void vnni_tile(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
               int64_t out_stride) {
  for (int64_t n = begin; n < end; ++n)
    vnni_column<MB>(mm, r0, n, out + (n - begin), out_stride);
}

void vnni_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                  float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return vnni_tile<1>(mm, r0, begin, end, out, out_stride);
    case 2: return vnni_tile<2>(mm, r0, begin, end, out, out_stride);
    case 3: return vnni_tile<3>(mm, r0, begin, end, out, out_stride);
    default: return vnni_tile<4>(mm, r0, begin, end, out, out_stride);
  }
}

// The 8-bit kernel on W in column blocks (kernels.h): the columns in vector lanes. A block's
// pair of k for its 16 columns is one register (32 bytes widened to 16-bit), x's pair of
// int16 at that k broadcast to every lane, and one `dpwssd` adds both products into each
// column's int32 sum: 16 per group and row give the group's 16 integer dot products, which
// are converted once and added times the 16 columns' scales times x's (one FMA), with no
// horizontal sum at the end. So per group, row and 16 columns 16 `dpwssd`, a convert, a
// multiply and an FMA, where the column kernel (vnni_column) spent a `dpwssd`, a convert, a
// permute and an FMA per column. Same integer sums; each column's fp32 sum runs over the
// groups in order (as generic_q8_columns'). C blocks (16 C columns) and MB rows per tile.

// acc + the products of w's 16-bit pairs with x[0], x[1] (the same pair in every lane): one
// `vpdpwssd` with x broadcast from memory, acc in place. In assembly: GCC 12 builds the
// intrinsic's accumulator in a copy (a move per `dpwssd`) and broadcasts x apart.
inline __m512i dot_pair(__m512i acc, __m512i w, const int16_t* x) {
  asm("vpdpwssd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// The tile's columns from block b (C blocks; `count` of them stored, a last block's masked)
// for MB rows from r0: out[m * out_stride + j].
template <int C, int MB>
inline void q8_tile(const QuantMatmul& mm, int64_t r0, int64_t b, float* out,
                    int64_t out_stride, int64_t count) {
  const int64_t groups = mm.groups;
  const int8_t* w = reinterpret_cast<const int8_t*>(mm.qs) + b * groups * 32 * kQ8Columns;
  const float* sc = mm.scale + b * groups * kQ8Columns;
  const int64_t block_bytes = groups * 32 * kQ8Columns, block_scales = groups * kQ8Columns;
  const int16_t* x[MB];
  const float* dx[MB];
  for (int m = 0; m < MB; ++m) {
    x[m] = mm.xq->q.data() + (r0 + m) * mm.k_in;
    dx[m] = mm.xq->d.data() + (r0 + m) * groups;
  }
  __m512 acc[C][MB];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MB; ++m) acc[c][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += 32 * kQ8Columns, sc += kQ8Columns) {
    __m512i dot[C][MB];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MB; ++m) dot[c][m] = _mm512_setzero_si512();
    for (int p = 0; p < 16; ++p) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c)
        wv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + c * block_bytes + p * 2 * kQ8Columns)));
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < C; ++c) dot[c][m] = dot_pair(dot[c][m], wv[c], x[m] + g * 32 + 2 * p);
    }
    for (int c = 0; c < C; ++c) {
      const __m512 scales = _mm512_loadu_ps(sc + c * block_scales);
      for (int m = 0; m < MB; ++m)
        acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c][m]),
                                    _mm512_mul_ps(scales, _mm512_set1_ps(dx[m][g])), acc[c][m]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __mmask16 mask = first_lanes(count - c * kQ8Columns);
    for (int m = 0; m < MB; ++m)
      _mm512_mask_storeu_ps(out + m * out_stride + c * kQ8Columns, mask, acc[c][m]);
  }
}

// MB rows from r0 over the blocks of [begin, end): C at a time while C are left, then one
// at a time.
template <int C, int MB>
void q8_rows(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
             int64_t out_stride) {
  int64_t n = begin;
  for (; end - n > (C - 1) * kQ8Columns; n += C * kQ8Columns)
    q8_tile<C, MB>(mm, r0, n / kQ8Columns, out + (n - begin), out_stride, end - n);
  for (; n < end; n += kQ8Columns)
    q8_tile<1, MB>(mm, r0, n / kQ8Columns, out + (n - begin), out_stride, end - n);
}

// ColumnsFn: rows in tiles of kQ8Rows, the 1-7 left in one more; 1-2 rows take 4 blocks at
// a time, 3-4 rows 2 (4-8 chains of `dpwssd` in flight; measured, one thread, the head at 2
// rows: 1.8-2.0 ms with 4 blocks, 2.6-2.8 with 2; a split of each sum into two chains, for 8
// at 1 row, bought nothing measurable).
constexpr int kQ8Rows = 8;

void q8_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                float* out, int64_t out_stride) {
  for (int64_t m = 0; m < rows; m += kQ8Rows) {
    float* o = out + m * out_stride;
    switch (std::min<int64_t>(kQ8Rows, rows - m)) {
      case 1: q8_rows<4, 1>(mm, r0 + m, begin, end, o, out_stride); break;
      case 2: q8_rows<4, 2>(mm, r0 + m, begin, end, o, out_stride); break;
      case 3: q8_rows<2, 3>(mm, r0 + m, begin, end, o, out_stride); break;
      case 4: q8_rows<2, 4>(mm, r0 + m, begin, end, o, out_stride); break;
      case 5: q8_rows<1, 5>(mm, r0 + m, begin, end, o, out_stride); break;
      case 6: q8_rows<1, 6>(mm, r0 + m, begin, end, o, out_stride); break;
      case 7: q8_rows<1, 7>(mm, r0 + m, begin, end, o, out_stride); break;
      default: q8_rows<1, 8>(mm, r0 + m, begin, end, o, out_stride); break;
    }
  }
}

// The 4-bit matmul at many fp32 rows (lane_rows, kernels.h), the rows in vector lanes: x
// transposed (`xt`, [K, lane_stride(rows)]) puts 16 rows' values of one k in a register. A
// tile of kLaneColumns output columns is dequantized kLaneDepth k at a time into a scratch
// about the L1's size (q * scale + offset, the weights fp_columns makes; each
// column's 256 bytes of nibbles read in one run), and every row runs over it: per k, one
// load of x per 16 rows, one broadcast weight per column and an FMA per column and 16 rows,
// so a weight is dequantized once for all rows (the 4-row tiles did it once per 4 rows, for
// 4 FMAs). Sums: each (row, column) in one lane along kLaneSum k at a time, then those
// partial sums in order (the order differs from fp_columns', not the products).
constexpr int kLaneColumns = 16;          // a pool chunk's columns (kColumnsPerLine)
constexpr int kLaneHalf = 8;              // columns per register tile at 16-48 rows
constexpr int64_t kLaneDepth = 512;       // k per scratch fill: 32 KiB of weights
constexpr int64_t kLaneSum = 128;         // k per partial sum (a whole number per fill)
constexpr int64_t kLaneChunk = 128;       // rows per pass over a column tile's scratch fills

// w [kLaneColumns, kLaneDepth]: columns n0 .. n0 + count of W (the others zero), k from k0
// (kc of them, whole groups).
inline void dequant_block(const QuantMatmul& mm, int64_t n0, int count, int64_t k0,
                          int64_t kc, float* w) {
  const __m512i mask = _mm512_set1_epi32(15);
  for (int j = 0; j < kLaneColumns; ++j) {
    float* dst = w + j * kLaneDepth;
    if (j >= count) {
      for (int64_t k = 0; k < kc; k += 16) _mm512_storeu_ps(dst + k, _mm512_setzero_ps());
      continue;
    }
    const uint8_t* row = mm.qs + (n0 + j) * mm.row_bytes;
    const float* sc = mm.scale + (n0 + j) * mm.groups;
    const float* of = mm.offset + (n0 + j) * mm.groups;
    for (int64_t g = k0 / 32; g < (k0 + kc) / 32; ++g, dst += 32) {
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512 s = _mm512_set1_ps(sc[g]), o = _mm512_set1_ps(of[g]);
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, mask)), s, o));
      _mm512_storeu_ps(dst + 16,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, o));
    }
  }
}

// y[j * kLaneChunk + i] (+)= sum over k < kc of x[k * ld + i] w[j * kLaneDepth + k] (`first`:
// =), for Z x 16 rows i in 512-bit registers and kLaneHalf columns j.
template <int Z>
inline void lane_block(const float* x, int64_t ld, const float* w, int64_t kc, float* y,
                       bool first) {
  __m512 acc[kLaneHalf][Z];
  for (int j = 0; j < kLaneHalf; ++j)
    for (int z = 0; z < Z; ++z) acc[j][z] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 xv[Z];
    for (int z = 0; z < Z; ++z) xv[z] = _mm512_loadu_ps(x + k * ld + 16 * z);
    for (int j = 0; j < kLaneHalf; ++j) {
      const __m512 b = _mm512_set1_ps(w[j * kLaneDepth + k]);
      for (int z = 0; z < Z; ++z) acc[j][z] = _mm512_fmadd_ps(xv[z], b, acc[j][z]);
    }
  }
  for (int j = 0; j < kLaneHalf; ++j)
    for (int z = 0; z < Z; ++z) {
      float* p = y + j * kLaneChunk + 16 * z;
      _mm512_storeu_ps(p, first ? acc[j][z] : _mm512_add_ps(_mm512_loadu_ps(p), acc[j][z]));
    }
}

template <int Z>
inline void lane_halves(const float* x, int64_t ld, const float* w, int64_t kc, float* y,
                        bool first) {
  for (int j = 0; j < kLaneColumns; j += kLaneHalf)
    lane_block<Z>(x, ld, w + j * kLaneDepth, kc, y + j * kLaneChunk, first);
}

// `lanes` rows of x (a multiple of 16) against one block of w, into y: 48 rows at a time
// while no whole run of 32 is left, then 32, then 16.
inline void lane_block_rows(const float* x, int64_t ld, int64_t lanes, const float* w,
                            int64_t kc, float* y, bool first) {
  int64_t i = 0;
  for (; lanes - i >= 48 && (lanes - i) % 32 != 0; i += 48)
    lane_halves<3>(x + i, ld, w, kc, y + i, first);
  for (; lanes - i >= 32; i += 32) lane_halves<2>(x + i, ld, w, kc, y + i, first);
  if (lanes - i >= 16) lane_halves<1>(x + i, ld, w, kc, y + i, first);
}

// ColumnsFn over the rows xt holds (r0 0, rows lane_rows(M)): column tile by tile,
// kLaneChunk rows at a time, scratch fill by fill of k, kLaneSum k per partial sum.
void lane_columns(const QuantMatmul& mm, int64_t, int rows, int64_t begin, int64_t end,
                  float* out, int64_t out_stride) {
  alignas(64) float w[kLaneColumns * kLaneDepth];
  alignas(64) float y[kLaneColumns * kLaneChunk];
  const int64_t ld = mm.xt_stride;
  for (int64_t n0 = begin; n0 < end; n0 += kLaneColumns) {
    const int count = static_cast<int>(std::min<int64_t>(kLaneColumns, end - n0));
    for (int64_t m0 = 0; m0 < rows; m0 += kLaneChunk) {
      const int64_t lanes = std::min(kLaneChunk, ld - m0);
      for (int64_t k0 = 0; k0 < mm.k_in; k0 += kLaneDepth) {
        const int64_t kc = std::min(kLaneDepth, mm.k_in - k0);
        dequant_block(mm, n0, count, k0, kc, w);
        for (int64_t k = 0; k < kc; k += kLaneSum)
          lane_block_rows(mm.xt + (k0 + k) * ld + m0, ld, lanes, w + k,
                          std::min(kLaneSum, kc - k), y, k0 + k == 0);
      }
      const int64_t m_end = std::min<int64_t>(rows, m0 + kLaneChunk);
      for (int64_t m = m0; m < m_end; ++m)
        for (int j = 0; j < count; ++j)
          out[m * out_stride + (n0 - begin) + j] = y[j * kLaneChunk + (m - m0)];
    }
  }
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
    k.prefill_block = avx512::prefill_rows_block<avx512::F32x16>;
    k.silu_mul_f32 = avx512::silu_mul_f32;
    k.round_bf16 = avx512::round_bf16_wide;
    k.quantize_row = avx512::quantize_row;
    k.int_columns = avx512::vnni_columns;
    k.q8_columns = avx512::q8_columns;
    k.fp_columns = avx512::fp_columns;
    k.lane_columns = avx512::lane_columns;
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
