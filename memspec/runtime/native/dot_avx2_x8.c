/* The AVX2 path's kernels for interleaved Q4_K and Q6_K (pack.h): 8 outputs per vector, no reductions.
 *
 * For one sub-block j of 32 weights, a vector of the packed block holds 4 consecutive weights of
 * each of the 8 rows; _mm256_maddubs_epi16 against the activation row's 4 bytes broadcast gives
 * each row's partial dot product in its own lanes.  Summed over the sub-block's 8 vectors in int16
 * (|q.x| <= 15*127 per product: at most 16 products, 30480, fit) and multiplied by the rows'
 * scales with one _mm256_madd_epi16, they leave row o's sub-block sum in int32 lane o; the mins
 * go two sub-blocks to a madd, row o's pair of mins against the activation's two sums of 32
 * (each the sum of dot.c's two sums of 16: the same integers).  So lane o holds dot.c's ia and ib for
 * row o, exactly, and the float update is k_update's, lane by lane.  Q6_K likewise (q6k_x8).
 *
 * The packed vectors of a sub-block are unpacked once and applied to up to 8 activation rows.
 * Eight rows' accumulators do not all fit the 16 vector registers beside the unpacked weights;
 * the ones spilled cost loads and stores, while the kernel is bound by the vector ALU ports,
 * which the unpacking shared by 8 rows instead of 4 relieves (Q6_K: 15% less per row in cache;
 * a pass of 5-8 rows reads each weight block once instead of twice). */
#if defined(__x86_64__)

#include <immintrin.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"
#include "pack.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE inline __attribute__((always_inline))
#define X8_ROWS 8 /* activation rows per packed block unpacked */

/* 8 bytes p[0..7] as int16 pairs: lanes 2o and 2o+1 both p[o] (a madd multiplier per row o). */
AVX2 static INLINE __m256i pairs16(const uint8_t *p) {
    __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}

/* 4 bytes (or two int16) at p in every 32-bit lane. */
AVX2 static INLINE __m256i splat32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc[i][o] += packed rows o . activation row r + i, i < G, over the k / 256 block columns. */
AVX2 static INLINE void q4k_x8(const block_q4_Kx8 *w, int k, const struct acts *a, int r, const int G,
                               float (*acc)[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    size_t stride = a->kpad;
    for (int c = 0; c * QK_K < k; c++) {
        const block_q4_Kx8 *b = &w[c];
        size_t at = (size_t)r * stride + (size_t)c * QK_K;
        __m256i ia[X8_ROWS], ib[X8_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) ia[i] = ib[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            __m256i q[8]; /* q[p]: weights 32j + 4p .. +3 of each row */
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(b->qs[j] + 32 * v));
                q[v] = _mm256_and_si256(raw, m4);
                q[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            __m256i sc = pairs16(b->sc[j]);
#pragma GCC unroll 8
            for (int i = 0; i < G; i++) {
                const int8_t *x = a->q + at + i * stride + 32 * j;
                __m256i s = _mm256_maddubs_epi16(q[0], splat32(x));
#pragma GCC unroll 8
                for (int p = 1; p < 8; p++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[p], splat32(x + 4 * p)));
                ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(s, sc));
            }
        }
#pragma GCC unroll 1
        for (int f = 0; f < 4; f++) { /* ib = sum over sub-blocks of min * the activation's sum of 32, two at a time */
            __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b->mn[f]));
#pragma GCC unroll 8
            for (int i = 0; i < G; i++)
                ib[i] = _mm256_add_epi32(ib[i], _mm256_madd_epi16(mn, splat32(a->sum32 + (at + i * stride) / 32 + 2 * f)));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->dmin));
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) { /* k_update, lane by lane */
            __m256 dx = _mm256_set1_ps(a->d[(at + i * stride) / QK_K]);
            __m256 nm = _mm256_xor_ps(_mm256_mul_ps(dmin, dx), _mm256_set1_ps(-0.0f));
            __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(ia[i]), _mm256_loadu_ps(acc[i]));
            _mm256_storeu_ps(acc[i], _mm256_fmadd_ps(nm, _mm256_cvtepi32_ps(ib[i]), s));
        }
    }
}

/* 16 bytes: sc[2f][0..7] then sc[2f+1][0..7] (int8) -> int16 lanes 2o, 2o+1 = 32 * sc[2f][o], 32 * sc[2f+1][o]:
 * the zero offsets of a pair of Q6_K sub-blocks against the activation's two sums of 16. */
AVX2 static INLINE __m256i zoff_pairs(const int8_t *sc) {
    __m128i a = _mm_loadl_epi64((const __m128i *)sc), b = _mm_loadl_epi64((const __m128i *)(sc + 8));
    return _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), 5);
}

/* acc[i][o] += packed Q6_K rows o . activation row r + i, i < G.  Per 16-weight sub-block, the
 * 4 vectors of 6-bit q (4 weights of each row) are rebuilt from their nibbles and top bits once;
 * per row, two maddubs products (|q.x| <= 2*63*127 each, their sum fits int16) go through one madd
 * by the sub-block's scales: ia = sum sc.(q.x) - 32 sc.sum16, ib = 0, as dot.c's k_row. */
AVX2 static INLINE void q6k_x8(const block_q6_Kx8 *w, int k, const struct acts *a, int r, const int G,
                               float (*acc)[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    size_t stride = a->kpad;
    for (int c = 0; c * QK_K < k; c++) {
        const block_q6_Kx8 *b = &w[c];
        size_t at = (size_t)r * stride + (size_t)c * QK_K;
        __m256i ia[X8_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int j = 0; j < 16; j++) { /* sub-block j: the low (j even) or high nibbles of pair f's vectors */
            int f = j / 2, hi = j % 2;
            __m256i q[4]; /* q[p]: weights 16j + 4p .. +3 of each row */
            __m256i h = _mm256_loadu_si256((const __m256i *)(b->pair[f].qh + 32 * hi));
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) { /* top bits: bits 2p, 2p+1 of h, to bits 4, 5 */
                __m256i raw = _mm256_loadu_si256((const __m256i *)(b->pair[f].ql + 32 * p));
                __m256i lo = _mm256_and_si256(hi ? _mm256_srli_epi16(raw, 4) : raw, m4);
                __m256i top = p == 0 ? _mm256_slli_epi16(h, 4) : p == 1 ? _mm256_slli_epi16(h, 2) : p == 2 ? h : _mm256_srli_epi16(h, 2);
                q[p] = _mm256_or_si256(lo, _mm256_and_si256(top, m2));
            }
            __m128i s8 = _mm_loadl_epi64((const __m128i *)b->sc[j]);
            __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8)); /* pairs16, signed */
#pragma GCC unroll 8
            for (int i = 0; i < G; i++) {
                const int8_t *x = a->q + at + i * stride + 16 * j;
                __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], splat32(x)), _mm256_maddubs_epi16(q[1], splat32(x + 4)));
                __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], splat32(x + 8)), _mm256_maddubs_epi16(q[3], splat32(x + 12)));
                ia[i] = _mm256_add_epi32(ia[i], _mm256_add_epi32(_mm256_madd_epi16(s0, sc), _mm256_madd_epi16(s1, sc)));
            }
        }
#pragma GCC unroll 1
        for (int f = 0; f < 8; f++) { /* the zero offsets, a pair of sub-blocks at a time */
            __m256i zm = zoff_pairs(b->sc[2 * f]);
#pragma GCC unroll 8
            for (int i = 0; i < G; i++)
                ia[i] = _mm256_sub_epi32(ia[i], _mm256_madd_epi16(zm, splat32(a->sum16 + (at + i * stride) / 16 + 2 * f)));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) { /* k_update with dmin = 0 and ib = 0, lane by lane (its -0 addition too) */
            __m256 dx = _mm256_set1_ps(a->d[(at + i * stride) / QK_K]);
            __m256 nm = _mm256_xor_ps(_mm256_mul_ps(_mm256_setzero_ps(), dx), _mm256_set1_ps(-0.0f));
            __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(ia[i]), _mm256_loadu_ps(acc[i]));
            _mm256_storeu_ps(acc[i], _mm256_fmadd_ps(nm, _mm256_setzero_ps(), s));
        }
    }
}

/* A block type's kernel over nr rows in groups of up to X8_ROWS (G a constant in each copy). */
#define X8_GROUPS(kernel, w)                                                      \
    for (int r = 0; r < nr;) {                                                    \
        int g = nr - r < X8_ROWS ? nr - r : X8_ROWS;                              \
        switch (g) {                                                              \
        case 1: kernel(w, k, a, r0 + r, 1, acc + r); break;                       \
        case 2: kernel(w, k, a, r0 + r, 2, acc + r); break;                       \
        case 3: kernel(w, k, a, r0 + r, 3, acc + r); break;                       \
        case 4: kernel(w, k, a, r0 + r, 4, acc + r); break;                       \
        case 5: kernel(w, k, a, r0 + r, 5, acc + r); break;                       \
        case 6: kernel(w, k, a, r0 + r, 6, acc + r); break;                       \
        case 7: kernel(w, k, a, r0 + r, 7, acc + r); break;                       \
        default: kernel(w, k, a, r0 + r, 8, acc + r); break;                      \
        }                                                                         \
        r += g;                                                                   \
    }

AVX2 void avx2_rows8(const struct type_info *t, const uint8_t *w8, int k, const struct acts *a, int r0, int nr,
                     float (*acc)[8]) {
    if (t->id == TYPE_Q4_K) {
        X8_GROUPS(q4k_x8, (const block_q4_Kx8 *)w8)
    } else { /* Q6_K: the other type packed_types lists */
        X8_GROUPS(q6k_x8, (const block_q6_Kx8 *)w8)
    }
}

#endif
