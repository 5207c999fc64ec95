/* The native kernels without Python, for any architecture (tests/test_native_build.py builds it with
 * the host compiler, and for aarch64 runs it under qemu-aarch64 where the cross compiler and qemu are
 * installed).
 *
 *   selftest [scalar]     one line per type: its name and a hash of every output's bits
 *
 * For every supported type, on random blocks: a row's outputs are the same bits in calls of 1..9
 * rows and at 1 and 3 threads, and within the error 8-bit activations allow of a double-precision
 * reference (quants.c's own dequantization).  A failure prints what differs and exits 1.  The
 * hashes let the test compare paths and machines: the scalar path, the host's SIMD path and another
 * architecture's must agree bit for bit (fmaf is correctly rounded everywhere; nothing else fuses). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "floatops.h"
#include "matmul.h"

#define N 24
#define M 9

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform(void) { return (float)(next() >> 8) / 16777216.0f * 2.0f - 1.0f; } /* [-1, 1) */

/* Offsets of a block's float16 scale fields (written with small positive normals). */
static void scale_fields(int type, int *at, int *count) {
    *count = 1, at[0] = 0, at[1] = 2;
    if (type == TYPE_Q4_1 || type == TYPE_Q4_K || type == TYPE_Q5_K) *count = 2;
    if (type == TYPE_Q6_K) at[0] = 208;
}

static void random_weights(const struct type_info *t, uint8_t *w, int n, int k) {
    size_t bytes = (size_t)n * row_bytes(t, k);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)next();
    if (t->family == FAM_FLOAT) {
        for (size_t i = 0; i < (size_t)n * k; i++) {
            float v = uniform() * 0.1f;
            uint32_t u;
            memcpy(&u, &v, 4);
            if (t->id == TYPE_F32) memcpy(w + 4 * i, &v, 4);
            else {
                uint16_t h = t->id == TYPE_BF16 ? (uint16_t)(u >> 16) : (uint16_t)(0x2000 | (next() & 0x83FF));
                memcpy(w + 2 * i, &h, 2);
            }
        }
        return;
    }
    int at[2], count;
    scale_fields(t->id, at, &count);
    for (size_t b = 0; b < bytes / t->bytes; b++)
        for (int f = 0; f < count; f++) {
            uint16_t h = (uint16_t)(0x1400 | (next() & 0x3FF)); /* about 2^-10 */
            memcpy(w + b * t->bytes + at[f], &h, 2);
        }
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001B3ull;
    return h;
}

static int check_type(const struct dot_isa *isa, int type, int k) {
    const struct type_info *t = type_info(type);
    size_t row = row_bytes(t, k);
    uint8_t *w = malloc(N * row);
    float *x = malloc(sizeof(float) * M * k), *full = malloc(sizeof(float) * M * N), *part = malloc(sizeof(float) * M * N);
    float *deq = malloc(sizeof(float) * k);
    random_weights(t, w, N, k);
    for (int i = 0; i < M * k; i++) x[i] = uniform() * (next() % 50 == 0 ? 20.0f : 1.0f);
    int bad = matmul(isa, t, w, N, k, x, M, full, 1) != 0;
    for (int m = 1; m <= M && !bad; m++)
        for (int threads = 1; threads <= 3 && !bad; threads += 2) {
            bad = matmul(isa, t, w, N, k, x + (size_t)(M - m) * k, m, part, threads) != 0;
            if (!bad && memcmp(part, full + (size_t)(M - m) * N, sizeof(float) * m * N)) {
                printf("%s: rows %d..%d of a %d-row call at %d threads differ from the %d-row call\n", t->name,
                       M - m, M - 1, m, threads, M);
                bad = 1;
            }
        }
    for (int j = 0; j < N && !bad; j++) { /* the double reference, and the 8-bit activations' bound */
        dequantize_row(t, w + j * row, k, deq);
        for (int r = 0; r < M && !bad; r++) {
            const float *xr = x + (size_t)r * k;
            double ref = 0, size = 0, err = 0;
            int block = t->family == FAM_FLOAT ? 0 : t->block == QK ? QK : QK_K;
            for (int i = 0; i < k; i++) {
                ref += (double)deq[i] * xr[i];
                size += fabs((double)deq[i] * xr[i]);
            }
            for (int b = 0; block && b < k / block; b++) {
                double amax = 0;
                for (int i = b * block; i < (b + 1) * block; i++) amax = fmax(amax, fabs(xr[i]));
                for (int i = b * block; i < (b + 1) * block; i++) err += fabs(deq[i]) * amax / 127.0 / 2.0;
            }
            double bound = err + (block ? 1e-5 : (k / 32.0 + 6) * 0x1p-24) * size + 1e-30;
            if (fabs(full[r * N + j] - ref) > bound) {
                printf("%s: output %d of row %d is %.9g, the reference %.9g (bound %.3g)\n", t->name, j, r,
                       full[r * N + j], ref, bound);
                bad = 1;
            }
        }
    }
    if (!bad && pack_unpacks(t) && pack_bytes(t, N, k)) { /* a tied head's lookup reads rows back from the packed copy */
        uint8_t *packed = malloc(pack_bytes(t, N, k)), raw[64];
        pack_rows(t, w, N, k, packed);
        for (int j = 0; j < N && !bad; j++)
            for (int p = 0; p < k / t->block && !bad; p++) {
                unpack_block(t, packed, k, j, p, raw);
                if (memcmp(raw, w + j * row + (size_t)p * t->bytes, (size_t)t->bytes)) {
                    printf("%s: block %d of row %d read back from the interleaved copy differs\n", t->name, p, j);
                    bad = 1;
                }
            }
        free(packed);
    }
    if (!bad) printf("%s %016llx\n", t->name, (unsigned long long)fnv(0xcbf29ce484222325ull, full, sizeof(float) * M * N));
    free(w), free(x), free(full), free(part), free(deq);
    return bad;
}

/* matmul.c takes each output with lanes_take_used: it must give lanes_take's bits (a -0.0 sum
 * included) and leave every lane cleared, for K-quants (1 lane), small blocks (8) and floats (32). */
static int check_lanes(void) {
    static const int used[] = {1, 8, LANES};
    float a[LANES] __attribute__((aligned(16))), b[LANES] __attribute__((aligned(16)));
    for (int u = 0; u < 3; u++) {
        for (int trial = 0; trial < 1000; trial++) {
            for (int i = 0; i < LANES; i++) {
                float v = uniform() * (float)(1 << (next() % 20));
                int kind = next() % 8; /* some lanes exact zeros of either sign */
                a[i] = i >= used[u] ? 0.0f : kind == 0 ? -0.0f : kind == 1 ? 0.0f : v;
            }
            if (trial == 0) /* every used lane -0.0: the sum is +0.0 */
                for (int i = 0; i < used[u]; i++) a[i] = -0.0f;
            memcpy(b, a, sizeof(a));
            float want = lanes_take(b), got = lanes_take_used(a, used[u]);
            if (memcmp(&want, &got, sizeof(float)) != 0 || memcmp(a, b, sizeof(a)) != 0) {
                printf("lanes_take_used(%d lanes) gives %a, lanes_take %a, or leaves a lane set\n", used[u],
                       (double)got, (double)want);
                return 1;
            }
        }
    }
    return 0;
}

/* floatops.h on this path: e^x within 2 ulp of double's exp over its range (and 0 or the clamp's
 * value beyond it), SiLU within 4 ulp of double's on finite inputs; one line with a hash of all the bits, which the
 * test compares across paths and architectures. */
static int check_floatops(const struct dot_isa *isa) {
    enum { COUNT = 40000 };
    const struct float_isa *f = float_isa_for(isa->name);
    static float x[COUNT], e[COUNT], g[COUNT], u[COUNT];
    for (int i = 0; i < COUNT; i++) {
        x[i] = i < 20000 ? -90.0f + 180.0f * (float)i / 20000.0f : uniform() * (float)(1 << (next() % 8));
        u[i] = uniform() * 4.0f;
    }
    x[0] = 0.0f, x[1] = -0.0f, x[2] = INFINITY, x[3] = -INFINITY, x[4] = 1e-30f, x[5] = -1e-30f;
    memcpy(e, x, sizeof(x));
    memcpy(g, x, sizeof(x));
    f->exp_shifted(e, COUNT - 7, 0.0f); /* an odd count: the vector loop and its scalar tail */
    e[COUNT - 7] = exp_fixed(x[COUNT - 7]);
    for (int i = COUNT - 6; i < COUNT; i++) f->exp_shifted(e + i, 1, 0.0f);
    f->silu_mul(g, u, COUNT - 3);
    f->silu_mul(g + COUNT - 3, u + COUNT - 3, 3);
    for (int i = 0; i < COUNT; i++) {
        double c = x[i] < -87.0f ? -87.0 : x[i] > 88.0f ? 88.0 : x[i];
        double want = exp(c), ulp = ldexp(1.0, ilogb(want) - 23);
        if (fabs(e[i] - want) > 2 * ulp) {
            printf("%s: e^%a is %a, double's %a (more than 2 ulp)\n", f->name, (double)x[i], (double)e[i], want);
            return 1;
        }
        if (isinf(x[i])) continue; /* silu(+-inf): a pass that has one has gone wrong already */
        double s = x[i] / (1.0 + exp(-(double)x[i])) * u[i];
        double su = s == 0 || isinf(s) ? 0 : ldexp(1.0, ilogb(s) - 23);
        if (!(g[i] == s || fabs(g[i] - s) <= 4 * su) && !(fabs(x[i]) > 87.0f && fabs(g[i] - s) <= 1e-30)) {
            printf("%s: silu(%a) * %a is %a, double's %a (more than 4 ulp)\n", f->name, (double)x[i], (double)u[i],
                   (double)g[i], s);
            return 1;
        }
    }
    /* to_f16 against f32_to_f16: random bits (NaNs with payloads, infinities, tiny and huge), floats in
     * and below float16's normal range, exact halfway cases there, NaNs, and the overflow edge */
    static float hx[COUNT];
    static uint16_t hw[COUNT];
    for (int i = 0; i < COUNT; i++) {
        uint32_t b = next(), sign = next() & 0x80000000u;
        if (i % 4 == 1) b = sign | (103 + next() % 41) << 23 | (next() & 0x7FFFFF);
        if (i % 4 == 2) b = sign | (100 + next() % 43) << 23 | (next() & 0x7FE000) | 0x1000; /* halfway (normals) */
        if (i % 4 == 3) b = sign | 0x7F800000 | ((next() & 0x7FFFFF) | 1);
        memcpy(&hx[i], &b, 4);
    }
    hx[0] = 65504.0f, hx[4] = 65519.996f, hx[8] = 65520.0f, hx[12] = -0.0f, hx[16] = 0x1p-25f, hx[20] = 0x1.8p-25f;
    f->to_f16(hx, hw, COUNT - 5);
    for (int i = COUNT - 5; i < COUNT; i++) f->to_f16(hx + i, hw + i, 1);
    for (int i = 0; i < COUNT; i++)
        if (hw[i] != f32_to_f16(hx[i])) {
            printf("%s: float16 of %a is %04x, the reference's %04x\n", f->name, (double)hx[i], hw[i], f32_to_f16(hx[i]));
            return 1;
        }
    uint64_t h = fnv(fnv(0xcbf29ce484222325ull, e, sizeof(e)), hw, sizeof(hw));
    printf("floatops %016llx\n", (unsigned long long)fnv(h, g, sizeof(g)));
    return 0;
}

/* floatops.h's quantize on this path against quants.c's quantize_row, the reference: the same bytes,
 * scales and sums of 16 for blocks of 32 and 256, over rows of every magnitude with zeros, -0, tiny
 * values, infinities and NaNs among them; one line with a hash of all of it, compared across paths. */
static int check_quantize(const struct dot_isa *isa) {
    enum { K = 1024 };
    const struct float_isa *f = float_isa_for(isa->name);
    static float x[K], dw[K / 32], dr[K / 32];
    static int8_t qw[K], qr[K];
    static int16_t sw[K / 16], sr[K / 16];
    uint64_t h = 0xcbf29ce484222325ull;
    for (int round = 0; round < 24; round++) {
        for (int i = 0; i < K; i++) x[i] = uniform() * (float)(1 << (next() % 12)) / (float)(1 << (round % 8));
        if (round % 3 == 1) /* a few odd values in some blocks; block 1 of 32 all zeros */
            for (int i = 0; i < 8; i++) x[next() % K] = (float[]){0.0f, -0.0f, 1e-40f, -1e-38f, INFINITY, -INFINITY, NAN, 127.5f}[i];
        if (round % 3 == 2) memset(x + 32, 0, 32 * sizeof(float));
        for (int block = 32; block <= 256; block *= 8) {
            quantize_row(x, K, block, qr, dr, sr);
            f->quantize(x, K, block, qw, dw, sw);
            if (memcmp(qr, qw, K) || memcmp(dr, dw, sizeof(float) * (K / block)) || memcmp(sr, sw, sizeof(sr))) {
                printf("%s: quantize (round %d, blocks of %d) differs from quantize_row\n", f->name, round, block);
                return 1;
            }
            h = fnv(fnv(fnv(h, qw, K), dw, sizeof(float) * (K / block)), sw, sizeof(sw));
        }
    }
    printf("quantize %016llx\n", (unsigned long long)h);
    return 0;
}

/* attention.h on this path: scores and mix over float16 keys and values (KV_F16), then over int8 rows
 * with their scales (KV_Q8, quantized here by kv_q8_row from random floats, a few rows all zeros), at
 * head sizes that are and are not a multiple of 64 (the AVX2 mix keeps 64 dimensions in registers) or
 * too wide for a tile of 8 keys (520), position counts around groups of 8 keys and tiles (32 and 64
 * rows at 128 and 64 dims), for 1..5 queries at once with counts that differ as a sequence's rows do.
 * Each query alone must give the bits it gives among others; one line per format with a hash of all
 * the bits (the KV_Q8 rows' too), which the test compares across paths. */
static int check_attention(const struct dot_isa *isa, int type) {
    const struct attn_isa *at = attn_isa_for(isa->name);
    static const int dims[] = {8, 64, 80, 128, 520}, counts[] = {1, 3, 4, 5, 37, 70};
    enum { MAXN = 74, MAXD = 520, MAXQ = 5 };
    static uint8_t kv[2][MAXN * (MAXD * 2)];
    static float q[MAXQ][MAXD], w[MAXQ][MAXN + ATTN_PAD], out[MAXQ][MAXD], w1[MAXN + ATTN_PAD], out1[MAXD], x[MAXD];
    uint64_t h = 0xcbf29ce484222325ull;
    int bad = 0;
    for (size_t d = 0; d < sizeof(dims) / sizeof(dims[0]); d++)
        for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++)
            for (int nq = 1; nq <= MAXQ; nq += 2) {
                int hd = dims[d], n = counts[c];
                size_t rb = kv_row_bytes(type, hd);
                float scale = type == KV_Q8 ? 1.0f / sqrtf((float)hd) : 0.125f; /* the engine's, not a power of 2 at 128 */
                struct attn_query qs[MAXQ];
                for (int i = 0; type == KV_F16 && i < (n + nq) * hd; i++) /* normal float16s of either sign, about 2^-3 .. 2^1 */
                    for (int which = 0; which < 2; which++) {
                        uint16_t f = (uint16_t)(0x3000 | (next() & 0x93FF));
                        memcpy(kv[which] + 2 * (size_t)i, &f, 2);
                    }
                for (int r = 0; type == KV_Q8 && r < n + nq; r++) /* floats of a row's own size, 1 row in 16 zeros */
                    for (int which = 0; which < 2; which++) {
                        uint8_t *row = kv[which] + (size_t)r * rb;
                        float mag = (float)(1 + next() % 64) * 0.0625f, zero = next() % 16 == 0;
                        for (int e = 0; e < hd; e++) x[e] = zero ? 0.0f : uniform() * mag;
                        kv_q8_row(x, hd, row);
                        h = fnv(h, row, rb);
                    }
                for (int i = 0; i < nq; i++) {
                    for (int e = 0; e < hd; e++) q[i][e] = uniform(), out[i][e] = 0.0f;
                    qs[i] = (struct attn_query){q[i], n + (i * 3) % (nq + 1), w[i], out[i]}; /* rows a few apart */
                }
                at->scores(qs, nq, kv[0], type, hd, scale);
                at->mix(qs, nq, kv[1], type, hd);
                for (int i = 0; i < nq; i++) {
                    int ni = qs[i].n;
                    struct attn_query one = {q[i], ni, w1, out1};
                    for (int e = 0; e < hd; e++) out1[e] = 0.0f;
                    at->scores(&one, 1, kv[0], type, hd, scale);
                    at->mix(&one, 1, kv[1], type, hd);
                    if (memcmp(w1, w[i], sizeof(float) * ni) != 0 || memcmp(out1, out[i], sizeof(float) * hd) != 0) {
                        printf("attention %s: query %d of %d (n %d, head %d) differs alone\n",
                               type == KV_Q8 ? "q8" : "f16", i, nq, ni, hd);
                        bad = 1;
                    }
                    h = fnv(fnv(h, w[i], sizeof(float) * ni), out[i], sizeof(float) * hd);
                }
            }
    printf("attention%s %016llx\n", type == KV_Q8 ? " q8" : "", (unsigned long long)h);
    return bad;
}

int main(int argc, char **argv) {
    const struct dot_isa *isa = argc > 1 ? dot_isa_named(argv[1]) : dot_isa_best();
    if (!isa) {
        fprintf(stderr, "no path %s on this CPU\n", argv[1]);
        return 2;
    }
    static const int types[][2] = {{TYPE_F32, 288}, {TYPE_F16, 288}, {TYPE_BF16, 288}, {TYPE_Q4_0, 608},
                                   {TYPE_Q4_1, 576}, {TYPE_Q5_0, 608}, {TYPE_Q8_0, 576}, {TYPE_Q4_K, 768},
                                   {TYPE_Q5_K, 768}, {TYPE_Q6_K, 1536}};
    int bad = 0;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) bad |= check_type(isa, types[i][0], types[i][1]);
    bad |= check_lanes(); /* after the types: their random blocks stay what they were */
    bad |= check_floatops(isa);
    bad |= check_quantize(isa);
    bad |= check_attention(isa, KV_F16);
    return bad | check_attention(isa, KV_Q8);
}
