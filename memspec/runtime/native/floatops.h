/* The pass's float loops outside the matmuls and attention's dots: e^x in the softmax and SiLU in
 * the MLP, per ISA, bit for bit alike.
 *
 * e^x is one fixed sequence of IEEE operations, not libm's expf: x clamped to [-87, 88] (as
 * max(x, lo) then min(x, hi), which x86's maxps/minps compute); n = x*log2(e) rounded to the nearest
 * integer by adding and subtracting 1.5*2^23; r = x - n*ln2 in two fused steps (ln2 split in a high
 * part with few bits and a low part); e^r by Cephes' degree-5 polynomial in Horner form with fused
 * steps, then (p*r*r + r) fused, then + 1; times 2^n built in the exponent bits.  Each path does
 * these operations, in this order: the scalar path with fmaf (correctly rounded on every CPU, in
 * hardware or in glibc), the AVX2 path 8 lanes at a time with FMA, the NEON path 4 at a time.  So the same bits on every path
 * and architecture, within 2 ulp of e^x (tests/native/selftest.c checks both).  Vectorized, it
 * takes the softmax's and SiLU's exponentials from 4% of a compute-bound pass to under 1%.
 *
 * quantize is quants.c's quantize_row (the activations' 8-bit blocks for the integer kernels): the
 * block's largest |x| (maxps skips a NaN as the scalar comparison does; the order of a max does
 * not matter), then each x * id rounded by the same add and subtract of 1.5*2^23, so the same
 * bytes and scales on every path.
 *
 * to_f16 is float32 -> IEEE float16 for the KV cache, rounded to nearest even, with subnormals and
 * infinities; a NaN stays a NaN, quieted, with the top bits of its payload (as x86's vcvtps2ph and
 * Arm's fcvtn write it).  Correctly rounded everywhere, so the same bits on every path. */
#ifndef MEMSPEC_FLOATOPS_H
#define MEMSPEC_FLOATOPS_H

#include "quants.h"

struct float_isa {
    const char *name;
    void (*exp_shifted)(float *w, int n, float top);       /* w[j] = e^(w[j] - top), j < n */
    void (*silu_mul)(float *g, const float *u, int n);     /* g[i] = g[i] / (1 + e^-g[i]) * u[i], i < n */
    quantize_fn quantize;                                  /* quants.h's quantize_row */
    void (*to_f16)(const float *x, uint16_t *h, int n);    /* h[i] = f32_to_f16(x[i]), i < n */
};

/* The path for a kernel path's name ("avx2", "avx512", "neon", "scalar"): AVX2 + FMA + F16C where the
 * CPU has them, NEON on aarch64, else the scalar loops. */
const struct float_isa *float_isa_for(const char *dot_isa_name);

/* e^x and float16 on the scalar path (the references the others match). */
float exp_fixed(float x);
uint16_t f32_to_f16(float f);

#endif
