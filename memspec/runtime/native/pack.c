/* The interleaved layouts (pack.h): K-quants built with the scalar decoder, small blocks by moving
 * their bytes; exact by construction. */
#include "pack.h"

#include <stddef.h>
#include <string.h>

_Static_assert(sizeof(block_q4_Kx8) == 1184, "block_q4_Kx8 layout");

_Static_assert(sizeof(block_q6_Kx8) == 8 * sizeof(block_q6_K), "block_q6_Kx8 layout");

_Static_assert(sizeof(block_q4_0x8) == 8 * sizeof(block_q4_0), "block_q4_0x8 layout");
_Static_assert(sizeof(block_q4_1x8) == 8 * sizeof(block_q4_1), "block_q4_1x8 layout");
_Static_assert(sizeof(block_q5_0x8) == 8 * sizeof(block_q5_0), "block_q5_0x8 layout");
_Static_assert(sizeof(block_q8_0x8) == 8 * sizeof(block_q8_0), "block_q8_0x8 layout");

size_t pack_bytes(const struct type_info *t, int n, int k) {
    if (n % PACK_ROWS) return 0;
    return (size_t)(n / PACK_ROWS) * (size_t)(k / t->block) * pack_block_bytes(t->id);
}

/* Where a small block's fields sit, in the file's block and in the interleaved column. */
struct small_fields {
    int m, qh, qs;        /* offsets in the file's block (-1: none) */
    size_t pm, pqh, pqs;  /* offsets in the interleaved column */
};

static struct small_fields small_fields(int type) {
    switch (type) {
    case TYPE_Q4_0: return (struct small_fields){-1, -1, 2, 0, 0, offsetof(block_q4_0x8, qs)};
    case TYPE_Q4_1: return (struct small_fields){2, -1, 4, offsetof(block_q4_1x8, m), 0, offsetof(block_q4_1x8, qs)};
    case TYPE_Q5_0: return (struct small_fields){-1, 2, 6, 0, offsetof(block_q5_0x8, qh), offsetof(block_q5_0x8, qs)};
    default: return (struct small_fields){-1, -1, 2, 0, 0, offsetof(block_q8_0x8, qs)}; /* Q8_0 */
    }
}

/* Row o's small block raw (the file's layout) into its column col.  4-bit quants: file byte j
 * (weights j and 16 + j) is byte 4o + j % 4 of vector j / 4, which holds weights 4v + t and
 * 16 + 4v + t (pack.h); Q8_0's weight j likewise in vector j / 4; Q5_0's fifth bit of weight j is
 * bit j / 4 of qh[4o + j % 4]. */
static void small_pack(int type, const uint8_t *raw, int o, uint8_t *col) {
    struct small_fields f = small_fields(type);
    memcpy(col + 2 * o, raw, 2);
    if (f.m >= 0) memcpy(col + f.pm + 2 * o, raw + f.m, 2);
    for (int j = 0; j < (type == TYPE_Q8_0 ? 32 : 16); j++) col[f.pqs + 32 * (j / 4) + 4 * o + j % 4] = raw[f.qs + j];
    if (f.qh >= 0) {
        uint32_t qh;
        memcpy(&qh, raw + f.qh, 4);
        for (int j = 0; j < 32; j++) col[f.pqh + 4 * o + j % 4] |= (uint8_t)(((qh >> j) & 1) << (j / 4));
    }
}

/* small_pack's inverse: row o's block from its column. */
static void small_unpack(int type, const uint8_t *col, int o, uint8_t *raw) {
    struct small_fields f = small_fields(type);
    memcpy(raw, col + 2 * o, 2);
    if (f.m >= 0) memcpy(raw + f.m, col + f.pm + 2 * o, 2);
    for (int j = 0; j < (type == TYPE_Q8_0 ? 32 : 16); j++) raw[f.qs + j] = col[f.pqs + 32 * (j / 4) + 4 * o + j % 4];
    if (f.qh >= 0) {
        uint32_t qh = 0;
        for (int j = 0; j < 32; j++) qh |= (uint32_t)((col[f.pqh + 4 * o + j % 4] >> (j / 4)) & 1) << j;
        memcpy(raw + f.qh, &qh, 4);
    }
}

void unpack_block(const struct type_info *t, const uint8_t *packed, int k, int row, int p, uint8_t *raw) {
    size_t col = pack_block_bytes(t->id), cols = (size_t)(k / t->block);
    small_unpack(t->id, packed + ((size_t)(row / PACK_ROWS) * cols + (size_t)p) * col, row % PACK_ROWS, raw);
}

/* Row o's 32 weights 32f .. 32f+31 (q, decoded) into a pair's 4 nibble vectors (pack.h). */
static void pack_nibbles(const uint8_t *q, int o, uint8_t *dst) {
    for (int v = 0; v < 4; v++)
        for (int i = 0; i < 4; i++)
            dst[32 * v + 4 * o + i] = (uint8_t)((q[4 * v + i] & 15) | (q[16 + 4 * v + i] & 15) << 4);
}

/* Row o (decoded as wc, its raw block at raw) into the interleaved block dst. */
static void pack_q4_k(const struct kchunk *wc, const uint8_t *raw, int o, block_q4_Kx8 *dst) {
    memcpy(&dst->d[o], raw, 2);
    memcpy(&dst->dmin[o], raw + 2, 2);
    for (int j = 0; j < 8; j++) { /* per 16 weights: sc[2j] and mn[2j] are sub-block j's */
        dst->sc[j][o] = (uint8_t)wc->sc[2 * j];
        dst->mn[j / 2][2 * o + j % 2] = (uint8_t)wc->mn[2 * j];
        pack_nibbles(wc->q + 32 * j, o, dst->qs[j]);
    }
}

static void pack_q6_k(const struct kchunk *wc, const uint8_t *raw, int o, block_q6_Kx8 *dst) {
    memcpy(&dst->d[o], raw + offsetof(block_q6_K, d), 2);
    for (int j = 0; j < 16; j++) dst->sc[j][o] = (int8_t)wc->sc[j];
    for (int f = 0; f < 8; f++) {
        const uint8_t *q = wc->q + 32 * f;
        pack_nibbles(q, o, dst->pair[f].ql);
        for (int p = 0; p < 8; p++)
            for (int i = 0; i < 4; i++) {
                uint8_t *h = &dst->pair[f].qh[32 * (p / 4) + 4 * o + i];
                *h = (uint8_t)(*h | (q[4 * p + i] >> 4) << (2 * (p % 4)));
            }
    }
}

void pack_rows(const struct type_info *t, const uint8_t *w, int n, int k, uint8_t *out) {
    int nb = k / t->block;
    size_t row = (size_t)nb * t->bytes, block = pack_block_bytes(t->id);
    for (int g = 0; g < n / PACK_ROWS; g++)
        for (int c = 0; c < nb; c++, out += block) {
            memset(out, 0, block);
            for (int o = 0; o < PACK_ROWS; o++) {
                const uint8_t *raw = w + (size_t)(PACK_ROWS * g + o) * row + (size_t)c * t->bytes;
                if (t->family == FAM_SMALL) {
                    small_pack(t->id, raw, o, out);
                    continue;
                }
                struct kchunk wc;
                decode_k(t->id, raw, &wc);
                if (t->id == TYPE_Q4_K) pack_q4_k(&wc, raw, o, (block_q4_Kx8 *)out);
                else pack_q6_k(&wc, raw, o, (block_q6_Kx8 *)out);
            }
        }
}
