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

// 16 fp32 values rounded to bf16 as `bf16_bits8` rounds 8 (x86_avx2_kernels.h), as 16 words.
inline __m256i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

// RoundBf16Fn, 16 at a time; the tail in masked lanes.
inline void round_bf16_wide(const float* x, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_bits16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 mask = first_lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, mask, bf16_bits16(_mm512_maskz_loadu_ps(mask, x + i)));
  }
}
