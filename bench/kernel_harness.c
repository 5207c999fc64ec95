/* The AVX2 interleaved K-quant kernels alone, their weights in cache: ns per (activation row,
 * block of 8 weight rows x 256 weights), the figure the kernels' op counts are checked against.
 *
 *   gcc -O3 -std=c11 -ffp-contract=off -Imemspec/runtime/native bench/kernel_harness.c \
 *       memspec/runtime/native/{dot_avx2_x8,dot_avx512_x8,pack,quants,dot,dot_avx2,dot_avx512,dot_neon}.c -lm -o /tmp/kh
 *   /tmp/kh [q4_k|q6_k] [weight rows, default 64] [k, default 1536]
 *
 * Random blocks with small fp16 scales; one thread; for each activation row count, the best of 7
 * repetitions.  On a VM whose speed wanders, run two builds in turn several times and compare
 * minima.  x86-64 with AVX2 only (the kernels it times are the AVX2 path's). */
#define _POSIX_C_SOURCE 200112L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"
#include "pack.h"
#include "quants.h"
#include "harness.h"

int main(int argc, char **argv) {
    int id = argc > 1 && strcmp(argv[1], "q6_k") == 0 ? TYPE_Q6_K : TYPE_Q4_K;
    int n = argc > 2 ? atoi(argv[2]) : 64, k = argc > 3 ? atoi(argv[3]) : 1536;
    if (n <= 0 || n % PACK_ROWS || k <= 0 || k % QK_K) {
        fprintf(stderr, "weight rows must be a positive multiple of %d and k of %d\n", PACK_ROWS, QK_K);
        return 2;
    }
    if (!dot_isa_named("avx2")) {
        fprintf(stderr, "this CPU has no AVX2\n");
        return 2;
    }
    const struct type_info *t = type_info(id);
    size_t rb = row_bytes(t, k), gb = pack_bytes(t, PACK_ROWS, k);
    uint8_t *w = malloc(rb * n), *packed = aligned_alloc(64, (pack_bytes(t, n, k) + 63) / 64 * 64);
    for (size_t i = 0; i < rb * n; i++) w[i] = (uint8_t)rnd();
    for (int r = 0; r < n; r++) /* fp16 scales of 2^-7, so no block's floats overflow */
        for (int c = 0; c < k / QK_K; c++) {
            uint8_t *b = w + r * rb + (size_t)c * t->bytes;
            if (id == TYPE_Q4_K) b[0] = 0, b[1] = 0x20, b[2] = 0, b[3] = 0x20;
            else b[t->bytes - 2] = 0, b[t->bytes - 1] = 0x20;
        }
    pack_rows(t, w, n, k, packed);
    enum { M = 16 };
    float *x = malloc(sizeof(float) * M * k), acc[M][8] __attribute__((aligned(32)));
    for (int i = 0; i < M * k; i++) x[i] = (float)((int)(rnd() % 2001) - 1000) / 1000.0f;
    struct acts a;
    if (!w || !packed || !x || acts_init(&a, t, x, M, k) != 0) return 1;
    printf("%s, %d weight rows x %d, %.0f KB interleaved\n", t->name, n, k, pack_bytes(t, n, k) / 1e3);
    for (int nr = 1; nr <= M; nr = nr < 8 ? nr + 1 : nr * 2) {
        double best = 1e9;
        for (int rep = 0; rep < 7; rep++) {
            int iters = 2000 / nr + 1;
            double t0 = now();
            for (int it = 0; it < iters; it++)
                for (int g = 0; g < n / PACK_ROWS; g++) avx2_rows8(t, packed + g * gb, k, &a, 0, nr, acc);
            double ns = (now() - t0) / iters / (n / PACK_ROWS) / (k / QK_K) / nr * 1e9;
            best = ns < best ? ns : best;
        }
        printf("%2d rows: %6.2f ns per (row, block of 8x256)\n", nr, best);
    }
    printf("(checksum %g)\n", (double)acc[0][0]);
    return 0;
}
