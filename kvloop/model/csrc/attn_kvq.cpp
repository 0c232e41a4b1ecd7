// The quantized KV cache's ops (kvloop/model/kv_quant.py: the format and the pure-torch
// twins these must agree with). Built into the CPU ops' extension beside cpu_ops.cpp and
// registered with torch's dispatcher under the build's own name
// (torch.ops.<extension name>.kvq_*), so this file needs nothing from cpu_ops.cpp.
//
// A layer's cache: uint8 [2, kv_heads, cache_tokens, dim + 4]; a row = dim one-byte codes
// (int8, fp8 e4m3fn or fp8 e5m2 bits), then its fp32 scale; value = code * scale. int8 rows
// (dim a power of two) hold the codes of x H, H the normalized Walsh-Hadamard matrix: the
// decode kernel rotates the query and the output instead of each key and value.
#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "kernels.h"   // slot_rows and the read-ahead (prefetch_rows, kPrefetchTokens)
#include "softmax.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kInt8 = 1, kE4M3 = 2, kE5M2 = 3;    // KVQuant.kind
constexpr int64_t kScaleBytes = 4;

template <int Kind> struct Code;
template <> struct Code<kInt8> {
  static constexpr float qmax = 127.f;
  static uint8_t encode(float y) { return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y))); }
  static float decode(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
};
template <> struct Code<kE4M3> {
  static constexpr float qmax = 448.f;
  static uint8_t encode(float y) { return c10::Float8_e4m3fn(y).x; }
  static float decode(uint8_t b) {
    return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
  }
};
template <> struct Code<kE5M2> {
  static constexpr float qmax = 57344.f;
  static uint8_t encode(float y) { return c10::Float8_e5m2(y).x; }
  static float decode(uint8_t b) {
    return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  }
};

// Whether rows of this format and size are stored rotated (kv_quant.KVQuant.rotates).
template <int Kind>
inline bool rotates(int64_t dim) {
  return Kind == kInt8 && dim > 0 && (dim & (dim - 1)) == 0;
}

// x[n] <- x H in place (normalized Walsh-Hadamard, Sylvester's order; n a power of two).
inline void hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= norm;
}

// The 256 values of a code byte, built once (an fp8 decode is a table look-up).
template <int Kind>
const float* decode_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = Code<Kind>::decode(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// A row's codes as fp32 (without its scale) into buf[dim].
template <int Kind>
inline void decode_row(const uint8_t* row, int64_t dim, float* buf) {
  if constexpr (Kind == kInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) buf[i] = static_cast<float>(c[i]);
  } else {
    const float* table = decode_table<Kind>();
    for (int64_t i = 0; i < dim; ++i) buf[i] = table[row[i]];
  }
}

inline float row_scale(const uint8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof s);
  return s;
}

// x[dim] -> codes and scale (kv_quant.quantize_rows, operation for operation); buf: dim
// floats of scratch.
template <int Kind, typename T>
inline void quantize_row(const T* x, int64_t dim, uint8_t* out, float* buf) {
  constexpr float qmax = Code<Kind>::qmax;
  for (int64_t i = 0; i < dim; ++i) buf[i] = static_cast<float>(x[i]);
  if (rotates<Kind>(dim)) hadamard(buf, dim);
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(buf[i]));
  const float scale = amax / qmax;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < dim; ++i)
    out[i] = Code<Kind>::encode(std::clamp(buf[i] * inv, -qmax, qmax));
  std::memcpy(out + dim, &scale, sizeof scale);
}

// The calling thread alone below this many operations (cpu_ops.cpp's rule: waking torch's
// OpenMP threads costs more than it saves there).
inline int64_t grain(int64_t rows, int64_t row_cost) {
  row_cost = std::max<int64_t>(1, row_cost);
  if (rows * row_cost < (int64_t{1} << 22)) return rows + 1;
  return std::max<int64_t>(1, (int64_t{1} << 18) / row_cost);
}

template <int Kind, typename T>
void rope_and_cache_kernel(T* qkv, const int64_t* positions, const float* cos, const float* sin,
                           uint8_t* cache, const int64_t* slots, int64_t tokens, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t cache_tokens) {
  const int64_t half = dim / 2, row = (heads + 2 * kv_heads) * dim, crow = dim + kScaleBytes;
  at::parallel_for(0, tokens, grain(tokens, row * 4), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t t = begin; t < end; ++t) {
      T* base = qkv + t * row;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* v = base + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          v[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
      for (int64_t kv = 0; kv < 2; ++kv) {
        const T* src = base + (heads + kv * kv_heads) * dim;
        for (int64_t h = 0; h < kv_heads; ++h)
          quantize_row<Kind, T>(src + h * dim, dim,
                                cache + ((kv * kv_heads + h) * cache_tokens + slots[t]) * crow,
                                buf.data());
      }
    }
  });
}

// One query per request, keys and values dequantized in the kernel a row at a time (into a
// dim-float buffer shared by the KV head's query heads): score = k_scale * (q . codes),
// out += p * v_scale * codes. No copy of the cache is made. Each pass reads
// kvloop::kPrefetchTokens rows ahead, as the fp32 kernels do (kernels.h: a block of 16
// rows is ~1 KiB here, so a request's scattered blocks break the stream even more often).
template <int Kind, typename T>
void decode_attention_kernel(const T* q, const uint8_t* cache, const int64_t* block_table,
                             const int64_t* seq_lens, T* out, int64_t reqs, int64_t heads,
                             int64_t kv_heads, int64_t dim, int64_t block_size,
                             int64_t cache_tokens, int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads, crow = dim + kScaleBytes;
  int64_t longest = 1;
  for (int64_t r = 0; r < reqs; ++r) longest = std::max(longest, seq_lens[r]);
  const uint8_t* values = cache + kv_heads * cache_tokens * crow;
  const int64_t work = reqs * kv_heads;
  at::parallel_for(0, work, grain(work, longest * dim * group * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), buf(dim), scores;
    std::vector<int64_t> slot;            // the request's cache rows (shared by its KV heads)
    int64_t slot_request = -1;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / kv_heads, kh = w % kv_heads, len = seq_lens[r];
      if (slot_request != r) {
        kvloop::slot_rows(block_table + r * max_blocks, block_size, len, slot);
        slot_request = r;
      }
      const uint8_t* keys = cache + kh * cache_tokens * crow;
      const uint8_t* vals = values + kh * cache_tokens * crow;
      kvloop::prefetch_first_rows(keys, vals, slot.data(), crow, len);
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = static_cast<float>(q[(r * heads + kh * group + g) * dim + i]) * scale;
        if (rotates<Kind>(dim)) hadamard(qf.data() + g * dim, dim);    // q . k = qH . kH
      }
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        kvloop::prefetch_row(keys, slot.data(), crow, t + kvloop::kPrefetchTokens, len);
        const uint8_t* k = keys + slot[t] * crow;
        decode_row<Kind>(k, dim, buf.data());
        const float ks = row_scale(k, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim; ++i) s += qg[i] * buf[i];
          scores[g * len + t] = s * ks;
        }
      }
      for (int64_t g = 0; g < group; ++g) kvloop::softmax_in_place(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        kvloop::prefetch_row(vals, slot.data(), crow, t + kvloop::kPrefetchTokens, len);
        const uint8_t* v = vals + slot[t] * crow;
        decode_row<Kind>(v, dim, buf.data());
        const float vs = row_scale(v, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t] * vs;
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) ag[i] += p * buf[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        if (rotates<Kind>(dim)) hadamard(acc.data() + g * dim, dim);   // (sum p vH) H
        for (int64_t i = 0; i < dim; ++i)
          out[(r * heads + kh * group + g) * dim + i] = static_cast<T>(acc[g * dim + i]);
      }
    }
  });
}

void check_cache(const at::Tensor& cache) {
  TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous(), "cache must be contiguous CPU");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 5 && cache.size(0) == 2,
              "a quantized cache is uint8 [2, kv_heads, blocks, block_size, dim + 4]");
}

// fn<Kind>() for the format id `kind`.
template <typename Fn>
void with_kind(int64_t kind, const Fn& fn) {
  switch (kind) {
    case kInt8: fn(std::integral_constant<int, kInt8>{}); break;
    case kE4M3: fn(std::integral_constant<int, kE4M3>{}); break;
    case kE5M2: fn(std::integral_constant<int, kE5M2>{}); break;
    default: TORCH_CHECK(false, "unknown quantized KV cache kind ", kind);
  }
}

}  // namespace

void kvq_rope_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor cache, const at::Tensor& slots,
                        int64_t heads, int64_t kv_heads, int64_t kind) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.is_contiguous(), "qkv must be contiguous CPU");
  check_cache(cache);
  const int64_t dim = cache.size(-1) - kScaleBytes;
  const int64_t cache_tokens = cache.size(2) * cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(),
                                  "kvq_rope_and_cache", [&] {
    with_kind(kind, [&](auto k) {
      rope_and_cache_kernel<decltype(k)::value, scalar_t>(
          qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
          sin.data_ptr<float>(), cache.data_ptr<uint8_t>(), slots.data_ptr<int64_t>(),
          qkv.size(0), heads, kv_heads, dim, cache_tokens);
    });
  });
}

at::Tensor kvq_decode_attention(const at::Tensor& q_in, const at::Tensor& cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens,
                                double scale, int64_t kind) {
  check_cache(cache);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t reqs = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(dim + kScaleBytes == cache.size(-1), "q's head_dim does not match the cache");
  auto out = at::empty({reqs, heads * dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "kvq_decode_attention", [&] {
    with_kind(kind, [&](auto k) {
      decode_attention_kernel<decltype(k)::value, scalar_t>(
          q.data_ptr<scalar_t>(), cache.data_ptr<uint8_t>(), table.data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), reqs, heads, cache.size(1), dim,
          cache.size(3), cache.size(2) * cache.size(3), table.size(1),
          static_cast<float>(scale));
    });
  });
  return out;
}

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("kvq_rope_and_cache", &kvq_rope_and_cache);
  m.def("kvq_decode_attention", &kvq_decode_attention);
}
