/* attention.h: the scalar path (the reference), the AVX2 + F16C path and the NEON path, and the
 * KV_Q8 rows' quantization.
 *
 * The SIMD paths share one driver (struct tiles): a tile of keys or values is converted to float32
 * once (TILE_FLOATS, in L1; KV_Q8: the int8s as they are, the scales aside), then each query runs
 * over it with the path's own kernel; a KV_Q8 tile's scales are applied to each query's scores after
 * its kernel (with scale 1: x * 1 is x), or to its weights before the mix.  A query's arithmetic is
 * the reference's whatever the tile and the others. */
#include "attention.h"

#include <math.h>
#include <string.h>

#include "quants.h"

#define TILE_FLOATS 4096 /* a tile of converted keys or values: 16 KB */

static int longest(const struct attn_query *qs, int nq) {
    int n = 0;
    for (int i = 0; i < nq; i++) n = qs[i].n > n ? qs[i].n : n;
    return n;
}

/* x - less (less NULL: x) as a KV_Q8 row. */
static void q8_row_less(const float *x, const float *less, int hd, uint8_t *row) {
    float amax = 0.0f;
    for (int i = 0; i < hd; i++) {
        float a = fabsf(less ? x[i] - less[i] : x[i]);
        amax = a > amax ? a : amax; /* a NaN is skipped */
    }
    float id = amax > 0.0f ? 127.0f / amax : 0.0f, s = amax / 127.0f;
    for (int i = 0; i < hd; i++) {
        float v = ((less ? x[i] - less[i] : x[i]) * id + 12582912.0f) - 12582912.0f; /* round half to even: quants.c's round_even */
        row[i] = (uint8_t)(int8_t)(v >= -127.0f && v <= 127.0f ? v : 0.0f);
    }
    memcpy(row + hd, &s, sizeof(s));
}

void kv_q8_row(const float *x, int hd, uint8_t *row) { q8_row_less(x, NULL, hd, row); }

void kv_q8_key(const float *k, const float *bias, int hd, uint8_t *row) { q8_row_less(k, bias, hd, row); }

/* Element d of a row as a float (exactly), and a KV_Q8 row's scale. */
static inline float row_at(const uint8_t *row, int type, int d) {
    uint16_t h;
    if (type == KV_Q8) return (float)(int8_t)row[d];
    memcpy(&h, row + 2 * (size_t)d, sizeof(h));
    return fp16_to_f32(h);
}

static inline float row_scale(const uint8_t *row, int hd) {
    float s;
    memcpy(&s, row + hd, sizeof(s));
    return s;
}

static void scores_scalar(const struct attn_query *qs, int nq, const uint8_t *keys, int type, int hd, float scale) {
    size_t rb = kv_row_bytes(type, hd);
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < qs[i].n; j++) {
            const uint8_t *k = keys + (size_t)j * rb;
            const float *q = qs[i].q;
            float a[8] = {0};
            for (int d = 0; d < hd; d += 8)
                for (int l = 0; l < 8; l++) a[l] += q[d + l] * row_at(k, type, d + l);
            float dot = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
            qs[i].w[j] = type == KV_Q8 ? (dot * row_scale(k, hd)) * scale : dot * scale;
        }
}

static void mix_scalar(const struct attn_query *qs, int nq, const uint8_t *vals, int type, int hd) {
    size_t rb = kv_row_bytes(type, hd);
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < qs[i].n; j++) {
            const uint8_t *v = vals + (size_t)j * rb;
            float wj = type == KV_Q8 ? qs[i].w[j] * row_scale(v, hd) : qs[i].w[j];
            for (int d = 0; d < hd; d++) qs[i].out[d] += wj * row_at(v, type, d);
        }
}

static const struct attn_isa ATTN_SCALAR = {"scalar", scores_scalar, mix_scalar};

#if defined(__x86_64__) || defined(__aarch64__)
/* A SIMD path's pieces for the tile driver below. */
struct tiles {
    int keys; /* keys a scores call fills at a time (its vector width); TILE_FLOATS / hd is cut to a multiple of 8 */
    void (*to_f32)(const uint16_t *h, int count, float *f); /* count float16s, a multiple of 8 */
    void (*q8_to_f32)(const uint8_t *rows, int n, int hd, float *f); /* n KV_Q8 rows' int8s, as floats */
    /* w[0 .. nk rounded up to `keys`) for the float32 keys kf (rows of hd; the rows past nk are zeros) */
    void (*scores)(const float *q, const float *kf, int nk, int hd, float scale, float *w);
    /* out += sum_{j < m} w[j] * vf row j, each output summed over j in order */
    void (*mix)(const float *w, const float *vf, int m, int hd, float *out);
    /* keys for `scores` in the path's own layout, rows nk .. padded zeros, and (KV_Q8) their scales;
     * NULL: rows of hd as load_tile writes them */
    void (*keys_f32)(const uint8_t *rows, int type, int nk, int padded, int hd, float *kf, float *ks);
};

/* n rows as float32 rows of hd in f, and (KV_Q8) their scales in s. */
static void load_tile(const struct tiles *t, const uint8_t *rows, int type, int n, int hd, float *f, float *s) {
    if (type != KV_Q8) {
        t->to_f32((const uint16_t *)rows, n * hd, f);
        return;
    }
    t->q8_to_f32(rows, n, hd, f);
    for (int j = 0; j < n; j++) s[j] = row_scale(rows + (size_t)j * (hd + 4), hd);
}

static void scores_tiled(const struct tiles *t, const struct attn_query *qs, int nq, const uint8_t *keys, int type,
                         int hd, float scale) {
    float kf[TILE_FLOATS] __attribute__((aligned(64))), ks[TILE_FLOATS / 8];
    int group = t->keys > 8 ? t->keys : 8, rows = (TILE_FLOATS / hd) / group * group, n = longest(qs, nq), q8 = type == KV_Q8;
    if (rows < group) { /* a head too wide for a tile of a group of keys (none the engine has met): the reference */
        scores_scalar(qs, nq, keys, type, hd, scale);
        return;
    }
    for (int j0 = 0; j0 < n; j0 += rows) {
        int nk = n - j0 < rows ? n - j0 : rows, padded = (nk + t->keys - 1) / t->keys * t->keys;
        const uint8_t *at = keys + (size_t)j0 * kv_row_bytes(type, hd);
        if (t->keys_f32) {
            t->keys_f32(at, type, nk, padded, hd, kf, ks);
        } else {
            load_tile(t, at, type, nk, hd, kf, ks);
            memset(kf + (size_t)nk * hd, 0, sizeof(float) * (size_t)(padded - nk) * hd); /* scores past n: never read */
        }
        for (int i = 0; i < nq; i++) {
            if (qs[i].n <= j0) continue;
            int m = qs[i].n - j0 < nk ? qs[i].n - j0 : nk;
            float *w = qs[i].w + j0;
            t->scores(qs[i].q, kf, m, hd, q8 ? 1.0f : scale, w);
            if (q8)
                for (int j = 0; j < m; j++) w[j] = (w[j] * ks[j]) * scale;
        }
    }
}

static void mix_tiled(const struct tiles *t, const struct attn_query *qs, int nq, const uint8_t *vals, int type,
                      int hd) {
    float vf[TILE_FLOATS] __attribute__((aligned(64))), vs[TILE_FLOATS / 8], ws[TILE_FLOATS / 8];
    int rows = TILE_FLOATS / hd, n = longest(qs, nq);
    if (rows < 1) { /* a head wider than a tile: the reference */
        mix_scalar(qs, nq, vals, type, hd);
        return;
    }
    for (int j0 = 0; j0 < n; j0 += rows) {
        int nv = n - j0 < rows ? n - j0 : rows;
        load_tile(t, vals + (size_t)j0 * kv_row_bytes(type, hd), type, nv, hd, vf, vs);
        for (int i = 0; i < nq; i++) {
            if (qs[i].n <= j0) continue;
            int m = qs[i].n - j0 < nv ? qs[i].n - j0 : nv;
            const float *w = qs[i].w + j0;
            if (type == KV_Q8) {
                for (int j = 0; j < m; j++) ws[j] = w[j] * vs[j];
                w = ws;
            }
            t->mix(w, vf, m, hd, qs[i].out);
        }
    }
}
#endif

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 static void to_f32_avx2(const uint16_t *h, int count, float *f) {
    for (int i = 0; i < count; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
}

AVX2 static void q8_to_f32_avx2(const uint8_t *rows, int n, int hd, float *f) {
    for (int j = 0; j < n; j++, rows += hd + 4, f += hd)
        for (int d = 0; d < hd; d += 8)
            _mm256_storeu_ps(f + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rows + d)))));
}

/* Eight keys' scores from their 8-lane sums a[u], each as the reference adds its lanes:
 * ((0+4)+(2+6))+((1+5)+(3+7)) for every key at once, then into key order. */
AVX2 static inline __attribute__((always_inline)) __m256 lanes_tree8(const __m256 a[8]) {
    __m256 s[4]; /* s[p]: keys 2p (low half) and 2p+1 (high half) as (0+4, 1+5, 2+6, 3+7) */
    for (int p = 0; p < 4; p++)
        s[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    /* keys (0, 2 | 1, 3) and (4, 6 | 5, 7), each as ((0+4)+(2+6), (1+5)+(3+7)) */
    __m256 t0 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
    __m256 t1 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
    /* keys (0, 2, 4, 6 | 1, 3, 5, 7) */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Eight keys at a time: eight independent chains of adds. */
AVX2 static void scores_avx2(const float *q, const float *kf, int nk, int hd, float scale, float *w) {
    __m256 sc = _mm256_set1_ps(scale);
    for (int u0 = 0; u0 < nk; u0 += 8) {
        const float *k = kf + (size_t)u0 * hd;
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) /* no FMA: the reference rounds twice */
                a[u] = _mm256_add_ps(a[u], _mm256_mul_ps(qv, _mm256_loadu_ps(k + (size_t)u * hd + d)));
        }
        _mm256_storeu_ps(w + u0, _mm256_mul_ps(lanes_tree8(a), sc));
    }
}

/* out[d0 .. d0 + 8nv) += sum_{j < n} w[j] * v_j[..] over float32 rows vf (stride hd), positions
 * outer, the nv vectors in registers: nv chains of adds, each output summed over j in order. */
AVX2 static inline __attribute__((always_inline)) void mix_block(const float *w, const float *vf, int n, int hd, int d0,
                                                                 const int nv, float *out) {
    __m256 o[8];
    for (int u = 0; u < nv; u++) o[u] = _mm256_loadu_ps(out + d0 + 8 * u);
    for (int j = 0; j < n; j++) {
        const float *v = vf + (size_t)j * hd + d0;
        __m256 wj = _mm256_set1_ps(w[j]);
#pragma GCC unroll 8
        for (int u = 0; u < nv; u++) o[u] = _mm256_add_ps(o[u], _mm256_mul_ps(wj, _mm256_loadu_ps(v + 8 * u)));
    }
    for (int u = 0; u < nv; u++) _mm256_storeu_ps(out + d0 + 8 * u, o[u]);
}

/* 64 dimensions at a time (8 vectors), then the rest. */
AVX2 static void mix_avx2(const float *w, const float *vf, int m, int hd, float *out) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) mix_block(w, vf, m, hd, d0, 8, out);
    if (d0 < hd) mix_block(w, vf, m, hd, d0, (hd - d0) / 8, out);
}

static const struct tiles TILES_AVX2 = {8, to_f32_avx2, q8_to_f32_avx2, scores_avx2, mix_avx2, NULL};
static void scores_tiles_avx2(const struct attn_query *qs, int nq, const uint8_t *keys, int type, int hd, float scale) {
    scores_tiled(&TILES_AVX2, qs, nq, keys, type, hd, scale);
}
static void mix_tiles_avx2(const struct attn_query *qs, int nq, const uint8_t *vals, int type, int hd) {
    mix_tiled(&TILES_AVX2, qs, nq, vals, type, hd);
}
static const struct attn_isa ATTN_AVX2 = {"avx2", scores_tiles_avx2, mix_tiles_avx2};

/* AVX-512: sixteen keys at a time, two in a register.  The keys' tile interleaves pairs: for keys
 * 2p and 2p+1, each block of 8 dimensions of 2p then the same of 2p+1 (16 floats), so one load
 * holds both keys' 8 lanes and each lane adds the products the reference's lane adds, in its order;
 * the lanes of each key are then added as the AVX2 path adds them (lanes_tree8).  mix keeps 16
 * dimensions a register, each output a chain of multiplies and adds over j in order. */
#define AVX512A __attribute__((target("avx512f,avx512vl,avx2,f16c")))

AVX512A static void to_f32_avx512(const uint16_t *h, int count, float *f) {
    int i = 0;
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i < count; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
}

AVX512A static void q8_to_f32_avx512(const uint8_t *rows, int n, int hd, float *f) {
    for (int j = 0; j < n; j++, rows += hd + 4, f += hd) {
        int d = 0;
        for (; d + 16 <= hd; d += 16)
            _mm512_storeu_ps(f + d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rows + d)))));
        for (; d < hd; d += 8)
            _mm256_storeu_ps(f + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rows + d)))));
    }
}

/* 8 dimensions of a row from d on, as 8 float16s (KV_Q8: converted from int8 exactly; F16: as they are). */
AVX512A static inline __m256 row8_avx512(const uint8_t *row, int type, int d) {
    if (type == KV_Q8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)d)));
}

AVX512A static void keys_f32_avx512(const uint8_t *rows, int type, int nk, int padded, int hd, float *kf, float *ks) {
    size_t rb = kv_row_bytes(type, hd);
    for (int j = 0; j < padded; j += 2) {
        const uint8_t *a = rows + (size_t)j * rb, *b = a + rb;
        float *f = kf + (size_t)j * hd;
        for (int d = 0; d < hd; d += 8) {
            __m256 x = j < nk ? row8_avx512(a, type, d) : _mm256_setzero_ps();
            __m256 y = j + 1 < nk ? row8_avx512(b, type, d) : _mm256_setzero_ps();
            _mm256_storeu_ps(f + 2 * d, x);
            _mm256_storeu_ps(f + 2 * d + 8, y);
        }
        if (type == KV_Q8) {
            if (j < nk) ks[j] = row_scale(a, hd);
            if (j + 1 < nk) ks[j + 1] = row_scale(b, hd);
        }
    }
}

AVX512A static void scores_avx512(const float *q, const float *kf, int nk, int hd, float scale, float *w) {
    __m256 sc = _mm256_set1_ps(scale);
    for (int u0 = 0; u0 < nk; u0 += 16) {
        const float *k = kf + (size_t)u0 * hd;
        __m512 a[8];
        for (int p = 0; p < 8; p++) a[p] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + d))));
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) /* no FMA: the reference rounds twice */
                a[p] = _mm512_add_ps(a[p], _mm512_mul_ps(qv, _mm512_loadu_ps(k + (size_t)p * 2 * hd + 2 * d)));
        }
        for (int half = 0; half < 2; half++) {
            __m256 b[8];
            for (int p = 0; p < 4; p++) {
                b[2 * p] = _mm512_castps512_ps256(a[4 * half + p]);
                b[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[4 * half + p]), 1));
            }
            _mm256_storeu_ps(w + u0 + 8 * half, _mm256_mul_ps(lanes_tree8(b), sc));
        }
    }
}

AVX512A static inline __attribute__((always_inline)) void mix_block512(const float *w, const float *vf, int n, int hd,
                                                                       int d0, const int nv, float *out) {
    __m512 o[8];
    for (int u = 0; u < nv; u++) o[u] = _mm512_loadu_ps(out + d0 + 16 * u);
    for (int j = 0; j < n; j++) {
        const float *v = vf + (size_t)j * hd + d0;
        __m512 wj = _mm512_set1_ps(w[j]);
#pragma GCC unroll 8
        for (int u = 0; u < nv; u++) o[u] = _mm512_add_ps(o[u], _mm512_mul_ps(wj, _mm512_loadu_ps(v + 16 * u)));
    }
    for (int u = 0; u < nv; u++) _mm512_storeu_ps(out + d0 + 16 * u, o[u]);
}

/* 128 dimensions at a time (8 registers), then 16 at a time, then a last 8 on the AVX2 path's block. */
AVX512A static void mix_avx512(const float *w, const float *vf, int m, int hd, float *out) {
    int d0 = 0;
    for (; d0 + 128 <= hd; d0 += 128) mix_block512(w, vf, m, hd, d0, 8, out);
    if (d0 + 16 <= hd) {
        mix_block512(w, vf, m, hd, d0, (hd - d0) / 16, out);
        d0 += (hd - d0) / 16 * 16;
    }
    if (d0 < hd) mix_block(w, vf, m, hd, d0, 1, out);
}

static const struct tiles TILES_AVX512 = {16, to_f32_avx512, q8_to_f32_avx512, scores_avx512, mix_avx512, keys_f32_avx512};
static void scores_tiles_avx512(const struct attn_query *qs, int nq, const uint8_t *keys, int type, int hd, float scale) {
    scores_tiled(&TILES_AVX512, qs, nq, keys, type, hd, scale);
}
static void mix_tiles_avx512(const struct attn_query *qs, int nq, const uint8_t *vals, int type, int hd) {
    mix_tiled(&TILES_AVX512, qs, nq, vals, type, hd);
}
static const struct attn_isa ATTN_AVX512 = {"avx512", scores_tiles_avx512, mix_tiles_avx512};
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

/* fcvtl: exact. */
static void to_f32_neon(const uint16_t *h, int count, float *f) {
    for (int i = 0; i < count; i += 4) vst1q_f32(f + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
}

static void q8_to_f32_neon(const uint8_t *rows, int n, int hd, float *f) {
    for (int j = 0; j < n; j++, rows += hd + 4, f += hd)
        for (int d = 0; d < hd; d += 8) {
            int16x8_t x = vmovl_s8(vld1_s8((const int8_t *)rows + d));
            vst1q_f32(f + d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(x))));
            vst1q_f32(f + d + 4, vcvtq_f32_s32(vmovl_high_s16(x)));
        }
}

/* Key u's 8 lanes (lo: 0-3, hi: 4-7) reduced as the reference: s = (0+4, 1+5, 2+6, 3+7), then
 * t = ((0+4)+(2+6), (1+5)+(3+7)); four keys' t paired and gathered into one vector. */
static inline float32x4_t lanes_tree4(const float32x4_t lo[4], const float32x4_t hi[4]) {
    float32x4_t t[4];
    for (int u = 0; u < 4; u++) {
        float32x4_t s = vaddq_f32(lo[u], hi[u]);
        t[u] = vaddq_f32(s, vextq_f32(s, s, 2));
    }
    return vuzp1q_f32(vpaddq_f32(t[0], t[1]), vpaddq_f32(t[2], t[3])); /* t0 + t1 of each key */
}

/* Four keys at a time: eight independent chains of adds. */
static void scores_neon(const float *q, const float *kf, int nk, int hd, float scale, float *w) {
    for (int u0 = 0; u0 < nk; u0 += 4) {
        const float *k = kf + (size_t)u0 * hd;
        float32x4_t lo[4], hi[4];
        for (int u = 0; u < 4; u++) lo[u] = hi[u] = vdupq_n_f32(0.0f);
        for (int d = 0; d < hd; d += 8) {
            float32x4_t q0 = vld1q_f32(q + d), q1 = vld1q_f32(q + d + 4);
            for (int u = 0; u < 4; u++) { /* no FMA: the reference rounds twice */
                lo[u] = vaddq_f32(lo[u], vmulq_f32(q0, vld1q_f32(k + (size_t)u * hd + d)));
                hi[u] = vaddq_f32(hi[u], vmulq_f32(q1, vld1q_f32(k + (size_t)u * hd + d + 4)));
            }
        }
        vst1q_f32(w + u0, vmulq_n_f32(lanes_tree4(lo, hi), scale));
    }
}

/* out[d0 .. d0 + 4nv) += sum_{j < n} w[j] * v_j[..], positions outer, nv vectors in registers. */
static inline __attribute__((always_inline)) void mix_block_neon(const float *w, const float *vf, int n, int hd, int d0,
                                                                 const int nv, float *out) {
    float32x4_t o[8];
    for (int u = 0; u < nv; u++) o[u] = vld1q_f32(out + d0 + 4 * u);
    for (int j = 0; j < n; j++) {
        const float *v = vf + (size_t)j * hd + d0;
        for (int u = 0; u < nv; u++) o[u] = vaddq_f32(o[u], vmulq_n_f32(vld1q_f32(v + 4 * u), w[j]));
    }
    for (int u = 0; u < nv; u++) vst1q_f32(out + d0 + 4 * u, o[u]);
}

/* 32 dimensions at a time (8 vectors), then the rest. */
static void mix_neon(const float *w, const float *vf, int m, int hd, float *out) {
    int d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32) mix_block_neon(w, vf, m, hd, d0, 8, out);
    if (d0 < hd) mix_block_neon(w, vf, m, hd, d0, (hd - d0) / 4, out);
}

static const struct tiles TILES_NEON = {4, to_f32_neon, q8_to_f32_neon, scores_neon, mix_neon, NULL};
static void scores_tiles_neon(const struct attn_query *qs, int nq, const uint8_t *keys, int type, int hd, float scale) {
    scores_tiled(&TILES_NEON, qs, nq, keys, type, hd, scale);
}
static void mix_tiles_neon(const struct attn_query *qs, int nq, const uint8_t *vals, int type, int hd) {
    mix_tiled(&TILES_NEON, qs, nq, vals, type, hd);
}
static const struct attn_isa ATTN_NEON = {"neon", scores_tiles_neon, mix_tiles_neon};
#endif

const struct attn_isa *attn_isa_for(const char *dot_isa_name) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (strcmp(dot_isa_name, "avx512") == 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("f16c"))
        return &ATTN_AVX512;
    if (strcmp(dot_isa_name, "scalar") != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return &ATTN_AVX2;
#elif defined(__aarch64__)
    if (strcmp(dot_isa_name, "scalar") != 0) return &ATTN_NEON; /* NEON is part of every aarch64 CPU */
#else
    (void)dot_isa_name; /* one path */
#endif
    return &ATTN_SCALAR;
}
