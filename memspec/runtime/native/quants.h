/* ggml block layouts, their decoding into the form the dot kernels consume, and the
 * 8-bit quantization of activation rows.
 *
 * Layouts are ggml's (ggml-common.h), as GGUF files store them: packed little-endian
 * structs, fp16 scales.  The dot kernels never read them directly; each path decodes
 * 256 weights at a time (a "chunk": one K-quant block, eight 32-weight blocks, or 256
 * floats) into one of three decoded forms below, once per chunk, and applies it to
 * every activation row.  Decoding is exact (integers and fp16 -> f32), so the scalar
 * and SIMD decoders produce the same bits.
 */
#ifndef MEMSPEC_QUANTS_H
#define MEMSPEC_QUANTS_H

#include <stddef.h>
#include <stdint.h>

/* ggml type ids (ggml.h enum ggml_type / gguf.GGMLQuantizationType): the supported ones. */
enum {
    TYPE_F32 = 0, TYPE_F16 = 1, TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q8_0 = 8,
    TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14, TYPE_BF16 = 30,
};

#define QK 32      /* weights per small block (Q4_0, Q4_1, Q5_0, Q8_0) */
#define QK_K 256   /* weights per K-quant super-block */
#define CHUNK 256  /* weights decoded at once and shared by all activation rows */

/* ---- stored layouts (fp16 fields kept as raw uint16) ---- */

typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;               /* w = d*(q - 8) */
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;            /* w = d*q + m */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0; /* w = d*(q - 16) */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;                /* w = d*q */
/* Q4_K / Q5_K: 8 sub-blocks of 32, w = d*sc[j]*q - dmin*m[j], sc/m 6-bit packed in scales[12]. */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } block_q5_K;
/* Q6_K: 16 sub-blocks of 16, w = d*sc[j]*(q - 32), q = 4 low bits (ql) | 2 high bits (qh). */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } block_q6_K;

/* What the kernels need to know about a type. */
enum family { FAM_FLOAT, FAM_SMALL, FAM_K };
struct type_info {
    int id;
    const char *name;
    int block;          /* weights per block: 1 for floats */
    int bytes;          /* bytes per block */
    enum family family; /* which decoded form: struct fchunk, qchunk or kchunk */
};

const struct type_info *type_info(int id); /* NULL when the type is not supported */

/* Bytes of one row of k weights of type t (k a multiple of its block), as the file stores it. */
static inline size_t row_bytes(const struct type_info *t, int k) { return (size_t)(k / t->block) * (size_t)t->bytes; }
const char *ggml_type_name(int id);        /* any ggml type id, for messages ("?" if unknown) */
extern const char SUPPORTED_TYPES[];       /* "F32, F16, ..." for messages */

/* IEEE half -> float, exactly (normals, subnormals, inf, nan). */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exp == 0x1F) {
        v.u = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exact in float */
        v.f = (float)man * 0x1p-24f;
        v.u |= sign;
    }
    return v.f;
}
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}
static inline float fp16_at(const void *p) { /* unaligned-safe */
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return fp16_to_f32(h);
}

/* ---- decoded forms ---- */

/* F32/F16/BF16: 256 weights as float32 (zero past the end of the row). */
struct fchunk { float w[CHUNK] __attribute__((aligned(32))); };

/* Eight 32-weight blocks: w[i] = d[b]*(q[i] - zero) + m[b], b = i/32.  Q8_0's q is signed
 * (q_signed); the others are unsigned.  Blocks past the end of the row are all zero. */
struct qchunk {
    uint8_t q[CHUNK] __attribute__((aligned(32)));
    float d[8] __attribute__((aligned(32)));
    float m[8] __attribute__((aligned(32)));
    int zero;     /* 8 (Q4_0), 16 (Q5_0), 0 (Q4_1, Q8_0) */
    int q_signed; /* Q8_0 */
    int has_min;  /* Q4_1: m is its min (the other types' m is 0) */
};

/* One K-quant block, per 16 weights j: w[i] = d*(sc[j]*q[i] - zoff[j]) - dmin*mn[j].
 * Q4_K/Q5_K: sc, mn = the 6-bit scale and min of the 32-weight sub-block, zoff = 0.
 * Q6_K: sc = the int8 scale, zoff = 32*sc, mn = 0 and dmin = 0. */
struct kchunk {
    uint8_t q[CHUNK] __attribute__((aligned(32)));
    int16_t sc[16] __attribute__((aligned(32)));
    int16_t zoff[16] __attribute__((aligned(32)));
    int16_t mn[16] __attribute__((aligned(32)));
    float d, dmin;
};

/* Scalar decoders: `count` weights (<= CHUNK, a multiple of the block) from `raw`. */
void decode_float(int type, const uint8_t *raw, int count, struct fchunk *out);
void decode_small(int type, const uint8_t *raw, int count, struct qchunk *out);
void decode_k(int type, const uint8_t *raw, struct kchunk *out);
/* decode_k without q: the scales, offsets and d, dmin (SIMD paths decode q themselves). */
void decode_k_scales(int type, const uint8_t *raw, struct kchunk *out);

/* Q4_K/Q5_K's 12 packed bytes -> the 6-bit scales sc[0..7] and mins mn[0..7] of the 8
 * sub-blocks.  Bytes 0-3 hold sc[0..3], 4-7 mn[0..3] (low 6 bits each); bytes 8-11 hold the
 * low 4 bits of sc[4..7] (low nibbles) and mn[4..7] (high nibbles), whose top 2 bits are the
 * top 2 bits of bytes 0-3 and 4-7.  (Little-endian words, as on x86-64 and aarch64.) */
static inline void k_scales_unpack(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], v[2];
    __builtin_memcpy(u, s, 12);
    v[0] = u[0] & 0x3F3F3F3F;
    v[1] = (u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030);
    __builtin_memcpy(sc, v, 8);
    v[0] = u[1] & 0x3F3F3F3F;
    v[1] = ((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030);
    __builtin_memcpy(mn, v, 8);
}

/* One row of k weights of type t (k a multiple of its block) as float32: the embedding lookup. */
void dequantize_row(const struct type_info *t, const uint8_t *raw, int k, float *out);

/* ---- activations ---- */

/* M activation rows, each padded with zeros to kpad (a multiple of CHUNK) so that every
 * chunk is whole.  Quantized types use q/d/sum16, float types f. */
struct acts {
    int m, kpad;
    int block;      /* weights per activation scale: 32 or 256 (0 for float types) */
    int8_t *q;      /* (m, kpad): x ~= d * q, q in [-127, 127] */
    float *d;       /* (m, kpad / block) */
    int16_t *sum16; /* (m, kpad / 16): sum of q over each 16 */
    int16_t *sum32; /* (m, kpad / 32): sum of q over each 32 (two sum16s) */
    float *fsum32;  /* (m, kpad / 32): the same sums as float (exact), for small blocks' float updates;
                     * NULL for K-quants */
    float *f;       /* (m, kpad): float types: x as given */
    int ahead;      /* one row (m == 1): 1, the interleaved kernels fetch the weights ahead themselves, as
                     * they do with two rows or more, and Q4_K and Q6_K go in pairs of groups (matmul.c);
                     * 0, the driver asks for them in a burst a group.  The same bits either way; which
                     * is faster is the machine's (struct model's fetch_ahead; acts_alloc sets 1) */
};

/* Allocate and fill `a` from x (m, k) float32 for weights of type `t`; 0 on success,
 * -1 when out of memory.  acts_free releases it. */
int acts_init(struct acts *a, const struct type_info *t, const float *x, int m, int k);
/* acts_init in two steps: allocate for m rows of k (zeroed), then fill rows [r0, r1) from x (m, k);
 * rows are independent, so threads may fill disjoint ranges. */
int acts_alloc(struct acts *a, const struct type_info *t, int m, int k);
typedef void (*quantize_fn)(const float *x, int k, int block, int8_t *q, float *d, int16_t *sum16);
void acts_fill(struct acts *a, const float *x, int k, int r0, int r1, quantize_fn quantize); /* NULL: quantize_row */
void acts_free(struct acts *a);

/* One row of k floats to 8-bit blocks of `block` (k a multiple of block): the reference, which
 * floatops.h's vector path matches bit for bit. */
void quantize_row(const float *x, int k, int block, int8_t *q, float *d, int16_t *sum16);

#endif
