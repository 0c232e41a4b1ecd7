// Lane helpers of the AVX-512 matmul kernels. Not a header of its own, as
// x86_avx2_kernels.h: x86_avx512.cpp and x86_avx512_bf16.cpp include it inside their target
// region and namespace (isa.h), after <immintrin.h>.

// The first n of 16 lanes (all 16 from n = 16 on).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// The permute that gives a pair of 4-bit groups (j, j + 1), whose products fill lanes 0-7
// and 8-15 of a register, their scales from a register of 16 groups' scales.
inline __m512i pair_pick(int64_t j) {
  return _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                          _mm512_set1_epi32(static_cast<int>(j)));
}
