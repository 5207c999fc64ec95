/* floatops.h: the scalar path (the reference), the AVX2 + FMA + F16C path and the NEON path. */
#include "floatops.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXP_LO -87.0f           /* e^x for x below: 2^-126 is the smallest normal scale */
#define EXP_HI 88.0f            /* and above: 2^127 is the largest */
#define LOG2E 1.44269504088896341f
#define ROUND 12582912.0f       /* 1.5 * 2^23: adding and subtracting it rounds to an integer (|v| < 2^22) */
#define LN2_HI 0.693359375f     /* ln 2 = LN2_HI + LN2_LO; LN2_HI has 9 significant bits, so n * LN2_HI is exact */
#define LN2_LO -2.12194440e-4f
/* Cephes' expf: e^r ~ 1 + r + r^2 (P0 r^5 + ... + P5) on |r| <= ln2 / 2 */
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

float exp_fixed(float x) {
    x = x > EXP_LO ? x : EXP_LO; /* maxps(x, lo): lo when x is NaN */
    x = x < EXP_HI ? x : EXP_HI; /* minps(x, hi) */
    float n = (x * LOG2E + ROUND) - ROUND;
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = fmaf(P0, r, P1);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P4);
    p = fmaf(p, r, P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

uint16_t f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000, e = (v.u >> 23) & 0xFF, man = v.u & 0x7FFFFF;
    if (e == 0xFF) return (uint16_t)(sign | 0x7C00 | (man ? 0x200 | (man >> 13) : 0)); /* NaN: quiet, payload's top */
    int exp = (int)e - 127 + 15;
    if (exp >= 0x1F) return (uint16_t)(sign | 0x7C00);
    if (exp <= 0) { /* subnormal half (or zero) */
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        int shift = 14 - exp;
        uint32_t h = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13), rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* may carry into the exponent: still right */
    return (uint16_t)(sign | h);
}

static void to_f16_scalar(const float *x, uint16_t *h, int n) {
    for (int i = 0; i < n; i++) h[i] = f32_to_f16(x[i]);
}

static void exp_shifted_scalar(float *w, int n, float top) {
    for (int j = 0; j < n; j++) w[j] = exp_fixed(w[j] - top);
}

static void silu_mul_scalar(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_fixed(-g[i])) * u[i];
}

static const struct float_isa FLOAT_SCALAR = {"scalar", exp_shifted_scalar, silu_mul_scalar, quantize_row, to_f16_scalar};

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* exp_fixed, lane by lane: the same operations in the same order. */
AVX2 static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 round = _mm256_set1_ps(ROUND);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), round), round);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x); /* -(n hi) + x: fmaf(-n, hi, x) */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2 static void exp_shifted_avx2(float *w, int n, float top) {
    __m256 t = _mm256_set1_ps(top);
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(w + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j), t)));
    for (; j < n; j++) w[j] = exp_fixed(w[j] - top);
}

AVX2 static void silu_mul_avx2(float *g, const float *u, int n) {
    __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 d = _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, d), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + exp_fixed(-g[i])) * u[i];
}

/* quantize_row, 8 floats at a time (block a multiple of 32: 32 or 256). */
AVX2 static void quantize_avx2(const float *x, int k, int block, int8_t *q, float *d, int16_t *sum16) {
    const __m256 sign = _mm256_set1_ps(-0.0f), round = _mm256_set1_ps(ROUND), lo = _mm256_set1_ps(-127.0f),
                 hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs' lane interleave undone */
    for (int b = 0; b < k / block; b++) {
        const float *xb = x + (size_t)b * block;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < block; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        __m256 vid = _mm256_set1_ps(id);
        for (int i = 0; i < block; i += 32) {
            __m256i n[4];
            for (int u = 0; u < 4; u++) {
                __m256 v = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * u), vid), round), round);
                __m256 ok = _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ), _mm256_cmp_ps(v, hi, _CMP_LE_OQ));
                n[u] = _mm256_cvttps_epi32(_mm256_and_ps(v, ok)); /* NaN or out of range: 0 */
            }
            __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            _mm256_storeu_si256((__m256i *)(q + (size_t)b * block + i), _mm256_permutevar8x32_epi32(w, order));
        }
    }
    for (int j = 0; j < k / 16; j++) { /* int16 sums of 16: pairs by maddubs, then madd, then the two halves */
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * j));
        __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), v), _mm_set1_epi16(1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        sum16[j] = (int16_t)_mm_cvtsi128_si32(s);
    }
}

/* f32_to_f16 8 at a time: vcvtps2ph rounding to nearest even (the immediate, not MXCSR). */
AVX2 static void to_f16_avx2(const float *x, uint16_t *h, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = f32_to_f16(x[i]);
}

static const struct float_isa FLOAT_AVX2 = {"avx2", exp_shifted_avx2, silu_mul_avx2, quantize_avx2, to_f16_avx2};
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

/* exp_fixed, lane by lane, as exp8 (vfmaq/vfmsq are fmaf's single rounding; the clamps are the
 * scalar comparisons, which keep lo and hi for a NaN). */
static inline float32x4_t exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(EXP_LO), hi = vdupq_n_f32(EXP_HI), round = vdupq_n_f32(ROUND);
    x = vbslq_f32(vcgtq_f32(x, lo), x, lo);
    x = vbslq_f32(vcltq_f32(x, hi), x, hi);
    float32x4_t n = vsubq_f32(vaddq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)), round), round);
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(LN2_HI)); /* x - n hi, fused: fmaf(-n, hi, x) */
    r = vfmsq_f32(r, n, vdupq_n_f32(LN2_LO));
    float32x4_t p = vfmaq_f32(vdupq_n_f32(P1), vdupq_n_f32(P0), r);
    p = vfmaq_f32(vdupq_n_f32(P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(P5), p, r);
    float32x4_t y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0f));
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23); /* n is whole: exact */
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
}

static void exp_shifted_neon(float *w, int n, float top) {
    float32x4_t t = vdupq_n_f32(top);
    int j = 0;
    for (; j + 4 <= n; j += 4) vst1q_f32(w + j, exp4(vsubq_f32(vld1q_f32(w + j), t)));
    for (; j < n; j++) w[j] = exp_fixed(w[j] - top);
}

static void silu_mul_neon(float *g, const float *u, int n) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t x = vld1q_f32(g + i);
        float32x4_t d = vaddq_f32(one, exp4(vnegq_f32(x)));
        vst1q_f32(g + i, vmulq_f32(vdivq_f32(x, d), vld1q_f32(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + exp_fixed(-g[i])) * u[i];
}

/* quantize_row, 4 floats at a time (block a multiple of 32): the max by the scalar comparison (a NaN
 * never enters it), the same rounding, the same lanes zeroed. */
static void quantize_neon(const float *x, int k, int block, int8_t *q, float *d, int16_t *sum16) {
    const float32x4_t round = vdupq_n_f32(ROUND), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f),
                      zero = vdupq_n_f32(0.0f);
    for (int b = 0; b < k / block; b++) {
        const float *xb = x + (size_t)b * block;
        float32x4_t m = zero;
        for (int i = 0; i < block; i += 4) {
            float32x4_t a = vabsq_f32(vld1q_f32(xb + i));
            m = vbslq_f32(vcgtq_f32(a, m), a, m);
        }
        float amax = 0.0f;
        for (int l = 0; l < 4; l++) amax = m[l] > amax ? m[l] : amax;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        float32x4_t vid = vdupq_n_f32(id);
        for (int i = 0; i < block; i += 8) {
            int16x4_t h[2];
            for (int u = 0; u < 2; u++) {
                float32x4_t v = vsubq_f32(vaddq_f32(vmulq_f32(vld1q_f32(xb + i + 4 * u), vid), round), round);
                uint32x4_t ok = vandq_u32(vcgeq_f32(v, lo), vcleq_f32(v, hi)); /* NaN: 0 */
                h[u] = vmovn_s32(vcvtq_s32_f32(vbslq_f32(ok, v, zero)));
            }
            vst1_s8(q + (size_t)b * block + i, vmovn_s16(vcombine_s16(h[0], h[1])));
        }
    }
    for (int j = 0; j < k / 16; j++) sum16[j] = (int16_t)vaddlvq_s8(vld1q_s8(q + 16 * j));
}

/* f32_to_f16 4 at a time: fcvtn rounds to nearest even (the default FPCR) and keeps a NaN's payload. */
static void to_f16_neon(const float *x, uint16_t *h, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
    for (; i < n; i++) h[i] = f32_to_f16(x[i]);
}

static const struct float_isa FLOAT_NEON = {"neon", exp_shifted_neon, silu_mul_neon, quantize_neon, to_f16_neon};
#endif

const struct float_isa *float_isa_for(const char *dot_isa_name) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (strcmp(dot_isa_name, "scalar") != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return &FLOAT_AVX2;
#elif defined(__aarch64__)
    if (strcmp(dot_isa_name, "scalar") != 0) return &FLOAT_NEON; /* NEON and FMA are part of every aarch64 CPU */
#else
    (void)dot_isa_name; /* one path */
#endif
    return &FLOAT_SCALAR;
}
