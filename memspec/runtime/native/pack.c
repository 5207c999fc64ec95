/* The interleaved layouts (pack.h), built with the scalar decoder: exact by construction. */
#include "pack.h"

#include <stddef.h>
#include <string.h>

_Static_assert(sizeof(block_q4_Kx8) == 1184, "block_q4_Kx8 layout");

_Static_assert(sizeof(block_q6_Kx8) == 8 * sizeof(block_q6_K), "block_q6_Kx8 layout");

static size_t packed_block(int type) {
    return type == TYPE_Q4_K ? sizeof(block_q4_Kx8) : type == TYPE_Q6_K ? sizeof(block_q6_Kx8) : 0;
}

size_t pack_bytes(const struct type_info *t, int n, int k) {
    if (n % PACK_ROWS) return 0;
    return (size_t)(n / PACK_ROWS) * (size_t)(k / QK_K) * packed_block(t->id);
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
    int nb = k / QK_K;
    size_t row = (size_t)nb * t->bytes, block = packed_block(t->id);
    for (int g = 0; g < n / PACK_ROWS; g++)
        for (int c = 0; c < nb; c++, out += block) {
            memset(out, 0, block);
            for (int o = 0; o < PACK_ROWS; o++) {
                const uint8_t *raw = w + (size_t)(PACK_ROWS * g + o) * row + (size_t)c * t->bytes;
                struct kchunk wc;
                decode_k(t->id, raw, &wc);
                if (t->id == TYPE_Q4_K) pack_q4_k(&wc, raw, o, (block_q4_Kx8 *)out);
                else pack_q6_k(&wc, raw, o, (block_q6_Kx8 *)out);
            }
        }
}
