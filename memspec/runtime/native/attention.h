/* Attention's inner loops over one sequence's float16 cache, per ISA, bit for bit alike.
 *
 * scores: w[j] = (q . k_j) * scale for j < n, the dot in 8 fixed lanes (lane l sums the
 *         products d = l, l+8, ...) added in the fixed tree ((0+4)+(2+6))+((1+5)+(3+7));
 * mix:    out[d] = sum_j w[j] * v_j[d], j in order, one multiply and one add each.
 * The AVX2 path converts float16 with F16C (exact, as the table is) and does the same
 * multiplies and adds in the same order, so both paths give the same bits. */
#ifndef MEMSPEC_ATTENTION_H
#define MEMSPEC_ATTENTION_H

#include <stdint.h>

struct attn_isa {
    const char *name;
    void (*scores)(const float *q, const uint16_t *keys, int n, int hd, float scale, float *w);
    void (*mix)(const float *w, const uint16_t *vals, int n, int hd, float *out); /* out: hd zeros in */
};

/* The path for a kernel path's name ("avx2", "avx512", "scalar"): AVX2+F16C where the CPU has it. */
const struct attn_isa *attn_isa_for(const char *dot_isa_name);

#endif
