/* Attention's inner loops over one sequence's cache, per ISA, bit for bit alike.
 *
 * The cache holds a row per position and KV head, of one of two formats (kv_row_bytes):
 *   KV_F16: hd float16s;
 *   KV_Q8:  hd int8s q, then their float32 scale s (x ~= s * q; s = max|x| / 127, kv_q8_row), so
 *           that a row is quantized once, from its own values, when it is written; a key less its
 *           head's key bias (kv_q8_key).
 *
 * A call takes several queries that read the same keys and values (the query heads of one KV head,
 * and the rows of one sequence in a pass), each with its own count n of positions, so that each
 * key and value is converted once for all of them.  For every query, whatever the others:
 *
 * scores: w[j] = (q . k_j) * scale for j < n, the dot in 8 fixed lanes (lane l sums the
 *         products d = l, l+8, ...) added in the fixed tree ((0+4)+(2+6))+((1+5)+(3+7));
 *         KV_Q8: the dot over the int8s as floats, then w[j] = (dot * s_j) * scale;
 * mix:    out[d] = sum_j w[j] * v_j[d], j < n in order, one multiply and one add each;
 *         KV_Q8: out[d] = sum_j (w[j] * s_j) * (float)v_j[d], the same way.
 *
 * The SIMD paths convert float16 exactly (F16C, NEON's fcvtl) and int8 exactly, as the scalar path
 * does, and do the same multiplies and adds in the same order, so every path gives the same bits. */
#ifndef MEMSPEC_ATTENTION_H
#define MEMSPEC_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#define ATTN_PAD 16 /* w has room for n rounded up to a multiple of this (scores may fill it: AVX-512 16 keys a time) */

struct attn_query {
    const float *q; /* hd floats */
    int n;          /* positions 0..n-1 (n >= 1) */
    float *w;       /* scores, then the weights mix reads */
    float *out;     /* hd floats: zeros in, the weighted sum out */
};

enum { KV_F16 = 0, KV_Q8 = 1 }; /* the cache's formats */

/* Bytes of one row (one position's key or value for one KV head) of format `type`. */
static inline size_t kv_row_bytes(int type, int hd) { return type == KV_Q8 ? (size_t)hd + 4 : (size_t)hd * 2; }

/* x (hd floats) as a KV_Q8 row: s = max|x| / 127, q = round-half-even(x * 127 / max|x|) (0 for all
 * of a row of zeros; a NaN's q is 0), as quants.c quantizes activations.  One row's bytes depend on
 * that row alone. */
void kv_q8_row(const float *x, int hd, uint8_t *row);

/* A rotated key k as a KV_Q8 row: kv_q8_row of k - bias, bias the head's key bias as the model adds
 * it before the rotation (NULL: a model without one).  A query's scores over every position then
 * move by the same q . bias, which the softmax cancels, while the bias's large channels no longer
 * set the row's scale: in Qwen2.5-Coder-1.5B's first layer a key's bias reaches 354 where the rest
 * of it varies by about 1.4, and a key's int8 step was a third of that spread.  The row depends on
 * the row and the model alone, as before. */
void kv_q8_key(const float *k, const float *bias, int hd, uint8_t *row);

/* keys / vals: rows 0..n-1 of format `type`, each kv_row_bytes(type, hd) after the last. */
struct attn_isa {
    const char *name;
    void (*scores)(const struct attn_query *qs, int nq, const uint8_t *keys, int type, int hd, float scale);
    void (*mix)(const struct attn_query *qs, int nq, const uint8_t *vals, int type, int hd);
};

/* The path for a kernel path's name ("avx2", "avx512", "neon", "scalar"): AVX2+F16C where the CPU has
 * it, NEON on aarch64. */
const struct attn_isa *attn_isa_for(const char *dot_isa_name);

#endif
