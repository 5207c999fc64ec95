/* attention.h: the scalar path (the reference) and the AVX2 + F16C path. */
#include "attention.h"

#include <string.h>

#include "quants.h"

static void scores_scalar(const float *q, const uint16_t *keys, int n, int hd, float scale, float *w) {
    for (int j = 0; j < n; j++) {
        const uint16_t *k = keys + (size_t)j * hd;
        float a[8] = {0};
        for (int d = 0; d < hd; d += 8)
            for (int l = 0; l < 8; l++) a[l] += q[d + l] * fp16_to_f32(k[d + l]);
        w[j] = (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) * scale;
    }
}

static void mix_scalar(const float *w, const uint16_t *vals, int n, int hd, float *out) {
    for (int j = 0; j < n; j++) {
        const uint16_t *v = vals + (size_t)j * hd;
        for (int d = 0; d < hd; d++) out[d] += w[j] * fp16_to_f32(v[d]);
    }
}

static const struct attn_isa ATTN_SCALAR = {"scalar", scores_scalar, mix_scalar};

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,f16c")))

/* One key's score, as scores_scalar computes it: 8 lanes, products added in d order, the fixed tree. */
AVX2 static inline __attribute__((always_inline)) float score_avx2(const float *q, const uint16_t *k, int hd,
                                                                   float scale) {
    __m256 a = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        __m256 kv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + d)));
        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + d), kv)); /* no FMA: the scalar rounds twice */
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* (0+4, 1+5, 2+6, 3+7) */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1))) * scale;
}

/* Four keys at a time: four independent chains of adds instead of one waiting on the last (each
 * key's arithmetic unchanged). */
AVX2 static void scores_avx2(const float *q, const uint16_t *keys, int n, int hd, float scale, float *w) {
    int j = 0;
    for (; j + 4 <= n; j += 4)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) w[j + u] = score_avx2(q, keys + (size_t)(j + u) * hd, hd, scale);
    for (; j < n; j++) w[j] = score_avx2(q, keys + (size_t)j * hd, hd, scale);
}

/* out[d0 .. d0 + 8nv) += sum_j w[j] * v_j[..], positions outer, the nv vectors in registers: nv
 * independent chains of adds, each output still summed over j in order (nv a constant when inlined). */
AVX2 static inline __attribute__((always_inline)) void mix_block(const float *w, const uint16_t *vals, int n, int hd,
                                                                 int d0, const int nv, float *out) {
    __m256 o[8];
    for (int u = 0; u < nv; u++) o[u] = _mm256_loadu_ps(out + d0 + 8 * u);
    for (int j = 0; j < n; j++) {
        const uint16_t *v = vals + (size_t)j * hd + d0;
        __m256 wj = _mm256_set1_ps(w[j]);
#pragma GCC unroll 8
        for (int u = 0; u < nv; u++)
            o[u] = _mm256_add_ps(o[u], _mm256_mul_ps(wj, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8 * u)))));
    }
    for (int u = 0; u < nv; u++) _mm256_storeu_ps(out + d0 + 8 * u, o[u]);
}

/* 64 dimensions at a time (8 vectors), then the rest. */
AVX2 static void mix_avx2(const float *w, const uint16_t *vals, int n, int hd, float *out) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) mix_block(w, vals, n, hd, d0, 8, out);
    if (d0 < hd) mix_block(w, vals, n, hd, d0, (hd - d0) / 8, out);
}

static const struct attn_isa ATTN_AVX2 = {"avx2", scores_avx2, mix_avx2};
#endif

const struct attn_isa *attn_isa_for(const char *dot_isa_name) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (strcmp(dot_isa_name, "scalar") != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return &ATTN_AVX2;
#else
    (void)dot_isa_name; /* one path */
#endif
    return &ATTN_SCALAR;
}
