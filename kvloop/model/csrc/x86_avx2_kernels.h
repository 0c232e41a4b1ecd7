// The AVX2 + FMA kernels. Not a header of its own: x86_avx2.cpp and x86_avx512.cpp include
// it inside their target region and namespace (isa.h), after <immintrin.h> and kernels.h,
// so each variant has its own copy built for its own target (under AVX-512VL the same code
// gets 32 vector registers, which the grouped attention needs).
//
// The integer matmul kernel (llama.cpp's recipe for Q4 x Q8, with 16-bit activations: as
// fast here, and 256x finer): x quantized per row and group to int16 (dx = max|x| / 32767),
// so a group's dot product is integer, sum(q * xq), 32 products in two `madd` instructions:
//   y[m, n] = sum_g scale[n, g] dx[m, g] sum(q xq) + offset[n, g] dx[m, g] sum(xq).
// Each group's nibbles are unpacked once for all rows of x.

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// exp(x) in vectors: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts,
// Cody and Waite's reduction) and e^r from its Taylor series to r^7 (|r| <= ln2 / 2:
// relative error < 1e-8). x is clamped to [-87, 88] (e^-87 ~ 1.6e-38, the smallest normal
// float; e^88 ~ 1.7e38, near the largest). Its numbers, for each register width (exp8 here,
// exp16 in x86_avx512.cpp).
struct ExpRecipe {
  static constexpr float kLow = -87.f, kHigh = 88.f, kLog2e = 1.44269504f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr int kTerms = 8;   // 1/7! .. 1/0!, Horner's order
  static constexpr float kInvFactorial[kTerms] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24,
                                                  1.f / 6,    0.5f,       1.f,       1.f};
};

// exp(x), 8 at a time (ExpRecipe).
inline __m256 exp8(__m256 x) {
  using R = ExpRecipe;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(R::kLow)), _mm256_set1_ps(R::kHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(R::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(R::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(R::kLn2Lo), r);
  __m256 e = _mm256_set1_ps(R::kInvFactorial[0]);
  for (int i = 1; i < R::kTerms; ++i)
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(R::kInvFactorial[i]));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

// 8 values of a cache row as fp32: fp32 as they are, bf16 widened (exactly: its bits are
// the fp32 value's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::BFloat16>(f[i]);
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
// vectorised (dim a multiple of 64; an fp32 or bf16 cache, fp32 math): `grouped_scores`,
// then `grouped_values` (docs/cpu-performance.md).
//
// The scores q . k of G heads (qf [G, dim], already scaled) into scores [G, stride]
// (stride = len rounded up to 8): 8 keys at a time, each key loaded (and widened, for bf16)
// once for all G heads into 8 x G accumulators.
template <typename T, int G>
inline void grouped_scores(const float* qf, int64_t dim, const T* keys, const int64_t* slot,
                           int64_t len, float* scores, bool read_ahead = true) {
  const int64_t stride = (len + 7) / 8 * 8;
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const T* key[8];
    for (int j = 0; j < 8; ++j) key[j] = keys + slot[std::min(t0 + j, len - 1)] * dim;
    if (read_ahead)
      prefetch_rows(keys, slot, dim, t0 + kPrefetchTokens, t0 + 8 + kPrefetchTokens, len);
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
}

// The softmax of each head's scores (in place) and P V into out (G rows `out_stride`
// apart, in O: the cache's T, or fp32 over a bf16 cache): a vector exp, then 64 dims of each
// head's output in registers, each value loaded once for all G heads.
template <typename T, int G, typename O = T>
inline void grouped_values(int64_t dim, const T* vals, const int64_t* slot, int64_t len,
                           float* scores, O* out, int64_t out_stride, bool read_ahead = true) {
  const int64_t stride = (len + 7) / 8 * 8;
  __m256 inv[G];
  for (int g = 0; g < G; ++g) {
    inv[g] = softmax_unscaled(scores + g * stride, len, stride);
  }
  for (int64_t part = 0; part < dim; part += 64) {
    __m256 a[G][8];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (read_ahead && part == 0) prefetch_row(vals, slot, dim, t + kPrefetchTokens, len);
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

template <typename T, int G, typename O = T>
inline void attend_grouped(const float* qf, int64_t dim, const T* keys, const T* vals,
                           const int64_t* slot, int64_t len, float* scores, O* out,
                           int64_t out_stride) {
  prefetch_first_rows(keys, vals, slot, dim, len);
  grouped_scores<T, G>(qf, dim, keys, slot, len, scores);
  grouped_values<T, G>(dim, vals, slot, len, scores, out, out_stride);
}

// The KV head's `group` query heads one at a time (16 vector registers: 8 accumulators);
// the first head's passes read ahead, the others find the rows in cache.
template <typename T, typename O = T>
inline void attend_heads(const float* qf, int64_t group, int64_t dim, const T* keys,
                         const T* vals, const int64_t* slot, int64_t len, float* scores,
                         O* out, int64_t out_stride) {
  prefetch_first_rows(keys, vals, slot, dim, len);
  for (int64_t g = 0; g < group; ++g) {
    grouped_scores<T, 1>(qf + g * dim, dim, keys, slot, len, scores, g == 0);
    grouped_values<T, 1>(dim, vals, slot, len, scores, out + g * out_stride, out_stride,
                         g == 0);
  }
}

// 8 fp32 values rounded to bf16 as c10::BFloat16(float) does (RoundBf16Fn): the bits plus
// 0x7FFF plus the kept part's lowest bit, shifted down 16 (to nearest, ties to even; inf
// stays inf, the largest finite values round to it), every NaN 0x7FC0; as 8 words.
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // (each lane < 2^16) packus per 128-bit half: [r0-3 r0-3 | r4-7 r4-7]; qwords 0 and 2
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

void round_bf16(const float* x, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16_bits8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = static_cast<c10::BFloat16>(x[i]);
}

// silu(gate) * up, 8 at a time with exp8; the tail as the portable kernel.
void silu_mul_f32(const float* gate, const float* up, float* out, int64_t f) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= f; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < f; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// One row quantized per group of 32 as the portable kernel does it: cvtps rounds to
// nearest even, as nearbyint does in the default rounding mode.
void quantize_row(const float* x, int64_t k_in, int16_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < k_in / 32; ++g) {
    const float* xg = x + g * 32;
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < 32; i += 8)
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i)));
    float tops[8];
    _mm256_storeu_ps(tops, top);
    const float amax = *std::max_element(tops, tops + 8);
    d[g] = amax / kQMax;
    const __m256 inv = _mm256_set1_ps(d[g] > 0.f ? 1.f / d[g] : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 32; i += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i + 8), inv));
      sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
      // packs interleaves the 128-bit halves: a0-3 b0-3 a4-7 b4-7; permute puts them in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32 + i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
    }
    int32_t lanes[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sum);
    int64_t total = 0;
    for (int32_t v : lanes) total += v;
    s[g] = d[g] * static_cast<float>(total);
  }
}

// A 4-bit group's 32 weights as int16 (8-bit weights: q8_columns, in column blocks).
inline void load_group(const uint8_t* group, __m256i& lo, __m256i& hi) {
  // Bytes widened once, to 16 bits: a lane's low nibble is weight i, the rest of it
  // (shifted down: the high byte is zero) weight i + 16. Measured, every 4-bit matmul of
  // a one-row step on one thread: 9.7 -> 8.4 ms against masking and widening each half.
  const __m256i bytes =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));                           // w0..15
  hi = _mm256_srli_epi16(bytes, 4);                                               // w16..31
}

// sum(q * xq) of one group in 8 int32 lanes (w_lo, w_hi: the group's 32 weights as int16).
inline __m256i group_dot(__m256i w_lo, __m256i w_hi, const int16_t* xg) {
  return _mm256_add_epi32(
      _mm256_madd_epi16(w_lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))),
      _mm256_madd_epi16(w_hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))));
}

// One output column n for MB rows of x from r0, a group at a time (the 4-row tiles).
template <int MB>
inline void quant_column(const QuantMatmul& mm, int64_t r0, int64_t n, float* out,
                         int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset + n * groups;
  float tail[MB];
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    tail[m] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i q_lo, q_hi;
    load_group(row + g * 16, q_lo, q_hi);
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const __m256i dot = group_dot(q_lo, q_hi, xq.q.data() + r * mm.k_in + g * 32);
      const float sd = sc[g] * xq.d[r * groups + g];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sd), acc[m]);
      tail[m] += of[g] * xq.s[r * groups + g];
    }
  }
  for (int m = 0; m < MB; ++m) out[m * out_stride] = hsum(acc[m]) + tail[m];
}

// quant_column for 1-2 rows, 8 groups at a time: their 8 integer dot products are reduced
// into one vector (lane j: group j's sum, by three rounds of hadd), converted once and scaled
// by 8 scales at once; the offsets' term is 8 products in one FMA. Measured here, every
// 4-bit matmul of a one-row decode step: 10.6 -> 9.1 ms on one thread, 5.0 -> 4.7 on two.
// Groups past the last multiple of 8 take quant_column's way, one at a time.
template <int MB>
inline void lanes_column(const QuantMatmul& mm, int64_t r0, int64_t n, float* out,
                         int64_t out_stride) {
  const QuantizedRows& xq = *mm.xq;
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset + n * groups;
  constexpr int64_t kGroupBytes = 16;
  __m256 acc[MB], tail[MB];
  float tail_rest[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = tail[m] = _mm256_setzero_ps();
    tail_rest[m] = 0.f;
  }
  const int16_t* xrow[MB];
  for (int m = 0; m < MB; ++m) xrow[m] = xq.q.data() + (r0 + m) * mm.k_in;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256i quad[2][MB];                 // lanes: groups g..g+3 (quad 0) or g+4..g+7 (1)
    for (int half = 0; half < 2; ++half) {
      __m256i pair[2][MB];
      for (int p = 0; p < 2; ++p) {
        const int64_t j = g + half * 4 + p * 2;
        __m256i lo0, hi0, lo1, hi1;
        load_group(row + j * kGroupBytes, lo0, hi0);
        load_group(row + (j + 1) * kGroupBytes, lo1, hi1);
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
      tail[m] = _mm256_fmadd_ps(_mm256_loadu_ps(of + g),
                                _mm256_loadu_ps(xq.s.data() + r * groups + g), tail[m]);
    }
  }
  for (; g < groups; ++g) {
    __m256i lo, hi;
    load_group(row + g * kGroupBytes, lo, hi);
    for (int m = 0; m < MB; ++m) {
      const int64_t r = r0 + m;
      const __m256 sd = _mm256_set1_ps(sc[g] * xq.d[r * groups + g]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot(lo, hi, xrow[m] + g * 32)), sd,
                               acc[m]);
      tail_rest[m] += of[g] * xq.s[r * groups + g];
    }
  }
  for (int m = 0; m < MB; ++m)
    out[m * out_stride] = hsum(_mm256_add_ps(acc[m], tail[m])) + tail_rest[m];
}

template <int MB>
void int_tile(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
              int64_t out_stride) {
  for (int64_t n = begin; n < end; ++n) {
    if constexpr (MB <= 2) lanes_column<MB>(mm, r0, n, out + (n - begin), out_stride);
    else quant_column<MB>(mm, r0, n, out + (n - begin), out_stride);
  }
}

// The integer kernel (4-bit W): 1-2 rows lanes_column, 3-4 rows quant_column.
void int_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                 float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return int_tile<1>(mm, r0, begin, end, out, out_stride);
    case 2: return int_tile<2>(mm, r0, begin, end, out, out_stride);
    case 3: return int_tile<3>(mm, r0, begin, end, out, out_stride);
    default: return int_tile<4>(mm, r0, begin, end, out, out_stride);
  }
}

// The fp32 kernel: each group's 32 weights dequantized to fp32 in registers once (q * scale
// + offset, as `Int4Weight.dequantize`) and shared by up to 4 rows, whose fp32 values
// multiply them with FMAs (no rounding of x at all); at 1-2 rows the integer kernel is as
// fast or faster (kFpRows).
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
template <int MB>
inline void dequant_column(const QuantMatmul& mm, int64_t r0, int64_t n, float* out,
                           int64_t out_stride) {
  const int64_t groups = mm.groups;
  const uint8_t* row = mm.qs + n * mm.row_bytes;
  const float* sc = mm.scale + n * groups;
  const float* of = mm.offset + n * groups;
  __m256 a0[MB], a1[MB];
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 w[4];
    dequant_q4_group(row + g * 16, sc[g], of[g], w);
    for (int m = 0; m < MB; ++m) {
      const float* x = mm.xf + (r0 + m) * mm.k_in + g * 32;
      a0[m] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a0[m]);
      a1[m] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a1[m]);
      a0[m] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a0[m]);
      a1[m] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m * out_stride] = hsum(_mm256_add_ps(a0[m], a1[m]));
}

template <int MB>
void fp_tile(const QuantMatmul& mm, int64_t r0, int64_t begin, int64_t end, float* out,
             int64_t out_stride) {
  for (int64_t n = begin; n < end; ++n)
    dequant_column<MB>(mm, r0, n, out + (n - begin), out_stride);
}

void fp_columns(const QuantMatmul& mm, int64_t r0, int rows, int64_t begin, int64_t end,
                float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return fp_tile<1>(mm, r0, begin, end, out, out_stride);
    case 2: return fp_tile<2>(mm, r0, begin, end, out, out_stride);
    case 3: return fp_tile<3>(mm, r0, begin, end, out, out_stride);
    default: return fp_tile<4>(mm, r0, begin, end, out, out_stride);
  }
}
