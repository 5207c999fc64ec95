/* The AVX2 + FMA (+ F16C) path: dot.c's scalar path with the integer work vectorized.
 *
 * Only these functions use AVX2, through the target attribute: the module is built for
 * plain x86-64 and dot.c picks this path at run time when the CPU has it.  The integer
 * sums equal the scalar ones exactly; the float updates are dot.h's, per lane.
 *
 * Quantized weights are never decoded to memory: each block is unpacked in registers and
 * multiplied straight into the activation rows.  K-quants take one row alone (k_one: its
 * float sum in a register) or rows in groups of up to 8 (k_group: each block unpacked once
 * for the group, the rows' float sums in vector lanes); small blocks take each 8-block
 * chunk once for all the rows.  Which loop a row takes changes no bit of its result. */
#if defined(__x86_64__)

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE inline __attribute__((always_inline)) /* the type a constant in each copy */

/* Lanes 0..3 (per 128-bit half) of the sums of a's and b's lanes 0,2 / 1,3 interleaved:
 * a0+a2, b0+b2, a1+a3, b1+b3 (unpacks, not hadd: that takes twice as long on AMD). */
AVX2 static inline __m256i fold_pair32(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* Eight vectors of 8 int32 -> one vector whose lane b is the sum of v[b]. */
AVX2 static inline __m256i hsum_8x8(const __m256i v[8]) {
    __m256i p01 = fold_pair32(v[0], v[1]), p23 = fold_pair32(v[2], v[3]);
    __m256i p45 = fold_pair32(v[4], v[5]), p67 = fold_pair32(v[6], v[7]);
    /* per 128-bit half: the half-sums of v0..v3, and of v4..v7 */
    __m256i q03 = _mm256_add_epi32(_mm256_unpacklo_epi64(p01, p23), _mm256_unpackhi_epi64(p01, p23));
    __m256i q47 = _mm256_add_epi32(_mm256_unpacklo_epi64(p45, p67), _mm256_unpackhi_epi64(p45, p67));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q03, q47, 0x20), _mm256_permute2x128_si256(q03, q47, 0x31));
}

/* The sums of a's lanes and of b's lanes, in lanes 0 and 1. */
AVX2 static inline __m128i hsum_2x8(__m256i a, __m256i b) {
    __m256i p = fold_pair32(a, b); /* per half: a, b, a, b partial sums */
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    return _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
}

/* Byte j is 0xFF where bit j of `bits` is set. */
AVX2 static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

static inline uint16_t u16_at(const uint8_t *p) { /* unaligned-safe */
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* ---- K-quants: computed from the packed block, in registers ----
 *
 * A block's 256 integers q are unpacked into 8 vectors (weights 32j .. 32j+31, quants.c's
 * decode_k order) once for all the rows and multiplied straight into each activation row by
 * _mm256_maddubs_epi16 (q unsigned, x signed: pairs, at most 2*63*127, no saturation); the
 * products are folded in int16 and then multiplied by their scales with _mm256_madd_epi16
 * (k_sums).  The int32 sums are the scalar path's ia and ib exactly, and each goes through
 * dot.h's k_update (or its lane-wise vector form), block after block. */

/* A block's scales: those of k_sums's folded vectors (int16, lane by lane), and per 16 weights
 * the min (Q4_K/Q5_K) or the zero offset 32*sc (Q6_K). */
struct kscales {
    __m256i sc[4]; /* the scales of k_sums's folded vectors */
    __m256i zm;
    float d, dmin;
};

AVX2 static INLINE void k_scales(int type, const uint8_t *raw, struct kscales *s) {
    if (type == TYPE_Q6_K) { /* int8 scale per 16 weights; folded pair f = (2f, 2f+1), half h: sc[4f+h], sc[4f+2+h] */
        const block_q6_K *p = (const block_q6_K *)raw;
        __m128i sc = _mm_loadu_si128((const __m128i *)p->scales);
        for (int f = 0; f < 4; f++) {
            __m128i lo = _mm_set1_epi16((short)((4 * f) | (4 * f + 2) << 8));
            __m128i hi = _mm_set1_epi16((short)((4 * f + 1) | (4 * f + 3) << 8));
            s->sc[f] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(_mm_shuffle_epi8(sc, lo), _mm_shuffle_epi8(sc, hi)));
        }
        s->zm = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);
        s->d = _cvtsh_ss(u16_at(raw + offsetof(block_q6_K, d)));
        s->dmin = 0.0f;
        return;
    }
    uint8_t s8[8], m8[8]; /* Q4_K/Q5_K: 6-bit scale and min per 32 weights */
    k_scales_unpack(raw + 4, s8, m8);
    __m128i sc = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)s8)); /* sc0 .. sc7 */
    if (type == TYPE_Q5_K) { /* folded in fours: sc0..3 twice, sc4..7 twice */
        s->sc[0] = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(sc, sc));
        s->sc[1] = _mm256_broadcastsi128_si256(_mm_unpackhi_epi64(sc, sc));
    } else { /* folded in eights: sc0..7 */
        s->sc[0] = _mm256_broadcastsi128_si256(sc);
    }
    __m128i m = _mm_loadl_epi64((const __m128i *)m8);
    s->zm = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)); /* each min twice */
    s->d = _cvtsh_ss(u16_at(raw));
    s->dmin = _cvtsh_ss(u16_at(raw + 2));
}

/* q vector j (0..7) of a block (quants.c's decode_q45_k and decode_q6_k). */
AVX2 static INLINE __m256i k_q(int type, const uint8_t *raw, int j) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (type == TYPE_Q6_K) { /* weight 128h + 32s + l: ql nibble | ((qh[32h + l] >> 2s) & 3) << 4 */
        const block_q6_K *p = (const block_q6_K *)raw;
        int h = j / 4, s = j % 4;
        __m256i l = _mm256_loadu_si256((const __m256i *)(p->ql + 64 * h + 32 * (s & 1)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(p->qh + 32 * h));
        __m256i lo = _mm256_and_si256(s < 2 ? l : _mm256_srli_epi16(l, 4), m4);
        __m256i hi = s == 0 ? _mm256_slli_epi16(hb, 4) : s == 1 ? _mm256_slli_epi16(hb, 2) : s == 2 ? hb : _mm256_srli_epi16(hb, 2);
        return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    }
    /* Q4_K/Q5_K: 32 bytes of qs hold q vector 2c (low nibbles) and 2c+1 (high nibbles) */
    const uint8_t *qs = raw + (type == TYPE_Q4_K ? 16 : 48);
    __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
    if (type == TYPE_Q5_K) { /* fifth bit of weight 32j + l: bit j of qh[l] */
        __m256i hb = _mm256_loadu_si256((const __m256i *)(raw + 16));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j), _mm256_set1_epi8(1)), 4));
    }
    return q;
}

/* Lanes of a and b, pairwise: per 128-bit half, a0+a4, b0+b4, a1+a5, b1+b5, a2+a6, b2+b6, a3+a7, b3+b7 (int16;
 * the caller's bounds keep every sum in range). */
AVX2 static inline __m256i fold16(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
}
AVX2 static inline __m256i fold32(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
AVX2 static inline __m256i fold64(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

/* Block `raw` against G activation rows, row i's 256 q at x + i * stride and its 16 sums at
 * sum16 + i * stride / 16: ia, ib as 8 int32 partial sums each.  Each q vector is unpacked
 * once for the G rows.  A row's 8 products p_j = maddubs(q_j, x_j) (int16 pairs) are folded
 * lane-wise in int16 as far as the type's bounds allow (Q4_K: |p| <= 2*15*127, sums of 8 lanes
 * fit; Q5_K: 2*31*127, 4 lanes; Q6_K: 2*63*127, 2 lanes) before one madd per folded vector
 * multiplies them by their scales: fewer multiplies per row than a madd per p_j, the same
 * integers. */
AVX2 static INLINE void k_sums(int type, const uint8_t *raw, const struct kscales *s, const int8_t *x,
                               const int16_t *sum16, size_t stride, const int G, __m256i *ia, __m256i *ib) {
    __m256i q[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) q[j] = k_q(type, raw, j);
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) {
        __m256i p[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            p[j] = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(x + i * stride + 32 * j)));
        __m256i f0 = fold16(p[0], p[1]), f1 = fold16(p[2], p[3]), f2 = fold16(p[4], p[5]), f3 = fold16(p[6], p[7]);
        __m256i sum;
        if (type == TYPE_Q6_K) {
            sum = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(f0, s->sc[0]), _mm256_madd_epi16(f1, s->sc[1])),
                                   _mm256_add_epi32(_mm256_madd_epi16(f2, s->sc[2]), _mm256_madd_epi16(f3, s->sc[3])));
        } else if (type == TYPE_Q5_K) {
            sum = _mm256_add_epi32(_mm256_madd_epi16(fold32(f0, f1), s->sc[0]),
                                   _mm256_madd_epi16(fold32(f2, f3), s->sc[1]));
        } else {
            sum = _mm256_madd_epi16(fold64(fold32(f0, f1), fold32(f2, f3)), s->sc[0]);
        }
        __m256i z = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(sum16 + i * (stride / 16))), s->zm);
        if (type == TYPE_Q6_K) { /* ia = sc.dot - zoff.sum16, ib = 0 */
            ia[i] = _mm256_sub_epi32(sum, z);
            ib[i] = _mm256_setzero_si256();
        } else { /* ia = sc.dot, ib = mn.sum16 */
            ia[i] = sum;
            ib[i] = z;
        }
    }
}

/* Lane i of acc: k_update(acc_i, d, dmin, dx_i, ia_i, ib_i) for 4 rows, ia and ib the sums of
 * v[i] and v[4 + i] (rows past G: zero vectors, dx 0, lanes unused).  The same operations
 * as k_update's, lane by lane (d * dx, its negation, int -> float, two fused multiply-adds
 * in that order), so the same bits. */
AVX2 static INLINE __m128 k_update4(__m128 acc, float d, float dmin, __m128 dx, const __m256i v[8]) {
    __m256 f = _mm256_cvtepi32_ps(hsum_8x8(v));
    __m128 nm = _mm_xor_ps(_mm_mul_ps(_mm_set1_ps(dmin), dx), _mm_set1_ps(-0.0f)); /* -(dmin * dx) */
    acc = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(d), dx), _mm256_castps256_ps128(f), acc);
    return _mm_fmadd_ps(nm, _mm256_extractf128_ps(f, 1), acc);
}

/* acc[i][0] += the weight row . activation row r + i, i < G (2..8): the rows' float sums in
 * vector lanes, each block decoded once for the G rows. */
AVX2 static INLINE void k_group(int type, const uint8_t *w, size_t bytes, int k, const struct acts *a, int r, const int G,
                                float (*acc)[LANES]) {
    size_t stride = a->kpad, at = (size_t)r * stride;
    float lanes[8] = {0};
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) lanes[i] = acc[i][0];
    __m128 s0 = _mm_loadu_ps(lanes), s1 = _mm_loadu_ps(lanes + 4);
    for (int c = 0; c * CHUNK < k; c++, at += CHUNK) {
        const uint8_t *raw = w + c * bytes;
        struct kscales s;
        __m256i v[16]; /* ia of row i in v[i], ib in v[8 + i] */
        k_scales(type, raw, &s);
        k_sums(type, raw, &s, a->q + at, a->sum16 + at / 16, stride, G, v, v + 8);
        const float *dxs = a->d + at / QK_K;
        float dx[8] = {0};
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) dx[i] = dxs[i * (stride / QK_K)];
        __m256i u[8]; /* rows 0..3: ia, ib */
#pragma GCC unroll 8
        for (int i = 0; i < 4; i++) {
            u[i] = i < G ? v[i] : _mm256_setzero_si256();
            u[4 + i] = i < G ? v[8 + i] : _mm256_setzero_si256();
        }
        s0 = k_update4(s0, s.d, s.dmin, _mm_loadu_ps(dx), u);
        if (G > 4) { /* rows 4..7 */
#pragma GCC unroll 8
            for (int i = 0; i < 4; i++) {
                u[i] = 4 + i < G ? v[4 + i] : _mm256_setzero_si256();
                u[4 + i] = 4 + i < G ? v[12 + i] : _mm256_setzero_si256();
            }
            s1 = k_update4(s1, s.d, s.dmin, _mm_loadu_ps(dx + 4), u);
        }
    }
    _mm_storeu_ps(lanes, s0);
    _mm_storeu_ps(lanes + 4, s1);
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) acc[i][0] = lanes[i];
}

/* acc[0] += the weight row . activation row r: the float sum in a register, k_update block
 * by block. */
AVX2 static INLINE void k_one(int type, const uint8_t *w, size_t bytes, int k, const struct acts *a, int r, float *acc) {
    size_t at = (size_t)r * a->kpad;
    const float *dx = a->d + at / QK_K;
    float sum = acc[0];
    for (int c = 0; c * CHUNK < k; c++) {
        const uint8_t *raw = w + c * bytes;
        const int8_t *x = a->q + at + (size_t)c * CHUNK;
        const int16_t *sum16 = a->sum16 + (at + (size_t)c * CHUNK) / 16;
        struct kscales s;
        __m256i ia, ib;
        k_scales(type, raw, &s);
        k_sums(type, raw, &s, x, sum16, 0, 1, &ia, &ib);
        __m128i u = hsum_2x8(ia, ib);
        sum = k_update(sum, s.d, s.dmin, dx[c], _mm_cvtsi128_si32(u), _mm_extract_epi32(u, 1));
    }
    acc[0] = sum;
}

/* A whole weight row of a K-quant type (type a constant after inlining), rows in groups of
 * up to 8. */
AVX2 static INLINE void k_row_all(int type, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                                  float (*acc)[LANES]) {
    size_t bytes = type == TYPE_Q4_K ? sizeof(block_q4_K) : type == TYPE_Q5_K ? sizeof(block_q5_K) : sizeof(block_q6_K);
    for (int r = 0; r < nr;) {
        int g = nr - r < 8 ? nr - r : 8;
        switch (g) {
        case 1: k_one(type, w, bytes, k, a, r0 + r, acc[r]); break;
        case 2: k_group(type, w, bytes, k, a, r0 + r, 2, acc + r); break;
        case 3: k_group(type, w, bytes, k, a, r0 + r, 3, acc + r); break;
        case 4: k_group(type, w, bytes, k, a, r0 + r, 4, acc + r); break;
        case 5: k_group(type, w, bytes, k, a, r0 + r, 5, acc + r); break;
        case 6: k_group(type, w, bytes, k, a, r0 + r, 6, acc + r); break;
        case 7: k_group(type, w, bytes, k, a, r0 + r, 7, acc + r); break;
        default: k_group(type, w, bytes, k, a, r0 + r, 8, acc + r); break;
        }
        r += g;
    }
}

/* ---- small blocks: eight 32-weight blocks per chunk, in registers ---- */

struct sblock {
    __m256i q[8]; /* block b's 32 integers (Q8_0: |q|) */
    __m256i s[8]; /* Q8_0: q itself, for its sign */
    __m256 d, m;  /* per block: scale, and Q4_1's min (0 otherwise) */
};

/* The first nb blocks of raw (the rest zero, as quants.c's decode_small). */
AVX2 static INLINE void small_load(int type, const uint8_t *raw, int nb, struct sblock *s) {
    const int bytes = type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q5_0 ? 22 : 34;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    uint16_t hd[8] = {0}, hm[8] = {0}; /* fp16 d and m of each block (0: past the row's end) */
    for (int b = 0; b < 8; b++) {
        const uint8_t *blk = raw + b * bytes;
        __m256i q = _mm256_setzero_si256();
        if (b < nb) {
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
            hd[b] = u16_at(blk);
            if (type == TYPE_Q4_1) hm[b] = u16_at(blk + 2);
        }
        if (type == TYPE_Q8_0) {
            s->s[b] = q;
            q = _mm256_abs_epi8(q);
        }
        s->q[b] = q;
    }
    s->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
    s->m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hm));
}

/* acc[r][b] += block b of the chunk . its activation block (scalar small_row), lane by lane. */
AVX2 static INLINE void small_rows(int type, const struct sblock *s, const struct acts *a, int c, int r0, int nr, int nb,
                                   float (*acc)[LANES]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
        const int8_t *x = a->q + at;
        __m256i v[8];
        for (int b = 0; b < 8; b++) {
            v[b] = _mm256_setzero_si256(); /* blocks past the end: q = 0 */
            if (b >= nb) continue;
            __m256i xb = _mm256_loadu_si256((const __m256i *)(x + QK * b));
            if (type == TYPE_Q8_0) xb = _mm256_sign_epi8(xb, s->s[b]); /* |q| * (x * sign q) */
            v[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(s->q[b], xb), ones);
        }
        small_update8(type, hsum_8x8(v), a->sum16 + at / 16, a->d + at / QK, s->d, s->m, acc[r]);
    }
}

/* A whole weight row of a small type (type a constant after inlining). */
AVX2 static INLINE void small_row_all(int type, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                                      float (*acc)[LANES]) {
    const int bytes = type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q5_0 ? 22 : 34;
    struct sblock s;
    int c = 0;
    for (; (c + 1) * CHUNK <= k; c++) {
        small_load(type, w + (size_t)c * 8 * bytes, 8, &s);
        small_rows(type, &s, a, c, r0, nr, 8, acc);
    }
    if (c * CHUNK < k) { /* a partial last chunk */
        int nb = (k - c * CHUNK) / QK;
        small_load(type, w + (size_t)c * 8 * bytes, nb, &s);
        small_rows(type, &s, a, c, r0, nr, nb, acc);
    }
}

/* ---- floats ---- */

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
    switch (t->id) { /* each type its own specialized loop */
    case TYPE_Q4_K: k_row_all(TYPE_Q4_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q5_K: k_row_all(TYPE_Q5_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q6_K: k_row_all(TYPE_Q6_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q4_0: small_row_all(TYPE_Q4_0, w, k, a, r0, nr, acc); return;
    case TYPE_Q4_1: small_row_all(TYPE_Q4_1, w, k, a, r0, nr, acc); return;
    case TYPE_Q5_0: small_row_all(TYPE_Q5_0, w, k, a, r0, nr, acc); return;
    case TYPE_Q8_0: small_row_all(TYPE_Q8_0, w, k, a, r0, nr, acc); return;
    }
    size_t chunk_bytes = (size_t)CHUNK * t->bytes;
    for (int c = 0; c * CHUNK < k; c++) {
        struct fchunk wc;
        decode_float_avx2(t->id, w + c * chunk_bytes, k - c * CHUNK < CHUNK ? k - c * CHUNK : CHUNK, &wc);
        float_rows(&wc, a, c, r0, nr, acc);
    }
}

const struct dot_isa DOT_AVX2 = {"avx2", avx2_rows, X86_PACKED_TYPES, avx2_rows8};

#endif
