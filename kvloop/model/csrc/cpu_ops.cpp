// kvloop's fused CPU ops: the torch bindings of the drivers (generic.cpp) and `DecodeStack`,
// each op run with the process's kernel variant (dispatch.cpp); see
// kvloop/model/cpu_ops.py for the contract of each op and its pure-torch twin, which tests
// compare against, and kernels.h for how the sources split.
#include <torch/extension.h>

#include "kernels.h"
#include "pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <vector>

using kvloop::active_kernels;

namespace {

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// fn(C{}) with C the element of a KV cache beside activations of T: T itself, or bf16 under
// fp32 activations (--kv-cache-dtype bfloat16); any other pair is refused.
template <typename T, typename Fn>
void with_cache_element(const at::Tensor& cache, const Fn& fn) {
  if (cache.scalar_type() == c10::CppTypeToScalarType<T>::value) return fn(T{});
  if constexpr (std::is_same_v<T, float>) {
    if (cache.scalar_type() == at::kBFloat16) return fn(c10::BFloat16{});
  }
  TORCH_CHECK(false, "a KV cache of ", cache.scalar_type(), " beside activations of ",
              c10::CppTypeToScalarType<T>::value, " (the cache takes the activations' dtype, "
              "or bf16 beside fp32)");
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
    kvloop::add_rms_norm<scalar_t>(x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(),
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
    with_cache_element<scalar_t>(cache, [&](auto element) {
      using C = decltype(element);
      kvloop::rope_and_cache<scalar_t, C>(
          active_kernels(), qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
          sin.data_ptr<float>(), cache.data_ptr<C>(), slots.data_ptr<int64_t>(), qkv.size(0),
          heads, kv_heads, dim, cache_tokens, false);
    });
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
    with_cache_element<scalar_t>(cache, [&](auto element) {
      using C = decltype(element);
      kvloop::decode_attention<scalar_t, C>(
          active_kernels(), q.data_ptr<scalar_t>(), heads * dim, cache.data_ptr<C>(),
          block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
          out.data_ptr<scalar_t>(), reqs, heads, cache.size(1), dim, cache.size(3),
          cache.size(2) * cache.size(3), block_table.size(1), static_cast<float>(scale), false);
    });
  });
  return out;
}

// q [c, heads, dim] (rows may be apart: a view of fused qkv rows), keys at slots [n] of the
// cache (the chunk's own last) -> [c, heads * dim]; window 0: none.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& slots,
                             double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 &&
              q.stride(1) == q.size(2), "q must be CPU [c, heads, dim] with contiguous rows");
  check_cpu_contiguous(cache, "cache");
  check_cpu_contiguous(slots, "slots");
  const int64_t chunk = q.size(0), heads = q.size(1), dim = q.size(2), keys = slots.size(0);
  TORCH_CHECK(cache.dim() == 5 && cache.size(4) == dim && heads % cache.size(1) == 0,
              "prefill_attention: the cache [2, kv_heads, blocks, block_size, dim] disagrees "
              "with q");
  TORCH_CHECK(chunk >= 1 && keys >= chunk, "prefill_attention: fewer keys than queries");
  auto out = at::empty({chunk, heads * dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "prefill_attention", [&] {
    with_cache_element<scalar_t>(cache, [&](auto element) {
      using C = decltype(element);
      kvloop::prefill_attention<scalar_t, C>(
          active_kernels(), q.data_ptr<scalar_t>(), q.stride(0), cache.data_ptr<C>(),
          slots.data_ptr<int64_t>(), keys, chunk, out.data_ptr<scalar_t>(), heads,
          cache.size(1), dim, cache.size(2) * cache.size(3), static_cast<float>(scale),
          window);
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu_contiguous(x, "x");
  const int64_t f = x.size(-1) / 2;
  auto out = at::empty({x.numel() / (2 * f), f}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    kvloop::silu_and_mul<scalar_t>(active_kernels(), x.data_ptr<scalar_t>(),
                                   out.data_ptr<scalar_t>(), x.numel() / (2 * f), f, false);
  });
  return out;
}

// x [M, K] and W's qs and scale agree with n_out columns: 4-bit [N, K / 2] and [N, K / 32],
// 8-bit in column blocks (kernels.h) [N', K] and [N', K / 32], N' = N padded to whole blocks.
template <int Bits>
void check_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  int64_t n_out) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qs, "qs");
  check_cpu_contiguous(scale, "scale");
  const int64_t k_in = x.size(1);
  const int64_t rows = Bits == 8 ? (n_out + kvloop::kQ8Columns - 1) / kvloop::kQ8Columns *
                                       kvloop::kQ8Columns
                                 : n_out;
  TORCH_CHECK(x.dim() == 2 && k_in % 32 == 0 && qs.size(0) == rows &&
              qs.size(1) == k_in * Bits / 8 && scale.size(0) == rows &&
              scale.size(1) == k_in / 32 && n_out > 0 && n_out < (int64_t(1) << 32),
              "quantized matmul: shapes disagree");
}

// The 4-bit W of n_out columns and k_in in column blocks (kernels.h, kQ4Columns): none (an
// empty list), or qs [N', K / 2], scale and offset [N', K / 32], N' = N padded to whole blocks.
std::optional<kvloop::Q4Blocks> q4_blocks(const std::vector<at::Tensor>& blocks, int64_t n_out,
                                          int64_t k_in) {
  if (blocks.empty()) return std::nullopt;
  TORCH_CHECK(blocks.size() == 3, "4-bit column blocks: qs, scale, offset");
  for (const auto& t : blocks) check_cpu_contiguous(t, "4-bit column blocks");
  const int64_t padded = (n_out + kvloop::kQ4Columns - 1) / kvloop::kQ4Columns *
                         kvloop::kQ4Columns;
  TORCH_CHECK(blocks[0].scalar_type() == at::kByte && blocks[1].scalar_type() == at::kFloat &&
              blocks[2].scalar_type() == at::kFloat && blocks[0].numel() == padded * k_in / 2 &&
              blocks[1].numel() == padded * (k_in / 32) &&
              blocks[2].numel() == padded * (k_in / 32),
              "4-bit column blocks: shapes disagree with the weight");
  return kvloop::Q4Blocks{static_cast<const uint8_t*>(blocks[0].data_ptr()),
                          blocks[1].data_ptr<float>(), blocks[2].data_ptr<float>()};
}

// `bf16_x`, `blocks`: quant_matmul's (kernels.h): fp32 x may be rounded to bf16 at 3+ rows;
// W also in column blocks.
template <int Bits>
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                        const float* offset, int64_t n_out, bool bf16_x = false,
                        const kvloop::Q4Blocks* blocks = nullptr) {
  check_matmul<Bits>(x, qs, scale, n_out);
  const int64_t rows = x.size(0), k_in = x.size(1);
  auto y = at::empty({rows, n_out}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_matmul",
                                  [&] {
    kvloop::quant_matmul<Bits, scalar_t>(active_kernels(), x.data_ptr<scalar_t>(),
                                        static_cast<const uint8_t*>(qs.data_ptr()),
                                        scale.data_ptr<float>(), offset,
                                        y.data_ptr<scalar_t>(), rows, n_out, k_in, bf16_x,
                                        blocks);
  });
  return y;
}

// (columns [M] int64, values [M] fp32): each row's argmax of x @ W.T and its value.
template <int Bits>
std::tuple<at::Tensor, at::Tensor> quant_matmul_argmax(const at::Tensor& x, const at::Tensor& qs,
                                                       const at::Tensor& scale,
                                                       const float* offset, int64_t n_out,
                                                       bool bf16_x = false) {
  check_matmul<Bits>(x, qs, scale, n_out);
  const int64_t rows = x.size(0), k_in = x.size(1);
  auto columns = at::empty({rows}, at::kLong);
  auto values = at::empty({rows}, at::kFloat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "quant_matmul_argmax", [&] {
    kvloop::quant_matmul_argmax<Bits, scalar_t>(
        active_kernels(), x.data_ptr<scalar_t>(), static_cast<const uint8_t*>(qs.data_ptr()),
        scale.data_ptr<float>(), offset, rows, n_out, k_in, columns.data_ptr<int64_t>(),
        values.data_ptr<float>(), bf16_x);
  });
  return {columns, values};
}

std::tuple<at::Tensor, at::Tensor> q4_matmul_argmax(const at::Tensor& x, const at::Tensor& qs,
                                                    const at::Tensor& scale,
                                                    const at::Tensor& offset, bool bf16_x) {
  check_cpu_contiguous(offset, "offset");
  return quant_matmul_argmax<4>(x, qs, scale, offset.data_ptr<float>(), qs.size(0), bf16_x);
}

// 8-bit W in column blocks (kernels.h), n_out columns.
std::tuple<at::Tensor, at::Tensor> q8_matmul_argmax(const at::Tensor& x, const at::Tensor& qs,
                                                    const at::Tensor& scale, int64_t n_out) {
  return quant_matmul_argmax<8>(x, qs, scale, nullptr, n_out);
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     const at::Tensor& offset, bool bf16_x, const std::vector<at::Tensor>& blocks) {
  check_cpu_contiguous(offset, "offset");
  TORCH_CHECK(x.dim() == 2, "quantized matmul: x must be 2-D");
  const auto b = q4_blocks(blocks, qs.size(0), x.size(1));
  return quant_matmul<4>(x, qs, scale, offset.data_ptr<float>(), qs.size(0), bf16_x,
                         b ? &*b : nullptr);
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                     int64_t n_out) {
  return quant_matmul<8>(x, qs, scale, nullptr, n_out);
}

// The decoder for a step of decodes (one query token per request), every layer in one call
// on kvloop's pool: the same kernels, in the same order, as the Python layer loop of
// kvloop/model/llama.py with low-bit weights, so the results are identical. Built once from
// the weights (checked then); a step passes only what changes per step.
class DecodeStack {
 public:
  // norms: 2 per layer (input, post-attention); quant: 12 per layer (qs, scale, offset of
  // qkv, o, gate_up, down), or 24 (each weight's three then the same in column blocks:
  // q4_matmul's `blocks`); bf16_x: the 4-bit matmuls' (q4_matmul's), as the layer loop
  // passes it.
  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> quant, int64_t heads,
              int64_t kv_heads, int64_t ffn, double eps, double scale, bool bf16_x)
      : norms_(std::move(norms)), quant_(std::move(quant)), layers_(norms_.size() / 2),
        heads_(heads), kv_heads_(kv_heads), ffn_(ffn), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)), bf16_x_(bf16_x) {
    TORCH_CHECK(layers_ > 0 && norms_.size() == 2 * layers_, "DecodeStack: 2 norms a layer");
    TORCH_CHECK(quant_.size() == 12 * layers_ || quant_.size() == 24 * layers_,
                "DecodeStack: 12 quantized tensors per layer (qs, scale, offset of qkv, o, "
                "gate_up, down), or 24 (each weight's then in column blocks)");
    for (const auto& t : norms_) check_cpu_contiguous(t, "norm");
    const size_t per_weight = quant_.size() / (4 * layers_);
    for (size_t i = 0; i < quant_.size(); i += per_weight) {
      check_cpu_contiguous(quant_[i], "qs");
      check_cpu_contiguous(quant_[i + 1], "scale");
      check_cpu_contiguous(quant_[i + 2], "offset");
      const std::vector<at::Tensor> blocks(quant_.begin() + i + 3,
                                           quant_.begin() + i + per_weight);
      weights_.push_back({static_cast<const uint8_t*>(quant_[i].data_ptr()),
                          quant_[i + 1].data_ptr<float>(), quant_[i + 2].data_ptr<float>(),
                          quant_[i].size(0),
                          q4_blocks(blocks, quant_[i].size(0), quant_[i].size(1) * 2)});
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
    for (const auto& c : caches) {
      check_cpu_contiguous(c, "cache");
      TORCH_CHECK(c.scalar_type() == caches[0].scalar_type(), "DecodeStack: one cache dtype");
    }
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
      const Step<scalar_t> step{active_kernels(), tokens, embedded.size(1), dim,
                                h.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), qkv.data_ptr<scalar_t>(),
                                attn.data_ptr<scalar_t>(), gu.data_ptr<scalar_t>(),
                                act.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                                slots.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                sin.data_ptr<float>(), block_table.data_ptr<int64_t>(),
                                block_table.size(1), seq_lens.data_ptr<int64_t>()};
      with_cache_element<scalar_t>(caches[0], [&](auto element) {
        using C = decltype(element);
        for (size_t l = 0; l < layers_; ++l) layer<scalar_t, C>(step, l, caches[l]);
      });
    });
    return {h, residual};
  }

 private:
  template <typename T>
  struct Step {            // one step's kernels, shapes, buffers and metadata
    const kvloop::Kernels& k;
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
  void q4(const kvloop::Kernels& k, const T* x, size_t w, T* y, int64_t rows,
          int64_t k_in) const {
    const QuantOperand& op = weights_[w];
    kvloop::quant_matmul<4, T>(k, x, op.qs, op.scale, op.offset, y, rows, op.n_out, k_in,
                               bf16_x_, op.blocks ? &*op.blocks : nullptr);
  }

  // One layer; the cache's element C is T, or bf16 beside fp32 T (with_cache_element).
  template <typename T, typename C>
  void layer(const Step<T>& s, size_t l, const at::Tensor& cache) const {
    const int64_t n = s.tokens, qkv_row = (heads_ + 2 * kv_heads_) * s.dim;
    const int64_t block_size = cache.size(3), cache_tokens = cache.size(2) * block_size;
    C* kv = cache.data_ptr<C>();
    const size_t w = 4 * l;
    kvloop::add_rms_norm<T>(s.h, l == 0 ? nullptr : s.residual, norms_[2 * l].data_ptr<T>(),
                            n, s.hidden, eps_, true);
    q4<T>(s.k, s.h, w, s.qkv, n, s.hidden);
    kvloop::rope_and_cache<T, C>(s.k, s.qkv, s.positions, s.cos, s.sin, kv, s.slots, n, heads_,
                                 kv_heads_, s.dim, cache_tokens, true);
    kvloop::decode_attention<T, C>(s.k, s.qkv, qkv_row, kv, s.block_table, s.seq_lens, s.attn,
                                   n, heads_, kv_heads_, s.dim, block_size, cache_tokens,
                                   s.max_blocks, scale_, true);
    q4<T>(s.k, s.attn, w + 1, s.h, n, heads_ * s.dim);
    kvloop::add_rms_norm<T>(s.h, s.residual, norms_[2 * l + 1].data_ptr<T>(), n, s.hidden,
                            eps_, true);
    q4<T>(s.k, s.h, w + 2, s.gu, n, s.hidden);
    kvloop::silu_and_mul<T>(s.k, s.gu, s.act, n, ffn_, true);
    q4<T>(s.k, s.act, w + 3, s.h, n, ffn_);
  }

  struct QuantOperand {
    const uint8_t* qs;
    const float* scale;
    const float* offset;
    int64_t n_out;
    std::optional<kvloop::Q4Blocks> blocks;
  };

  std::vector<at::Tensor> norms_, quant_;   // held: weights_ points into quant_
  size_t layers_;
  int64_t heads_, kv_heads_, ffn_;
  float eps_, scale_;
  bool bf16_x_;
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

std::string cpu_kernels() { return active_kernels().name; }

// (name, features it needs, built here, this CPU runs it) of each variant, best first.
std::vector<std::tuple<std::string, std::string, bool, bool>> cpu_kernel_variants() {
  std::vector<std::tuple<std::string, std::string, bool, bool>> out;
  for (const kvloop::Variant& v : kvloop::variants()) {
    const bool built = v.kernels() != nullptr;
    out.emplace_back(v.name, v.needs, built, built && v.cpu_runs());
  }
  return out;
}

void use_cpu_kernels(const std::string& name) {
  try {
    kvloop::use_variant(name.c_str());
  } catch (const std::exception& e) {
    throw std::invalid_argument(e.what());
  }
}

void register_pool_tests(pybind11::module& m);   // testing.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "x @ W.T for 4-bit group-32 weights (skinny x); bf16_x: "
        "fp32 x may be rounded to bf16 at 3+ rows; blocks: W also in column blocks",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("scale"),
        pybind11::arg("offset"), pybind11::arg("bf16_x") = false,
        pybind11::arg("blocks") = std::vector<at::Tensor>{});
  m.def("q8_matmul", &q8_matmul, "x @ W.T for 8-bit group-32 weights (Q8_0; skinny x) in "
        "column blocks, n_out columns", pybind11::arg("x"), pybind11::arg("qs"),
        pybind11::arg("scale"), pybind11::arg("n_out"));
  m.attr("q8_block_columns") = kvloop::kQ8Columns;      // the 8-bit layout's block (kernels.h)
  m.attr("q4_block_columns") = kvloop::kQ4Columns;      // the 4-bit column blocks' (kernels.h)
  m.def("has_q4_block_kernel", [] { return active_kernels().bf16_block_columns != nullptr; },
        "the active variant runs 4-bit weights in column blocks (q4_matmul's `blocks`)");
  m.def("q4_matmul_argmax", &q4_matmul_argmax,
        "(argmax, max) of each row of x @ W.T, 4-bit W, never writing the row whole",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("scale"), pybind11::arg("offset"),
        pybind11::arg("bf16_x") = false);
  m.def("q8_matmul_argmax", &q8_matmul_argmax,
        "(argmax, max) of each row of x @ W.T, 8-bit W in column blocks, never writing the "
        "row whole", pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("scale"),
        pybind11::arg("n_out"));
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rms_norm(residual) * weight");
  m.def("rope_and_cache", &rope_and_cache, "RoPE on q and k in place, k and v into the cache");
  m.def("decode_attention", &decode_attention, "one-query attention over the paged cache");
  m.def("prefill_attention", &prefill_attention,
        "a prefill chunk's causal attention over the paged cache (flash style)");
  m.def("has_prefill_kernel", [] { return active_kernels().prefill_block != nullptr; },
        "the active variant has a vector kernel for prefill_attention");
  m.attr("attention_prefetch_tokens") = kvloop::kPrefetchTokens;    // (for the tests)
  m.def("bf16_lane_rows", &kvloop::bf16_lane_rows,
        "the rows of a 4-bit matmul of M rows that the bf16 lane kernel takes, from row 0");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "every decoder layer of a step of decodes, "
                                "low-bit, in one call")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          int64_t, double, double, bool>(),
           pybind11::arg("norms"), pybind11::arg("quant"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("ffn"), pybind11::arg("eps"),
           pybind11::arg("scale"), pybind11::arg("bf16_x") = false)
      .def("forward", &DecodeStack::forward);
  m.def("huge_page_buffer", &huge_page_buffer, "uninitialised bytes in 2 MiB pages");
  m.def("set_pool_threads", &set_pool_threads, "threads of kvloop's pool (caller included)");
  m.def("pool_threads", &pool_threads, "threads of kvloop's pool (caller included)");
  m.def("cpu_kernels", &cpu_kernels, "the kernel variant the ops run (dispatch.cpp)");
  m.def("cpu_kernel_variants", &cpu_kernel_variants,
        "(name, needs, built, runs here) of each kernel variant, best first");
  m.def("use_cpu_kernels", &use_cpu_kernels,
        "run the named kernel variant from now on (ValueError where it cannot run)");
  register_pool_tests(m);
}
