/* ggml block types: the scalar (reference) decoders and the activation quantizer. */
#include "quants.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const struct type_info TYPES[] = {
    {TYPE_F32, "F32", 1, 4, FAM_FLOAT},
    {TYPE_F16, "F16", 1, 2, FAM_FLOAT},
    {TYPE_BF16, "BF16", 1, 2, FAM_FLOAT},
    {TYPE_Q4_0, "Q4_0", QK, sizeof(block_q4_0), FAM_SMALL},
    {TYPE_Q4_1, "Q4_1", QK, sizeof(block_q4_1), FAM_SMALL},
    {TYPE_Q5_0, "Q5_0", QK, sizeof(block_q5_0), FAM_SMALL},
    {TYPE_Q8_0, "Q8_0", QK, sizeof(block_q8_0), FAM_SMALL},
    {TYPE_Q4_K, "Q4_K", QK_K, sizeof(block_q4_K), FAM_K},
    {TYPE_Q5_K, "Q5_K", QK_K, sizeof(block_q5_K), FAM_K},
    {TYPE_Q6_K, "Q6_K", QK_K, sizeof(block_q6_K), FAM_K},
};
const char SUPPORTED_TYPES[] = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K";

_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 layout");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 layout");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 layout");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 layout");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K layout");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K layout");

const struct type_info *type_info(int id) {
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (TYPES[i].id == id) return &TYPES[i];
    return NULL;
}

const char *ggml_type_name(int id) {
    /* ggml.h's enum ggml_type, ids 0..41; gaps were removed types */
    static const char *const names[] = {
        "F32", "F16", "Q4_0", "Q4_1", "?", "?", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
        "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
        "BF16", "?", "?", "?", "TQ1_0", "TQ2_0", "?", "?", "?", "MXFP4", "NVFP4", "Q1_0",
    };
    return id >= 0 && id < (int)(sizeof(names) / sizeof(names[0])) ? names[id] : "?";
}

/* ---- decoders ---- */

void decode_float(int type, const uint8_t *raw, int count, struct fchunk *out) {
    if (type == TYPE_F32) {
        memcpy(out->w, raw, (size_t)count * 4);
    } else {
        for (int i = 0; i < count; i++) {
            uint16_t h;
            memcpy(&h, raw + 2 * i, 2);
            out->w[i] = type == TYPE_F16 ? fp16_to_f32(h) : bf16_to_f32(h);
        }
    }
    for (int i = count; i < CHUNK; i++) out->w[i] = 0.0f;
}

/* The 32 weights of one small block into q[0..31]: low nibbles are weights 0..15, high
 * nibbles 16..31; Q5_0's fifth bit of weight j is bit j of qh (little-endian uint32). */
static void decode_small_block(int type, const uint8_t *raw, uint8_t *q, float *d, float *m) {
    const uint8_t *qs = raw + (type == TYPE_Q4_1 ? 4 : type == TYPE_Q5_0 ? 6 : 2);
    *d = fp16_at(raw);
    *m = type == TYPE_Q4_1 ? fp16_at(raw + 2) : 0.0f;
    if (type == TYPE_Q8_0) {
        memcpy(q, qs, QK);
        return;
    }
    uint32_t qh = 0;
    if (type == TYPE_Q5_0) memcpy(&qh, raw + 2, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
}

void decode_small(int type, const uint8_t *raw, int count, struct qchunk *out) {
    int bytes = type_info(type)->bytes, nb = count / QK;
    for (int b = 0; b < 8; b++) {
        if (b < nb) {
            decode_small_block(type, raw + b * bytes, out->q + QK * b, &out->d[b], &out->m[b]);
        } else {
            memset(out->q + QK * b, 0, QK);
            out->d[b] = out->m[b] = 0.0f;
        }
    }
    out->zero = type == TYPE_Q4_0 ? 8 : type == TYPE_Q5_0 ? 16 : 0;
    out->q_signed = type == TYPE_Q8_0;
    out->has_min = type == TYPE_Q4_1;
}

/* Q4_K/Q5_K: each 32 bytes of qs hold sub-block 2c (low nibbles) and 2c+1 (high nibbles);
 * Q5_K's fifth bit of weight 32*j + l is bit j of qh[l]. */
static void decode_q45_k(const uint8_t *qs, const uint8_t *qh, uint8_t *q) {
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            uint8_t hi_lo = qh ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
            uint8_t hi_hi = qh ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
            q[64 * c + l] = (qs[32 * c + l] & 0x0F) | hi_lo;
            q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | hi_hi;
        }
    }
}

/* Q6_K: half h of 128 weights uses ql[64h..64h+63] and qh[32h..32h+31]: weight 128h + 32s + l
 * takes its low 4 bits from ql[64h + 32*(s&1) + l] (low nibble for s < 2, high for s >= 2)
 * and its high 2 bits from (qh[32h + l] >> 2s) & 3. */
static void decode_q6_k(const block_q6_K *b, uint8_t *q) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        uint8_t *qq = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            qq[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            qq[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            qq[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            qq[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

void decode_k_scales(int type, const uint8_t *raw, struct kchunk *out) {
    if (type == TYPE_Q6_K) {
        const block_q6_K *b = (const block_q6_K *)raw;
        for (int j = 0; j < 16; j++) {
            out->sc[j] = b->scales[j];
            out->zoff[j] = (int16_t)(32 * b->scales[j]);
            out->mn[j] = 0;
        }
        out->d = fp16_at(&b->d);
        out->dmin = 0.0f;
        return;
    }
    uint8_t sc[8], mn[8];
    k_scales_unpack(raw + 4, sc, mn); /* Q4_K and Q5_K: after d and dmin */
    for (int j = 0; j < 16; j++) {
        out->sc[j] = sc[j / 2];
        out->mn[j] = mn[j / 2];
        out->zoff[j] = 0;
    }
    out->d = fp16_at(raw);
    out->dmin = fp16_at(raw + 2);
}

void decode_k(int type, const uint8_t *raw, struct kchunk *out) {
    decode_k_scales(type, raw, out);
    if (type == TYPE_Q6_K) {
        decode_q6_k((const block_q6_K *)raw, out->q);
    } else if (type == TYPE_Q4_K) {
        decode_q45_k(((const block_q4_K *)raw)->qs, NULL, out->q);
    } else {
        const block_q5_K *b = (const block_q5_K *)raw;
        decode_q45_k(b->qs, b->qh, out->q);
    }
}

/* ---- activations ---- */

/* x ~= d * q per block with d = max|x| / 127 and q = round-half-even(x * 127 / max|x|). */
/* nearbyintf(v) for |v| <= 127 under the default rounding mode (to nearest, ties to even), without a
 * libm call (base x86-64 has no roundss): v + 1.5 * 2^23 lands where floats are 1 apart. */
static inline float round_even(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

void quantize_row(const float *x, int k, int block, int8_t *q, float *d, int16_t *sum16) {
    for (int b = 0; b < k / block; b++) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax; /* fmaxf, but inlined (a NaN is skipped, as fmaxf skips it) */
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int i = 0; i < block; i++) {
            float v = round_even(xb[i] * id); /* in [-127, 127], or NaN from an inf/nan input */
            q[b * block + i] = (int8_t)(v >= -127.0f && v <= 127.0f ? v : 0.0f);
        }
    }
    for (int j = 0; j < k / 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * j + i];
        sum16[j] = (int16_t)s;
    }
}

void dequantize_row(const struct type_info *t, const uint8_t *raw, int k, float *out) {
    size_t chunk_bytes = (size_t)(CHUNK / t->block) * t->bytes;
    for (int c = 0; c * CHUNK < k; c++, raw += chunk_bytes) {
        int count = k - c * CHUNK < CHUNK ? k - c * CHUNK : CHUNK;
        float *y = out + (size_t)c * CHUNK;
        if (t->family == FAM_FLOAT) {
            struct fchunk w;
            decode_float(t->id, raw, count, &w);
            memcpy(y, w.w, (size_t)count * sizeof(float));
        } else if (t->family == FAM_SMALL) {
            struct qchunk w;
            decode_small(t->id, raw, count, &w);
            for (int i = 0; i < count; i++) {
                int q = w.q_signed ? (int8_t)w.q[i] : w.q[i];
                y[i] = w.d[i / QK] * (float)(q - w.zero) + w.m[i / QK];
            }
        } else {
            struct kchunk w;
            decode_k(t->id, raw, &w);
            for (int i = 0; i < CHUNK; i++) {
                int j = i / 16;
                y[i] = w.d * (float)(w.sc[j] * w.q[i] - w.zoff[j]) - w.dmin * (float)w.mn[j];
            }
        }
    }
}

int acts_alloc(struct acts *a, const struct type_info *t, int m, int k) {
    memset(a, 0, sizeof(*a));
    a->m = m;
    a->ahead = 1;
    a->kpad = (k + CHUNK - 1) / CHUNK * CHUNK;
    size_t n = (size_t)(m > 0 ? m : 1) * a->kpad;
    if (t->family == FAM_FLOAT) {
        a->f = calloc(n, sizeof(float));
        return a->f ? 0 : -1;
    }
    a->block = t->block == QK ? QK : QK_K;
    a->q = calloc(n, 1);
    a->d = calloc(n / a->block, sizeof(float));
    a->sum16 = calloc(n / 16, sizeof(int16_t));
    a->sum32 = calloc(n / 32, sizeof(int16_t));
    if (a->block == QK) a->fsum32 = calloc(n / 32, sizeof(float)); /* only small blocks' updates read it */
    if (!a->q || !a->d || !a->sum16 || !a->sum32 || (a->block == QK && !a->fsum32)) {
        acts_free(a);
        return -1;
    }
    return 0;
}

void acts_fill(struct acts *a, const float *x, int k, int r0, int r1, quantize_fn quantize) {
    if (!quantize) quantize = quantize_row;
    for (int r = r0; r < r1; r++) {
        size_t at = (size_t)r * a->kpad;
        if (a->f) memcpy(a->f + at, x + (size_t)r * k, (size_t)k * sizeof(float));
        else {
            quantize(x + (size_t)r * k, k, a->block, a->q + at, a->d + at / a->block, a->sum16 + at / 16);
            for (size_t j = at / 32; j < (at + (size_t)a->kpad) / 32; j++) { /* |sum| <= 32 * 127 */
                a->sum32[j] = (int16_t)(a->sum16[2 * j] + a->sum16[2 * j + 1]);
                if (a->fsum32) a->fsum32[j] = (float)a->sum32[j];
            }
        }
    }
}

int acts_init(struct acts *a, const struct type_info *t, const float *x, int m, int k) {
    if (acts_alloc(a, t, m, k) != 0) return -1;
    acts_fill(a, x, k, 0, m, NULL);
    return 0;
}

void acts_free(struct acts *a) {
    free(a->q);
    free(a->d);
    free(a->sum16);
    free(a->sum32);
    free(a->fsum32);
    free(a->f);
    memset(a, 0, sizeof(*a));
}
