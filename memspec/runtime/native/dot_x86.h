/* What the two x86 SIMD paths (dot_avx2.c, dot_avx512.c) share: compiled for AVX2 + FMA, which
 * the AVX-512 path's functions include, so it inlines into both. */
#ifndef MEMSPEC_DOT_X86_H
#define MEMSPEC_DOT_X86_H

#if defined(__x86_64__)
#include <immintrin.h>

#include "dot.h"

/* acc[b] += small block b of a chunk . its activation block, b = 0..7, from isum = the blocks'
 * q.x: dot.c's small_update lane by lane (the zero offset from the activation sums first). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
small_update8(int type, __m256i isum, const int16_t *sum16, const float *dx, __m256 d, __m256 m, float *acc) {
    __m256i xsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)sum16), _mm256_set1_epi16(1));
    if (type == TYPE_Q4_0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(xsum, 3)); /* q.x - zero * xsum */
    if (type == TYPE_Q5_0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(xsum, 4));
    __m256 vdx = _mm256_loadu_ps(dx);
    __m256 lanes = _mm256_loadu_ps(acc);
    lanes = _mm256_fmadd_ps(_mm256_mul_ps(d, vdx), _mm256_cvtepi32_ps(isum), lanes);
    if (type == TYPE_Q4_1) lanes = _mm256_fmadd_ps(_mm256_mul_ps(m, vdx), _mm256_cvtepi32_ps(xsum), lanes);
    _mm256_storeu_ps(acc, lanes);
}

/* The types both x86 paths multiply interleaved (pack.h), through rows8. */
#define X86_PACKED_TYPES \
    (1u << TYPE_Q4_K | 1u << TYPE_Q6_K | 1u << TYPE_Q4_0 | 1u << TYPE_Q4_1 | 1u << TYPE_Q5_0 | 1u << TYPE_Q8_0)

/* The types the AVX-512 path multiplies two interleaved groups at a time, through rows16. */
#define X86_PAIRED_TYPES (1u << TYPE_Q4_K | 1u << TYPE_Q6_K)

/* dot_avx2_x8.c, dot_avx512_x8.c: each path's rows8 (dot_x8.inc); the AVX-512 path's rows16. */
void avx2_rows8(const struct type_info *t, const uint8_t *w8, int k, const struct acts *a, int r0, int nr,
                float (*acc)[8]);
void avx512_rows8(const struct type_info *t, const uint8_t *w8, int k, const struct acts *a, int r0, int nr,
                  float (*acc)[8]);
void avx512_rows16(const struct type_info *t, const uint8_t *w16, int k, const struct acts *a, int r0, int nr,
                   float (*acc)[16]);

#endif
#endif
