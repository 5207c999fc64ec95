/* Dot products of weight rows against activation rows, one implementation per ISA.
 *
 * Exactness: every (activation row, output) pair owns LANES float accumulators and
 * sees the same sequence of float operations on every path, whatever the other rows:
 *   - the integer part of a block's dot product is exact, so the order in which a
 *     SIMD path adds its integers does not matter;
 *   - the float part is fixed here, in the inline helpers both paths call (or their
 *     lane-wise vector equivalents): one fused multiply-add per block into a fixed lane;
 *   - lanes_take() reduces the lanes in a fixed tree at the end.
 * So the scalar and SIMD paths agree bit for bit, and a row's result does not depend
 * on how many rows share the call.
 */
#ifndef MEMSPEC_DOT_H
#define MEMSPEC_DOT_H

#include <math.h>

#include "quants.h"

/* Float accumulators per (row, output).  Lane of each contribution:
 *   K-quants: lane 0 (one update per 256-weight block);
 *   small blocks: lane b for block b of its 8-block chunk;
 *   floats: lane i % 32 for weight i. */
#define LANES 32

struct dot_isa {
    const char *name;
    /* Add the dot products of weight row w (k weights of type t) with activation rows
     * r0 .. r0+nr-1 into acc[0 .. nr-1], decoding each chunk of w once. */
    void (*rows)(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                 float (*acc)[LANES]);
    /* Bit t set: rows8 takes type t interleaved (pack.h); 0 where the path has no such kernel. */
    unsigned packed_types;
    /* acc[i][o] += output o of an interleaved group of 8 weight rows w8 (k weights each) . activation
     * row r0 + i, i < nr: for each (row, output), the float updates of `rows` on the row layout in
     * the same order and lanes (K-quants: one k_update per block into lane 0; small blocks: one
     * small_update per block into lane block % 8, the 8 lanes then reduced as lanes_take_used
     * reduces them), so the same bits. */
    void (*rows8)(const struct type_info *t, const uint8_t *w8, int k, const struct acts *a, int r0, int nr,
                  float (*acc)[8]);
    /* Bit t set: rows16 takes type t (one of packed_types) two interleaved groups at a time; 0 where
     * the path has no such kernel. */
    unsigned paired_types;
    /* rows8 over two consecutive groups at once, w16 (outputs 0..7 of acc) and w16 + a group's
     * bytes (8..15): the same bits as two rows8 calls.  Worth it with two rows or more, where the
     * kernels are bound by instructions, not by reading the weights. */
    void (*rows16)(const struct type_info *t, const uint8_t *w16, int k, const struct acts *a, int r0, int nr,
                   float (*acc)[16]);
};

extern const struct dot_isa DOT_SCALAR;
#if defined(__x86_64__)
extern const struct dot_isa DOT_AVX2;
extern const struct dot_isa DOT_AVX512; /* AVX-512 F/BW/VL with VNNI */
#endif
#if defined(__aarch64__)
extern const struct dot_isa DOT_NEON;
#endif

/* The path called `name` ("scalar", "avx2", "avx512", "neon"), or NULL if unknown or this CPU lacks it. */
const struct dot_isa *dot_isa_named(const char *name);
/* The best path this CPU supports. */
const struct dot_isa *dot_isa_best(void);
/* Every path this CPU supports, scalar first, the best last; returns how many (at most 4). */
int dot_isas(const struct dot_isa *out[4]);

/* K-quant block: ia = sum sc*(q.x) - zoff.sum16, ib = mn.sum16 (integers, exact). */
static inline float k_update(float acc, float d, float dmin, float dx, int32_t ia, int32_t ib) {
    acc = fmaf(d * dx, (float)ia, acc);
    return fmaf(-(dmin * dx), (float)ib, acc); /* Q6_K: dmin = 0, ib = 0: adds -0 */
}

/* Small block b: isum = q.x - zero*xsum, xsum = sum of the activation block's q.  The min term
 * only where the type has one (Q4_1): the others' m is 0, whose term would add a zero, and every
 * path skips it alike (the packed kernels save a multiply and an FMA a block by it). */
static inline float small_update(float acc, float d, float m, float dx, int32_t isum, int32_t xsum, int has_min) {
    acc = fmaf(d * dx, (float)isum, acc);
    return has_min ? fmaf(m * dx, (float)xsum, acc) : acc;
}

/* The LANES accumulators of one (row, output), added in a fixed pairwise tree (lane i + half
 * into lane i, half = 16, 8, 4, 2, 1), four lanes per vector operation; acc is cleared for the
 * next output.  acc: 16-byte aligned. */
typedef float lanes4 __attribute__((vector_size(16), may_alias));
static inline float lanes_take(float *acc) {
    _Static_assert(LANES == 32, "lanes_take sums 32 lanes");
    lanes4 *p = (lanes4 *)acc, v[8];
    for (int i = 0; i < 8; i++) {
        v[i] = p[i];
        p[i] = (lanes4){0.0f, 0.0f, 0.0f, 0.0f};
    }
    for (int i = 0; i < 4; i++) v[i] += v[i + 4]; /* half 16 */
    for (int i = 0; i < 2; i++) v[i] += v[i + 2]; /* half 8 */
    v[0] += v[1];                                 /* half 4 */
    float a = v[0][0] + v[0][2], b = v[0][1] + v[0][3]; /* half 2 */
    return a + b;                                 /* half 1 */
}

/* How many of a (row, output)'s lanes type t's updates touch (the lane rule above): K-quants 1,
 * small blocks 8, floats all; the others stay +0.0 from the last lanes_take. */
static inline int lanes_used(const struct type_info *t) {
    return t->family == FAM_FLOAT ? LANES : t->block == QK ? 8 : 1;
}

/* lanes_take(acc) for accumulators whose lanes from `used` (1, 8 or LANES) on are +0.0: the same
 * bits with only the tree's live additions (x + 0.0 keeps x, but for -0.0, which becomes +0.0, so
 * each used lane gets that addition once), and only the used lanes cleared.  acc: 16-byte aligned. */
static inline float lanes_take_used(float *acc, int used) {
    if (used == 1) {
        float v = acc[0] + 0.0f;
        acc[0] = 0.0f;
        return v;
    }
    if (used == 8) { /* the tree's lanes 0..7: half 16 and 8 add zeros, half 4 adds lane i + 4 to lane i */
        lanes4 *p = (lanes4 *)acc, z = {0.0f, 0.0f, 0.0f, 0.0f};
        lanes4 v = (p[0] + z) + (p[1] + z);
        p[0] = z, p[1] = z;
        float a = v[0] + v[2], b = v[1] + v[3];
        return a + b;
    }
    return lanes_take(acc);
}

#endif
