// The portable prefill block kernel (PrefillBlockFn, kernels.h) in plain loops the compiler
// vectorises. Not a header of its own, as x86_avx2_kernels.h: generic.cpp includes it for
// the baseline and x86_avx2.cpp inside its target region and namespace (isa.h), so each
// has its own copy built for its own target. Each row on its own: its scores over the
// keys it sees, the online-softmax update (running max, sum, output rescaled by e^(m_old -
// m_new)), then the values.
inline void portable_prefill_block(const float* qs, int64_t rows, int64_t dim, const float* kt,
                                   const float* v, int64_t n, const int32_t* lo,
                                   const int32_t* hi, float* m, float* l, float* o,
                                   float* s) {
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
