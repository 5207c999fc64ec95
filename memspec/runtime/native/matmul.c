/* The matmul driver: activation quantization, cache tiling and threads.
 *
 * Each weight chunk (256 weights) is decoded once and applied to a tile of up to
 * ROW_TILE activation rows, and a tile of weight rows stays in cache while every row
 * tile passes over it, so M rows cost little more than one when memory-bound.  A matrix
 * the path takes interleaved (pack.h) goes the same way, 8 weight rows at a time.  Threads
 * take contiguous ranges of outputs; the reduction over k is never split. */
#include "matmul.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_BYTES 8192 /* how far ahead of the weights being multiplied their successors are fetched */
#define ROW_TILE 16                   /* activation rows sharing each decoded chunk */
#define WEIGHT_TILE_BYTES (64 * 1024) /* weight rows kept in cache across row tiles */

struct job {
    const struct dot_isa *isa;
    const struct tensor *w;
    const struct acts *a;
    float *out;
    int n0, n1; /* this job's outputs */
};

/* Ask for the bytes [at + PREFETCH_BYTES, + len) of a stream that ends at `end` into L2 while
 * the bytes at `at` compute (locality 1: prefetcht2).  The interleaved kernels ask for their own
 * with two rows or more (dot_x8.inc's X8_L2_AHEAD), a slice at a time, so there only a one-row pass
 * comes here.  Not the non-temporal hint (0): on a Xeon
 * that fills L1 alone and the stream stays latency-bound (the 1.5B decoding, 2 threads: 97
 * against 60 ms a step). */
static void prefetch_ahead(const uint8_t *at, size_t len, const uint8_t *end) {
    if (at + PREFETCH_BYTES + len > end) return;
    for (size_t b = 0; b < len; b += 64) __builtin_prefetch(at + PREFETCH_BYTES + b, 0, 1);
}

/* The row layout: each weight row applied to tiles of ROW_TILE activation rows. */
static void outputs_rows(const struct dot_isa *isa, const struct tensor *w, const struct acts *a, float *out, int n0,
                         int n1) {
    float acc[ROW_TILE][LANES] __attribute__((aligned(32)));
    const struct type_info *t = w->t;
    size_t rb = row_bytes(t, w->k);
    int m = a->m, n = w->n;
    int wtile = rb < WEIGHT_TILE_BYTES ? (int)(WEIGHT_TILE_BYTES / rb) : 1;
    int used = lanes_used(t); /* a K-quant output's sum is in lane 0: no 32-lane tree a row and output */
    memset(acc, 0, sizeof(acc));
    for (int j0 = n0; j0 < n1; j0 += wtile) {
        int j1 = j0 + wtile < n1 ? j0 + wtile : n1;
        for (int r0 = 0; r0 < m; r0 += ROW_TILE) {
            int nr = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            for (int j = j0; j < j1; j++) {
                if (r0 == 0) prefetch_ahead(w->data + (size_t)j * rb, rb, w->data + (size_t)n1 * rb);
                isa->rows(t, w->data + (size_t)j * rb, w->k, a, r0, nr, acc);
                for (int r = 0; r < nr; r++) out[(size_t)(r0 + r) * n + j] = lanes_take_used(acc[r], used);
            }
        }
    }
}

/* The interleaved layout: each group of PACK_ROWS outputs applied to tiles of activation rows;
 * an output's float sum is its lane-0 accumulator, taken as lanes_take_used(acc, 1) takes it.  With
 * two rows or more, or one where the kernels fetch ahead (acts.ahead), a path with rows16 for the
 * type takes the groups two at a time (the same bits). */
static void outputs_packed(const struct dot_isa *isa, const struct tensor *w, const struct acts *a, float *out,
                           int n0, int n1) {
    float acc[ROW_TILE][2 * PACK_ROWS] __attribute__((aligned(64)));
    size_t gb = pack_bytes(w->t, PACK_ROWS, w->k); /* one group's bytes */
    int m = a->m, n = w->n, g0 = n0 / PACK_ROWS, g1 = n1 / PACK_ROWS;
    int paired = (m > 1 || a->ahead) && isa->rows16 && (isa->paired_types >> w->t->id & 1);
    int gtile = gb < WEIGHT_TILE_BYTES ? (int)(WEIGHT_TILE_BYTES / gb) : 1;
    if (paired && gtile % 2) gtile++; /* whole pairs in a tile */
    memset(acc, 0, sizeof(acc));
    for (int h0 = g0; h0 < g1; h0 += gtile) {
        int h1 = h0 + gtile < g1 ? h0 + gtile : g1;
        for (int r0 = 0; r0 < m; r0 += ROW_TILE) {
            int nr = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            for (int g = h0; g < h1;) {
                int two = paired && g + 1 < h1, width = two ? 2 * PACK_ROWS : PACK_ROWS;
                if (r0 == 0 && m == 1 && !a->ahead) prefetch_ahead(w->packed + (size_t)g * gb, gb, w->packed + (size_t)g1 * gb);
                if (two) isa->rows16(w->t, w->packed + (size_t)g * gb, w->k, a, r0, nr, acc);
                else isa->rows8(w->t, w->packed + (size_t)g * gb, w->k, a, r0, nr, (float (*)[PACK_ROWS])acc);
                float *lanes = &acc[0][0];
                for (int r = 0; r < nr; r++)
                    for (int o = 0; o < width; o++) {
                        out[(size_t)(r0 + r) * n + (size_t)g * PACK_ROWS + o] = lanes[r * width + o] + 0.0f;
                        lanes[r * width + o] = 0.0f;
                    }
                g += two ? 2 : 1;
            }
        }
    }
}

void matmul_outputs(const struct dot_isa *isa, const struct tensor *w, const struct acts *a, float *out, int n0,
                    int n1) {
    if (w->packed) outputs_packed(isa, w, a, out, n0, n1);
    else outputs_rows(isa, w, a, out, n0, n1);
}

static void run_job(const struct job *p) { matmul_outputs(p->isa, p->w, p->a, p->out, p->n0, p->n1); }

static void *job_thread(void *p) {
    run_job(p);
    return NULL;
}

int matmul_tensor(const struct dot_isa *isa, const struct tensor *w, const float *x, int m, float *out, int threads) {
    if (m == 0 || w->n == 0) return 0;
    int nt = threads < w->n ? threads : w->n;
    struct acts a;
    struct job *jobs = calloc((size_t)nt, sizeof(*jobs));
    pthread_t *tids = calloc((size_t)nt, sizeof(*tids));
    char *started = calloc((size_t)nt, 1);
    int rc = -1;
    if (!jobs || !tids || !started || acts_init(&a, w->t, x, m, w->k) != 0) goto done;
    for (int i = 0; i < nt; i++) {
        jobs[i] = (struct job){isa, w, &a, out, 0, 0};
        matmul_range(w, i, nt, &jobs[i].n0, &jobs[i].n1);
        if (i > 0) started[i] = pthread_create(&tids[i], NULL, job_thread, &jobs[i]) == 0;
    }
    run_job(&jobs[0]);
    for (int i = 1; i < nt; i++) {
        if (started[i]) pthread_join(tids[i], NULL);
        else run_job(&jobs[i]); /* no thread: same outputs, same arithmetic, just later */
    }
    acts_free(&a);
    rc = 0;
done:
    free(jobs);
    free(tids);
    free(started);
    return rc;
}

int matmul(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
           const float *x, int m, float *out, int threads) {
    struct tensor tw = {w, t, n, k, NULL};
    uint8_t *packed = NULL;
    if (matmul_packs(isa, t, n, k)) {
        if (!(packed = malloc(pack_bytes(t, n, k)))) return -1;
        pack_rows(t, w, n, k, packed);
        tw.packed = packed;
    }
    int rc = matmul_tensor(isa, &tw, x, m, out, threads);
    free(packed);
    return rc;
}
