/* The portable scalar path (the reference for every SIMD path) and the choice of path. */
#include "dot.h"

#include <string.h>

/* acc[0] += K-quant block w . activation block c of row r. */
static void k_row(const struct kchunk *w, const struct acts *a, int c, int r, float *acc) {
    size_t at = (size_t)r * a->kpad + (size_t)c * CHUNK;
    const int8_t *x = a->q + at;
    const int16_t *sum16 = a->sum16 + at / 16;
    int32_t ia = 0, ib = 0;
    for (int j = 0; j < 16; j++) {
        int32_t dot = 0;
        for (int i = 16 * j; i < 16 * j + 16; i++) dot += w->q[i] * x[i];
        ia += w->sc[j] * dot - w->zoff[j] * sum16[j];
        ib += w->mn[j] * sum16[j];
    }
    acc[0] = k_update(acc[0], w->d, w->dmin, a->d[at / QK_K], ia, ib);
}

/* acc[b] += small block b of w . its activation block, b = 0..7. */
static void small_row(const struct qchunk *w, const struct acts *a, int c, int r, float *acc) {
    size_t at = (size_t)r * a->kpad + (size_t)c * CHUNK;
    const int8_t *x = a->q + at;
    const int16_t *sum16 = a->sum16 + at / 16;
    const float *dx = a->d + at / QK;
    for (int b = 0; b < 8; b++) {
        int32_t dot = 0, xsum = sum16[2 * b] + sum16[2 * b + 1];
        for (int i = QK * b; i < QK * b + QK; i++)
            dot += (w->q_signed ? (int8_t)w->q[i] : w->q[i]) * x[i];
        acc[b] = small_update(acc[b], w->d[b], w->m[b], dx[b], dot - w->zero * xsum, xsum, w->has_min);
    }
}

/* acc[i % LANES] += w[i] * x[i]. */
static void float_row(const struct fchunk *w, const struct acts *a, int c, int r, float *acc) {
    const float *x = a->f + (size_t)r * a->kpad + (size_t)c * CHUNK;
    for (int i = 0; i < CHUNK; i++) acc[i % LANES] = fmaf(w->w[i], x[i], acc[i % LANES]);
}

static void scalar_rows(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                        float (*acc)[LANES]) {
    size_t chunk_bytes = (size_t)(CHUNK / t->block) * t->bytes;
    for (int c = 0; c * CHUNK < k; c++) {
        const uint8_t *raw = w + c * chunk_bytes;
        int count = k - c * CHUNK < CHUNK ? k - c * CHUNK : CHUNK;
        if (t->family == FAM_K) {
            struct kchunk wc;
            decode_k(t->id, raw, &wc);
            for (int r = 0; r < nr; r++) k_row(&wc, a, c, r0 + r, acc[r]);
        } else if (t->family == FAM_SMALL) {
            struct qchunk wc;
            decode_small(t->id, raw, count, &wc);
            for (int r = 0; r < nr; r++) small_row(&wc, a, c, r0 + r, acc[r]);
        } else {
            struct fchunk wc;
            decode_float(t->id, raw, count, &wc);
            for (int r = 0; r < nr; r++) float_row(&wc, a, c, r0 + r, acc[r]);
        }
    }
}

const struct dot_isa DOT_SCALAR = {"scalar", scalar_rows};

#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

int dot_isas(const struct dot_isa *out[4]) {
    int n = 0;
    out[n++] = &DOT_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        out[n++] = &DOT_AVX2;
    if (n == 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        out[n++] = &DOT_AVX512; /* calls the AVX2 loops for a lone row and floats */
#endif
#if defined(__aarch64__)
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) out[n++] = &DOT_NEON; /* SDOT/UDOT */
#endif
    return n;
}

const struct dot_isa *dot_isa_named(const char *name) {
    const struct dot_isa *all[4];
    int n = dot_isas(all);
    for (int i = 0; i < n; i++)
        if (strcmp(name, all[i]->name) == 0) return all[i];
    return NULL;
}

const struct dot_isa *dot_isa_best(void) {
    const struct dot_isa *all[4];
    return all[dot_isas(all) - 1];
}
