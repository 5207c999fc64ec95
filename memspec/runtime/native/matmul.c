/* The matmul driver: activation quantization, cache tiling and threads.
 *
 * Each weight chunk (256 weights) is decoded once and applied to a tile of up to
 * ROW_TILE activation rows, and a tile of weight rows stays in cache while every row
 * tile passes over it, so M rows cost little more than one when memory-bound.  Threads
 * take contiguous ranges of outputs; the reduction over k is never split. */
#include "matmul.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_BYTES 8192 /* how far ahead of the row being multiplied its successors are fetched */
#define ROW_TILE 16                   /* activation rows sharing each decoded chunk */
#define WEIGHT_TILE_BYTES (64 * 1024) /* weight rows kept in cache across row tiles */

struct job {
    const struct dot_isa *isa;
    const struct type_info *t;
    const uint8_t *w;
    int n, k;
    const struct acts *a;
    float *out;
    int n0, n1; /* this job's outputs */
};

static size_t row_bytes(const struct type_info *t, int k) { return (size_t)(k / t->block) * t->bytes; }

void matmul_outputs(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
                    const struct acts *a, float *out, int n0, int n1) {
    float acc[ROW_TILE][LANES] __attribute__((aligned(32)));
    size_t rb = row_bytes(t, k);
    int m = a->m;
    int wtile = rb < WEIGHT_TILE_BYTES ? (int)(WEIGHT_TILE_BYTES / rb) : 1;
    int used = lanes_used(t); /* a K-quant output's sum is in lane 0: no 32-lane tree a row and output */
    memset(acc, 0, sizeof(acc));
    for (int j0 = n0; j0 < n1; j0 += wtile) {
        int j1 = j0 + wtile < n1 ? j0 + wtile : n1;
        for (int r0 = 0; r0 < m; r0 += ROW_TILE) {
            int nr = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            for (int j = j0; j < j1; j++) {
                if (r0 == 0 && (size_t)(j + 1) * rb + PREFETCH_BYTES <= (size_t)n1 * rb) {
                    /* ask for the weights PREFETCH_BYTES on while this row computes, into L2 (locality 1:
                     * prefetcht2).  Not the non-temporal hint (0): on a Xeon that fills L1 alone and the
                     * stream stays latency-bound (the 1.5B decoding, 2 threads: 97 against 60 ms a step) */
                    const char *next = (const char *)w + (size_t)j * rb + PREFETCH_BYTES;
                    for (size_t b = 0; b < rb; b += 64) __builtin_prefetch(next + b, 0, 1);
                }
                isa->rows(t, w + (size_t)j * rb, k, a, r0, nr, acc);
                for (int r = 0; r < nr; r++) out[(size_t)(r0 + r) * n + j] = lanes_take_used(acc[r], used);
            }
        }
    }
}

static void run_job(const struct job *p) { matmul_outputs(p->isa, p->t, p->w, p->n, p->k, p->a, p->out, p->n0, p->n1); }

static void *job_thread(void *p) {
    run_job(p);
    return NULL;
}

int matmul(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
           const float *x, int m, float *out, int threads) {
    if (m == 0 || n == 0) return 0;
    int nt = threads < n ? threads : n;
    struct acts a;
    struct job *jobs = calloc((size_t)nt, sizeof(*jobs));
    pthread_t *tids = calloc((size_t)nt, sizeof(*tids));
    char *started = calloc((size_t)nt, 1);
    int rc = -1;
    if (!jobs || !tids || !started || acts_init(&a, t, x, m, k) != 0) goto done;
    for (int i = 0; i < nt; i++) {
        jobs[i] = (struct job){isa, t, w, n, k, &a, out, (int)((long long)n * i / nt), (int)((long long)n * (i + 1) / nt)};
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
