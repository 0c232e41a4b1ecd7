// The portable kernels (plain C++ for the architecture's baseline: any CPU of it runs them)
// and the drivers of every op, which call the active variant's inner kernels (kernels.h).
//
// Why fused ops: a decode step of a small model is ~10 eager ops per layer that each cost
// more in dispatch and thread wake-ups than in arithmetic. These ops do one layer's norm,
// RoPE + KV write, decode attention and SwiGLU in one call each, in fp32 math, parallel over
// rows with at::parallel_for (torch's own thread pool: no second OpenMP runtime) or, for the
// low-bit decode path, on kvloop's pool (pool.h): the quantized matmuls and `DecodeStack`.
#include "kernels.h"

#include <ATen/Parallel.h>

#include "pool.h"
#include "softmax.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

namespace kvloop {
namespace {

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
static_assert(kColumnsPerLine % kQ8Columns == 0, "a task's columns start a column block");
static_assert(kColumnsPerLine % kQ4Columns == 0, "a task's columns start a column block");

// The block kernel's columns go to the pool as kBlockChunksPerThread runs of whole blocks per
// thread, so each thread streams its weights in long runs, not block by block in turn with
// the other. Zen 4, the served fused step (bench.steps' engine), the chunk sizes taking
// turns step by step in one process, best of ~15 steps each, load 2.5-5 (noisy): at 4 rows
// chunks of 16 columns 7.6-7.9 ms where 32 gave 6.9-7.1, 64 6.2-6.5, 128 5.8-5.9 (two runs);
// 16 columns 7.7 and 9.7 where two runs a thread gave 5.4 and 9.4 (two more); at 8 rows
// 16.4 and 16.4 against 12.5 and 14.4.
constexpr int64_t kBlockChunksPerThread = 2;

inline int64_t block_chunk(int64_t n_out) {
  const int64_t runs = kBlockChunksPerThread * Pool::get().threads();
  return std::max<int64_t>(1, (n_out + runs * kQ4Columns - 1) / (runs * kQ4Columns)) *
         kQ4Columns;
}

template <typename T, typename C>
AttendFn<T, C> attend_of(const Kernels& k) {
  if constexpr (!std::is_same_v<T, C>) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<C, c10::BFloat16>);
    return k.attend_f32_bf16;
  } else if constexpr (std::is_same_v<T, float>) {
    return k.attend_f32;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return k.attend_bf16;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return k.attend_f16;
  } else {
    return generic_attend<T>;     // fp64 (torch's dispatch includes it): no variant
  }
}

// out[i] = silu(gate[i]) * up[i], silu rounded to T first, as the unfused
// silu-then-multiply does.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t f) {
  for (int64_t i = 0; i < f; ++i) {
    const float g = to_f(gate[i]);
    const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
    out[i] = static_cast<T>(to_f(silu) * to_f(up[i]));
  }
}

void generic_silu_mul_f32(const float* gate, const float* up, float* out, int64_t f) {
  silu_mul_row<float>(gate, up, out, f);
}

void generic_round_bf16(const float* x, c10::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::BFloat16>(x[i]);
}

// One row, per group of 32: dx = max|x| / 32767, q = round-to-nearest-even(x / dx).
void generic_quantize_row(const float* x, int64_t k_in, int16_t* q, float* d, float* s) {
  for (int64_t g = 0; g < k_in / 32; ++g) {
    const float* xg = x + g * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float dx = amax / kQMax, inv = dx > 0.f ? 1.f / dx : 0.f;
    int64_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xg[i] * inv));
      q[g * 32 + i] = static_cast<int16_t>(v);
      sum += v;
    }
    d[g] = dx;
    s[g] = dx * static_cast<float>(sum);
  }
}

// The 4-bit integer kernel (llama.cpp's recipe for Q4 x Q8, with 16-bit activations):
//   y[m, n] = sum_g scale[n, g] dx[m, g] sum(q xq) + offset[n, g] dx[m, g] sum(xq),
// a group's weight i the low nibble of its byte i, weight i + 16 the high one.
template <int MB>
void int_columns_of(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
                    int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = mm.qs + n * mm.row_bytes;
    const float* sc = mm.scale + n * groups;
    const float* of = mm.offset + n * groups;
    float acc[MB], tail[MB];
    for (int m = 0; m < MB; ++m) acc[m] = tail[m] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = row + g * 16;
      for (int m = 0; m < MB; ++m) {
        const int64_t r = r0 + m;
        const int16_t* xg = xq.q.data() + r * mm.k_in + g * 32;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) dot += (group[i] & 15) * xg[i] + (group[i] >> 4) * xg[i + 16];
        acc[m] += sc[g] * xq.d[r * groups + g] * static_cast<float>(dot);
        tail[m] += of[g] * xq.s[r * groups + g];
      }
    }
    for (int m = 0; m < MB; ++m) out[m * out_stride + (n - begin)] = acc[m] + tail[m];
  }
}

void generic_int_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                         int64_t end, float* out, int64_t out_stride) {
  switch (rows) {
    case 4: return int_columns_of<4>(mm, r0, begin, end, out, out_stride);
    case 3: return int_columns_of<3>(mm, r0, begin, end, out, out_stride);
    case 2: return int_columns_of<2>(mm, r0, begin, end, out, out_stride);
    default: return int_columns_of<1>(mm, r0, begin, end, out, out_stride);
  }
}

// The 8-bit integer kernel on W in column blocks (kernels.h), a column and a row at a time:
//   y[m, n] = sum_g scale[n, g] dx[m, g] sum(q xq), the groups in order.
void generic_q8_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                        int64_t end, float* out, int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  const int8_t* qs = reinterpret_cast<const int8_t*>(mm.qs);
  for (int64_t n = begin; n < end; ++n) {
    const int64_t b = n / kQ8Columns, j = n % kQ8Columns;
    for (int m = 0; m < rows; ++m) {
      const int64_t r = r0 + m;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* w = qs + (b * groups + g) * 32 * kQ8Columns + 2 * j;
        const int16_t* xg = xq.q.data() + r * mm.k_in + g * 32;
        int32_t dot = 0;
        for (int p = 0; p < 16; ++p)
          dot += w[p * 2 * kQ8Columns] * xg[2 * p] + w[p * 2 * kQ8Columns + 1] * xg[2 * p + 1];
        acc += mm.scale[(b * groups + g) * kQ8Columns + j] * xq.d[r * groups + g] *
               static_cast<float>(dot);
      }
      out[m * out_stride + (n - begin)] = acc;
    }
  }
}

// 4-bit weights dequantized (q * scale + offset, as `Int4Weight.dequantize`) against fp32
// rows, in 8 lanes of two accumulators as the vector kernels sum.
template <int MB>
void fp_columns_of(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
                   int64_t out_stride) {
  const int64_t groups = mm.groups;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = mm.qs + n * mm.row_bytes;
    float a0[MB][8] = {}, a1[MB][8] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = row + g * 16;
      const float sc = mm.scale[n * groups + g], of = mm.offset[n * groups + g];
      float w[32];
      for (int i = 0; i < 16; ++i) {
        w[i] = static_cast<float>(group[i] & 15) * sc + of;
        w[i + 16] = static_cast<float>(group[i] >> 4) * sc + of;
      }
      for (int m = 0; m < MB; ++m) {
        const float* x = mm.xf + (r0 + m) * mm.k_in + g * 32;
        for (int j = 0; j < 8; ++j) {
          a0[m][j] += w[j] * x[j];
          a1[m][j] += w[8 + j] * x[8 + j];
          a0[m][j] += w[16 + j] * x[16 + j];
          a1[m][j] += w[24 + j] * x[24 + j];
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      float total = 0.f;
      for (int j = 0; j < 8; ++j) total += a0[m][j] + a1[m][j];
      out[m * out_stride + (n - begin)] = total;
    }
  }
}

void generic_fp_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin,
                        int64_t end, float* out, int64_t out_stride) {
  switch (rows) {
    case 4: return fp_columns_of<4>(mm, r0, begin, end, out, out_stride);
    case 3: return fp_columns_of<3>(mm, r0, begin, end, out, out_stride);
    case 2: return fp_columns_of<2>(mm, r0, begin, end, out, out_stride);
    default: return fp_columns_of<1>(mm, r0, begin, end, out, out_stride);
  }
}

// Rows of x (int16 or bf16 values) with each pair of groups (g, g + 1) as [x_g 0-15,
// x_g+1 0-15, x_g 16-31, x_g+1 16-31] (an odd last group as it is): the order in which a
// 512-bit register of two 4-bit groups' widened bytes holds their weights (x86_avx512.cpp).
template <typename E>
std::vector<E> pair_order(const E* x, int64_t rows, int64_t k_in) {
  std::vector<E> out(rows * k_in);
  const int64_t pairs = k_in / 64;
  for (int64_t m = 0; m < rows; ++m) {
    const E* src = x + m * k_in;
    E* dst = out.data() + m * k_in;
    for (int64_t p = 0; p < pairs; ++p, src += 64, dst += 64) {
      std::copy(src, src + 16, dst);
      std::copy(src + 32, src + 48, dst + 16);
      std::copy(src + 16, src + 32, dst + 32);
      std::copy(src + 48, src + 64, dst + 48);
    }
    std::copy(src, x + (m + 1) * k_in, dst);
  }
  return out;
}

// Each group of 32's sum of x, [rows, k_in / 32].
template <typename T>
std::vector<float> group_sums(const T* x, int64_t rows, int64_t k_in) {
  std::vector<float> out(rows * (k_in / 32), 0.f);
  for (int64_t i = 0; i < rows * k_in; ++i) out[i / 32] += to_f(x[i]);
  return out;
}

// x's first `rows` rows [rows, k_in] transposed for the lane kernel: [k_in,
// lane_stride(rows)], the padding zero.
template <typename T>
std::vector<float> lane_order(const T* x, int64_t rows, int64_t k_in) {
  const int64_t stride = lane_stride(rows);
  std::vector<float> out(k_in * stride, 0.f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k_in; ++i) out[i * stride + m] = to_f(x[m * k_in + i]);
  return out;
}

// bf16 x's first `rows` rows for the bf16 lane kernel (kernels.h: `xtb`, `xts`): in pairs,
// transposed, with their group sums (the table's lane_pairs), [k_in / 2 or k_in / 32,
// lane_stride(rows)].
void bf16_lane_order(const Kernels& k, const c10::BFloat16* x, int64_t rows, int64_t k_in,
                     std::vector<uint32_t>& xt, std::vector<float>& xs) {
  const int64_t stride = lane_stride(rows);
  xt.resize(k_in / 2 * stride);
  xs.resize(k_in / 32 * stride);
  k.lane_pairs(x, rows, k_in, xt.data(), xs.data(), stride);
}

template <typename T>
std::vector<float> widen(const T* x, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = to_f(x[i]);
  return out;
}

template <typename T>
QuantizedRows quantize_rows(const Kernels& k, const T* x, int64_t rows, int64_t k_in) {
  const int64_t groups = k_in / 32;
  QuantizedRows out{std::vector<int16_t>(rows * k_in), std::vector<float>(rows * groups),
                    std::vector<float>(rows * groups)};
  for (int64_t m = 0; m < rows; ++m) {
    std::vector<float> wide;
    const float* xf;
    if constexpr (std::is_same_v<T, float>) {
      xf = x + m * k_in;
    } else {              // bf16 and fp16 widen to fp32 exactly
      wide = widen(x + m * k_in, k_in);
      xf = wide.data();
    }
    k.quantize_row(xf, k_in, out.q.data() + m * k_in, out.d.data() + m * groups,
                   out.s.data() + m * groups);
  }
  return out;
}

}  // namespace

// --- the portable inner kernels ------------------------------------------------------------
// The prefill block kernel in plain loops (no variant's table has it: the driver's fallback
// where a variant has no vector kernel). Each row on its own: its scores over the keys it
// sees, the online-softmax update (running max, sum, output rescaled by e^(m_old -
// m_new)), then the values.
void generic_prefill_block(const float* qs, int64_t rows, int64_t dim, const float* kt,
                           const float* v, int64_t n, const int32_t* lo, const int32_t* hi,
                           float* m, float* l, float* o, float* s) {
  (void)n;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = lo[r], last = hi[r];
    if (first >= last) continue;
    float* sr = s + r * kPrefillKeys;
    const float* qr = qs + r * dim;
    for (int64_t j = first; j < last; ++j) sr[j] = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float qd = qr[d];
      const float* kd = kt + d * kPrefillKeys;
#pragma omp simd
      for (int64_t j = first; j < last; ++j) sr[j] += qd * kd[j];
    }
    float top = m[r];
    for (int64_t j = first; j < last; ++j) top = std::max(top, sr[j]);
    const float alpha = std::exp(m[r] - top);     // 0 before any key (m = -inf)
    float sum = 0.f;
    for (int64_t j = first; j < last; ++j) {
      sr[j] = std::exp(sr[j] - top);
      sum += sr[j];
    }
    l[r] = l[r] * alpha + sum;
    m[r] = top;
    float* orow = o + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) orow[d] *= alpha;
    for (int64_t j = first; j < last; ++j) {
      const float p = sr[j];
      const float* vj = v + j * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) orow[d] += p * vj[d];
    }
  }
}

template <typename T, typename C>
void generic_attend(const T* q, float scale, int64_t group, int64_t dim, const C* keys,
                    const C* vals, const int64_t* slot, int64_t len, float* scores, T* out,
                    int64_t out_stride) {
  const std::vector<float> qf = scaled_query(q, group * dim, scale);
  const int64_t stride = (len + 7) / 8 * 8;
  prefetch_first_rows(keys, vals, slot, dim, len);
  for (int64_t t = 0; t < len; ++t) {
    prefetch_row(keys, slot, dim, t + kPrefetchTokens, len);
    const C* k = keys + slot[t] * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < dim; ++i) s += qg[i] * to_f(k[i]);
      scores[g * stride + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) kvloop::softmax_in_place(scores + g * stride, len);
  std::vector<float> acc(group * dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    prefetch_row(vals, slot, dim, t + kPrefetchTokens, len);
    const C* v = vals + slot[t] * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * stride + t];
      float* ag = acc.data() + g * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) ag[i] += p * to_f(v[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < dim; ++i) out[g * out_stride + i] = static_cast<T>(acc[g * dim + i]);
}

const Kernels& generic_kernels() {
  static const Kernels table{"generic", generic_attend<float>, generic_attend<c10::BFloat16>,
                             generic_attend<c10::Half>,
                             generic_attend<float, c10::BFloat16>, nullptr,
                             generic_silu_mul_f32,
                             generic_round_bf16, generic_quantize_row, generic_int_columns,
                             generic_q8_columns, generic_fp_columns, nullptr, nullptr, nullptr, nullptr,
                             false, nullptr, nullptr};
  return table;
}

// --- the drivers ---------------------------------------------------------------------------
// residual += x (when residual is given); x = residual / rms(residual) * weight.
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps,
                  bool pooled) {
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
// store K and V into the paged cache [2, K, blocks, block_size, D] at slot_mapping[t]
// (rounded to the cache's C where it is narrower: bf16 under fp32, to nearest even).
template <typename T, typename C>
void rope_and_cache(const Kernels& k, T* qkv, const int64_t* positions, const float* cos,
                    const float* sin, C* cache, const int64_t* slots, int64_t tokens,
                    int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_tokens, bool pooled) {
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
          C* dst = cache + ((kv * kv_heads + h) * cache_tokens + slot) * dim;
          if constexpr (std::is_same_v<T, C>) {
            std::copy(src + h * dim, src + (h + 1) * dim, dst);
          } else {
            static_assert(std::is_same_v<T, float> && std::is_same_v<C, c10::BFloat16>);
            k.round_bf16(src + h * dim, dst, dim);
          }
        }
      }
    }
  });
}

// One query token per request: out[r, h] = softmax(q[r, h] . K[r]^T * scale) V[r], keys read
// in place from the paged cache through block_table; the query heads of a KV head together
// (the variant's `attend`). q's rows are `q_row` elements apart (heads * dim when
// contiguous; more when q is the first part of a fused qkv row).
template <typename T, typename C>
void decode_attention(const Kernels& k, const T* q, int64_t q_row, const C* cache,
                      const int64_t* block_table, const int64_t* seq_lens, T* out,
                      int64_t reqs, int64_t heads, int64_t kv_heads, int64_t dim,
                      int64_t block_size, int64_t cache_tokens, int64_t max_blocks,
                      float scale, bool pooled) {
  const int64_t group = heads / kv_heads;
  int64_t longest = 1;
  for (int64_t r = 0; r < reqs; ++r) longest = std::max(longest, seq_lens[r]);
  const C* values = cache + kv_heads * cache_tokens * dim;
  const AttendFn<T, C> attend = attend_of<T, C>(k);
  par_for(pooled, reqs * kv_heads, longest * dim * group * 2, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> slot;            // the request's cache slots (shared by its KV heads)
    int64_t slot_request = -1;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / kv_heads, kh = w % kv_heads, len = seq_lens[r];
      if (slot_request != r) {
        slot_rows(block_table + r * max_blocks, block_size, len, slot);
        slot_request = r;
      }
      scores.resize(group * ((len + 7) / 8 * 8));
      attend(q + r * q_row + kh * group * dim, scale, group, dim,
             cache + kh * cache_tokens * dim, values + kh * cache_tokens * dim, slot.data(),
             len, scores.data(), out + (r * heads + kh * group) * dim, dim);
    }
  });
}

namespace {

// A chunk's keys and values widened to fp32 once, for all its query tiles (each tile
// reads its KV head's blocks from here, not the paged cache): per KV head and block of
// kPrefillKeys keys, the keys transposed [dim, kPrefillKeys] (the columns past the last
// key zero) and the values [kPrefillKeys, dim]. Measured on Zen 4: widening each block
// within each tile cost about as much as the tile's arithmetic.
struct PrefillKeys {
  int64_t dim, blocks;
  std::unique_ptr<float[]> kt, v;     // (uninitialised: every value read is written)

  template <typename C>
  PrefillKeys(const C* cache, const int64_t* slots, int64_t keys, int64_t kv_heads,
              int64_t dim_, int64_t cache_tokens)
      : dim(dim_), blocks((keys + kPrefillKeys - 1) / kPrefillKeys),
        kt(new float[kv_heads * blocks * dim_ * kPrefillKeys]),
        v(new float[kv_heads * blocks * kPrefillKeys * dim_]) {
    const C* values = cache + kv_heads * cache_tokens * dim;
    par_for(true, kv_heads * blocks, kPrefillKeys * dim * 4, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t kh = w / blocks, b0 = (w % blocks) * kPrefillKeys;
        const int64_t n = std::min(kPrefillKeys, keys - b0);
        float* bk = block_keys(kh, b0);
        float* bv = block_values(kh, b0);
        if (n < kPrefillKeys) std::fill(bk, bk + dim * kPrefillKeys, 0.f);
        // the keys 16 at a time, so each transposed row of them is one cache line
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          const int64_t count = std::min<int64_t>(16, n - j0);
          const C* key[16];
          for (int64_t j = 0; j < count; ++j)
            key[j] = cache + (kh * cache_tokens + slots[b0 + j0 + j]) * dim;
          for (int64_t i = 0; i < dim; ++i)
            for (int64_t j = 0; j < count; ++j) bk[i * kPrefillKeys + j0 + j] = to_f(key[j][i]);
        }
        for (int64_t j = 0; j < n; ++j) {
          const C* val = values + (kh * cache_tokens + slots[b0 + j]) * dim;
          for (int64_t i = 0; i < dim; ++i) bv[j * dim + i] = to_f(val[i]);
        }
      }
    });
  }

  float* block_keys(int64_t kh, int64_t b0) {
    return kt.get() + (kh * blocks + b0 / kPrefillKeys) * dim * kPrefillKeys;
  }
  float* block_values(int64_t kh, int64_t b0) {
    return v.get() + (kh * blocks + b0 / kPrefillKeys) * kPrefillKeys * dim;
  }
};

// One (KV head, query tile) task of prefill_attention: its rows' queries scaled to fp32,
// each row's visible keys [lo, hi) of the chunk's, each row's running max, sum and output.
template <typename T>
struct PrefillTile {
  int64_t dim, rows = 0;
  std::vector<float> qs, m, l, o, s;
  std::vector<int64_t> lo, hi;
  std::vector<int32_t> block_lo, block_hi;

  PrefillTile(int64_t dim_, int64_t max_rows)
      : dim(dim_), qs(max_rows * dim_), m(max_rows), l(max_rows), o(max_rows * dim_),
        s(max_rows * kPrefillKeys), lo(max_rows), hi(max_rows), block_lo(max_rows),
        block_hi(max_rows) {}

  // Rows of query positions [p0, p1) of a KV head's `group` heads from q_head (the first
  // head's row of position 0); position p sees keys up to ctx + p (and past ctx + p -
  // window where window > 0).
  void start(const T* q_head, int64_t q_row, int64_t group, int64_t p0, int64_t p1,
             int64_t ctx, int64_t window, float scale) {
    rows = (p1 - p0) * group;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (p - p0) * group + g;
        const T* src = q_head + p * q_row + g * dim;
        for (int64_t i = 0; i < dim; ++i) qs[r * dim + i] = to_f(src[i]) * scale;
        hi[r] = ctx + p + 1;
        lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window) : 0;
      }
    std::fill(m.begin(), m.begin() + rows, -INFINITY);
    std::fill(l.begin(), l.begin() + rows, 0.f);
    std::fill(o.begin(), o.begin() + rows * dim, 0.f);
  }

  // Each row's part of the block of keys [b0, b0 + n).
  void clip(int64_t b0, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      block_lo[r] = static_cast<int32_t>(std::clamp<int64_t>(lo[r] - b0, 0, n));
      block_hi[r] = static_cast<int32_t>(std::clamp<int64_t>(hi[r] - b0, 0, n));
    }
  }

  // The keys any row sees: [first_key, end_key).
  int64_t first_key() const { return *std::min_element(lo.begin(), lo.begin() + rows); }
  int64_t end_key() const { return *std::max_element(hi.begin(), hi.begin() + rows); }

  void finish(T* out_head, int64_t out_row, int64_t group, int64_t p0) const {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = p0 + r / group, g = r % group;
      T* dst = out_head + p * out_row + g * dim;
      const float inv = 1.f / l[r];
      for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<T>(o[r * dim + i] * inv);
    }
  }
};

}  // namespace

template <typename T, typename C>
void prefill_attention(const Kernels& k, const T* q, int64_t q_row, const C* cache,
                       const int64_t* slots, int64_t keys, int64_t chunk, T* out,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_tokens,
                       float scale, int64_t window) {
  const int64_t group = heads / kv_heads, ctx = keys - chunk;
  const int64_t positions = prefill_positions(group);
  const int64_t tiles = (chunk + positions - 1) / positions;
  PrefillKeys packed(cache, slots, keys, kv_heads, dim, cache_tokens);
  const PrefillBlockFn block = k.prefill_block ? k.prefill_block : generic_prefill_block;
  // a KV head's tiles together (its keys stay in cache), the costliest first (the last
  // queries see the most keys): the pool's threads claim tasks in order
  kvloop::pool_for(tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    PrefillTile<T> tile(dim, positions * group);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t kh = w / tiles, t = tiles - 1 - w % tiles;
      const int64_t p0 = t * positions, p1 = std::min(chunk, p0 + positions);
      tile.start(q + kh * group * dim, q_row, group, p0, p1, ctx, window, scale);
      const int64_t last = tile.end_key();
      for (int64_t b0 = tile.first_key() / kPrefillKeys * kPrefillKeys; b0 < last;
           b0 += kPrefillKeys) {
        const int64_t n = std::min(kPrefillKeys, keys - b0);
        tile.clip(b0, n);
        block(tile.qs.data(), tile.rows, dim, packed.block_keys(kh, b0),
                        packed.block_values(kh, b0), n, tile.block_lo.data(),
                        tile.block_hi.data(), tile.m.data(), tile.l.data(), tile.o.data(),
                        tile.s.data());
      }
      tile.finish(out + kh * group * dim, heads * dim, group, p0);
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, F + i] for x [T, 2F].
template <typename T>
void silu_and_mul(const Kernels& k, const T* x, T* out, int64_t rows, int64_t f, bool pooled) {
  par_for(pooled, rows, f * 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * f;
      if constexpr (std::is_same_v<T, float>) k.silu_mul_f32(gate, gate + f, out + r * f, f);
      else silu_mul_row<T>(gate, gate + f, out + r * f, f);
    }
  });
}

namespace {

// x as a quantized matmul's kernel reads it: from kFpRows rows of bf16 x (or of fp32 x under
// `bf16_x`, rounded), 4-bit weights with `blocks` give every row to the block kernel where
// the variant has one (x in row pairs); else they give their first rows to a lane kernel
// where the variant has one (x transposed, in one call): the bf16 one for bf16 x, and for
// fp32 x under `bf16_x` (rounded to bf16; bf16_lane_rows), else the fp32 one (lane_rows);
// the other rows take the bf16 kernel where x is bf16 and the variant has one (x in pair
// order, its group sums), else the fp32 kernel (x widened). Below kFpRows, and for
// 8-bit weights, x is quantized per row and group to int16 and each group's dot product is
// integer. Neither copied nor moved: `mm` points into it.
struct PreparedMatmul {
  QuantMatmul mm;
  bool fp;
  bool block = false;             // the block kernel takes every row
  int64_t lanes = 0;              // rows of the lane kernel, from row 0
  ColumnsFn columns;
  ColumnsFn lane_columns = nullptr;
  std::vector<float> xf;
  std::vector<float> xt;
  QuantizedRows xq;
  std::vector<int16_t> xp;
  std::vector<c10::BFloat16> xb;
  std::vector<float> xs;
  std::vector<uint32_t> xtb;
  std::vector<float> xts;
  std::vector<uint32_t> xrp;

  template <typename T>
  PreparedMatmul(const Kernels& k, int bits, const T* x, const uint8_t* qs, const float* scale,
                 const float* offset, int64_t rows, int64_t k_in, bool bf16_x,
                 const Q4Blocks* blocks = nullptr)
      : mm{qs,      scale,   offset,  bits,    k_in,    k_in / 32, k_in * bits / 8, nullptr,
           nullptr, nullptr, nullptr, nullptr, nullptr, 0,         nullptr,         nullptr,
           nullptr},
        fp(bits == 4 && rows >= kFpRows),
        columns(fp ? k.fp_columns : bits == 8 ? k.q8_columns : k.int_columns) {
    if (fp && k.bf16_columns != nullptr) {     // the variant has the bf16 kernels
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        use_bf16(k, x, rows, k_in, blocks);
        return;
      } else if constexpr (std::is_same_v<T, float>) {
        if (bf16_x) {                            // fp32 x under bf16 layer matmuls: rounded once
          std::vector<c10::BFloat16> rounded(rows * k_in);
          k.round_bf16(x, rounded.data(), rows * k_in);
          use_bf16(k, rounded.data(), rows, k_in, blocks);
          return;
        }
      }
    }
    if (fp && lanes == 0 && k.lane_columns != nullptr && lane_rows(rows) > 0) {
      lanes = lane_rows(rows);
      lane_columns = k.lane_columns;
      xt = lane_order(x, lanes, k_in);
      mm.xt = xt.data();
      mm.xt_stride = lane_stride(lanes);
    }
    if (fp) {
      if (lanes < rows) {           // rows left to the 4-row tiles (which read x widened)
        xf = widen(x, rows * k_in);
        mm.xf = xf.data();
      }
    } else {
      xq = quantize_rows(k, x, rows, k_in);
      mm.xq = &xq;
      if (bits == 4 && k.q4_pairs) xp = pair_order(xq.q.data(), rows, k_in);
      mm.xv = xp.empty() ? xq.q.data() : xp.data();
    }
  }
  PreparedMatmul(const PreparedMatmul&) = delete;

  // The bf16 kernels on bf16 x: the block kernel for every row, where the weights come in
  // blocks too and the variant has it; else the lane kernel for its rows (bf16_lane_rows),
  // where the variant has it, then the bf16 tiles (pair order, group sums) for the rows past
  // them.
  void use_bf16(const Kernels& k, const c10::BFloat16* x, int64_t rows, int64_t k_in,
                const Q4Blocks* blocks) {
    if (blocks != nullptr && k.bf16_block_columns != nullptr) {
      block = true;
      columns = k.bf16_block_columns;
      mm.qs = blocks->qs;
      mm.scale = blocks->scale;
      mm.offset = blocks->offset;
      xrp.resize(rows * k_in / 2);
      xs.resize(rows * (k_in / 32));
      k.row_pairs(x, rows, k_in, xrp.data(), xs.data());
      mm.xrp = xrp.data();
      mm.xs = xs.data();
      return;
    }
    columns = k.bf16_columns;
    if (k.bf16_lane_columns != nullptr && bf16_lane_rows(rows) > 0) {
      lanes = bf16_lane_rows(rows);
      lane_columns = k.bf16_lane_columns;
      bf16_lane_order(k, x, lanes, k_in, xtb, xts);
      mm.xtb = xtb.data();
      mm.xts = xts.data();
      mm.xt_stride = lane_stride(lanes);
    }
    if (lanes < rows) {
      xb = pair_order(x, rows, k_in);
      xs = group_sums(x, rows, k_in);
      mm.xb = xb.data();
      mm.xs = xs.data();
    }
  }
  PreparedMatmul& operator=(const PreparedMatmul&) = delete;

  // fn(kernel, r0, mb) over the rows: 8-bit weights' all at once (q8_columns tiles them
  // itself); else the lane kernel's at once, then the others in tiles of 4 (then 2, then 1;
  // the fp32 kernel: the 1-3 rows left at once), so the weights stream once per 4 rows.
  template <typename Fn>
  void tiles(int64_t rows, const Fn& fn) const {
    if (mm.bits == 8 || block) {
      fn(columns, 0, static_cast<int>(rows));
      return;
    }
    if (lanes > 0) fn(lane_columns, 0, static_cast<int>(lanes));
    int64_t r0 = lanes;
    for (; rows - r0 >= 4; r0 += 4) fn(columns, r0, 4);
    if (fp) {
      if (rows > r0) fn(columns, r0, static_cast<int>(rows - r0));
      return;
    }
    if (rows - r0 >= 2) {
      fn(columns, r0, 2);
      r0 += 2;
    }
    if (rows - r0 >= 1) fn(columns, r0, 1);
  }
};

}  // namespace

// y [M, N] = x [M, K] @ W.T (QuantMatmul: W's layout). Columns go to the pool's threads in
// whole cache lines (whole column blocks of 8-bit W; of 4-bit W in blocks, a few long runs
// per thread: block_chunk); each task runs its columns tile by tile of rows (PreparedMatmul).
template <int Bits, typename T>
void quant_matmul(const Kernels& k, const T* x, const uint8_t* qs, const float* scale,
                  const float* offset, T* y, int64_t rows, int64_t n_out, int64_t k_in,
                  bool bf16_x, const Q4Blocks* blocks) {
  const PreparedMatmul p(k, Bits, x, qs, scale, offset, rows, k_in, bf16_x, blocks);
  const int64_t align = p.block ? block_chunk(n_out) : kColumnsPerLine;
  par_for(true, n_out, rows * k_in, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;             // T other than fp32: the tile's y, then rounded
    p.tiles(rows, [&](ColumnsFn columns, int64_t r0, int mb) {
      if constexpr (std::is_same_v<T, float>) {
        columns(p.mm, r0, mb, begin, end, y + r0 * n_out + begin, n_out);
      } else {
        const int64_t width = end - begin;
        buf.resize(mb * width);
        columns(p.mm, r0, mb, begin, end, buf.data(), width);
        for (int m = 0; m < mb; ++m)
          for (int64_t n = 0; n < width; ++n)
            y[(r0 + m) * n_out + begin + n] = static_cast<T>(buf[m * width + n]);
      }
    });
  }, align);
}

namespace {

// A (value, column) pair as one integer whose order is the pair's: larger value first, then
// the lower column (torch.argmax's first maximum). -0.0 orders below +0.0, NaN above +inf.
inline uint64_t argmax_key(float value, int64_t column) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(column));
}

inline void argmax_of_key(uint64_t key, int64_t* column, float* value) {
  *column = 0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu);
  uint32_t bits = static_cast<uint32_t>(key >> 32);
  bits = (bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits;
  std::memcpy(value, &bits, sizeof bits);
}

}  // namespace

// For each row of x: the column of y = x @ W.T with the largest value (the first, on a tie)
// and that value, y as quant_matmul rounds it to T; y is never written whole (each task
// keeps one tile of its columns, in cache). Greedy decoding's LM head.
template <int Bits, typename T>
void quant_matmul_argmax(const Kernels& k, const T* x, const uint8_t* qs, const float* scale,
                         const float* offset, int64_t rows, int64_t n_out, int64_t k_in,
                         int64_t* column, float* value, bool bf16_x) {
  const PreparedMatmul p(k, Bits, x, qs, scale, offset, rows, k_in, bf16_x);
  std::vector<std::atomic<uint64_t>> best(rows);
  for (auto& b : best) b.store(0, std::memory_order_relaxed);
  par_for(true, n_out, rows * k_in, [&](int64_t begin, int64_t end) {
    const int64_t width = end - begin;
    std::vector<float> buf;
    std::vector<uint64_t> mine(rows, 0);
    p.tiles(rows, [&](ColumnsFn columns, int64_t r0, int mb) {
      buf.resize(mb * width);
      columns(p.mm, r0, mb, begin, end, buf.data(), width);
      for (int m = 0; m < mb; ++m)
        for (int64_t n = 0; n < width; ++n) {
          const float v = to_f(static_cast<T>(buf[m * width + n]));
          mine[r0 + m] = std::max(mine[r0 + m], argmax_key(v, begin + n));
        }
    });
    for (int64_t r = 0; r < rows; ++r) {
      uint64_t seen = best[r].load(std::memory_order_relaxed);
      while (mine[r] > seen && !best[r].compare_exchange_weak(seen, mine[r])) {
      }
    }
  }, kColumnsPerLine);
  for (int64_t r = 0; r < rows; ++r) argmax_of_key(best[r].load(), column + r, value + r);
}

#define KVLOOP_INSTANTIATE(T)                                                                 \
  template void generic_attend<T>(const T*, float, int64_t, int64_t, const T*, const T*,      \
                                  const int64_t*, int64_t, float*, T*, int64_t);              \
  template void add_rms_norm<T>(T*, T*, const T*, int64_t, int64_t, float, bool);             \
  template void rope_and_cache<T>(const Kernels&, T*, const int64_t*, const float*,          \
                                  const float*, T*, const int64_t*, int64_t, int64_t, int64_t, \
                                  int64_t, int64_t, bool);                                    \
  template void decode_attention<T>(const Kernels&, const T*, int64_t, const T*,              \
                                    const int64_t*, const int64_t*, T*, int64_t, int64_t,     \
                                    int64_t, int64_t, int64_t, int64_t, int64_t, float, bool); \
  template void prefill_attention<T>(const Kernels&, const T*, int64_t, const T*,             \
                                     const int64_t*, int64_t, int64_t, T*, int64_t, int64_t,  \
                                     int64_t, int64_t, float, int64_t);                       \
  template void silu_and_mul<T>(const Kernels&, const T*, T*, int64_t, int64_t, bool);        \
  template void quant_matmul<4, T>(const Kernels&, const T*, const uint8_t*, const float*,    \
                                   const float*, T*, int64_t, int64_t, int64_t, bool,         \
                                   const Q4Blocks*);                                          \
  template void quant_matmul<8, T>(const Kernels&, const T*, const uint8_t*, const float*,    \
                                   const float*, T*, int64_t, int64_t, int64_t, bool,         \
                                   const Q4Blocks*);                                          \
  template void quant_matmul_argmax<4, T>(const Kernels&, const T*, const uint8_t*,           \
                                          const float*, const float*, int64_t, int64_t,       \
                                          int64_t, int64_t*, float*, bool);                   \
  template void quant_matmul_argmax<8, T>(const Kernels&, const T*, const uint8_t*,           \
                                          const float*, const float*, int64_t, int64_t,       \
                                          int64_t, int64_t*, float*, bool);

KVLOOP_INSTANTIATE(double)
KVLOOP_INSTANTIATE(float)
KVLOOP_INSTANTIATE(c10::BFloat16)
KVLOOP_INSTANTIATE(c10::Half)
#undef KVLOOP_INSTANTIATE

// fp32 activations over a bf16 cache (--kv-cache-dtype bfloat16)
using BF16 = c10::BFloat16;
template void generic_attend<float, BF16>(const float*, float, int64_t, int64_t, const BF16*,
                                          const BF16*, const int64_t*, int64_t, float*, float*,
                                          int64_t);
template void rope_and_cache<float, BF16>(const Kernels&, float*, const int64_t*,
                                          const float*, const float*, BF16*, const int64_t*,
                                          int64_t, int64_t, int64_t, int64_t, int64_t, bool);
template void decode_attention<float, BF16>(const Kernels&, const float*, int64_t, const BF16*,
                                            const int64_t*, const int64_t*, float*, int64_t,
                                            int64_t, int64_t, int64_t, int64_t, int64_t,
                                            int64_t, float, bool);
template void prefill_attention<float, BF16>(const Kernels&, const float*, int64_t,
                                             const BF16*, const int64_t*, int64_t, int64_t,
                                             float*, int64_t, int64_t, int64_t, int64_t, float,
                                             int64_t);

}  // namespace kvloop
