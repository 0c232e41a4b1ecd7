// The prefill-attention block kernel (PrefillBlockFn, kernels.h) for any fp32 vector width.
// Not a header of its own, as x86_avx2_kernels.h: x86_avx2.cpp and x86_avx512.cpp include
// it inside their target region and namespace (isa.h) and instantiate `prefill_rows_block`
// with their vector's lane facts V (`F32x8`, `F32x16`):
//   Reg, Mask                 a register of V::kLanes floats, a set of its lanes
//   kLanes                    floats per register
//   kRows                     rows of the tile per pass (scores, softmax, values)
//   kScoreVecs                key vectors per pass of the scores (kRows x kScoreVecs sums)
//   kValueVecs                output vectors per pass of P V (kRows x kValueVecs sums)
//   zero, set1, load, store, add, sub, mul, fmadd, exp
//   lanes(first, last, c0)    the lanes of keys [first, last) among those from key c0
//   max_in(top, m, x)         top, with the lanes of m raised to x's where larger
//   keep(m, x)                x in the lanes of m, 0 elsewhere
//   reduce_max, reduce_add    over the lanes
// The register budget (16 registers on AVX2, 32 on AVX-512) picks the three counts; the
// code is the same.

// The scores of R rows (qs, rows `dim` apart) against C vectors of keys from kt (rows
// kPrefillKeys apart) into s (rows kPrefillKeys apart): R x C accumulators, each key vector
// loaded once for the R rows.
template <class V, int R, int C>
inline void block_scores(const float* qs, int64_t dim, const float* kt, float* s) {
  typename V::Reg a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = V::zero();
  for (int64_t d = 0; d < dim; ++d) {
    typename V::Reg k[C];
    for (int c = 0; c < C; ++c) k[c] = V::load(kt + d * kPrefillKeys + V::kLanes * c);
    for (int r = 0; r < R; ++r) {
      const typename V::Reg q = V::set1(qs[r * dim + d]);
      for (int c = 0; c < C; ++c) a[r][c] = V::fmadd(q, k[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) V::store(s + r * kPrefillKeys + V::kLanes * c, a[r][c]);
}

// block_scores over `vecs` (1 to C) key vectors.
template <class V, int R, int C>
inline void block_scores_n(int64_t vecs, const float* qs, int64_t dim, const float* kt,
                           float* s) {
  if constexpr (C > 1)
    if (vecs < C) return block_scores_n<V, R, C - 1>(vecs, qs, dim, kt, s);
  block_scores<V, R, C>(qs, dim, kt, s);
}

// The scores of the key vectors up to the rows' last visible key, kScoreVecs at a time.
template <class V, int R>
inline void block_scores_upto(const float* qs, int64_t dim, const float* kt, int64_t last,
                              float* s) {
  constexpr int64_t C = V::kScoreVecs;
  const int64_t vecs = (last + V::kLanes - 1) / V::kLanes;
  for (int64_t c = 0; c < vecs; c += C)
    block_scores_n<V, R, C>(std::min(C, vecs - c), qs, dim, kt + V::kLanes * c,
                            s + V::kLanes * c);
}

// P V for R rows: o [R, dim] += p [R, keys first..last) v, kValueVecs vectors of dims at a
// time in R x kValueVecs accumulators, each value vector loaded once for the R rows.
template <class V, int R>
inline void block_values(const float* p, int64_t dim, const float* v, int64_t first,
                         int64_t last, float* o) {
  constexpr int C = V::kValueVecs;
  for (int64_t part = 0; part < dim; part += C * V::kLanes) {
    typename V::Reg a[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = V::load(o + r * dim + part + V::kLanes * c);
    for (int64_t j = first; j < last; ++j) {
      typename V::Reg vj[C];
      for (int c = 0; c < C; ++c) vj[c] = V::load(v + j * dim + part + V::kLanes * c);
      for (int r = 0; r < R; ++r) {
        const typename V::Reg pr = V::set1(p[r * kPrefillKeys + j]);
        for (int c = 0; c < C; ++c) a[r][c] = V::fmadd(pr, vj[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) V::store(o + r * dim + part + V::kLanes * c, a[r][c]);
  }
}

// One row's online-softmax update: its scores s [kPrefillKeys] over keys [first, last)
// become e^(s - m_new) (0 elsewhere up to `last`), its sum and output rescaled by e^(m_old
// - m_new); a row that sees none of the block's keys gets zeros up to `upto`.
template <class V>
inline void block_softmax_row(float* s, int64_t first, int64_t last, int64_t upto,
                              int64_t dim, float* m, float* l, float* o) {
  if (first >= last) {
    for (int64_t c = 0; c < upto; c += V::kLanes) V::store(s + c, V::zero());
    return;
  }
  typename V::Reg top = V::set1(-INFINITY);
  for (int64_t c = first / V::kLanes * V::kLanes; c < last; c += V::kLanes)
    top = V::max_in(top, V::lanes(first, last, c), V::load(s + c));
  const float m_new = std::max(*m, V::reduce_max(top));
  const float alpha = m_new == *m ? 1.f : std::exp(*m - m_new);   // 0 before any key
  const typename V::Reg shift = V::set1(m_new);
  typename V::Reg sum = V::zero();
  for (int64_t c = 0; c < upto; c += V::kLanes) {
    const typename V::Reg e =
        V::keep(V::lanes(first, last, c), V::exp(V::sub(V::load(s + c), shift)));
    V::store(s + c, e);
    sum = V::add(sum, e);
  }
  *l = *l * alpha + V::reduce_add(sum);
  *m = m_new;
  if (alpha != 1.f) {
    const typename V::Reg factor = V::set1(alpha);
    for (int64_t d = 0; d < dim; d += V::kLanes) V::store(o + d, V::mul(V::load(o + d), factor));
  }
}

// R rows of the tile from r (R 1 to kRows): scores, softmax, values.
template <class V, int R>
inline void block_rows(const float* qs, int64_t dim, const float* kt, const float* v,
                       const int32_t* lo, const int32_t* hi, float* m, float* l, float* o,
                       float* s) {
  int64_t first = kPrefillKeys, last = 0;
  for (int r = 0; r < R; ++r)
    if (lo[r] < hi[r]) {
      first = std::min<int64_t>(first, lo[r]);
      last = std::max<int64_t>(last, hi[r]);
    }
  if (first >= last) return;                       // no row sees a key of the block
  block_scores_upto<V, R>(qs, dim, kt, last, s);
  const int64_t upto = (last + V::kLanes - 1) / V::kLanes * V::kLanes;
  for (int r = 0; r < R; ++r)
    block_softmax_row<V>(s + r * kPrefillKeys, lo[r], hi[r], upto, dim, m + r, l + r,
                         o + r * dim);
  block_values<V, R>(s, dim, v, first, last, o);
}

// block_rows for the last `rows` (1 to R) rows.
template <class V, int R>
inline void block_rows_n(int64_t rows, const float* qs, int64_t dim, const float* kt,
                         const float* v, const int32_t* lo, const int32_t* hi, float* m,
                         float* l, float* o, float* s) {
  if constexpr (R > 1)
    if (rows < R) return block_rows_n<V, R - 1>(rows, qs, dim, kt, v, lo, hi, m, l, o, s);
  block_rows<V, R>(qs, dim, kt, v, lo, hi, m, l, o, s);
}

// The head_dims the vector kernel takes: whole passes of P V (the others: generic).
template <class V>
constexpr bool prefill_dim_fits(int64_t dim) {
  return dim % (V::kValueVecs * V::kLanes) == 0;
}

// PrefillBlockFn: rows kRows at a time, the last few together; head_dims that do not fit
// as generic.
template <class V>
void prefill_rows_block(const float* qs, int64_t rows, int64_t dim, const float* kt,
                        const float* v, int64_t n, const int32_t* lo, const int32_t* hi,
                        float* m, float* l, float* o, float* s) {
  if (!prefill_dim_fits<V>(dim))
    return generic_prefill_block(qs, rows, dim, kt, v, n, lo, hi, m, l, o, s);
  for (int64_t r = 0; r < rows; r += V::kRows)
    block_rows_n<V, V::kRows>(std::min<int64_t>(V::kRows, rows - r), qs + r * dim, dim, kt, v,
                              lo + r, hi + r, m + r, l + r, o + r * dim,
                              s + r * kPrefillKeys);
}
