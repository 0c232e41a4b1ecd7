// The AVX-512 BF16 variant (the AVX-512 variant's CPUs with `vdpbf16ps`: AMD Zen 4 and 5,
// Cooper Lake and Sapphire Rapids Xeons and later): the AVX-512 table with bf16 dot
// products where a bf16 operand is exact, so that they change no number beyond the order
// of the fp32 sums (docs/cpu-performance.md, "Kernels and dispatch"):
// - decode attention on a bf16 cache under bf16 activations: q . k as bf16 products of q and
//   the keys as they are, fp32 sums, then scaled (the torch twin's order); under fp32
//   activations (--kv-cache-dtype bfloat16) q is not bf16, so the keys are widened as in the
//   AVX-512 table (`attend_f32_bf16`, inherited: rounding q would change the scores);
// - the 4-bit matmul from kFpRows bf16 rows: the nibbles (0-15, exact in bf16) against x,
//   scaled per group afterwards.
// `vdpbf16ps` multiplies bf16 pairs exactly (8-bit by 8-bit significands) and adds them in
// fp32; it flushes denormal inputs and results (below 1.2e-38) to zero.
#include "isa.h"
#include "kernels.h"

#ifdef KVLOOP_X86
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

KVLOOP_TARGET_BEGIN("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
namespace kvloop::avx512_bf16 {

#include "x86_avx2_kernels.h"
#include "x86_avx512_kernels.h"

// --- decode attention on a bf16 cache ------------------------------------------------------
inline __m256bh load16bh(const c10::BFloat16* p) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// grouped_scores with bf16 products: 16 dims of a key and a head per `vdpbf16ps`, q and the
// keys as they are (nothing widened), each score times `scale` once summed, as the torch
// twin's (q . k) * scale.
template <int G>
inline void bf16_scores(const c10::BFloat16* q, float scale, int64_t dim,
                        const c10::BFloat16* keys, const int64_t* slot, int64_t len,
                        float* scores) {
  const int64_t stride = (len + 7) / 8 * 8;
  const __m256 factor = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const c10::BFloat16* key[8];
    for (int j = 0; j < 8; ++j) key[j] = keys + slot[std::min(t0 + j, len - 1)] * dim;
    prefetch_rows(keys, slot, dim, t0 + kPrefetchTokens, t0 + 8 + kPrefetchTokens, len);
    __m256 a[G][8];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      __m256bh qc[G];
      for (int g = 0; g < G; ++g) qc[g] = load16bh(q + g * dim + c);
      for (int j = 0; j < 8; ++j) {
        const __m256bh k = load16bh(key[j] + c);
        for (int g = 0; g < G; ++g) a[g][j] = _mm256_dpbf16_ps(a[g][j], qc[g], k);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm256_storeu_ps(scores + g * stride + t0, _mm256_mul_ps(reduce8(a[g]), factor));
  }
}

template <int G>
inline void attend_bf16_grouped(const c10::BFloat16* q, float scale, int64_t dim,
                                const c10::BFloat16* keys, const c10::BFloat16* vals,
                                const int64_t* slot, int64_t len, float* scores,
                                c10::BFloat16* out, int64_t out_stride) {
  prefetch_first_rows(keys, vals, slot, dim, len);
  bf16_scores<G>(q, scale, dim, keys, slot, len, scores);
  grouped_values<c10::BFloat16, G>(dim, vals, slot, len, scores, out, out_stride);
}

// As the AVX-512 variant's `attend` (2-4 heads together, else one at a time).
void attend_bf16(const c10::BFloat16* q, float scale, int64_t group, int64_t dim,
                 const c10::BFloat16* keys, const c10::BFloat16* vals, const int64_t* slot,
                 int64_t len, float* scores, c10::BFloat16* out, int64_t out_stride) {
  if (dim % 64 != 0)
    return generic_attend<c10::BFloat16>(q, scale, group, dim, keys, vals, slot, len, scores,
                                         out, out_stride);
  switch (group) {
    case 2: return attend_bf16_grouped<2>(q, scale, dim, keys, vals, slot, len, scores, out,
                                          out_stride);
    case 3: return attend_bf16_grouped<3>(q, scale, dim, keys, vals, slot, len, scores, out,
                                          out_stride);
    case 4: return attend_bf16_grouped<4>(q, scale, dim, keys, vals, slot, len, scores, out,
                                          out_stride);
    default:
      for (int64_t g = 0; g < group; ++g)
        attend_bf16_grouped<1>(q + g * dim, scale, dim, keys, vals, slot, len, scores,
                               out + g * out_stride, out_stride);
  }
}

// --- the 4-bit matmul from kFpRows bf16 rows ------------------------------------------------
// Per group, w . x = scale * (q . x) + offset * sum(x), q the nibbles: q . x in bf16 products
// (q exact), the sums of x come with the rows (`xs`). Two groups fill a register as in the
// VNNI kernel (x86_avx512.cpp): their 32 bytes widen to 16-bit lanes, the low nibbles (weights
// 0-15 of both) and the high ones (16-31) become bf16 by a table lookup (`vpermw`), x is in
// that pair order (`xb`), and the 16 fp32 lanes of a pair's products (8 per group) take their
// group's scale by a permute of 16 groups' scales.
// Word i (i < 32): the bf16 bits of i % 16.
inline __m512i nibble_table() {
  alignas(64) uint16_t bits[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16);
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  return _mm512_load_si512(bits);
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

inline __m512bh load32bh(const c10::BFloat16* p) {      // 16 values, the upper lanes zero
  return as_bh(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// One output column n for MB rows of xb from r0.
template <int MB>
inline void nibble_column(const QuantMatmul& mm, int64_t r0, int64_t n, const __m512i table,
                          float* out, int64_t out_stride) {
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset + n * groups;
  __m512 acc[MB], tail[MB];
  for (int m = 0; m < MB; ++m) acc[m] = tail[m] = _mm512_setzero_ps();
  const c10::BFloat16* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = mm.xb + (r0 + m) * mm.k_in;
  for (int64_t g = 0; g < groups; g += 16) {
    const int64_t left = std::min<int64_t>(16, groups - g);
    const __mmask16 mask = first_lanes(left);
    const __m512 scales = _mm512_maskz_loadu_ps(mask, sc + g);
    const __m512 offsets = _mm512_maskz_loadu_ps(mask, of + g);
    for (int m = 0; m < MB; ++m)
      tail[m] = _mm512_fmadd_ps(offsets,
                                _mm512_maskz_loadu_ps(mask, mm.xs + (r0 + m) * groups + g),
                                tail[m]);
    int64_t j = 0;
    for (; j + 2 <= left; j += 2) {
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g + j) * 16)));
      const __m512bh lo = as_bh(_mm512_permutexvar_epi16(bytes, table));   // index mod 32
      const __m512bh hi = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
      const __m512 s = _mm512_permutexvar_ps(pair_pick(j), scales);
      for (int m = 0; m < MB; ++m) {
        const c10::BFloat16* xg = xrow[m] + (g + j) * 32;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, as_bh(_mm512_loadu_si512(xg)));
        dot = _mm512_dpbf16_ps(dot, hi, as_bh(_mm512_loadu_si512(xg + 32)));
        acc[m] = _mm512_fmadd_ps(dot, s, acc[m]);
      }
    }
    if (j < left) {                     // an odd last group: 16 lanes, half of them zero
      const __m512i bytes = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (g + j) * 16))));
      const __m512bh lo = as_bh(_mm512_permutexvar_epi16(bytes, table));   // (0 is bf16 0)
      const __m512bh hi = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
      const __m512 s = _mm512_set1_ps(sc[g + j]);
      for (int m = 0; m < MB; ++m) {
        const c10::BFloat16* xg = xrow[m] + (g + j) * 32;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, load32bh(xg));
        dot = _mm512_dpbf16_ps(dot, hi, load32bh(xg + 16));
        acc[m] = _mm512_fmadd_ps(dot, s, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    out[m * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], tail[m]));
}

template <int MB>
void nibble_tile(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
                 int64_t out_stride) {
  const __m512i table = nibble_table();
  for (int64_t n = begin; n < end; ++n)
    nibble_column<MB>(mm, r0, n, table, out + (n - begin), out_stride);
}

void nibble_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                    float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return nibble_tile<1>(mm, r0, begin, end, out, out_stride);
    case 2: return nibble_tile<2>(mm, r0, begin, end, out, out_stride);
    case 3: return nibble_tile<3>(mm, r0, begin, end, out, out_stride);
    default: return nibble_tile<4>(mm, r0, begin, end, out, out_stride);
  }
}

// --- the 4-bit matmul at lane rows of bf16 x ----------------------------------------------
// The rows in 32-bit lanes (lane_rows, kernels.h), as `lane_columns` (x86_avx512.cpp) holds
// fp32 rows, but each lane a bf16 pair: x transposed (`xtb`, [K / 2, xt_stride]) holds in lane
// r, for group g and i < 16, (x[r, 32g + i], x[r, 32g + i + 16]): the two weights of nibble
// byte i of the group (low, high). A tile of kLaneColumns output columns has its nibbles
// expanded kBf16Depth k at a time into a scratch of bf16 pairs (q exact), once for all rows;
// per group, `vdpbf16ps` sums q . x for 8-16 columns by 16-48 rows in fp32 lanes (32 exact
// products each), then y += scale * (q . x) + offset * sum(x), with the group sums of x in
// lanes (`xts`, [G, xt_stride]): bf16_columns' products and sums, in lanes.
constexpr int kLaneColumns = 16;          // a pool chunk's columns (kColumnsPerLine)
// Columns per register tile: all 16 at 16 rows (16 accumulators), 8 at 32-48 rows (16-24).
constexpr int lane_tile_columns(int z) { return z == 1 ? kLaneColumns : kLaneColumns / 2; }
constexpr int64_t kBf16Depth = 1024;      // k per scratch fill: 32 KiB of pairs
constexpr int64_t kPairDepth = kBf16Depth / 2;
constexpr int64_t kLaneChunk = 128;       // rows per pass over a column tile's fills

// Word i (i < 32) of the lookup: the bf16 bits of i % 16 (nibble_table); a dword whose low
// word is a nibble byte b and high word b >> 4 becomes the pair (bf16(b & 15), bf16(b >> 4)).
// wq [kLaneColumns, kPairDepth]: columns n0 .. n0 + count (the others zero), groups from g0
// (gc of them); sc, of [kLaneColumns, gc]: their scales and offsets (zero likewise).
inline void expand_block(const QuantMatmul& mm, int64_t n0, int count, int64_t g0, int64_t gc,
                         const __m512i table, uint32_t* wq, float* sc, float* of) {
  for (int j = 0; j < kLaneColumns; ++j) {
    uint32_t* dst = wq + j * kPairDepth;
    if (j >= count) {
      for (int64_t p = 0; p < gc * 16; p += 16) _mm512_storeu_si512(dst + p, _mm512_setzero_si512());
      for (int64_t g = 0; g < gc; ++g) sc[j * gc + g] = of[j * gc + g] = 0.f;
      continue;
    }
    const uint8_t* row = mm.qs + (n0 + j) * mm.row_bytes + g0 * 16;
    const int64_t ahead = kLaneColumns;     // the next tile's column j, asked for into L2
    prefetch_bytes(row + ahead * mm.row_bytes, gc * 16);
    prefetch_bytes(mm.scale + (n0 + j + ahead) * mm.groups + g0, gc * 4);
    prefetch_bytes(mm.offset + (n0 + j + ahead) * mm.groups + g0, gc * 4);
    for (int64_t g = 0; g < gc; ++g, dst += 16) {
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512i index = _mm512_add_epi32(b, _mm512_slli_epi32(b, 12));    // (b, b >> 4)
      _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(index, table));
    }
    std::copy(mm.scale + (n0 + j) * mm.groups + g0, mm.scale + (n0 + j) * mm.groups + g0 + gc,
              sc + j * gc);
    std::copy(mm.offset + (n0 + j) * mm.groups + g0, mm.offset + (n0 + j) * mm.groups + g0 + gc,
              of + j * gc);
  }
}

// The two register widths of the lane kernel: 16 rows in a 512-bit register, 8 in a 256-bit
// one (a last 8 rows: bf16_lane_rows, kernels.h), with the same tiles.
struct Rows16 {
  static constexpr int kRows = 16;
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512bh pairs(const uint32_t* p) { return as_bh(_mm512_loadu_si512(p)); }
  static __m512bh pair1(uint32_t v) { return as_bh(_mm512_set1_epi32(static_cast<int>(v))); }
  static F dot(F acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
};

struct Rows8 {
  static constexpr int kRows = 8;
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256bh pairs(const uint32_t* p) {
    return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static __m256bh pair1(uint32_t v) { return (__m256bh)_mm256_set1_epi32(static_cast<int>(v)); }
  static F dot(F acc, __m256bh x, __m256bh w) { return _mm256_dpbf16_ps(acc, x, w); }
};

// y[j * kLaneChunk + i] += sum over the gc groups of scale * (q . x) + offset * sum(x), for
// Z x V::kRows rows i and J columns j: x pairs from xp ([gc * 16, ld]), group sums from xs
// ([gc, ld]), pairs wq ([J, kPairDepth]), scales and offsets ([J, gstride]).
template <typename V, int Z, int J>
inline void bf16_lane_block(const uint32_t* xp, const float* xs, int64_t ld, const uint32_t* wq,
                            const float* sc, const float* of, int64_t gstride, int64_t gc,
                            float* y) {
  constexpr int W = V::kRows;
  typename V::F out[J][Z];
  for (int j = 0; j < J; ++j)
    for (int z = 0; z < Z; ++z) out[j][z] = V::load(y + j * kLaneChunk + W * z);
  for (int64_t g = 0; g < gc; ++g) {
    typename V::F acc[J][Z];
    for (int j = 0; j < J; ++j)
      for (int z = 0; z < Z; ++z) acc[j][z] = V::zero();
    for (int i = 0; i < 16; ++i) {
      const uint32_t* x = xp + (g * 16 + i) * ld;
      decltype(V::pairs(x)) xv[Z];
      for (int z = 0; z < Z; ++z) xv[z] = V::pairs(x + W * z);
      for (int j = 0; j < J; ++j) {
        const auto w = V::pair1(wq[j * kPairDepth + g * 16 + i]);
        for (int z = 0; z < Z; ++z) acc[j][z] = V::dot(acc[j][z], xv[z], w);
      }
    }
    typename V::F sums[Z];
    for (int z = 0; z < Z; ++z) sums[z] = V::load(xs + g * ld + W * z);
    for (int j = 0; j < J; ++j) {
      const auto s = V::set1(sc[j * gstride + g]), o = V::set1(of[j * gstride + g]);
      for (int z = 0; z < Z; ++z)
        out[j][z] = V::fmadd(sums[z], o, V::fmadd(acc[j][z], s, out[j][z]));
    }
  }
  for (int j = 0; j < J; ++j)
    for (int z = 0; z < Z; ++z) V::store(y + j * kLaneChunk + W * z, out[j][z]);
}

template <typename V, int Z>
inline void bf16_lane_halves(const uint32_t* xp, const float* xs, int64_t ld,
                             const uint32_t* wq, const float* sc, const float* of, int64_t gc,
                             float* y) {
  constexpr int J = lane_tile_columns(Z);
  for (int j = 0; j < kLaneColumns; j += J)
    bf16_lane_block<V, Z, J>(xp, xs, ld, wq + j * kPairDepth, sc + j * gc, of + j * gc, gc, gc,
                             y + j * kLaneChunk);
}

// `lanes` rows (a multiple of 8) against one fill: 48 rows at a time while no whole run of
// 32 is left, then 32, then 16, then 8 (lane_block_rows).
inline void bf16_lane_rows(const uint32_t* xp, const float* xs, int64_t ld, int64_t lanes,
                           const uint32_t* wq, const float* sc, const float* of, int64_t gc,
                           float* y) {
  int64_t i = 0;
  for (; lanes - i >= 48 && (lanes - i) % 32 != 0; i += 48)
    bf16_lane_halves<Rows16, 3>(xp + i, xs + i, ld, wq, sc, of, gc, y + i);
  for (; lanes - i >= 32; i += 32)
    bf16_lane_halves<Rows16, 2>(xp + i, xs + i, ld, wq, sc, of, gc, y + i);
  if (lanes - i >= 16) {
    bf16_lane_halves<Rows16, 1>(xp + i, xs + i, ld, wq, sc, of, gc, y + i);
    i += 16;
  }
  if (lanes - i >= 8) bf16_lane_halves<Rows8, 1>(xp + i, xs + i, ld, wq, sc, of, gc, y + i);
}

// LanePairsFn, 16 rows at a time: a row's group of 32 becomes 16 pairs by one word permute,
// 16 rows' pairs are transposed (16 x 16 dwords), and the sums come from the transposed pairs
// (a pair's low word shifted up is x_i, its high word masked x_i+16).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(u[i + j], u[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(u[i + j], u[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

inline __m512i pair_words() {             // word 2i: i, word 2i + 1: i + 16
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(i);
    idx[2 * i + 1] = static_cast<uint16_t>(i + 16);
  }
  return _mm512_load_si512(idx);
}

void lane_pairs(const c10::BFloat16* x, int64_t rows, int64_t k_in, uint32_t* xt, float* xs,
                int64_t stride) {
  const __m512i order = pair_words();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t m0 = 0; m0 < rows; m0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - m0);
    for (int64_t g = 0; g < k_in / 32; ++g) {
      __m512i p[16];
      for (int r = 0; r < 16; ++r)
        p[r] = r < n ? _mm512_permutexvar_epi16(
                           order, _mm512_loadu_si512(x + (m0 + r) * k_in + g * 32))
                     : _mm512_setzero_si512();
      transpose16(p);
      __m512 sum = _mm512_setzero_ps();
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(xt + (g * 16 + i) * stride + m0, p[i]);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(p[i], 16)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(p[i], high)));
      }
      _mm512_storeu_ps(xs + g * stride + m0, sum);
    }
  }
}

// ColumnsFn over the rows xtb holds (r0 0, rows bf16_lane_rows(M): 16s, 13-15 padded to 16,
// 8): column tile by tile, kLaneChunk rows at a time, scratch fill by fill of k.
//
// The scratch is page-aligned so that its offsets within a page are the same in every process:
// 64-byte aligned, the main thread's stack (whose start Linux randomizes within a page)
// put them elsewhere per process, and in about a third of fresh processes 8-16-row fused
// decode steps ran 35-40 % slower (Zen 4, 4 layers: 8 rows 2.8-3.6 against 1.8-2.3 ms; none
// with ASLR off). Page-aligned, 1 of 13 fresh processes timed an 8-row step slow (2.8 ms).
// 4K aliasing against the heap's x is the presumed cause: this VM exposes no counters.
void bf16_lane_columns(const QuantMatmul& mm, int64_t, int rows, int64_t begin, int64_t end,
                       float* out, int64_t out_stride) {
  alignas(4096) uint32_t wq[kLaneColumns * kPairDepth];
  alignas(4096) float sc[kLaneColumns * (kBf16Depth / 32)], of[kLaneColumns * (kBf16Depth / 32)];
  alignas(4096) float y[kLaneColumns * kLaneChunk];
  const __m512i table = nibble_table();
  const int64_t ld = mm.xt_stride;
  for (int64_t n0 = begin; n0 < end; n0 += kLaneColumns) {
    const int count = static_cast<int>(std::min<int64_t>(kLaneColumns, end - n0));
    for (int64_t m0 = 0; m0 < rows; m0 += kLaneChunk) {
      const int64_t lanes = std::min(kLaneChunk, (rows + 7) / 8 * 8 - m0);
      std::fill(y, y + kLaneColumns * kLaneChunk, 0.f);
      for (int64_t g0 = 0; g0 < mm.groups; g0 += kBf16Depth / 32) {
        const int64_t gc = std::min(kBf16Depth / 32, mm.groups - g0);
        expand_block(mm, n0, count, g0, gc, table, wq, sc, of);
        bf16_lane_rows(mm.xtb + g0 * 16 * ld + m0, mm.xts + g0 * ld + m0, ld, lanes, wq, sc,
                       of, gc, y);
      }
      const int64_t m_end = std::min<int64_t>(rows, m0 + kLaneChunk);
      for (int64_t m = m0; m < m_end; ++m)
        for (int j = 0; j < count; ++j)
          out[m * out_stride + (n0 - begin) + j] = y[j * kLaneChunk + (m - m0)];
    }
  }
}

// --- the 4-bit matmul on weights in column blocks -------------------------------------------
// The columns in lanes (kQ4Columns, kernels.h): per group and nibble byte i, the block's 16
// bytes widen to one register of 16 columns' bf16 pairs (the weights 32g + i and 32g + i + 16,
// by the `nibble_table` lookup), which serves every row of a tile: one `vdpbf16ps` per row
// against that row's pair (x[32g + i], x[32g + i + 16]) broadcast. Per group and row, y +=
// scale * (q . x) + offset * sum(x) in 16 lanes at once (the block's scales and offsets as
// they lie): bf16_columns' exact products and fp32 sums, no horizontal sums, each weight
// widened once per tile of up to kBlockRows rows.
constexpr int kBlockRows = 8;

template <int MB>
inline void block_tile(const QuantMatmul& mm, const uint8_t* qs, const float* sc,
                       const float* of, const uint32_t* xp, const float* xs, const __m512i table,
                       float* out, int64_t out_stride, int count) {
  const int64_t groups = mm.groups, half = mm.k_in / 2;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, qs += 16 * kQ4Columns) {
    __m512 dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + i * kQ4Columns)));
      const __m512i index = _mm512_add_epi32(b, _mm512_slli_epi32(b, 12));    // (b, b >> 4)
      const __m512bh w = as_bh(_mm512_permutexvar_epi16(index, table));
      for (int m = 0; m < MB; ++m)
        dot[m] = _mm512_dpbf16_ps(
            dot[m], w, as_bh(_mm512_set1_epi32(static_cast<int>(xp[m * half + g * 16 + i]))));
    }
    const __m512 s = _mm512_loadu_ps(sc + g * kQ4Columns);
    const __m512 o = _mm512_loadu_ps(of + g * kQ4Columns);
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[m * groups + g]),
                               _mm512_fmadd_ps(dot[m], s, acc[m]));
  }
  const __mmask16 mask = first_lanes(count);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(out + m * out_stride, mask, acc[m]);
}

// ColumnsFn over W in column blocks (mm.qs, scale, offset) and x in row pairs (`xrp`, `xs`):
// block by block, the rows from r0 in tiles of kBlockRows (the block's weights stay in L1).
void bf16_block_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                        int64_t end, float* out, int64_t out_stride) {
  const __m512i table = nibble_table();
  const int64_t groups = mm.groups, half = mm.k_in / 2;
  for (int64_t n0 = begin; n0 < end; n0 += kQ4Columns) {
    const int64_t b = n0 / kQ4Columns;
    const uint8_t* qs = mm.qs + b * groups * 16 * kQ4Columns;
    const float* sc = mm.scale + b * groups * kQ4Columns;
    const float* of = mm.offset + b * groups * kQ4Columns;
    const int count = static_cast<int>(std::min<int64_t>(kQ4Columns, end - n0));
    for (int64_t m0 = r0; m0 < r0 + rows; m0 += kBlockRows) {
      const uint32_t* xp = mm.xrp + m0 * half;
      const float* xs = mm.xs + m0 * groups;
      float* y = out + (m0 - r0) * out_stride + (n0 - begin);
      switch (std::min<int64_t>(kBlockRows, r0 + rows - m0)) {
        case 1: block_tile<1>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 2: block_tile<2>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 3: block_tile<3>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 4: block_tile<4>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 5: block_tile<5>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 6: block_tile<6>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        case 7: block_tile<7>(mm, qs, sc, of, xp, xs, table, y, out_stride, count); break;
        default: block_tile<8>(mm, qs, sc, of, xp, xs, table, y, out_stride, count);
      }
    }
  }
}

// RowPairsFn: a row's group of 32 becomes its 16 pairs by one word permute (pair_words); the
// group's sum from the pairs (a pair's low word shifted up is x_i, its high word masked
// x_i+16).
void row_pairs(const c10::BFloat16* x, int64_t rows, int64_t k_in, uint32_t* xp, float* xs) {
  const __m512i order = pair_words();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t groups = k_in / 32;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i p = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(x + m * k_in + g * 32));
      _mm512_storeu_si512(xp + m * k_in / 2 + g * 16, p);
      const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(p, 16)),
                                       _mm512_castsi512_ps(_mm512_and_si512(p, high)));
      xs[m * groups + g] = _mm512_reduce_add_ps(sum);
    }
}

}  // namespace kvloop::avx512_bf16
KVLOOP_TARGET_END

namespace kvloop {

const Kernels* avx512_bf16_kernels() {
  static const Kernels table = [] {
    Kernels k = *avx512_kernels();
    k.name = "avx512_bf16";
    k.attend_bf16 = avx512_bf16::attend_bf16;
    k.bf16_columns = avx512_bf16::nibble_columns;
    k.bf16_lane_columns = avx512_bf16::bf16_lane_columns;
    k.lane_pairs = avx512_bf16::lane_pairs;
    k.bf16_block_columns = avx512_bf16::bf16_block_columns;
    k.row_pairs = avx512_bf16::row_pairs;
    return k;
  }();
  return &table;
}

}  // namespace kvloop

#else

namespace kvloop {
const Kernels* avx512_bf16_kernels() { return nullptr; }
}  // namespace kvloop

#endif
