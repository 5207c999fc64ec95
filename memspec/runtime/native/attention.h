/* Attention's inner loops over one sequence's float16 cache, per ISA, bit for bit alike.
 *
 * A call takes several queries that read the same keys and values (the query heads of one KV head,
 * and the rows of one sequence in a pass), each with its own count n of positions, so that each
 * float16 key and value is converted once for all of them.  For every query, whatever the others:
 *
 * scores: w[j] = (q . k_j) * scale for j < n, the dot in 8 fixed lanes (lane l sums the
 *         products d = l, l+8, ...) added in the fixed tree ((0+4)+(2+6))+((1+5)+(3+7));
 * mix:    out[d] = sum_j w[j] * v_j[d], j < n in order, one multiply and one add each.
 *
 * The SIMD paths convert float16 exactly (F16C, NEON's fcvtl), as the scalar path does, and do the
 * same multiplies and adds in the same order, so every path gives the same bits. */
#ifndef MEMSPEC_ATTENTION_H
#define MEMSPEC_ATTENTION_H

#include <stdint.h>

#define ATTN_PAD 8 /* w has room for n rounded up to a multiple of this (scores may fill it) */

struct attn_query {
    const float *q; /* hd floats */
    int n;          /* positions 0..n-1 (n >= 1) */
    float *w;       /* scores, then the weights mix reads */
    float *out;     /* hd floats: zeros in, the weighted sum out */
};

struct attn_isa {
    const char *name;
    void (*scores)(const struct attn_query *qs, int nq, const uint16_t *keys, int hd, float scale);
    void (*mix)(const struct attn_query *qs, int nq, const uint16_t *vals, int hd);
};

/* The path for a kernel path's name ("avx2", "avx512", "neon", "scalar"): AVX2+F16C where the CPU has
 * it, NEON on aarch64. */
const struct attn_isa *attn_isa_for(const char *dot_isa_name);

#endif
