/* out = x @ W^T for a GGUF weight matrix, threads splitting the outputs. */
#ifndef MEMSPEC_MATMUL_H
#define MEMSPEC_MATMUL_H

#include "dot.h"

/* out (m, n) float32 = x (m, k) float32 @ W^T, W (n, k) of type t stored as raw blocks, rows
 * contiguous.  Row r of out depends only on row r of x and W: not on m, the other rows or
 * `threads`.  Returns 0, or -1 when out of memory. */
int matmul(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
           const float *x, int m, float *out, int threads);

/* out[r, j] for every activation row r of `a` (already quantized for t) and output j in
 * [n0, n1): the forward pass's threads each take a range (one row's arithmetic, whatever the range). */
void matmul_outputs(const struct dot_isa *isa, const struct type_info *t, const uint8_t *w, int n, int k,
                    const struct acts *a, float *out, int n0, int n1);

#endif
