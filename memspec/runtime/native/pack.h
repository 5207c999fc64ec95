/* Interleaved layouts: the blocks of 8 weight rows side by side, repacked once at load.
 *
 * A kernel that computes 8 outputs at once then reads one contiguous run of bytes per block
 * column and keeps the 8 outputs in the lanes of one vector: no horizontal sum per row and
 * block, and each weight vector serves every activation row of the pass.  Repacking is
 * lossless (the same integers, the same fp16 scales, only moved), and a row's float updates
 * are dot.h's k_update or small_update, block after block, exactly as on the row layout: the
 * outputs are the same bits.  Which types a path takes interleaved is its struct dot_isa's packed_types. */
#ifndef MEMSPEC_PACK_H
#define MEMSPEC_PACK_H

#include <stddef.h>

#include "quants.h"

#define PACK_ROWS 8 /* weight rows interleaved */

/* Block column c of Q4_K rows 8g .. 8g+7 (1184 bytes against 8 x 144: 2.8% more, for the
 * scales and mins unpacked to bytes). */
typedef struct {
    uint16_t d[8], dmin[8]; /* row o's d and dmin, fp16 as stored */
    uint8_t sc[8][8];       /* [sub-block j][row o]: the 6-bit scale */
    uint8_t mn[4][16];      /* [f][2o + h]: the 6-bit min of sub-block 2f + h (pairs of a row's mins, for one
                             * madd against the activation's two sums of 32) */
    /* sub-block j (weights 32j .. 32j+31): 4 vectors of 32 bytes; in vector v, byte 4o + t holds
     * row o's weight 32j + 4v + t in its low nibble and weight 32j + 16 + 4v + t in its high one */
    uint8_t qs[8][128];
} block_q4_Kx8;

/* Block column c of Q6_K rows 8g .. 8g+7 (1680 bytes: 8 x 210, the same bits moved).  Pair f of
 * 16-weight sub-blocks (weights 32f .. 32f+31) is laid out as Q4_K's sub-block: in vector v of
 * pair[f].ql, byte 4o + t holds the low 4 bits of row o's weight 32f + 4v + t (low nibble) and of
 * 32f + 16 + 4v + t (high); so vector p = 0..7 of the pair (low nibbles, then high) holds weights
 * 32f + 4p + t, and bits 2s, 2s+1 of byte 4o + t in pair[f].qh[32u ..] are that weight's top 2 bits
 * for p = 4u + s. */
typedef struct {
    uint16_t d[8];     /* row o's d, fp16 as stored */
    int8_t sc[16][8];  /* [sub-block j][row o]: the int8 scale */
    struct {
        uint8_t ql[128];
        uint8_t qh[64];
    } pair[8];         /* pairs in the order they are read */
} block_q6_Kx8;

/* Block column p (weights 32p .. 32p+31) of small-block rows 8g .. 8g+7: the same bytes as the 8
 * blocks, moved (144, 160, 176, 272 bytes against 8 x 18, 20, 22, 34).  The quants of 4 consecutive
 * weights of every row make one 32-byte vector, so vector p' = 0..7 holds weights 32p + 4p' + t of
 * row o in byte 4o + t:
 *   Q4_0, Q4_1: vector v of qs holds p' = v in its low nibbles and p' = v + 4 in its high ones
 *               (weights 4v + t and 16 + 4v + t of the block);
 *   Q5_0: as Q4_0, and bit p' of qh[4o + t] is the fifth bit of row o's weight 4p' + t;
 *   Q8_0: vector p' of qs, as stored (int8). */
typedef struct {
    uint16_t d[8];      /* row o's d, fp16 as stored */
    uint8_t qs[4][32];
} block_q4_0x8;
typedef struct {
    uint16_t d[8], m[8]; /* row o's d and m, fp16 as stored */
    uint8_t qs[4][32];
} block_q4_1x8;
typedef struct {
    uint16_t d[8];
    uint8_t qs[4][32];
    uint8_t qh[32];
} block_q5_0x8;
typedef struct {
    uint16_t d[8];
    int8_t qs[8][32];
} block_q8_0x8;

/* Bytes of one interleaved block column of `type` (8 rows), or 0 when it has no interleaved form
 * (inline: a constant in each kernel). */
static inline size_t pack_block_bytes(int type) {
    switch (type) {
    case TYPE_Q4_K: return sizeof(block_q4_Kx8);
    case TYPE_Q6_K: return sizeof(block_q6_Kx8);
    case TYPE_Q4_0: return sizeof(block_q4_0x8);
    case TYPE_Q4_1: return sizeof(block_q4_1x8);
    case TYPE_Q5_0: return sizeof(block_q5_0x8);
    case TYPE_Q8_0: return sizeof(block_q8_0x8);
    default: return 0;
    }
}

/* Bytes of the interleaved form of an (n, k) matrix of type t, or 0 when t has none or n is
 * not a multiple of PACK_ROWS. */
size_t pack_bytes(const struct type_info *t, int n, int k);

/* Interleave the (n, k) matrix w of type t (pack_bytes > 0) into out (pack_bytes of them). */
void pack_rows(const struct type_info *t, const uint8_t *w, int n, int k, uint8_t *out);

/* Whether unpack_block takes type t: the small blocks, whose rows a lookup can read back from the
 * interleaved copy (a tied head's embedding rows). */
static inline int pack_unpacks(const struct type_info *t) { return t->family == FAM_SMALL; }

/* Block p of row `row` of the interleaved (n, k) matrix `packed` of type t (pack_unpacks), as the
 * file stored it, into raw (t->bytes of them): pack_rows's exact inverse. */
void unpack_block(const struct type_info *t, const uint8_t *packed, int k, int row, int p, uint8_t *raw);

#endif
