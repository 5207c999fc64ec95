/* Attention's inner loops alone (attention.h), one thread, at long context: ns per (query,
 * position) for scores, the softmax's exponentials and mix, for one KV head's queries in a unit.
 *
 *   gcc -O3 -std=c11 -ffp-contract=off -Imemspec/runtime/native bench/attention_harness.c \
 *       memspec/runtime/native/{attention,floatops,quants,pack,dot,dot_avx2,dot_avx2_x8,dot_avx512,dot_avx512_x8,dot_neon}.c -lm -o /tmp/ah
 *   /tmp/ah [path: scalar|avx2|avx512|neon, default the best] [positions, default 8192] [queries, default 3]
 *           [head dim, default 128] [kv: f16|q8, default f16]
 *
 * Random normal float16 keys and values; the best of 7 repetitions.  The shapes the engine meets:
 * Qwen2.5's 1.5B has 6 query heads a KV head of 128 (a decode step's unit holds 3 of them on 2
 * threads), SmolLM2-135M 3 of 64. */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "dot.h"
#include "floatops.h"
#include "harness.h"

int main(int argc, char **argv) {
    const struct dot_isa *isa = argc > 1 ? dot_isa_named(argv[1]) : dot_isa_best();
    int n = argc > 2 ? atoi(argv[2]) : 8192, nq = argc > 3 ? atoi(argv[3]) : 3, hd = argc > 4 ? atoi(argv[4]) : 128;
    int type = argc > 5 && strcmp(argv[5], "q8") == 0 ? KV_Q8 : KV_F16;
    if (!isa || n < 1 || nq < 1 || hd < 8 || hd % 8) {
        fprintf(stderr, "usage: %s [path] [positions] [queries] [head dim, a multiple of 8]\n", argv[0]);
        return 2;
    }
    const struct attn_isa *at = attn_isa_for(isa->name);
    const struct float_isa *fo = float_isa_for(isa->name);
    size_t rb = kv_row_bytes(type, hd);
    uint8_t *keys = malloc(rb * n), *vals = malloc(rb * n);
    float *q = malloc(sizeof(float) * nq * hd), *out = malloc(sizeof(float) * nq * hd);
    float *w = aligned_alloc(64, sizeof(float) * nq * ((n + ATTN_PAD + 15) / 16 * 16));
    if (!keys || !vals || !q || !out || !w) return 1;
    for (size_t i = 0; type == KV_F16 && i < (size_t)n * hd; i++) {
        uint16_t a = (uint16_t)(0x3000 | (rnd() & 0x93FF)), b = (uint16_t)(0x3000 | (rnd() & 0x93FF));
        memcpy(keys + 2 * i, &a, 2), memcpy(vals + 2 * i, &b, 2);
    }
    float *x = malloc(sizeof(float) * hd);
    for (int r = 0; type == KV_Q8 && r < n; r++)
        for (int which = 0; which < 2; which++) {
            for (int e = 0; e < hd; e++) x[e] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
            kv_q8_row(x, hd, (which ? vals : keys) + (size_t)r * rb);
        }
    for (int i = 0; i < nq * hd; i++) q[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
    struct attn_query qs[64];
    size_t stride = (size_t)(n + ATTN_PAD + 15) / 16 * 16;
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 7; rep++) {
        for (int i = 0; i < nq; i++) {
            qs[i] = (struct attn_query){q + (size_t)i * hd, n, w + i * stride, out + (size_t)i * hd};
            memset(qs[i].out, 0, sizeof(float) * hd);
        }
        double t0 = now();
        at->scores(qs, nq, keys, type, hd, 1.0f / sqrtf((float)hd));
        double t1 = now();
        for (int i = 0; i < nq; i++) fo->exp_shifted(qs[i].w, n, 0.0f);
        double t2 = now();
        at->mix(qs, nq, vals, type, hd);
        double t3 = now(), d[3] = {t1 - t0, t2 - t1, t3 - t2};
        for (int k = 0; k < 3; k++) best[k] = d[k] < best[k] ? d[k] : best[k];
    }
    double per = 1e9 / ((double)n * nq);
    printf("%s (attention %s, %s), %d positions, %d queries, head %d: ns per (query, position): scores %.3f, exp %.3f, mix %.3f, all %.3f\n",
           isa->name, at->name, type == KV_Q8 ? "q8" : "f16", n, nq, hd, best[0] * per, best[1] * per, best[2] * per, (best[0] + best[1] + best[2]) * per);
    printf("(checksum %g %g)\n", (double)out[0], (double)w[n / 2]);
    return 0;
}
