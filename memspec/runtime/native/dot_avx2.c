/* The AVX2 + FMA (+ F16C) path: dot.c's scalar path with the integer work vectorized.
 *
 * Only these functions use AVX2, through the target attribute: the module is built for
 * plain x86-64 and dot.c picks this path at run time when the CPU has it.  The integer
 * sums equal the scalar ones exactly; the float updates are dot.h's, per lane. */
#if defined(__x86_64__)

#include <immintrin.h>
#include <string.h>

#include "dot.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Eight vectors of 8 int32 -> one vector whose lane b is the sum of v[b]. */
AVX2 static inline __m256i hsum_8x8(const __m256i v[8]) {
    __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    __m256i ab = _mm256_hadd_epi32(a, b); /* per 128-bit half: sums of v0..v3's half */
    __m256i cd = _mm256_hadd_epi32(c, d); /* and of v4..v7's */
    __m256i lo = _mm256_permute2x128_si256(ab, cd, 0x20), hi = _mm256_permute2x128_si256(ab, cd, 0x31);
    return _mm256_add_epi32(lo, hi);
}

/* Byte j is 0xFF where bit j of `bits` is set. */
AVX2 static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* ---- decoders (same output as quants.c's) ---- */

/* K-quant block -> its 256 integers q (as quants.c's decode_k). */
AVX2 static void decode_k_q(int type, const uint8_t *raw, uint8_t *q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    if (type == TYPE_Q6_K) {
        const block_q6_K *b = (const block_q6_K *)raw;
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int s = 0; s < 4; s++) {
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), m2);
                _mm256_store_si256((__m256i *)(q + 128 * h + 32 * s), _mm256_or_si256(lows[s], _mm256_slli_epi16(high, 4)));
            }
        }
        return;
    }
    const uint8_t *qs = raw + (type == TYPE_Q4_K ? 16 : 48);
    __m256i hb = type == TYPE_Q5_K ? _mm256_loadu_si256((const __m256i *)(raw + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i hlo = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), m1);
        __m256i hhi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), m1);
        _mm256_store_si256((__m256i *)(q + 64 * c), _mm256_or_si256(lo, _mm256_slli_epi16(hlo, 4)));
        _mm256_store_si256((__m256i *)(q + 64 * c + 32), _mm256_or_si256(hi, _mm256_slli_epi16(hhi, 4)));
    }
}

/* A K-quant block's scales in registers (quants.c's decode_k_scales, as vectors). */
struct kscales {
    __m256i sc[8];    /* int16 scale of each weight in 32i..32i+31: sc[2i] low half, sc[2i+1] high */
    __m256i zoff, mn; /* int16 per 16 weights */
    float d, dmin;
};

AVX2 static void decode_k_scales_avx2(int type, const uint8_t *raw, struct kscales *ks) {
    __m128i sc; /* int8 scale per 16 weights */
    if (type == TYPE_Q6_K) {
        const block_q6_K *b = (const block_q6_K *)raw;
        sc = _mm_loadu_si128((const __m128i *)b->scales);
        ks->zoff = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5); /* 32 * sc */
        ks->mn = _mm256_setzero_si256();
        ks->d = fp16_at(&b->d);
        ks->dmin = 0.0f;
    } else {
        uint8_t s8[8], m8[8];
        k_scales_unpack(raw + 4, s8, m8);
        __m128i s = _mm_loadl_epi64((const __m128i *)s8), m = _mm_loadl_epi64((const __m128i *)m8);
        sc = _mm_unpacklo_epi8(s, s); /* each 32-weight scale twice */
        ks->zoff = _mm256_setzero_si256();
        ks->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
        ks->d = fp16_at(raw);
        ks->dmin = fp16_at(raw + 2);
    }
    const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int i = 0; i < 8; i++)
        ks->sc[i] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_add_epi8(pick, _mm_set1_epi8((char)(2 * i)))));
}

AVX2 static void decode_small_avx2(int type, const uint8_t *raw, int count, struct qchunk *out) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    int bytes = type_info(type)->bytes, nb = count / QK;
    for (int b = 0; b < 8; b++) {
        __m256i q = _mm256_setzero_si256();
        out->d[b] = out->m[b] = 0.0f;
        if (b < nb) {
            const uint8_t *blk = raw + b * bytes;
            if (type == TYPE_Q8_0) {
                q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            } else { /* low nibbles are weights 0..15, high nibbles 16..31 */
                __m128i v = _mm_loadu_si128((const __m128i *)(blk + bytes - 16));
                q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
            }
            if (type == TYPE_Q5_0) {
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
            }
            out->d[b] = fp16_at(blk);
            out->m[b] = type == TYPE_Q4_1 ? fp16_at(blk + 2) : 0.0f;
        }
        _mm256_store_si256((__m256i *)(out->q + QK * b), q);
    }
    out->zero = type == TYPE_Q4_0 ? 8 : type == TYPE_Q5_0 ? 16 : 0;
    out->q_signed = type == TYPE_Q8_0;
}

AVX2 static void decode_float_avx2(int type, const uint8_t *raw, int count, struct fchunk *out) {
    int i = 0;
    if (type == TYPE_F32) {
        memcpy(out->w, raw, (size_t)count * 4);
        i = count;
    }
    for (; type == TYPE_F16 && i + 8 <= count; i += 8)
        _mm256_store_ps(out->w + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(raw + 2 * i))));
    for (; type == TYPE_BF16 && i + 8 <= count; i += 8) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(raw + 2 * i)));
        _mm256_store_ps(out->w + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
    }
    for (; i < count; i++) out->w[i] = type == TYPE_F16 ? fp16_at(raw + 2 * i) : bf16_to_f32(raw[2 * i] | raw[2 * i + 1] << 8);
    for (; i < CHUNK; i++) out->w[i] = 0.0f;
}

/* ---- row kernels ---- */

AVX2 static void k_rows(int type, const uint8_t *q, const struct kscales *w, const struct acts *a, int c, int r0, int nr,
                        float (*acc)[LANES]) {
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
        const int8_t *x = a->q + at;
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(q + 32 * i)),
                                             _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, w->sc[i]));
        }
        __m256i s16 = _mm256_loadu_si256((const __m256i *)(a->sum16 + at / 16));
        int32_t ia, ib = 0; /* the scalar path's sums, less its terms that are zero for this type */
        if (type == TYPE_Q6_K) { /* mn = 0 */
            ia = hsum_i32(_mm256_sub_epi32(sum, _mm256_madd_epi16(s16, w->zoff)));
        } else { /* zoff = 0 */
            ia = hsum_i32(sum);
            ib = hsum_i32(_mm256_madd_epi16(s16, w->mn));
        }
        acc[r][0] = k_update(acc[r][0], w->d, w->dmin, a->d[at / QK_K], ia, ib);
    }
}

/* 8 int32 partial sums of a 32-weight block . its activations. */
AVX2 static inline __m256i block_dot(__m256i w, __m256i x, int q_signed) {
    __m256i p = q_signed ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
                         : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

AVX2 static void small_rows(const struct qchunk *w, const struct acts *a, int c, int r0, int nr, float (*acc)[LANES]) {
    __m256 d = _mm256_load_ps(w->d), m = _mm256_load_ps(w->m);
    __m256i zero = _mm256_set1_epi32(w->zero);
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
        const int8_t *x = a->q + at;
        __m256i v[8];
        for (int b = 0; b < 8; b++)
            v[b] = block_dot(_mm256_load_si256((const __m256i *)(w->q + QK * b)),
                             _mm256_loadu_si256((const __m256i *)(x + QK * b)), w->q_signed);
        __m256i xsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->sum16 + at / 16)), _mm256_set1_epi16(1));
        __m256i isum = _mm256_sub_epi32(hsum_8x8(v), _mm256_mullo_epi32(zero, xsum));
        __m256 dx = _mm256_loadu_ps(a->d + at / QK);
        __m256 lanes = _mm256_loadu_ps(acc[r]); /* small_update, lane by lane */
        lanes = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum), lanes);
        lanes = _mm256_fmadd_ps(_mm256_mul_ps(m, dx), _mm256_cvtepi32_ps(xsum), lanes);
        _mm256_storeu_ps(acc[r], lanes);
    }
}

AVX2 static void float_rows(const struct fchunk *w, const struct acts *a, int c, int r0, int nr, float (*acc)[LANES]) {
    for (int r = 0; r < nr; r++) {
        const float *x = a->f + (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
        __m256 l[4];
        for (int j = 0; j < 4; j++) l[j] = _mm256_loadu_ps(acc[r] + 8 * j);
        for (int i = 0; i < CHUNK; i += LANES)
            for (int j = 0; j < 4; j++)
                l[j] = _mm256_fmadd_ps(_mm256_load_ps(w->w + i + 8 * j), _mm256_loadu_ps(x + i + 8 * j), l[j]);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[r] + 8 * j, l[j]);
    }
}

AVX2 static void avx2_rows(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                           float (*acc)[LANES]) {
    size_t chunk_bytes = (size_t)(CHUNK / t->block) * t->bytes;
    for (int c = 0; c * CHUNK < k; c++) {
        const uint8_t *raw = w + c * chunk_bytes;
        int count = k - c * CHUNK < CHUNK ? k - c * CHUNK : CHUNK;
        if (t->family == FAM_K) {
            uint8_t q[CHUNK] __attribute__((aligned(32)));
            struct kscales ks;
            decode_k_q(t->id, raw, q);
            decode_k_scales_avx2(t->id, raw, &ks);
            k_rows(t->id, q, &ks, a, c, r0, nr, acc);
        } else if (t->family == FAM_SMALL) {
            struct qchunk wc;
            decode_small_avx2(t->id, raw, count, &wc);
            small_rows(&wc, a, c, r0, nr, acc);
        } else {
            struct fchunk wc;
            decode_float_avx2(t->id, raw, count, &wc);
            float_rows(&wc, a, c, r0, nr, acc);
        }
    }
}

const struct dot_isa DOT_AVX2 = {"avx2", avx2_rows};

#endif
