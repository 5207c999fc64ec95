/* The AVX-512 + VNNI path: quantized blocks through 512-bit integer dot products, floats as AVX2.
 *
 * Like dot_avx2.c, only these functions use the wider instructions (target attribute) and
 * dot.c picks this path at run time when the CPU has AVX-512 F/BW/VL and VNNI.  The integer
 * sums ia, ib of a block equal the scalar path's exactly; the float updates are dot.h's
 * k_update, lane by lane, so the bits are the scalar path's.
 *
 * Why VNNI: with several rows in a pass (a draft being verified, or several sequences) the
 * work per extra row is integer multiplies.  vpdpbusd multiplies 64 unsigned weights by 64
 * signed activations and adds them four at a time into 16 int32 lanes in one instruction,
 * where AVX2 needs maddubs, a fold and a madd for 32.  A block's 256 quants are unpacked once
 * into four 512-bit vectors (weights 64c .. 64c+63) for all the rows of a group.
 *
 * The scales: each int32 lane of vpdpbusd(q_c, x_c) holds 4 products of one sub-block, at
 * most 4*63*127 = 32004, so two rows' lanes pack into int16 without saturation (packs) and one
 * vpdpwssd multiplies them by their sub-block scales and adds them in int32.  Rows go in
 * pairs: row a's lanes and row b's share each pack, so one pack and one vpdpwssd serve two
 * rows.  Per 128-bit lane of the accumulator: [a, a, b, b] (int32).
 *
 * Small blocks (Q4_0, Q4_1, Q5_0, Q8_0): a chunk's eight blocks in four 512-bit vectors, vpdpbusd
 * per row, the block sums in one reduction (small_sums).
 *
 * A row alone (decode) takes the AVX2 loop: one row has no partner to share the packs, and
 * there the 256-bit loop was faster (Q4_K, 512x1536 in L2, one thread: 11.8 against 17.1 ns a
 * block); decode is bound by reading the weights anyway.  Groups of 2..8 rows: 5.9 against 6.9
 * ns a block and row (bench/kernels.py --isa avx2,avx512 gives the whole-matrix figures).
 *
 * Matrices whose rows come in eights, of every type but Q5_K, are not run here but interleaved
 * (dot_avx512_x8.c, as on AVX2): on a Zen 4 EPYC that layout made a one-row pass of the 1.5B
 * 0.86x this file's time and a four-row pass 0.60x; SmolLM2's (small blocks) 0.66x and 0.61x.
 * With two rows or more, Q4_K and Q6_K go two groups at a time in 512-bit vectors (rows16, there).
 * These row kernels take the rest. */
#if defined(__x86_64__)

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE inline __attribute__((always_inline))

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* A block's scales in the forms the sums need. */
struct kscales {
    __m512i s[4]; /* vector c: the int16 scale of each lane of pack(P_a[c], P_b[c]) */
    __m512i zm;   /* per 16 weights (each 64-bit unit twice, as the pairs interleave them): the min
                     (Q4_K/Q5_K) or minus the zero offset 32*sc (Q6_K) */
    float d, dmin;
};

/* t: per (c, i) the scale of lanes 4i..4i+3 of P[c] (int16, 16 of them in a 256-bit vector):
 * Q4_K/Q5_K sub-block 2c + i/2, Q6_K sub-block 4c + i. */
AVX512 static INLINE void k_scales(int type, const uint8_t *raw, struct kscales *s) {
    __m256i t, z;
    if (type == TYPE_Q6_K) {
        const block_q6_K *p = (const block_q6_K *)raw;
        t = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p->scales));
        z = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(t, 5)); /* -32*sc, |.| <= 4096 */
        s->d = _cvtsh_ss(u16_at(raw + offsetof(block_q6_K, d)));
        s->dmin = 0.0f;
    } else {
        uint8_t s8[8], m8[8];
        k_scales_unpack(raw + 4, s8, m8);
        __m128i sc = _mm_loadl_epi64((const __m128i *)s8), mn = _mm_loadl_epi64((const __m128i *)m8);
        t = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc)); /* each scale twice */
        z = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn)); /* each min twice: per 16 weights */
        s->d = _cvtsh_ss(u16_at(raw));
        s->dmin = _cvtsh_ss(u16_at(raw + 2));
    }
    __m512i t512 = _mm512_zextsi256_si512(t);
    for (int c = 0; c < 4; c++) { /* packed int16 lane 8i + m (m < 4: row a, else row b) <- t[4c + i] */
        const __m512i idx = _mm512_set_epi16(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3,
                                             4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                             4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1,
                                             4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                             4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c);
        s->s[c] = _mm512_permutexvar_epi16(idx, t512);
    }
    __m512i z512 = _mm512_zextsi256_si512(z);
    s->zm = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), z512);
}

/* Quants of weights 64c .. 64c+63 of a block (quants.c's decode_q45_k and decode_q6_k order). */
AVX512 static INLINE __m512i k_q(int type, const uint8_t *raw, int c) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == TYPE_Q6_K) { /* weight 128h + 32s + l: ql nibble | ((qh[32h + l] >> 2s) & 3) << 4, s = 2(c%2) + half */
        const block_q6_K *p = (const block_q6_K *)raw;
        int h = c / 2, odd = c % 2;
        __m512i l = _mm512_loadu_si512((const void *)(p->ql + 64 * h));
        __m512i lo = _mm512_and_si512(odd ? _mm512_srli_epi16(l, 4) : l, m4);
        __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p->qh + 32 * h)));
        __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * odd)), _mm256_set1_epi16((short)(4 * odd + 2)), 1);
        __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hb, shift), _mm512_set1_epi8(3));
        return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
    }
    /* Q4_K/Q5_K: 32 bytes of qs hold weights 64c .. +31 (low nibbles) and 64c+32 .. +63 (high) */
    const uint8_t *qs = raw + (type == TYPE_Q4_K ? 16 : 48);
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
    __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), m4);
    if (type == TYPE_Q5_K) { /* fifth bit of weight 32j + l: bit j of qh[l], j = 2c (low half), 2c+1 (high) */
        __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(raw + 16)));
        __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))), _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
        q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hb, bit), q, _mm512_set1_epi8(16));
    }
    return q;
}

/* The integer sums of a block for rows a and b (b NULL: none), in pair layout (per 128-bit lane
 * [a, a, b, b]): *ia = sum sc * (q . x) (Q6_K: minus zoff . sum16), *ib = mn . sum16 (Q6_K: 0). */
AVX512 static INLINE void k_pair(int type, const __m512i q[4], const struct kscales *s, const int8_t *xa,
                                 const int8_t *xb, const int16_t *sa, const int16_t *sb, __m512i *ia, __m512i *ib) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512i pa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512((const void *)(xa + 64 * c)));
        __m512i pb = _mm512_setzero_si512();
        if (xb) pb = _mm512_dpbusd_epi32(pb, q[c], _mm512_loadu_si512((const void *)(xb + 64 * c)));
        acc = _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(pa, pb), s->s[c]);
    }
    /* the 16 sums of 16 activations of each row, 64-bit units interleaved a0 b0 a1 b1 .. as s->zm */
    __m512i za = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)sa));
    __m512i zb = xb ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)sb)) : _mm512_setzero_si512();
    __m512i z = _mm512_permutex2var_epi64(za, _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0), zb);
    __m512i m = _mm512_dpwssd_epi32(_mm512_setzero_si512(), z, s->zm);
    if (type == TYPE_Q6_K) {
        *ia = _mm512_add_epi32(acc, m);
        *ib = _mm512_setzero_si512();
    } else {
        *ia = acc;
        *ib = m;
    }
}

/* Four pair-layout vectors (pair p: rows 2p, 2p+1) -> lane i = the sum of row i's lanes. */
AVX512 static INLINE __m256i reduce_pairs(const __m512i v[4]) {
    __m256i t[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) /* [a a b b | a a b b] */
        t[p] = _mm256_add_epi32(_mm512_castsi512_si256(v[p]), _mm512_extracti64x4_epi64(v[p], 1));
    __m256i u01 = _mm256_add_epi32(_mm256_permute2x128_si256(t[0], t[1], 0x20), _mm256_permute2x128_si256(t[0], t[1], 0x31));
    __m256i u23 = _mm256_add_epi32(_mm256_permute2x128_si256(t[2], t[3], 0x20), _mm256_permute2x128_si256(t[2], t[3], 0x31));
    __m256i h = _mm256_hadd_epi32(u01, u23); /* [r0 r1 r4 r5 | r2 r3 r6 r7] */
    return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

/* acc[i][0] += the weight row . activation row r + i, i < G (2..8): each block unpacked once for
 * the G rows, their float sums in the lanes of one vector, updated as k_update lane by lane. */
AVX512 static INLINE void k_group(int type, const uint8_t *w, size_t bytes, int k, const struct acts *a, int r,
                                  const int G, float (*acc)[LANES]) {
    size_t stride = a->kpad, at = (size_t)r * stride;
    float lanes[8] = {0};
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) lanes[i] = acc[i][0];
    __m256 sum = _mm256_loadu_ps(lanes);
    for (int c = 0; c * CHUNK < k; c++, at += CHUNK) {
        const uint8_t *raw = w + c * bytes;
        struct kscales s;
        __m512i q[4], ia[4], ib[4];
        k_scales(type, raw, &s);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) q[j] = k_q(type, raw, j);
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            ia[p] = ib[p] = _mm512_setzero_si512();
            if (2 * p >= G) continue;
            size_t ra = at + 2 * p * stride, rb = ra + stride;
            k_pair(type, q, &s, a->q + ra, 2 * p + 1 < G ? a->q + rb : NULL, a->sum16 + ra / 16,
                   a->sum16 + rb / 16, &ia[p], &ib[p]);
        }
        const float *dxs = a->d + at / QK_K;
        float dx[8] = {0};
#pragma GCC unroll 8
        for (int i = 0; i < G; i++) dx[i] = dxs[i * (stride / QK_K)];
        __m256 vdx = _mm256_loadu_ps(dx);
        __m256 nm = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(s.dmin), vdx), _mm256_set1_ps(-0.0f)); /* -(dmin*dx) */
        sum = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(s.d), vdx), _mm256_cvtepi32_ps(reduce_pairs(ia)), sum);
        sum = _mm256_fmadd_ps(nm, _mm256_cvtepi32_ps(reduce_pairs(ib)), sum);
    }
    _mm256_storeu_ps(lanes, sum);
#pragma GCC unroll 8
    for (int i = 0; i < G; i++) acc[i][0] = lanes[i];
}

AVX512 static INLINE void k_row_all(const struct type_info *t, int type, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                                    float (*acc)[LANES]) {
    size_t bytes = type == TYPE_Q4_K ? sizeof(block_q4_K) : type == TYPE_Q5_K ? sizeof(block_q5_K) : sizeof(block_q6_K);
    for (int r = 0; r < nr;) {
        int g = nr - r < 8 ? nr - r : 8;
        switch (g) {
        case 1: DOT_AVX2.rows(t, w, k, a, r0 + r, 1, acc + r); break; /* alone: see the top */
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

/* ---- small blocks: a chunk's eight 32-weight blocks in four 512-bit vectors (blocks 2t, 2t+1) ---- */

struct sblock {
    __m512i q[4];      /* unsigned quants (Q8_0: |q|) */
    __mmask64 neg[4];  /* Q8_0: where q < 0 (the activation takes its sign) */
    __m256 d, m;       /* per block: scale, and Q4_1's min (0 otherwise) */
};

/* The first nb blocks of raw, the rest zero (as quants.c's decode_small). */
AVX512 static INLINE void small_load(int type, const uint8_t *raw, int nb, struct sblock *s) {
    const int bytes = type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q5_0 ? 22 : 34;
    uint16_t hd[8] = {0}, hm[8] = {0};
    for (int t = 0; t < 4; t++) {
        __m256i half[2];
        uint64_t high = 0; /* Q5_0: the fifth bits of the two blocks */
        for (int h = 0; h < 2; h++) {
            int b = 2 * t + h;
            const uint8_t *blk = raw + b * bytes;
            half[h] = _mm256_setzero_si256();
            if (b >= nb) continue;
            if (type == TYPE_Q8_0) {
                half[h] = _mm256_loadu_si256((const __m256i *)(blk + 2));
            } else { /* low nibbles: weights 0..15, high nibbles: 16..31 */
                __m128i v = _mm_loadu_si128((const __m128i *)(blk + bytes - 16));
                half[h] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
            }
            if (type == TYPE_Q5_0) {
                uint32_t qh;
                memcpy(&qh, blk + 2, 4);
                high |= (uint64_t)qh << (32 * h);
            }
            hd[b] = u16_at(blk);
            if (type == TYPE_Q4_1) hm[b] = u16_at(blk + 2);
        }
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
        if (type == TYPE_Q5_0) q = _mm512_mask_add_epi8(q, (__mmask64)high, q, _mm512_set1_epi8(16));
        if (type == TYPE_Q8_0) {
            s->neg[t] = _mm512_movepi8_mask(q);
            q = _mm512_abs_epi8(q); /* -128 -> 128 as unsigned: |q| still */
        }
        s->q[t] = q;
    }
    s->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
    s->m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hm));
}

/* Four vectors of 16 int32 (vector t: block 2t in its low half, 2t+1 in its high half) -> lane b
 * = the sum of block b's 8 lanes. */
AVX512 static INLINE __m256i small_sums(const __m512i p[4]) {
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    /* 128-bit lane j: the sums of lane j of p0, p1, p2, p3 */
    __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    u = _mm512_add_epi32(u, _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(2, 3, 0, 1))); /* lanes 0+1, 2+3 */
    __m128i even = _mm512_castsi512_si128(u), odd = _mm512_extracti32x4_epi32(u, 2); /* blocks 0,2,4,6 / 1,3,5,7 */
    return _mm256_set_m128i(_mm_unpackhi_epi32(even, odd), _mm_unpacklo_epi32(even, odd));
}

/* acc[r][b] += block b of the chunk . its activation block (scalar small_row), lane by lane. */
AVX512 static INLINE void small_rows(int type, const struct sblock *s, const struct acts *a, int c, int r0, int nr,
                                     float (*acc)[LANES]) {
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
        const int8_t *x = a->q + at;
        __m512i p[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * t));
            if (type == TYPE_Q8_0) xv = _mm512_mask_sub_epi8(xv, s->neg[t], _mm512_setzero_si512(), xv); /* |q| * (x * sign q) */
            p[t] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), s->q[t], xv);
        }
        small_update8(type, small_sums(p), a->sum16 + at / 16, a->d + at / QK, s->d, s->m, acc[r]);
    }
}

AVX512 static INLINE void small_row_all(int type, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                                        float (*acc)[LANES]) {
    const int bytes = type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q5_0 ? 22 : 34;
    struct sblock s;
    for (int c = 0; c * CHUNK < k; c++) {
        int nb = k - c * CHUNK < CHUNK ? (k - c * CHUNK) / QK : 8;
        small_load(type, w + (size_t)c * 8 * bytes, nb, &s);
        small_rows(type, &s, a, c, r0, nr, acc);
    }
}

AVX512 static void quant_rows(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                          float (*acc)[LANES]) {
    switch (t->id) {
    case TYPE_Q4_K: k_row_all(t, TYPE_Q4_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q5_K: k_row_all(t, TYPE_Q5_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q6_K: k_row_all(t, TYPE_Q6_K, w, k, a, r0, nr, acc); return;
    case TYPE_Q4_0: small_row_all(TYPE_Q4_0, w, k, a, r0, nr, acc); return;
    case TYPE_Q4_1: small_row_all(TYPE_Q4_1, w, k, a, r0, nr, acc); return;
    case TYPE_Q5_0: small_row_all(TYPE_Q5_0, w, k, a, r0, nr, acc); return;
    case TYPE_Q8_0: small_row_all(TYPE_Q8_0, w, k, a, r0, nr, acc); return;
    }
}

/* Not itself compiled for AVX-512, so that a call the AVX2 loops serve (a row alone, floats)
 * runs no 512-bit instruction at all. */
static void avx512_rows(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                        float (*acc)[LANES]) {
    if (nr > 1 && t->family != FAM_FLOAT) quant_rows(t, w, k, a, r0, nr, acc);
    else DOT_AVX2.rows(t, w, k, a, r0, nr, acc);
}

const struct dot_isa DOT_AVX512 = {"avx512", avx512_rows, X86_PACKED_TYPES, avx512_rows8, X86_PAIRED_TYPES, avx512_rows16};

#endif
