/* The AVX-512 path's kernels for the interleaved types (pack.h): dot_avx2_x8.c's, with each
 * sub-block's products formed by vpdpbusd on 256-bit vectors (AVX-512 VL + VNNI) instead of
 * maddubs, add and madd.
 *
 * vpdpbusd adds the 4 products of each int32 lane (4 weights of one row against 4 activation
 * bytes) straight into int32, so a sub-block of 32 weights is 8 instructions and one multiply by
 * the rows' scales, where AVX2 needs 8 maddubs, 7 adds and a madd: the integer sums are the same,
 * the float updates are the same code, so the bits are the scalar path's.  On a Zen 4 EPYC (2
 * threads) the row layout of dot_avx512.c took 37 ms for a one-row pass of the 1.5B and 90 ms for
 * four rows; the interleaved AVX2 kernels 31 and 62 (docs/results.md has this path's figures). */
#if defined(__x86_64__)

#include <immintrin.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"
#include "pack.h"

#define X8 __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")))
#define X8_NAME(n) avx512_##n
#define X8_VNNI 1
#include "dot_x8.inc"

/* ---- Q4_K and Q6_K, two groups at once: 16 outputs in the lanes of one 512-bit vector ----
 *
 * Why: with two rows or more, the 256-bit kernels above run about 6 instructions for each vpdpbusd
 * (the unpacking, the addresses, the scales and the prefetches around it), and the core issues
 * them no faster than its dot products: the 1.5B's Q6_K matrices reached a third of the VNNI
 * peak at 4 rows.  Here groups g and g + 1 of the same layout (contiguous: the second's column c
 * is the first's plus the group's bytes) share each instruction, lanes 0..7 the first group's
 * outputs and 8..15 the second's: half the instructions per product.  A Zen 4 runs a 512-bit
 * vpdpbusd at half the rate of a 256-bit one, so the products cost the same and only the
 * instructions around them are saved; where AVX-512 is full width (Intel) the products gain too.
 *
 * Exactness: each lane is one output; its integer sums are the 256-bit kernels' (exact, in any
 * order) and its float updates the same operations in the same order (k_update, lane by lane), so
 * the outputs are the same bits. */

#define X16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define X16_INLINE inline __attribute__((always_inline))
#define X16_ROWS 8 /* activation rows per pair of block columns unpacked */

/* acc + vpdpbusd(q, the 4 bytes at p in every lane), the broadcast embedded ({1to16}). */
#define DPBUSD16_AT(acc, q, p) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t *)(p)))

static X16_INLINE void x16_prefetch(const void *p0, const void *p1, size_t len) { /* L1 and, X8_L2_AHEAD on, L2 */
    avx512_prefetch_l1(p0, len);
    avx512_prefetch_l1(p1, len);
    avx512_prefetch_l2((const char *)p0 + X8_L2_AHEAD, len);
    avx512_prefetch_l2((const char *)p1 + X8_L2_AHEAD, len);
}

X16 static X16_INLINE __m512i x16_splat32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 32 bytes at p0 (lanes 0..7's) then 32 at p1 (lanes 8..15's). */
X16 static X16_INLINE __m512i x16_two256(const void *p0, const void *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* n bytes (8 or 16) at p0 then n at p1, in one 128- or 256-bit vector. */
X16 static X16_INLINE __m128i x16_two64(const void *p0, const void *p1) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p0), _mm_loadl_epi64((const __m128i *)p1));
}
X16 static X16_INLINE __m256i x16_two128(const void *p0, const void *p1) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                   _mm_loadu_si128((const __m128i *)p1), 1);
}

/* ia + (lane o) sc[o] * (q . x) over n vectors q[p] (4 weights of each output) against x[0 .. 4n-1]:
 * the 256-bit sub()'s sums, 16 outputs at a time. */
X16 static X16_INLINE __m512i x16_sub(__m512i ia, const __m512i *q, const int n, const int8_t *x, __m512i sc) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < n; p += 2) {
        DPBUSD16_AT(s0, q[p], x + 4 * p);
        DPBUSD16_AT(s1, q[p + 1], x + 4 * p + 4);
    }
    return _mm512_add_epi32(ia, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
}

/* k_update lane by lane on 16 outputs: acc += d dx ia - (dmin dx) ib. */
X16 static X16_INLINE void x16_update(float *acc, __m512 d, __m512 dmin, float dx1, __m512i ia, __m512i ib) {
    __m512 dx = _mm512_set1_ps(dx1);
    __m512 nm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, dx)),
                                                     _mm512_set1_epi32((int)0x80000000u)));
    __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(ia), _mm512_loadu_ps(acc));
    _mm512_storeu_ps(acc, _mm512_fmadd_ps(nm, _mm512_cvtepi32_ps(ib), s));
}

/* acc[i][o] += output o of groups w0 (o < 8) and w1 (o - 8) . activation row r + i, i < G: q4k above. */
X16 static X16_INLINE void avx512_q4k16(const block_q4_Kx8 *w0, const block_q4_Kx8 *w1, int k, const struct acts *a,
                                    int r, const int G, float (*acc)[16]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    size_t stride = a->kpad;
    for (int c = 0; c * QK_K < k; c++) {
        const block_q4_Kx8 *b0 = &w0[c], *b1 = &w1[c];
        size_t at = (size_t)r * stride + (size_t)c * QK_K;
        __m512i ia[X16_ROWS], ib[X16_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) ia[i] = ib[i] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            x16_prefetch((const char *)(b0 + 1) + j * sizeof(*b0) / 8, (const char *)(b1 + 1) + j * sizeof(*b1) / 8,
                         sizeof(*b0) / 8);
            __m512i q[8];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m512i raw = x16_two256(b0->qs[j] + 32 * v, b1->qs[j] + 32 * v);
                q[v] = _mm512_and_si512(raw, m4);
                q[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            }
            __m512i sc = _mm512_cvtepu8_epi32(x16_two64(b0->sc[j], b1->sc[j]));
#pragma GCC unroll 8
            for (int i = 0; i < G; i++) ia[i] = x16_sub(ia[i], q, 8, a->q + at + i * stride + 32 * j, sc);
        }
#pragma GCC unroll 1
        for (int f = 0; f < 4; f++) {
            __m512i mn = _mm512_cvtepu8_epi16(x16_two128(b0->mn[f], b1->mn[f]));
#pragma GCC unroll 8
            for (int i = 0; i < G; i++)
                ib[i] = _mm512_dpwssd_epi32(ib[i], mn, x16_splat32(a->sum32 + (at + i * stride) / 32 + 2 * f));
        }
        __m512 d = _mm512_cvtph_ps(x16_two128(b0->d, b1->d)), dmin = _mm512_cvtph_ps(x16_two128(b0->dmin, b1->dmin));
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) x16_update(acc[i], d, dmin, a->d[(at + i * stride) / QK_K], ia[i], ib[i]);
    }
}

/* The same for Q6_K: q6k above, 16 outputs at a time. */
X16 static X16_INLINE void avx512_q6k16(const block_q6_Kx8 *w0, const block_q6_Kx8 *w1, int k, const struct acts *a,
                                    int r, const int G, float (*acc)[16]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    size_t stride = a->kpad;
    for (int c = 0; c * QK_K < k; c++) {
        const block_q6_Kx8 *b0 = &w0[c], *b1 = &w1[c];
        size_t at = (size_t)r * stride + (size_t)c * QK_K;
        __m512i ia[X16_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) ia[i] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int f = 0; f < 8; f++) { /* pair f: sub-blocks 2f (low nibbles) and 2f + 1 (high) */
            x16_prefetch((const char *)(b0 + 1) + f * sizeof(*b0) / 8, (const char *)(b1 + 1) + f * sizeof(*b1) / 8,
                         sizeof(*b0) / 8);
            __m512i raw[4];
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) raw[p] = x16_two256(b0->pair[f].ql + 32 * p, b1->pair[f].ql + 32 * p);
#pragma GCC unroll 2
            for (int hi = 0; hi < 2; hi++) {
                int j = 2 * f + hi;
                __m512i h = x16_two256(b0->pair[f].qh + 32 * hi, b1->pair[f].qh + 32 * hi), q[4];
#pragma GCC unroll 4
                for (int p = 0; p < 4; p++) { /* top bits: bits 2p, 2p+1 of h, to bits 4, 5 */
                    __m512i lo = _mm512_and_si512(hi ? _mm512_srli_epi16(raw[p], 4) : raw[p], m4);
                    __m512i top = p == 0 ? _mm512_slli_epi16(h, 4) : p == 1 ? _mm512_slli_epi16(h, 2) : p == 2 ? h : _mm512_srli_epi16(h, 2);
                    q[p] = _mm512_or_si512(lo, _mm512_and_si512(top, m2));
                }
                __m512i sc = _mm512_cvtepi8_epi32(x16_two64(b0->sc[j], b1->sc[j]));
#pragma GCC unroll 8
                for (int i = 0; i < G; i++) ia[i] = x16_sub(ia[i], q, 4, a->q + at + i * stride + 16 * j, sc);
            }
        }
#pragma GCC unroll 1
        for (int f = 0; f < 8; f++) { /* the zero offsets: -32 sc of a pair of sub-blocks against the activation's two sums of 16 */
            __m512i zm = _mm512_inserti64x4(_mm512_castsi256_si512(avx512_zoff_pairs(b0->sc[2 * f])),
                                            avx512_zoff_pairs(b1->sc[2 * f]), 1);
            zm = _mm512_sub_epi16(_mm512_setzero_si512(), zm); /* |.| <= 4096 */
#pragma GCC unroll 8
            for (int i = 0; i < G; i++)
                ia[i] = _mm512_dpwssd_epi32(ia[i], zm, x16_splat32(a->sum16 + (at + i * stride) / 16 + 2 * f));
        }
        __m512 d = _mm512_cvtph_ps(x16_two128(b0->d, b1->d));
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) /* k_update with dmin = 0 and ib = 0 (its -0 addition too) */
            x16_update(acc[i], d, _mm512_setzero_ps(), a->d[(at + i * stride) / QK_K], ia[i], _mm512_setzero_si512());
    }
}

#define X16_GROUPS(kernel, type, w, gb)                                                                      \
    for (int r = 0; r < nr;) {                                                                               \
        int g = nr - r < X16_ROWS ? nr - r : X16_ROWS;                                                       \
        const type *w0 = (const type *)(w), *w1 = (const type *)((w) + (gb));                                \
        switch (g) {                                                                                         \
        case 1: kernel(w0, w1, k, a, r0 + r, 1, acc + r); break;                                             \
        case 2: kernel(w0, w1, k, a, r0 + r, 2, acc + r); break;                                             \
        case 3: kernel(w0, w1, k, a, r0 + r, 3, acc + r); break;                                             \
        case 4: kernel(w0, w1, k, a, r0 + r, 4, acc + r); break;                                             \
        case 5: kernel(w0, w1, k, a, r0 + r, 5, acc + r); break;                                             \
        case 6: kernel(w0, w1, k, a, r0 + r, 6, acc + r); break;                                             \
        case 7: kernel(w0, w1, k, a, r0 + r, 7, acc + r); break;                                             \
        default: kernel(w0, w1, k, a, r0 + r, 8, acc + r); break;                                            \
        }                                                                                                    \
        r += g;                                                                                              \
    }

X16 void avx512_rows16(const struct type_info *t, const uint8_t *w16, int k, const struct acts *a, int r0, int nr,
                       float (*acc)[16]) {
    size_t gb = pack_bytes(t, PACK_ROWS, k); /* one group's bytes: the second group starts there */
    switch (t->id) { /* the types X86_PAIRED_TYPES lists */
    case TYPE_Q4_K: X16_GROUPS(avx512_q4k16, block_q4_Kx8, w16, gb) break;
    case TYPE_Q6_K: X16_GROUPS(avx512_q6k16, block_q6_Kx8, w16, gb) break;
    }
}

#endif
