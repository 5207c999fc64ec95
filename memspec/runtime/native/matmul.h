/* out = x @ W^T for a GGUF weight matrix, threads splitting the outputs. */
#ifndef MEMSPEC_MATMUL_H
#define MEMSPEC_MATMUL_H

#include "dot.h"
#include "pack.h"

/* A GGUF tensor: (n, k) for a matrix (rows of k weights), (n) for a vector (k = 1, F32). */
struct tensor {
    const uint8_t *data;       /* its blocks as the file stores them: n rows of k / block blocks */
    const struct type_info *t;
    int n, k;
    const uint8_t *packed;     /* the same matrix interleaved (pack.h) for the path in use, or NULL */
};

/* out (m, n) float32 = x (m, k) float32 @ W^T, W (n, k) of type t stored as raw blocks, rows
 * contiguous; interleaved first (into a scratch copy) when the path multiplies t that way.  Row
 * r of out depends only on row r of x and W: not on m, the other rows, `threads` or the layout.
 * Returns 0, or -1 when out of memory. */
int matmul(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
           const float *x, int m, float *out, int threads);

/* matmul for a tensor, through w->packed where it is set. */
int matmul_tensor(const struct dot_isa *isa, const struct tensor *w, const float *x, int m, float *out, int threads);

/* Whether `isa` multiplies w interleaved: then its outputs go in groups of PACK_ROWS. */
static inline int matmul_packs(const struct dot_isa *isa, const struct type_info *t, int n, int k) {
    return ((isa->packed_types >> t->id) & 1) && pack_bytes(t, n, k) > 0;
}

/* Thread i of n's outputs of w: contiguous, whole interleaved groups where w is packed. */
static inline void matmul_range(const struct tensor *w, int i, int n, int *lo, int *hi) {
    int unit = w->packed ? PACK_ROWS : 1, units = w->n / unit;
    *lo = (int)((long long)units * i / n) * unit;
    *hi = (int)((long long)units * (i + 1) / n) * unit;
}

/* out[r, j] for every activation row r of `a` (already quantized for w's type) and output j in
 * [n0, n1) (a matmul_range): the forward pass's threads each take a range (one row's arithmetic,
 * whatever the range). */
void matmul_outputs(const struct dot_isa *isa, const struct tensor *w, const struct acts *a, float *out, int n0,
                    int n1);

#endif
