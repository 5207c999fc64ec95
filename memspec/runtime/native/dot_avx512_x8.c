/* The AVX-512 path's kernels for the interleaved types (pack.h): dot_avx2_x8.c's, with each
 * sub-block's products formed by vpdpbusd on 256-bit vectors (AVX-512 VL + VNNI) instead of
 * maddubs, add and madd.
 *
 * vpdpbusd adds the 4 products of each int32 lane (4 weights of one row against 4 activation
 * bytes) straight into int32, so a sub-block of 32 weights is 8 instructions and one multiply by
 * the rows' scales, where AVX2 needs 8 maddubs, 7 adds and a madd: the integer sums are the same,
 * the float updates are the same code, so the bits are the scalar path's.  On a Zen 4 EPYC (2
 * threads) the row layout of dot_avx512.c took 37 ms for a one-row pass of the 1.5B and 90 ms for
 * four rows; the interleaved AVX2 kernels 31 and 62 (docs/results.md has this path's figures). */
#if defined(__x86_64__)

#include <immintrin.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"
#include "pack.h"

#define X8 __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")))
#define X8_NAME(n) avx512_##n
#define X8_VNNI 1
#include "dot_x8.inc"

#endif
