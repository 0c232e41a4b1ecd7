// kvloop's CPU kernels: the dispatch table every instruction-set variant fills, and the
// drivers (generic.cpp) that run an op with a table.
//
// Layout (docs/cpu-performance.md, "Kernels and dispatch"):
// - generic.cpp: the portable kernels (plain C++, built for the architecture's baseline) and
//   the drivers: threading, row quantization, tiling; each driver calls the table's inner
//   kernels where a variant has faster ones;
// - x86_avx2.cpp, x86_avx512.cpp, x86_avx512_bf16.cpp: one file per instruction set, each
//   compiled for its own target inside a `KVLOOP_TARGET` region (isa.h), each filling a
//   `Kernels` table;
// - dispatch.cpp: the variants in order (`kVariants`: the one place a variant is
//   registered), the CPU's check of each, and the process's choice;
// - cpu_ops.cpp: the torch bindings and `DecodeStack`, which call the drivers with the chosen
//   table.
// This header includes no torch header: the ISA files must not instantiate torch's inline
// code with their target flags (the linker keeps one copy of an inline function, and a
// wide-vector copy would then run on every CPU).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvloop {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Decode attention's software prefetch. A paged cache scatters a request's blocks (16
// tokens of one head: 4 KiB in fp32, one page), and the hardware prefetcher stops at a
// page's end, so a kernel that left it alone would start every block with misses to DRAM.
// The attention kernels' passes over a KV head's keys, then its values, each ask for the
// row kPrefetchTokens ahead of the one in use (the first rows of both as the work starts),
// into L2 (not L1: the L1's few miss buffers then cap the stream; measured, one
// thread over 30 layers' shuffled blocks: 8.6 GB/s into L1, 17-18 GB/s into L2 at 16-64
// tokens ahead, 7.5 GB/s without).
constexpr int64_t kPrefetchTokens = 32;

// Asks for the `bytes` from p into L2. On x86 in assembly: GCC 12 emits nothing for
// __builtin_prefetch (or _mm_prefetch) in a file where immintrin.h's target pragmas follow
// this header (every file here that includes it).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht2 %0" : : "m"(c[i]));
#else
    __builtin_prefetch(c + i, 0, 1);
#endif
  }
}

// Rows [begin, end) of a pass over a KV head's keys or values (token t's row at
// rows + slot[t] * dim), those below len, asked for ahead of use.
template <typename T>
inline void prefetch_rows(const T* rows, const int64_t* slot, int64_t dim, int64_t begin,
                          int64_t end, int64_t len) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t = begin; t < std::min(end, len); ++t)
    prefetch_bytes(rows + slot[t] * dim, bytes);
}

// The first kPrefetchTokens rows of both passes, asked for as a KV head's work starts (its
// values' then sit in L2 when the keys' pass ends).
template <typename T>
inline void prefetch_first_rows(const T* keys, const T* vals, const int64_t* slot, int64_t dim,
                                int64_t len) {
  prefetch_rows(keys, slot, dim, 0, kPrefetchTokens, len);
  prefetch_rows(vals, slot, dim, 0, kPrefetchTokens, len);
}

// Row t alone (prefetch_rows).
template <typename T>
inline void prefetch_row(const T* rows, const int64_t* slot, int64_t dim, int64_t t,
                         int64_t len) {
  prefetch_rows(rows, slot, dim, t, t + 1, len);
}

// slot[t] for t < len: the cache row of a request's token t (its block table's `blocks`),
// built a block at a time (no division per token).
inline void slot_rows(const int64_t* blocks, int64_t block_size, int64_t len,
                      std::vector<int64_t>& slot) {
  slot.resize(len);
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
    const int64_t first = blocks[b] * block_size, n = std::min(block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) slot[t0 + i] = first + i;
  }
}

// Rows of x quantized per group of 32 to int16 (dx = max|x| / 32767): the integer kernels'
// operand.
constexpr float kQMax = 32767.f;

struct QuantizedRows {
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> d;       // [M, G]: dx
  std::vector<float> s;       // [M, G]: dx * sum(xq)
};

// 8-bit weights (Q8_0: int8 q, one fp32 scale per group of 32) in blocks of kQ8Columns
// output columns, N padded with zero columns to a whole block, so that one register holds
// a pair of k for every column of a block (the `q8_columns` kernels): block b, group g, pair
// p (k = 32g + 2p and 32g + 2p + 1) is 32 bytes, column j's two at 2j and 2j + 1:
//   qs[((b * G + g) * 16 + p) * 32 + 2j + i] = q[16b + j, 32g + 2p + i]   [N', K]
//   scale[(b * G + g) * 16 + j] = scale[16b + j, g]                      [N', G]
// (kvloop.model.quant.q8_column_blocks writes it at load).
constexpr int64_t kQ8Columns = 16;

// One quantized matmul y = x @ W.T as the column kernels read it. W [N, K] in groups of 32:
// 4-bit: qs [N, K/2] (per group 16 bytes, byte i = weight i low nibble, weight i + 16 high),
// scale and offset [N, K/32] (w = q * scale + offset); 8-bit: in column blocks (above),
// offset nullptr.
struct QuantMatmul {
  const uint8_t* qs;
  const float* scale;
  const float* offset;
  int bits;
  int64_t k_in, groups, row_bytes;
  const QuantizedRows* xq;    // the integer kernels: x as int16 per group
  const int16_t* xv;          // xq->q in the order `int_columns` reads it (`q4_pairs`)
  const float* xf;            // the fp32 kernels: x widened to fp32, [M, K]
  const c10::BFloat16* xb;    // the bf16 kernel: bf16 x [M, K] in pair order (`pair_order`)
  const float* xs;            // the bf16 kernel: each group's sum of x, [M, G]
  const float* xt;            // the lane kernel: x's first lane_rows(M) rows transposed,
  int64_t xt_stride;          //   [K, xt_stride = lane_stride(lane_rows(M))], zero-padded
  const uint32_t* xtb;        // the bf16 lane kernel: its bf16_lane_rows(M) rows as bf16
                              //   pairs, [K / 2, xt_stride] (`bf16_lane_order`), zero-padded
  const float* xts;           // and each group's sum of those bf16 values, [K / 32, xt_stride]
  const uint32_t* xrp;        // the block kernel: bf16 x's rows as pairs, [M, K / 2] (RowPairsFn)
};

// 4-bit weights in column blocks, for the block kernel (`bf16_block_columns`): N padded with
// zero columns to whole blocks of kQ4Columns output columns; per block b and group g, nibble
// byte i (weights 32g + i and 32g + i + 16: `QuantMatmul`) of every column of the block side
// by side, and the block's scales and offsets likewise:
//   qs[((b * G + g) * 16 + i) * kQ4Columns + j] = qs[16b + j, 16g + i]   [N' / 16, G, 16, 16]
//   scale[(b * G + g) * kQ4Columns + j] = scale[16b + j, g]             [N' / 16, G, 16]
// (kvloop.model.quant.q4_column_blocks writes it at load), so that one register holds a pair of
// k of every column of a block.
constexpr int64_t kQ4Columns = 16;

// y for `rows` (1-4; q8_columns, bf16_block_columns: any) rows of x from r0 and the columns [begin, end), in
// fp32: out[m * out_stride + (n - begin)].
using ColumnsFn = void (*)(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                           int64_t end, float* out, int64_t out_stride);

// One request's decode attention for one KV head: `group` query heads q [group, dim] (rows
// `dim` apart), each score q . k times `scale`, keys and values at `slot[0, len)` (token
// rows of `dim`), scores scratch [group, stride] (stride = len rounded up to 8), out
// [group] rows `out_stride` apart. q and out in the activations' dtype T, the cache in C: T
// itself, or bf16 under fp32 activations (--kv-cache-dtype bfloat16; widened exactly).
template <typename T, typename C = T>
using AttendFn = void (*)(const T* q, float scale, int64_t group, int64_t dim, const C* keys,
                          const C* vals, const int64_t* slot, int64_t len, float* scores,
                          T* out, int64_t out_stride);

// Prefill (chunk) attention, flash style: a task holds the rows of one KV head's query
// tile (prefill_positions(G) query positions x its G query heads, row r = position * G +
// head) and streams the keys in blocks of kPrefillKeys, keeping each row's running max,
// sum and output (online softmax), so nothing of size queries x keys is materialized.
constexpr int64_t kPrefillKeys = 128;
constexpr int64_t kPrefillRows = 48;       // rows of a task's tile (positions x G, at most)
inline int64_t prefill_positions(int64_t group) {
  return std::max<int64_t>(1, kPrefillRows / group);
}

// One key block of a tile: rows qs [rows, dim] (fp32, already scaled), the block's n <=
// kPrefillKeys keys transposed kt [dim, kPrefillKeys] (fp32, the columns past n zero) and
// values v [n, dim] (fp32); row r sees the block's keys [lo[r], hi[r]) (empty: the row is
// left as it is). Updates each row's running max m[r] (-inf before any key), sum l[r] of
// e^(s - m) and output o [rows, dim] (the sum of e^(s - m) v); s: scratch [rows,
// kPrefillKeys].
using PrefillBlockFn = void (*)(const float* qs, int64_t rows, int64_t dim, const float* kt,
                                const float* v, int64_t n, const int32_t* lo,
                                const int32_t* hi, float* m, float* l, float* o, float* s);

// q [n] widened to fp32 and multiplied by `scale`: the query of the fp32 attention kernels
// (scaled once, not each score).
template <typename T>
inline std::vector<float> scaled_query(const T* q, int64_t n, float scale) {
  std::vector<float> qf(n);
  for (int64_t i = 0; i < n; ++i) qf[i] = to_f(q[i]) * scale;
  return qf;
}

// One row of fp32 x quantized per group of 32: q [K], d and s [K / 32] (QuantizedRows).
using QuantizeRowFn = void (*)(const float* x, int64_t k_in, int16_t* q, float* d, float* s);

// out[i] = silu(gate[i]) * up[i], i < f (fp32 rows).
using SiluMulFn = void (*)(const float* gate, const float* up, float* out, int64_t f);

// out[i] = x[i] rounded to bf16 as c10::BFloat16(float) rounds it (to nearest even; every NaN
// to the quiet NaN 0x7FC0), i < n: a bf16 KV cache's write beside fp32 activations.
using RoundBf16Fn = void (*)(const float* x, c10::BFloat16* out, int64_t n);

// bf16 rows x [rows, k_in] as the bf16 lane kernel reads them: each group g's 16 pairs (x[32g
// + i], x[32g + i + 16]) transposed, xt [k_in / 2, stride] (xt[(16g + i) * stride + m]), and
// each group's sum of its 32 values in fp32 in the order x_0, x_16, x_1, x_17, ..., x_31, xs
// [k_in / 32, stride]; lanes from `rows` up to the next multiple of 16 (<= stride) zero.
using LanePairsFn = void (*)(const c10::BFloat16* x, int64_t rows, int64_t k_in, uint32_t* xt,
                             float* xs, int64_t stride);

// bf16 rows x [rows, k_in] as the block kernel reads them: each group g's 16 pairs (x[32g + i],
// x[32g + i + 16]) in order, xp [rows, k_in / 2] (xp[m * k_in / 2 + 16g + i]), and each group's
// sum of its 32 values in fp32, xs [rows, k_in / 32].
using RowPairsFn = void (*)(const c10::BFloat16* x, int64_t rows, int64_t k_in, uint32_t* xp,
                            float* xs);

// What an instruction-set variant provides; every entry is set (a variant starts from the
// generic table and replaces what it does faster). An op whose kernel has no variant (the
// norm, RoPE's rotation) is not here: generic.cpp alone holds it.
struct Kernels {
  const char* name;
  AttendFn<float> attend_f32;
  AttendFn<c10::BFloat16> attend_bf16;
  AttendFn<c10::Half> attend_f16;
  AttendFn<float, c10::BFloat16> attend_f32_bf16;   // fp32 q and output, a bf16 cache
  // A prefill chunk's attention, one key block of a query tile (every dtype: the driver
  // widens q, keys and values); nullptr where the variant has no vector kernel for it (the
  // generic table: the driver then runs the portable one, and cpu_ops.py prefers SDPA:
  // measured on Zen 4, 512 fresh tokens on one thread, the portable loops 27.6 ms, SDPA 8.5,
  // the AVX-512 kernel 4.0, the AVX2 one 4.2; x86_prefill.h).
  PrefillBlockFn prefill_block;
  SiluMulFn silu_mul_f32;
  RoundBf16Fn round_bf16;
  QuantizeRowFn quantize_row;
  ColumnsFn int_columns;      // the integer kernel: x int16, W 4-bit
  // The 8-bit integer kernel: x int16, W in column blocks (kQ8Columns); every row from r0
  // (`rows` any count) in one call, columns [begin, end) with begin a multiple of kQ8Columns.
  ColumnsFn q8_columns;
  ColumnsFn fp_columns;       // 4-bit W dequantized against fp32 x (from kFpRows rows)
  // 4-bit W's nibbles against bf16 x (from kFpRows rows of x that is bf16 already: it reads
  // `xb` and `xs`); nullptr where the variant has none (fp_columns then runs on x widened).
  ColumnsFn bf16_columns;
  // 4-bit W against fp32 x with the rows in vector lanes (it reads `xt`): rows [0,
  // lane_rows(M)) in one call (r0 0); nullptr where the variant has none (fp_columns then
  // takes every row, in tiles of 4).
  ColumnsFn lane_columns;
  // 4-bit W's nibbles against bf16 x with the rows in vector lanes (it reads `xtb`, `xts`):
  // rows [0, bf16_lane_rows(M)) of bf16 x, or of fp32 x rounded to bf16 where the caller allows it
  // (quant_matmul's `bf16_x`), in one call (r0 0); nullptr where the variant has none.
  ColumnsFn bf16_lane_columns;
  LanePairsFn lane_pairs;     // its x (generic.cpp's bf16_lane_order); nullptr where it is
  bool q4_pairs;              // int_columns reads 4-bit x in pair order (generic.cpp)
  // 4-bit W in column blocks (kQ4Columns) against bf16 x's rows in pairs (it reads `xrp`, `xs`):
  // every row from r0 (`rows` any count, tiled inside) in one call, columns [begin, end) with
  // begin a multiple of kQ4Columns; nullptr where the variant has none (the weights' row
  // layout then runs: quant_matmul's `blocks` unused).
  ColumnsFn bf16_block_columns = nullptr;
  RowPairsFn row_pairs = nullptr;     // its x
};

// From this many rows on, a 4-bit matmul runs `fp_columns` (fp32 rows against weights
// dequantized in registers: no rounding of x; measured on AVX2, all 4-bit matmuls of a step
// of SmolLM2-135M on 2 threads: 8 rows 30 -> 25 ms, 16 rows 59 -> 52 ms); below it
// `int_columns` (8-bit weights: `q8_columns` at every row count).
constexpr int64_t kFpRows = 3;

// The rows of a 4-bit matmul that a variant with `lane_columns` gives it, from row 0 (the rest
// go to `fp_columns` in tiles of 4): whole vectors of 16 rows, and the last 13-15 rows too
// (padded to one more vector). Measured on Zen 4, a step's 120 matmuls on one thread: 16 rows
// 42.9 ms in lanes against 51.6 in tiles; 12 rows padded to 16, 41.8 against 39.4.
constexpr int64_t kLaneWidth = 16;
constexpr int64_t kLanePadFrom = 13;
inline int64_t lane_rows(int64_t rows) {
  const int64_t whole = rows / kLaneWidth * kLaneWidth;
  return rows - whole >= kLanePadFrom ? rows : whole;
}

// The rows the bf16 lane kernel takes (`bf16_lane_columns`): whole vectors of 16, a last
// 9-15 rows padded to one more, a last 8 in a half vector; fewer go to the bf16 tiles of 4
// (`bf16_columns`). Measured on Zen 4, a step's 120 matmuls on one thread, fp32 x under bf16
// layer matmuls, two runs each (load 1.2-1.6): 12 rows as 8 in a half vector and 4 in a
// tile 36.9 and 34.8 ms, padded to 16 27.8 and 31.1; 10 rows 32.5 and 35.2 -> 27.6 and 32.2;
// 9 rows 29.5 and 29.1 -> 26.8 and 37.0 (noise); 16 rows 28.6-31.3; 8 rows in a half vector
// 23.5-23.8, about two tiles of 4 (4 rows 11.5-11.7).
constexpr int64_t kHalfLane = 8;
constexpr int64_t kBf16LanePadFrom = 9;
inline int64_t bf16_lane_rows(int64_t rows) {
  const int64_t whole = rows / kLaneWidth * kLaneWidth;
  const int64_t left = rows - whole;
  if (left >= kBf16LanePadFrom) return rows;
  return left >= kHalfLane ? whole + kHalfLane : whole;
}

// The lane kernel's x for its `lanes` rows: padded to whole vectors, the padding zero:
// [K, lane_stride(lanes)].
inline int64_t lane_stride(int64_t lanes) {
  return (lanes + kLaneWidth - 1) / kLaneWidth * kLaneWidth;
}

// The portable table (generic.cpp) and each instruction set's (its own file; nullptr where
// not built for this architecture).
const Kernels& generic_kernels();
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();
const Kernels* avx512_bf16_kernels();

// The variants in dispatch order and the process's choice (dispatch.cpp).
struct Variant {
  const char* name;
  const char* needs;              // the CPU features it needs, as /proc/cpuinfo names them
  const Kernels* (*kernels)();    // nullptr: not built for this architecture
  bool (*cpu_runs)();             // the CPU (and OS) can run it
};
const std::vector<Variant>& variants();
const Kernels& active_kernels();
// Makes the named variant the process's choice; throws std::invalid_argument for an unknown
// name and std::runtime_error where this build or CPU cannot run it.
void use_variant(const char* name);

// --- the drivers (generic.cpp): each op of cpu_ops.cpp on raw pointers ---------------------
// `pooled`: on kvloop's pool (pool.h), else torch's OpenMP team.
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps,
                  bool pooled);
// The cache's element C: T, or bf16 beside fp32 T (AttendFn).
template <typename T, typename C = T>
void rope_and_cache(const Kernels& k, T* qkv, const int64_t* positions, const float* cos,
                    const float* sin, C* cache, const int64_t* slots, int64_t tokens,
                    int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_tokens, bool pooled);
template <typename T, typename C = T>
void decode_attention(const Kernels& k, const T* q, int64_t q_row, const C* cache,
                      const int64_t* block_table, const int64_t* seq_lens, T* out,
                      int64_t reqs, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t cache_tokens, int64_t max_blocks,
                      float scale, bool pooled);
// One prefill chunk of `chunk` query tokens q [chunk, heads, dim] (rows `q_row` apart)
// over `keys` keys read in place from the paged cache at slots[0, keys) (the chunk's own
// K and V last: written before), lower-right causal: query i sees keys j <= keys - chunk +
// i, and with `window` > 0 only those with j > keys - chunk + i - window (a sliding window
// of W keys, the slots counted from a block-aligned first key). Scores, softmax and sums in
// fp32; out [chunk, heads * dim] in T. On kvloop's pool, a task per (KV head, query tile).
template <typename T, typename C = T>
void prefill_attention(const Kernels& k, const T* q, int64_t q_row, const C* cache,
                       const int64_t* slots, int64_t keys, int64_t chunk, T* out,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_tokens,
                       float scale, int64_t window);
template <typename T>
void silu_and_mul(const Kernels& k, const T* x, T* out, int64_t rows, int64_t f, bool pooled);
// `bf16_x`: fp32 x may be rounded to bf16 for the rows the bf16 kernels take (3+ rows where
// the variant has them: the lane kernel's, then the bf16 tiles'; the precision's layer
// matmuls are bf16: docs/cpu-performance.md, "Precision"); bf16 x takes them whatever this
// says, other x never.
// `blocks`: the same 4-bit W also in column blocks (kQ4Columns), which the block kernel
// reads where it runs: from kFpRows rows of x that the bf16 kernels take (bf16 x, or fp32 x
// under `bf16_x`, rounded), on a variant with `bf16_block_columns`.
struct Q4Blocks {
  const uint8_t* qs;
  const float* scale;
  const float* offset;
};
template <int Bits, typename T>
void quant_matmul(const Kernels& k, const T* x, const uint8_t* qs, const float* scale,
                  const float* offset, T* y, int64_t rows, int64_t n_out, int64_t k_in,
                  bool bf16_x = false, const Q4Blocks* blocks = nullptr);

// For each row of x, the column of x @ W.T with the largest value (the first of equals) and
// that value (rounded to T as quant_matmul's y), without writing y whole.
template <int Bits, typename T>
void quant_matmul_argmax(const Kernels& k, const T* x, const uint8_t* qs, const float* scale,
                         const float* offset, int64_t rows, int64_t n_out, int64_t k_in,
                         int64_t* column, float* value, bool bf16_x = false);

// The portable inner kernels, for a variant to fall back on (generic.cpp).
void generic_prefill_block(const float* qs, int64_t rows, int64_t dim, const float* kt,
                           const float* v, int64_t n, const int32_t* lo, const int32_t* hi,
                           float* m, float* l, float* o, float* s);
template <typename T, typename C = T>
void generic_attend(const T* q, float scale, int64_t group, int64_t dim, const C* keys,
                    const C* vals, const int64_t* slot, int64_t len, float* scores, T* out,
                    int64_t out_stride);

}  // namespace kvloop
