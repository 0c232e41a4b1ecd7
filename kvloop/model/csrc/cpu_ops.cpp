// kvloop's fused CPU ops for one decoder layer (see kvloop/model/cpu_ops.py for the contract
// of each and its pure-torch twin, which tests compare against).
//
// Why: a decode step of a small model is ~10 eager ops per layer that each cost more in
// dispatch and thread wake-ups than in arithmetic. These ops do one layer's norm, RoPE + KV
// write, decode attention and SwiGLU in one call each, in fp32 math (plain C++ vectorised by
// the compiler; AVX2 intrinsics for the quantized matmuls, fp32 decode attention and the
// exp of softmax and SiLU), parallel over rows with at::parallel_for (torch's own thread
// pool: no second OpenMP runtime) or, for the low-bit decode path, on kvloop's pool
// (pool.h): the quantized matmuls and `DecodeStack`, the whole decoder for a step of
// decodes in one call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "pool.h"

#include <sys/mman.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

// at::parallel_for's grain for `rows` rows of `row_cost` operations each: the calling thread
// alone below kParallelWork operations in all (waking torch's other OpenMP threads costs
// more than it saves there: measured, a decode step of single-row ops ran 20 ms serial and
// 27-40 ms with every op parallel), else tasks of at least kTaskWork operations.
constexpr int64_t kParallelWork = 1 << 22;
constexpr int64_t kTaskWork = 1 << 18;

inline int64_t grain(int64_t rows, int64_t row_cost) {
  row_cost = std::max<int64_t>(1, row_cost);
  if (rows * row_cost < kParallelWork) return rows + 1;
  return std::max<int64_t>(1, kTaskWork / row_cost);
}

// On kvloop's pool (`pooled`) the break-even is far lower: its workers are awake during a
// decode step, so a region costs a few atomics, not a futex wake-up.
constexpr int64_t kPoolWork = 1 << 16;
constexpr int64_t kPoolTask = 1 << 15;

// fn(begin, end) over `rows` rows of `row_cost` operations each: on kvloop's pool or torch's.
// `align` (pool only): every chunk but the last a multiple of it.
template <typename Fn>
void par_for(bool pooled, int64_t rows, int64_t row_cost, const Fn& fn, int64_t align = 1) {
  row_cost = std::max<int64_t>(1, row_cost);
  if (!pooled) {
    at::parallel_for(0, rows, grain(rows, row_cost), fn);
  } else if (rows * row_cost < kPoolWork) {
    if (rows > 0) fn(0, rows);
  } else {
    const int64_t chunk = std::max<int64_t>(1, kPoolTask / row_cost);
    kvloop::pool_for(rows, (chunk + align - 1) / align * align, fn);
  }
}

// The output columns of a quantized matmul go to the pool's threads in whole cache lines of
// y (16 fp32 columns), so two threads never write one line (measured: with unaligned chunks
// the second thread bought 1.1-1.4x at 8 rows, with aligned ones 1.6-1.9x).
constexpr int64_t kColumnsPerLine = 16;

// residual += x (when residual is given); x = residual / rms(residual) * weight.
template <typename T>
void add_rms_norm_kernel(T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
                         float eps, bool pooled) {
  par_for(pooled, rows, dim * 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* rr = residual ? residual + r * dim : nullptr;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        float v = to_f(xr[i]) + (rr ? to_f(rr[i]) : 0.f);
        buf[i] = v;
        sum += v * v;
      }
      if (rr) {
        for (int64_t i = 0; i < dim; ++i) rr[i] = static_cast<T>(buf[i]);
        // the normalised value is computed from the stored (rounded) residual, as an
        // unfused add followed by a norm would
        for (int64_t i = 0; i < dim; ++i) buf[i] = to_f(rr[i]);
        sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) sum += buf[i] * buf[i];
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) xr[i] = static_cast<T>(buf[i] * inv * to_f(weight[i]));
    }
  });
}

// qkv [T, (H + 2K) * D]: rotate the H + K query/key heads in place (half-split pairs), then
// store K and V into the paged cache [2, K, blocks, block_size, D] at slot_mapping[t].
template <typename T>
void rope_and_cache_kernel(T* qkv, const int64_t* positions, const float* cos, const float* sin,
                           T* cache, const int64_t* slots, int64_t tokens, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t cache_tokens, bool pooled) {
  const int64_t half = dim / 2;
  const int64_t row = (heads + 2 * kv_heads) * dim;
  par_for(pooled, tokens, row * 3, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* base = qkv + t * row;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* v = base + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
          v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          v[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
      const int64_t slot = slots[t];
      for (int64_t kv = 0; kv < 2; ++kv) {
        const T* src = base + (heads + kv * kv_heads) * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          T* dst = cache + ((kv * kv_heads + h) * cache_tokens + slot) * dim;
          std::copy(src + h * dim, src + (h + 1) * dim, dst);
        }
      }
    }
  });
}

#ifdef __AVX2__
// exp(x), 8 at a time: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts,
// Cody and Waite's reduction) and e^r from its Taylor series to r^7 (|r| <= ln2 / 2:
// relative error < 1e-8). x is clamped to [-87, 88] (e^-87 ~ 1.6e-38, the smallest normal
// float; e^88 ~ 1.7e38, near the largest).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  constexpr float kInvFactorial[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6,
                                     0.5f, 1.f, 1.f};
  __m256 e = _mm256_set1_ps(kInvFactorial[0]);
  for (int i = 1; i < 8; ++i) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(kInvFactorial[i]));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

// 8 values of a cache row as fp32: fp32 as they are, bf16 widened (exactly: its bits are
// the fp32 value's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<at::BFloat16>(f[i]);
}

// Lane j: the sum of a[j]'s lanes.
inline __m256 reduce8(const __m256* a) {
  // hadd twice: [t0..t3 | t0..t3] partial sums of the low and high halves of each chunk
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s47 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                       _mm256_permute2f128_ps(s03, s47, 0x31));
}

// s[0, len) -> e^(s - max s) in place (s padded to `stride`, a multiple of 8, with -inf);
// returns 1 / their sum in every lane, for the caller to scale by once at the end.
inline __m256 softmax_unscaled(float* s, int64_t len, int64_t stride) {
  for (int64_t t = len; t < stride; ++t) s[t] = -INFINITY;    // the last tile's padding
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < stride; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  float tops[8];
  _mm256_storeu_ps(tops, top);
  const __m256 m = _mm256_set1_ps(*std::max_element(tops, tops + 8));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < stride; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  // (the padding adds (stride - len) e^-87 to a total of at least 1: below its last bit)
  return _mm256_set1_ps(1.f / hsum(total));
}

// The decode attention of G query heads (G a constant) sharing one request's KV head,
// vectorised (dim a multiple of 64; an fp32 or bf16 cache, fp32 math): scores 8 keys at a
// time, each key loaded (and widened, for bf16) once for all G heads into 8 x G
// accumulators, a vector exp, and P V with 64 dims of each head's output in registers, each
// value loaded once for all G heads (docs/cpu-performance.md).
template <typename T, int G>
inline void attend_grouped(const float* qf, int64_t dim, const T* keys, const T* vals,
                           const std::vector<int64_t>& slot, float* scores, T* out,
                           int64_t out_stride) {
  const int64_t len = static_cast<int64_t>(slot.size()), stride = (len + 7) / 8 * 8;
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const T* key[8];
    for (int j = 0; j < 8; ++j) key[j] = keys + slot[std::min(t0 + j, len - 1)] * dim;
    __m256 a[G][8];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
      __m256 qc[G];
      for (int g = 0; g < G; ++g) qc[g] = _mm256_loadu_ps(qf + g * dim + c);
      for (int j = 0; j < 8; ++j) {
        const __m256 k = load8(key[j] + c);
        for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(qc[g], k, a[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores + g * stride + t0, reduce8(a[g]));
  }
  __m256 inv[G];
  for (int g = 0; g < G; ++g) {
    inv[g] = softmax_unscaled(scores + g * stride, len, stride);
  }
  for (int64_t part = 0; part < dim; part += 64) {
    __m256 a[G][8];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      __m256 pt[G];
      for (int g = 0; g < G; ++g) pt[g] = _mm256_set1_ps(scores[g * stride + t]);
      const T* v = vals + slot[t] * dim + part;
      for (int j = 0; j < 8; ++j) {
        const __m256 vj = load8(v + 8 * j);
        for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(pt[g], vj, a[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j)
        store8(out + g * out_stride + part + 8 * j, _mm256_mul_ps(a[g][j], inv[g]));
  }
}

// A KV head's `group` query heads: together where AVX-512 gives the 32 vector registers
// that 8 x G accumulators need (G 2-4), else one head at a time.
template <typename T>
inline void attend(const float* qf, int64_t group, int64_t dim, const T* keys, const T* vals,
                   const std::vector<int64_t>& slot, float* scores, T* out, int64_t out_stride) {
#ifdef __AVX512VL__
  switch (group) {
    case 2: return attend_grouped<T, 2>(qf, dim, keys, vals, slot, scores, out, out_stride);
    case 3: return attend_grouped<T, 3>(qf, dim, keys, vals, slot, scores, out, out_stride);
    case 4: return attend_grouped<T, 4>(qf, dim, keys, vals, slot, scores, out, out_stride);
    default: break;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    attend_grouped<T, 1>(qf + g * dim, dim, keys, vals, slot, scores, out + g * out_stride,
                         out_stride);
}
#endif

// One query token per request: out[r, h] = softmax(q[r, h] . K[r]^T * scale) V[r], keys read
// in place from the paged cache through block_table; the query heads of a KV head together.
// q's rows are `q_row` elements apart (heads * dim when contiguous; more when q is the first
// part of a fused qkv row).
template <typename T>
void decode_attention_kernel(const T* q, int64_t q_row, const T* cache,
                             const int64_t* block_table, const int64_t* seq_lens, T* out,
                             int64_t reqs, int64_t heads, int64_t kv_heads, int64_t dim,
                             int64_t block_size, int64_t cache_tokens, int64_t max_blocks,
                             float scale, bool pooled) {
  const int64_t group = heads / kv_heads;
  int64_t longest = 1;
  for (int64_t r = 0; r < reqs; ++r) longest = std::max(longest, seq_lens[r]);
  const T* values = cache + kv_heads * cache_tokens * dim;
  par_for(pooled, reqs * kv_heads, longest * dim * group * 2, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores;
    std::vector<int64_t> slot;            // the request's cache slots (shared by its KV heads)
    int64_t slot_request = -1;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / kv_heads, kh = w % kv_heads, len = seq_lens[r];
      const int64_t* blocks = block_table + r * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = to_f(q[r * q_row + (kh * group + g) * dim + i]) * scale;
#ifdef __AVX2__
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        if (dim % 64 == 0) {
          if (slot_request != r) {
            slot.resize(len);
            for (int64_t t = 0; t < len; ++t)
              slot[t] = blocks[t / block_size] * block_size + t % block_size;
            slot_request = r;
          }
          scores.resize(group * ((len + 7) / 8 * 8));
          attend<T>(qf.data(), group, dim, cache + kh * cache_tokens * dim,
                      values + kh * cache_tokens * dim, slot, scores.data(),
                      out + (r * heads + kh * group) * dim, dim);
          continue;
        }
      }
#endif
      scores.assign(group * len, 0.f);
      const T* keys = cache + kh * cache_tokens * dim;
      for (int64_t t = 0; t < len; ++t) {
        const T* k = keys + (blocks[t / block_size] * block_size + t % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim; ++i) s += qg[i] * to_f(k[i]);
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float top = *std::max_element(sg, sg + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - top);
          total += sg[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* vals = values + kh * cache_tokens * dim;
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vals + (blocks[t / block_size] * block_size + t % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) ag[i] += p * to_f(v[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          out[(r * heads + kh * group + g) * dim + i] = static_cast<T>(acc[g * dim + i]);
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, F + i] for x [T, 2F].
template <typename T>
void silu_and_mul_kernel(const T* x, T* out, int64_t rows, int64_t f, bool pooled) {
  par_for(pooled, rows, f * 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * f;
      const T* up = gate + f;
      T* o = out + r * f;
      int64_t i = 0;
#ifdef __AVX2__
      if constexpr (std::is_same_v<T, float>) {       // 8 at a time, with exp8
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= f; i += 8) {
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
      }
#endif
      for (; i < f; ++i) {
        const float g = to_f(gate[i]);
        // silu rounded to T first, as the unfused silu-then-multiply does
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        o[i] = static_cast<T>(to_f(silu) * to_f(up[i]));
      }
    }
  });
}

// y [M, N] = x [M, K] @ W.T for 4-bit W, with integer dot products (llama.cpp's recipe for
// Q4 x Q8, with 16-bit activations: as fast here, and 256x finer).
// W: per row, per group of 32 weights, 16 bytes whose byte i holds weight i (low nibble) and
// weight i + 16 (high nibble), with an fp32 scale and offset: w = q * scale + offset.
// x is quantized per row and group to int16 (dx = max|x| / 32767), so a group's dot product
// is integer: sum(q * xq), 32 products in two `madd` instructions on AVX2, and
//   y[m, n] = sum_g scale[n, g] dx[m, g] sum(q xq) + offset[n, g] dx[m, g] sum(xq).
// Each group's nibbles are unpacked once for all rows of x. Without AVX2: the same in scalar.
// (This integer way serves 1-2 rows of 4-bit weights and every row count of 8-bit ones;
// from 3 rows 4-bit weights take `dequant_matmul_kernel`, below.)
constexpr float kQMax = 32767.f;

struct QuantizedRows {
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> d;       // [M, G]: dx
  std::vector<float> s;       // [M, G]: dx * sum(xq)
};

#ifdef __AVX2__
// One group of 32 fp32 values as quantize_rows' scalar loop does it: cvtps rounds to
// nearest even, as nearbyint does in the default rounding mode.
inline void quantize_group_fp32(const float* xg, int16_t* q, float& d, float& s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8)
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i)));
  float tops[8];
  _mm256_storeu_ps(tops, top);
  const float amax = *std::max_element(tops, tops + 8);
  d = amax / kQMax;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 32; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i + 8), inv));
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
    // packs interleaves the 128-bit halves: a0-3 b0-3 a4-7 b4-7; permute puts them in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
  }
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int64_t total = 0;
  for (int32_t v : lanes) total += v;
  s = d * static_cast<float>(total);
}
#endif

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k_in) {
  const int64_t groups = k_in / 32;
  QuantizedRows out{std::vector<int16_t>(rows * k_in), std::vector<float>(rows * groups),
                    std::vector<float>(rows * groups)};
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* xg = x + m * k_in + g * 32;
#ifdef __AVX2__
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        // the same numbers, 8 at a time (bf16 widened to fp32 first, exactly)
        float wide[32];
        const float* xf = wide;
        if constexpr (std::is_same_v<T, float>) xf = xg;
        else for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(wide + i, load8(xg + i));
        quantize_group_fp32(xf, out.q.data() + m * k_in + g * 32, out.d[m * groups + g],
                            out.s[m * groups + g]);
        continue;
      }
#endif
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(to_f(xg[i])));
      const float d = amax / kQMax, inv = d > 0.f ? 1.f / d : 0.f;
      int64_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(to_f(xg[i]) * inv));
        out.q[m * k_in + g * 32 + i] = static_cast<int16_t>(v);
        sum += v;
      }
      out.d[m * groups + g] = d;
      out.s[m * groups + g] = d * static_cast<float>(sum);
    }
  }
  return out;
}

// A group's 32 weights as integers, in x's order: 4-bit (16 bytes, byte i = weights i and
// i + 16) or 8-bit (32 signed bytes).
template <int Bits>
inline int32_t weight_at(const uint8_t* group, int i) {
  if constexpr (Bits == 4) return i < 16 ? (group[i] & 15) : (group[i - 16] >> 4);
  else return static_cast<int8_t>(group[i]);
}

#ifdef __AVX2__
template <int Bits>
inline void load_group(const uint8_t* group, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 4) {
    // Bytes widened once, to 16 bits: a lane's low nibble is weight i, the rest of it
    // (shifted down: the high byte is zero) weight i + 16. Measured, every 4-bit matmul of
    // a one-row step on one thread: 9.7 -> 8.4 ms against masking and widening each half.
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));                         // w0..15
    hi = _mm256_srli_epi16(bytes, 4);                                             // w16..31
  } else {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
  }
}
#endif

// One output column n for MB rows of x starting at r0 (MB a constant: the accumulators
// stay in registers). `of` (4-bit only; nullptr for 8-bit): per-group offsets.
template <int Bits, int MB, typename T>
inline void quant_column(const uint8_t* row, const float* sc, const float* of,
                         const QuantizedRows& xq, int64_t r0, int64_t k_in, int64_t groups,
                         T* y, int64_t n_out, int64_t n) {
  constexpr int64_t kGroupBytes = Bits * 4;
  float tail[MB];
  for (int m = 0; m < MB; ++m) tail[m] = 0.f;
#ifdef __AVX2__
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i q_lo, q_hi;
    load_group<Bits>(row + g * kGroupBytes, q_lo, q_hi);
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const int16_t* xg = xq.q.data() + r * k_in + g * 32;
      const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
      const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16));
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(q_lo, x_lo),
                                           _mm256_madd_epi16(q_hi, x_hi));
      const float sd = sc[g] * xq.d[r * groups + g];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sd), acc[m]);
      if (of) tail[m] += of[g] * xq.s[r * groups + g];
    }
  }
  for (int m = 0; m < MB; ++m) y[(r0 + m) * n_out + n] = static_cast<T>(hsum(acc[m]) + tail[m]);
#else
  float acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = row + g * kGroupBytes;
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const int16_t* xg = xq.q.data() + r * k_in + g * 32;
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) dot += weight_at<Bits>(group, i) * xg[i];
      acc[m] += sc[g] * xq.d[r * groups + g] * static_cast<float>(dot);
      if (of) tail[m] += of[g] * xq.s[r * groups + g];
    }
  }
  for (int m = 0; m < MB; ++m) y[(r0 + m) * n_out + n] = static_cast<T>(acc[m] + tail[m]);
#endif
}

#ifdef __AVX2__
// sum(q * xq) of one group in 8 int32 lanes (w_lo, w_hi: the group's 32 weights as int16).
inline __m256i group_dot(__m256i w_lo, __m256i w_hi, const int16_t* xg) {
  return _mm256_add_epi32(
      _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))),
      _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))));
}

// quant_column for 1-2 rows, 8 groups at a time: their 8 integer dot products are reduced
// into one vector (lane j: group j's sum, by three rounds of hadd), converted once and scaled
// by 8 scales at once; the offsets' term is 8 products in one FMA. Measured here, every
// 4-bit matmul of a one-row decode step: 10.6 -> 9.1 ms on one thread, 5.0 -> 4.7 on two.
// Groups past the last multiple of 8 take quant_column's way, one at a time.
template <int Bits, int MB, typename T>
inline void lanes_column(const uint8_t* row, const float* sc, const float* of,
                         const QuantizedRows& xq, int64_t r0, int64_t k_in, int64_t groups,
                         T* y, int64_t n_out, int64_t n) {
  constexpr int64_t kGroupBytes = Bits * 4;
  __m256 acc[MB], tail[MB];
  float tail_rest[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = tail[m] = _mm256_setzero_ps();
    tail_rest[m] = 0.f;
  }
  const int16_t* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = xq.q.data() + (r0 + m) * k_in;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256i quad[2][MB];                 // lanes: groups g..g+3 (quad 0) or g+4..g+7 (1)
    for (int half = 0; half < 2; ++half) {
      __m256i pair[2][MB];
      for (int p = 0; p < 2; ++p) {
        const int64_t j = g + half * 4 + p * 2;
        __m256i lo0, hi0, lo1, hi1;
        load_group<Bits>(row + j * kGroupBytes, lo0, hi0);
        load_group<Bits>(row + (j + 1) * kGroupBytes, lo1, hi1);
        for (int m = 0; m < MB; ++m)
          pair[p][m] = _mm256_hadd_epi32(group_dot(lo0, hi0, xrow[m] + j * 32),
                                         group_dot(lo1, hi1, xrow[m] + (j + 1) * 32));
      }
      for (int m = 0; m < MB; ++m) quad[half][m] = _mm256_hadd_epi32(pair[0][m], pair[1][m]);
    }
    const __m256 scales = _mm256_loadu_ps(sc + g);
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const __m256i sums =
          _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][m], quad[1][m], 0x20),
                           _mm256_permute2x128_si256(quad[0][m], quad[1][m], 0x31));
      const __m256 sd = _mm256_mul_ps(scales, _mm256_loadu_ps(xq.d.data() + r * groups + g));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), sd, acc[m]);
      if (of)
        tail[m] = _mm256_fmadd_ps(_mm256_loadu_ps(of + g),
                                  _mm256_loadu_ps(xq.s.data() + r * groups + g), tail[m]);
    }
  }
  for (; g < groups; ++g) {
    __m256i lo, hi;
    load_group<Bits>(row + g * kGroupBytes, lo, hi);
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const __m256 sd = _mm256_set1_ps(sc[g] * xq.d[r * groups + g]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot(lo, hi, xrow[m] + g * 32)), sd,
                               acc[m]);
      if (of) tail_rest[m] += of[g] * xq.s[r * groups + g];
    }
  }
  for (int m = 0; m < MB; ++m)
    y[(r0 + m) * n_out + n] =
        static_cast<T>(hsum(_mm256_add_ps(acc[m], tail[m])) + tail_rest[m]);
}
#endif

#ifdef __AVX2__
// From 3 rows of x on, 4-bit weights go faster another way: each group's 32 weights are
// dequantized to fp32 in registers once (q * scale + offset, as `Int4Weight.dequantize`) and
// shared by up to 4 rows, whose fp32 values multiply them with FMAs (no rounding of x at
// all). Measured here, all 4-bit matmuls of a step of SmolLM2-135M on 2 threads: 8 rows
// 30 -> 25 ms, 16 rows 59 -> 52 ms; at 1-2 rows the integer kernel is as fast or faster.
constexpr int64_t kDequantRows = 3;

inline void dequant_q4_group(const uint8_t* group, float scale, float offset, __m256 w[4]) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256i b0 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 8)));
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), s, o);   // w0..7
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), s, o);   // w8..15
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), s, o);     // w16..23
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), s, o);     // w24..31
}

// One output column n for MB rows of xf (fp32 [rows, K]) from r0, two accumulators a row.
template <int MB, typename T>
inline void dequant_column(const uint8_t* row, const float* sc, const float* of, const float* xf,
                           int64_t r0, int64_t k_in, int64_t groups, T* y, int64_t n_out,
                           int64_t n) {
  __m256 a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 w[4];
    dequant_q4_group(row + g * 16, sc[g], of[g], w);
    for (int m = 0; m < MB; ++m) {
      const float* x = xf + (r0 + m) * k_in + g * 32;
      a0[m] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a0[m]);
      a1[m] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a1[m]);
      a0[m] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a0[m]);
      a1[m] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a1[m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    y[(r0 + m) * n_out + n] = static_cast<T>(hsum(_mm256_add_ps(a0[m], a1[m])));
}

template <typename T>
void dequant_matmul_kernel(const T* x, const uint8_t* qs, const float* scale,
                           const float* offset, T* y, int64_t rows, int64_t n_out, int64_t k_in) {
  const int64_t groups = k_in / 32, row_bytes = k_in / 2;
  std::vector<float> xf(rows * k_in);
  for (int64_t i = 0; i < rows * k_in; ++i) xf[i] = to_f(x[i]);
  par_for(true, n_out, rows * k_in, [&](int64_t begin, int64_t end) {
    int64_t r0 = 0;
    auto pass = [&](auto mb) {        // all columns of this task for rows r0 .. r0 + mb
      constexpr int MB = decltype(mb)::value;
      for (int64_t n = begin; n < end; ++n)
        dequant_column<MB, T>(qs + n * row_bytes, scale + n * groups, offset + n * groups,
                              xf.data(), r0, k_in, groups, y, n_out, n);
      r0 += MB;
    };
    while (rows - r0 >= 4) pass(std::integral_constant<int, 4>{});
    if (rows - r0 == 3) pass(std::integral_constant<int, 3>{});
    else if (rows - r0 == 2) pass(std::integral_constant<int, 2>{});
    else if (rows - r0 == 1) pass(std::integral_constant<int, 1>{});
  }, kColumnsPerLine);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVLOOP_VNNI 1
// The 1-2 row integer kernel on AVX-512 VNNI: `dpwssd` multiplies 32 int16 pairs and adds
// them into 16 int32 lanes in one instruction, where AVX2 needs a `madd` and an `add` per
// 16. Two 4-bit groups fill one register: their 32 bytes widen to 32 16-bit lanes, whose low
// nibbles are weights 0-15 of both groups and whose high nibbles weights 16-31, so x is read
// in that order (`pair_order`, made once per call). The products of a pair land in 16 lanes,
// 8 per group: converted once and scaled by a vector holding each group's scale in its 8
// lanes (a permute of 16 groups' scales, loaded together). 8-bit groups are 32 signed bytes,
// one register each, in x's own order. Same integer sums as the AVX2 kernel; the float sums
// run in another order.

// x's int16 values with each pair of groups (g, g + 1) as [x_g 0-15, x_g+1 0-15,
// x_g 16-31, x_g+1 16-31]; an odd last group stays as it is.
std::vector<int16_t> pair_order(const QuantizedRows& xq, int64_t rows, int64_t k_in) {
  std::vector<int16_t> out(xq.q.size());
  const int64_t pairs = k_in / 64;
  for (int64_t m = 0; m < rows; ++m) {
    const int16_t* src = xq.q.data() + m * k_in;
    int16_t* dst = out.data() + m * k_in;
    for (int64_t p = 0; p < pairs; ++p, src += 64, dst += 64) {
      std::copy(src, src + 16, dst);
      std::copy(src + 32, src + 48, dst + 16);
      std::copy(src + 16, src + 32, dst + 32);
      std::copy(src + 48, src + 64, dst + 48);
    }
    std::copy(src, xq.q.data() + (m + 1) * k_in, dst);
  }
  return out;
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// acc += dot's sums times the scales that `pick` selects from sd (one per lane).
inline __m512 add_scaled(__m512 acc, __m512i dot, __m512i pick, __m512 sd) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, sd), acc);
}

inline __m512i load_epi16x16(const int16_t* p) {      // 16 values, the upper lanes zero
  return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One output column n for MB rows of x from r0 (xp: x in pair order for 4-bit, xq.q for
// 8-bit).
template <int Bits, int MB, typename T>
inline void vnni_column(const uint8_t* row, const float* sc, const float* of,
                        const QuantizedRows& xq, const int16_t* xp, int64_t r0, int64_t k_in,
                        int64_t groups, T* y, int64_t n_out, int64_t n) {
  __m512 acc[MB], tail[MB];
  for (int m = 0; m < MB; ++m) acc[m] = tail[m] = _mm512_setzero_ps();
  const int16_t* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = xp + (r0 + m) * k_in;
  const __m512i two_groups = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
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
        const __m512i pick = _mm512_add_epi32(two_groups, _mm512_set1_epi32(static_cast<int>(j)));
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
    y[(r0 + m) * n_out + n] = static_cast<T>(_mm512_reduce_add_ps(_mm512_add_ps(acc[m], tail[m])));
}
#endif

// y [M, N] = x @ W.T, W [N, K] in groups of 32 (Bits 4: qs [N, K/2], scale and offset
// [N, K/32]; Bits 8: qs [N, K] signed, scale [N, K/32], offset nullptr).
template <int Bits, typename T>
void quant_matmul_kernel(const T* x, const uint8_t* qs, const float* scale,
                         const float* offset, T* y, int64_t rows, int64_t n_out, int64_t k_in) {
#ifdef __AVX2__
  if (Bits == 4 && rows >= kDequantRows)
    return dequant_matmul_kernel<T>(x, qs, scale, offset, y, rows, n_out, k_in);
#endif
  const int64_t groups = k_in / 32;
  const int64_t row_bytes = k_in * Bits / 8;
  const QuantizedRows xq = quantize_rows(x, rows, k_in);
#ifdef KVLOOP_VNNI
  const std::vector<int16_t> xp = Bits == 4 ? pair_order(xq, rows, k_in) : std::vector<int16_t>();
  const int16_t* xv = Bits == 4 ? xp.data() : xq.q.data();
#endif
  par_for(true, n_out, rows * k_in, [&](int64_t begin, int64_t end) {
    int64_t r0 = 0;
    auto pass = [&](auto mb) {        // all columns of this task for rows r0 .. r0 + mb
      constexpr int MB = decltype(mb)::value;
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* w = qs + n * row_bytes;
        const float* sc = scale + n * groups;
        const float* of = offset ? offset + n * groups : nullptr;
#if defined(KVLOOP_VNNI)
        vnni_column<Bits, MB, T>(w, sc, of, xq, xv, r0, k_in, groups, y, n_out, n);
        continue;
#elif defined(__AVX2__)
        if constexpr (MB <= 2) {
          lanes_column<Bits, MB, T>(w, sc, of, xq, r0, k_in, groups, y, n_out, n);
          continue;
        }
#endif
        quant_column<Bits, MB, T>(w, sc, of, xq, r0, k_in, groups, y, n_out, n);
      }
      r0 += MB;
    };
    while (rows - r0 >= 4) pass(std::integral_constant<int, 4>{});
    if (rows - r0 >= 2) pass(std::integral_constant<int, 2>{});
    if (rows - r0 >= 1) pass(std::integral_constant<int, 1>{});
  }, kColumnsPerLine);
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

void add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& weight,
                  double eps) {
  check_cpu_contiguous(x, "x");
  const int64_t dim = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] {
    scalar_t* res = nullptr;
    if (residual.has_value()) {
      check_cpu_contiguous(*residual, "residual");
      res = residual->data_ptr<scalar_t>();
    }
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(),
                                  x.numel() / dim, dim, static_cast<float>(eps), false);
  });
}

void rope_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor cache, const at::Tensor& slots,
                    int64_t heads, int64_t kv_heads) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cache, "cache");
  const int64_t dim = cache.size(-1);
  const int64_t cache_tokens = cache.size(2) * cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache",
                                  [&] {
    rope_and_cache_kernel<scalar_t>(
        qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
        sin.data_ptr<float>(), cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
        qkv.size(0), heads, kv_heads, dim, cache_tokens, false);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale) {
  check_cpu_contiguous(q, "q");
  check_cpu_contiguous(cache, "cache");
  check_cpu_contiguous(block_table, "block_table");
  const int64_t reqs = q.size(0), heads = q.size(1), dim = q.size(2);
  auto out = at::empty({reqs, heads * dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
    decode_attention_kernel<scalar_t>(
        q.data_ptr<scalar_t>(), heads * dim, cache.data_ptr<scalar_t>(),
        block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), reqs, heads, cache.size(1), dim, cache.size(3),
        cache.size(2) * cache.size(3), block_table.size(1), static_cast<float>(scale), false);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu_contiguous(x, "x");
  const int64_t f = x.size(-1) / 2;
  auto out = at::empty({x.numel() / (2 * f), f}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  x.numel() / (2 * f), f, false);
  });
  return out;
}

template <int Bits>
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                        const float* offset) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qs, "qs");
  check_cpu_contiguous(scale, "scale");
  const int64_t rows = x.size(0), k_in = x.size(1), n_out = qs.size(0);
  TORCH_CHECK(k_in % 32 == 0 && qs.size(1) == k_in * Bits / 8 &&
              scale.size(0) == n_out && scale.size(1) == k_in / 32,
              "quantized matmul: shapes disagree");
  auto y = at::empty({rows, n_out}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_matmul",
                                  [&] {
    quant_matmul_kernel<Bits, scalar_t>(x.data_ptr<scalar_t>(),
                                        static_cast<const uint8_t*>(qs.data_ptr()),
                                        scale.data_ptr<float>(), offset,
                                        y.data_ptr<scalar_t>(), rows, n_out, k_in);
  });
  return y;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& offset) {
  check_cpu_contiguous(offset, "offset");
  return quant_matmul<4>(x, qs, scale, offset.data_ptr<float>());
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  return quant_matmul<8>(x, qs, scale, nullptr);
}

// The decoder for a step of decodes (one query token per request), every layer in one call
// on kvloop's pool: the same kernels, in the same order, as the Python layer loop of
// kvloop/model/llama.py with low-bit weights, so the results are identical. Built once from
// the weights (checked then); a step passes only what changes per step.
class DecodeStack {
 public:
  // norms: 2 per layer (input, post-attention); quant: 12 per layer (qs, scale, offset of
  // qkv, o, gate_up, down).
  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> quant, int64_t heads,
              int64_t kv_heads, int64_t ffn, double eps, double scale)
      : norms_(std::move(norms)), quant_(std::move(quant)), layers_(norms_.size() / 2),
        heads_(heads), kv_heads_(kv_heads), ffn_(ffn), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(layers_ > 0 && norms_.size() == 2 * layers_, "DecodeStack: 2 norms a layer");
    TORCH_CHECK(quant_.size() == 12 * layers_,
                "DecodeStack: 12 quantized tensors per layer (qs, scale, offset of qkv, o, "
                "gate_up, down)");
    for (const auto& t : norms_) check_cpu_contiguous(t, "norm");
    for (size_t i = 0; i < quant_.size(); i += 3) {
      check_cpu_contiguous(quant_[i], "qs");
      check_cpu_contiguous(quant_[i + 1], "scale");
      check_cpu_contiguous(quant_[i + 2], "offset");
      weights_.push_back({static_cast<const uint8_t*>(quant_[i].data_ptr()),
                          quant_[i + 1].data_ptr<float>(), quant_[i + 2].data_ptr<float>(),
                          quant_[i].size(0)});
    }
  }

  // embedded [T, hidden] -> (h, residual) after the last layer (the stream is their sum), as
  // the Python layer loop returns them; caches: one per layer.
  std::tuple<at::Tensor, at::Tensor> forward(
      const at::Tensor& embedded, const std::vector<at::Tensor>& caches,
      const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& cos,
      const at::Tensor& sin, const at::Tensor& block_table, const at::Tensor& seq_lens) {
    check_cpu_contiguous(embedded, "embedded");
    check_cpu_contiguous(block_table, "block_table");
    TORCH_CHECK(caches.size() == layers_, "DecodeStack: one KV cache per layer");
    for (const auto& c : caches) check_cpu_contiguous(c, "cache");
    const int64_t tokens = embedded.size(0), dim = caches[0].size(-1);
    TORCH_CHECK(block_table.size(0) == tokens && seq_lens.size(0) == tokens,
                "DecodeStack: one block-table row and sequence length per token");
    auto h = embedded.clone(), residual = embedded.clone();
    auto qkv = at::empty({tokens, (heads_ + 2 * kv_heads_) * dim}, embedded.options());
    auto attn = at::empty({tokens, heads_ * dim}, embedded.options());
    auto gu = at::empty({tokens, 2 * ffn_}, embedded.options());
    auto act = at::empty({tokens, ffn_}, embedded.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "DecodeStack",
                                    [&] {
      const Step<scalar_t> step{tokens, embedded.size(1), dim, h.data_ptr<scalar_t>(),
                                residual.data_ptr<scalar_t>(), qkv.data_ptr<scalar_t>(),
                                attn.data_ptr<scalar_t>(), gu.data_ptr<scalar_t>(),
                                act.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                                slots.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                sin.data_ptr<float>(), block_table.data_ptr<int64_t>(),
                                block_table.size(1), seq_lens.data_ptr<int64_t>()};
      for (size_t l = 0; l < layers_; ++l) layer<scalar_t>(step, l, caches[l]);
    });
    return {h, residual};
  }

 private:
  template <typename T>
  struct Step {            // one step's shapes, buffers and metadata
    int64_t tokens, hidden, dim;
    T *h, *residual, *qkv, *attn, *gu, *act;
    const int64_t* positions;
    const int64_t* slots;
    const float* cos;
    const float* sin;
    const int64_t* block_table;
    int64_t max_blocks;
    const int64_t* seq_lens;
  };

  template <typename T>
  void q4(const T* x, size_t w, T* y, int64_t rows, int64_t k_in) const {
    const QuantOperand& op = weights_[w];
    quant_matmul_kernel<4, T>(x, op.qs, op.scale, op.offset, y, rows, op.n_out, k_in);
  }

  template <typename T>
  void layer(const Step<T>& s, size_t l, const at::Tensor& cache) const {
    const int64_t n = s.tokens, qkv_row = (heads_ + 2 * kv_heads_) * s.dim;
    const int64_t block_size = cache.size(3), cache_tokens = cache.size(2) * block_size;
    T* kv = cache.data_ptr<T>();
    const size_t w = 4 * l;
    add_rms_norm_kernel<T>(s.h, l == 0 ? nullptr : s.residual, norms_[2 * l].data_ptr<T>(), n,
                           s.hidden, eps_, true);
    q4<T>(s.h, w, s.qkv, n, s.hidden);
    rope_and_cache_kernel<T>(s.qkv, s.positions, s.cos, s.sin, kv, s.slots, n, heads_,
                             kv_heads_, s.dim, cache_tokens, true);
    decode_attention_kernel<T>(s.qkv, qkv_row, kv, s.block_table, s.seq_lens, s.attn, n,
                               heads_, kv_heads_, s.dim, block_size, cache_tokens,
                               s.max_blocks, scale_, true);
    q4<T>(s.attn, w + 1, s.h, n, heads_ * s.dim);
    add_rms_norm_kernel<T>(s.h, s.residual, norms_[2 * l + 1].data_ptr<T>(), n, s.hidden, eps_,
                           true);
    q4<T>(s.h, w + 2, s.gu, n, s.hidden);
    silu_and_mul_kernel<T>(s.gu, s.act, n, ffn_, true);
    q4<T>(s.act, w + 3, s.h, n, ffn_);
  }

  struct QuantOperand {
    const uint8_t* qs;
    const float* scale;
    const float* offset;
    int64_t n_out;
  };

  std::vector<at::Tensor> norms_, quant_;   // held: weights_ points into quant_
  size_t layers_;
  int64_t heads_, kv_heads_, ffn_;
  float eps_, scale_;
  std::vector<QuantOperand> weights_;
};

// `nbytes` of uninitialised memory in 2 MiB pages where the kernel gives them (transparent
// huge pages on request, `madvise`; else ordinary pages): the home of the low-bit weights,
// which every decode step streams end to end. In 4 KiB pages their ~110 MB span ~27,000 TLB
// entries a step, so the step's other work (torch's dispatch, Python) finds its own
// translations evicted; in 2 MiB pages, ~55. Filled by `kvloop.model.cpu_ops.
// huge_page_copies`; measured in docs/cpu-performance.md.
at::Tensor huge_page_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "huge_page_buffer: nbytes must be > 0");
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t size = (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge;
  // A fresh anonymous mapping, never a reused heap chunk: pages the allocator had already
  // faulted in as 4 KiB stay so whatever `madvise` says afterwards. Mapped one huge page
  // longer, trimmed to a 2 MiB-aligned `size`, advised before the first touch.
  const size_t span = size + kHuge;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "huge_page_buffer: out of memory for ", nbytes, " bytes");
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
  if (start > base) munmap(raw, start - base);
  const size_t tail = base + span - (start + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(start + size), tail);
  void* p = reinterpret_cast<void*>(start);
  madvise(p, size, MADV_HUGEPAGE);          // advice: without THP the pages stay 4 KiB
  return torch::from_blob(p, {nbytes}, [size](void* q) { munmap(q, size); },
                          at::TensorOptions().dtype(at::kByte));
}

void set_pool_threads(int64_t threads) {
  TORCH_CHECK(threads >= 1, "pool threads must be >= 1");
  kvloop::Pool::get(static_cast<int>(threads));
}

int64_t pool_threads() { return kvloop::Pool::get().threads(); }

// fn(i) for i in [0, n) on the pool, counting the runs of each (tests of the pool: fails
// unless each ran exactly once).
at::Tensor pool_run_ids(int64_t n) {
  std::vector<std::atomic<int64_t>> hits(n);
  kvloop::Pool::get().run(n, [&](int64_t i) { hits[i].fetch_add(1); });
  auto out = at::empty({n}, at::kLong);
  int64_t* runs = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    runs[i] = hits[i].load();
    TORCH_CHECK(runs[i] == 1, "pool ran chunk ", i, " ", runs[i], " times");
  }
  return out;
}

// `jobs` jobs of alternately few and many chunks back to back (a worker still leaving one
// job while the next is published: the pool's hardest case), each chunk counted; returns
// how many chunks ran other than exactly once (0), or never returns if a job is lost.
int64_t pool_stress(int64_t jobs) {
  constexpr int64_t kSizes[] = {2, 37, 3, 64, 5, 19};
  std::vector<std::atomic<int64_t>> hits(64);
  int64_t wrong = 0;
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t n = kSizes[j % 6];
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    kvloop::Pool::get().run(n, [&](int64_t i) { hits[i].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) wrong += hits[i].load() != 1;
  }
  return wrong;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "x @ W.T for 4-bit group-32 weights (skinny x)");
  m.def("q8_matmul", &q8_matmul, "x @ W.T for 8-bit group-32 weights (Q8_0; skinny x)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rms_norm(residual) * weight");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q and k in place, k and v into the cache");
  m.def("decode_attention", &decode_attention, "one-query attention over the paged cache");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "every decoder layer of a step of decodes, "
                                "low-bit, in one call")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          int64_t, double, double>())
      .def("forward", &DecodeStack::forward);
  m.def("huge_page_buffer", &huge_page_buffer, "uninitialised bytes in 2 MiB pages");
  m.def("set_pool_threads", &set_pool_threads, "threads of kvloop's pool (caller included)");
  m.def("pool_threads", &pool_threads, "threads of kvloop's pool (caller included)");
  m.def("pool_run_ids", &pool_run_ids, "run n chunks on the pool; the runs of each");
  m.def("pool_stress", &pool_stress, "jobs of mixed sizes back to back; chunks run wrongly");
}
