/* The NEON + dot-product path (aarch64, ARMv8.2's SDOT: the Jetson's Cortex-A78AE): dot.c's scalar
 * path with the integer work vectorized.
 *
 * Only this file uses the dot-product instructions, through the target pragma: the module is built
 * for plain ARMv8-A and dot.c picks this path at run time when the CPU reports them (HWCAP_ASIMDDP).
 * The integer sums equal the scalar ones exactly (SDOT adds four int8 products into an int32 lane;
 * every partial sum fits), and the float updates are dot.h's, one row at a time, so the bits are the
 * scalar path's.
 *
 * Each chunk is unpacked once into registers-sized pieces of a decoded form (struct kchunk's q and
 * scales, struct qchunk, struct fchunk) and applied to every activation row. */
#if defined(__aarch64__)

#pragma GCC target("arch=armv8.2-a+dotprod")
#include <arm_neon.h>
#include <string.h>

#include "dot.h"

/* ---- K-quants ---- */

/* Block raw's 256 q (quants.c's decode_q45_k / decode_q6_k order) into q. */
static inline void k_unpack(int type, const uint8_t *raw, uint8_t *q) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(0x03), one = vdupq_n_u8(1);
    if (type == TYPE_Q6_K) { /* weight 128h + 32s + l: ql nibble | ((qh[32h + l] >> 2s) & 3) << 4 */
        const block_q6_K *b = (const block_q6_K *)raw;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l += 16) {
                uint8x16_t a = vld1q_u8(b->ql + 64 * h + l), c = vld1q_u8(b->ql + 64 * h + 32 + l);
                uint8x16_t hb = vld1q_u8(b->qh + 32 * h + l);
                uint8_t *qq = q + 128 * h + l;
                vst1q_u8(qq, vorrq_u8(vandq_u8(a, m4), vshlq_n_u8(vandq_u8(hb, m3), 4)));
                vst1q_u8(qq + 32, vorrq_u8(vandq_u8(c, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4)));
                vst1q_u8(qq + 64, vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4)));
                vst1q_u8(qq + 96, vorrq_u8(vshrq_n_u8(c, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4)));
            }
        return;
    }
    /* Q4_K/Q5_K: 32 bytes of qs hold weights 64c .. 64c+31 (low nibbles) and 64c+32 .. 64c+63 (high);
     * Q5_K's fifth bit of weight 32j + l is bit j of qh[l] */
    const uint8_t *qs = raw + (type == TYPE_Q4_K ? 16 : 48), *qh = raw + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 16) {
            uint8x16_t v = vld1q_u8(qs + 32 * c + l), lo = vandq_u8(v, m4), hi = vshrq_n_u8(v, 4);
            if (type == TYPE_Q5_K) {
                uint8x16_t h = vld1q_u8(qh + l);
                lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(-2 * c))), one), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(-2 * c - 1))), one), 4));
            }
            vst1q_u8(q + 64 * c + l, lo);
            vst1q_u8(q + 64 * c + 32 + l, hi);
        }
}

/* acc[0] += the decoded block w . the activation block at x (its 16 sums at sum16, scale dx):
 * ia = sum sc*(q.x) - zoff.sum16, ib = mn.sum16, then k_update, as dot.c's k_row. */
static inline void k_apply(const struct kchunk *w, const int8_t *x, const int16_t *sum16, float dx, float *acc) {
    int32x4_t ia = vdupq_n_s32(0);
    for (int g = 0; g < 4; g++) { /* 16-weight groups 4g .. 4g+3 */
        int32x4_t p[4];
        for (int j = 0; j < 4; j++) {
            int o = 64 * g + 16 * j;
            p[j] = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vld1q_u8(w->q + o)), vld1q_s8(x + o));
        }
        int32x4_t dots = vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3])); /* q.x of each group */
        ia = vmlaq_s32(ia, dots, vmovl_s16(vld1_s16(w->sc + 4 * g)));
    }
    int16x8_t s0 = vld1q_s16(sum16), s1 = vld1q_s16(sum16 + 8);
    int32x4_t z = vmull_s16(vget_low_s16(s0), vld1_s16(w->zoff));
    z = vmlal_s16(z, vget_high_s16(s0), vld1_s16(w->zoff + 4));
    z = vmlal_s16(z, vget_low_s16(s1), vld1_s16(w->zoff + 8));
    z = vmlal_s16(z, vget_high_s16(s1), vld1_s16(w->zoff + 12));
    int32x4_t m = vmull_s16(vget_low_s16(s0), vld1_s16(w->mn));
    m = vmlal_s16(m, vget_high_s16(s0), vld1_s16(w->mn + 4));
    m = vmlal_s16(m, vget_low_s16(s1), vld1_s16(w->mn + 8));
    m = vmlal_s16(m, vget_high_s16(s1), vld1_s16(w->mn + 12));
    acc[0] = k_update(acc[0], w->d, w->dmin, dx, vaddvq_s32(ia) - vaddvq_s32(z), vaddvq_s32(m));
}

/* ---- small blocks ---- */

/* acc[b] += small block b of w . its activation block, b = 0..7 (dot.c's small_row). */
static inline void small_apply(const struct qchunk *w, const int8_t *x, const int16_t *sum16, const float *dx,
                               float *acc) {
    for (int b = 0; b < 8; b++) {
        const int8_t *q = (const int8_t *)w->q + QK * b; /* unsigned q fit int8 (<= 31) */
        int32x4_t p = vdotq_s32(vdupq_n_s32(0), vld1q_s8(q), vld1q_s8(x + QK * b));
        p = vdotq_s32(p, vld1q_s8(q + 16), vld1q_s8(x + QK * b + 16));
        int32_t xsum = sum16[2 * b] + sum16[2 * b + 1];
        acc[b] = small_update(acc[b], w->d[b], w->m[b], dx[b], vaddvq_s32(p) - w->zero * xsum, xsum, w->has_min);
    }
}

/* ---- floats: lane i % 32 takes weight i, as dot.c's float_row ---- */

static inline void float_apply(const struct fchunk *w, const float *x, float *acc) {
    float32x4_t l[8];
    for (int j = 0; j < 8; j++) l[j] = vld1q_f32(acc + 4 * j);
    for (int i = 0; i < CHUNK; i += LANES)
        for (int j = 0; j < 8; j++) l[j] = vfmaq_f32(l[j], vld1q_f32(w->w + i + 4 * j), vld1q_f32(x + i + 4 * j));
    for (int j = 0; j < 8; j++) vst1q_f32(acc + 4 * j, l[j]);
}

static void neon_rows(const struct type_info *t, const uint8_t *w, int k, const struct acts *a, int r0, int nr,
                      float (*acc)[LANES]) {
    size_t chunk_bytes = (size_t)(CHUNK / t->block) * t->bytes;
    for (int c = 0; c * CHUNK < k; c++) {
        const uint8_t *raw = w + c * chunk_bytes;
        int count = k - c * CHUNK < CHUNK ? k - c * CHUNK : CHUNK;
        if (t->family == FAM_K) {
            struct kchunk wc;
            decode_k_scales(t->id, raw, &wc);
            k_unpack(t->id, raw, wc.q);
            for (int r = 0; r < nr; r++) {
                size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
                k_apply(&wc, a->q + at, a->sum16 + at / 16, a->d[at / QK_K], acc[r]);
            }
        } else if (t->family == FAM_SMALL) {
            struct qchunk wc;
            decode_small(t->id, raw, count, &wc);
            for (int r = 0; r < nr; r++) {
                size_t at = (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK;
                small_apply(&wc, a->q + at, a->sum16 + at / 16, a->d + at / QK, acc[r]);
            }
        } else {
            struct fchunk wc;
            decode_float(t->id, raw, count, &wc);
            for (int r = 0; r < nr; r++)
                float_apply(&wc, a->f + (size_t)(r0 + r) * a->kpad + (size_t)c * CHUNK, acc[r]);
        }
    }
}

const struct dot_isa DOT_NEON = {"neon", neon_rows};

#endif
