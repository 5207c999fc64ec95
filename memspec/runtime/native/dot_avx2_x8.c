/* The AVX2 path's kernels for the interleaved types (pack.h): 8 outputs per vector, no reductions.
 *
 * For one sub-block j of 32 weights, a vector of the packed block holds 4 consecutive weights of
 * each of the 8 rows; _mm256_maddubs_epi16 against the activation row's 4 bytes broadcast gives
 * each row's partial dot product in its own lanes.  Summed over the sub-block's 8 vectors in int16
 * (|q.x| <= 15*127 per product: at most 16 products, 30480, fit) and multiplied by the rows'
 * scales with one _mm256_madd_epi16, they leave row o's sub-block sum in int32 lane o; the mins
 * go two sub-blocks to a madd, row o's pair of mins against the activation's two sums of 32
 * (each the sum of dot.c's two sums of 16: the same integers).  So lane o holds dot.c's ia and ib for
 * row o, exactly, and the float update is k_update's, lane by lane.  Q6_K likewise (q6k_x8).
 *
 * The packed vectors of a sub-block are unpacked once and applied to up to 8 activation rows.
 * Eight rows' accumulators do not all fit the 16 vector registers beside the unpacked weights;
 * the ones spilled cost loads and stores, while the kernel is bound by the vector ALU ports,
 * which the unpacking shared by 8 rows instead of 4 relieves (Q6_K: 15% less per row in cache;
 * a pass of 5-8 rows reads each weight block once instead of twice).
 *
 * Small blocks (dot_x8.inc's small): a block column's 8 vectors, 4 weights of each row, against the
 * activation block's bytes broadcast, as for Q4_K; their float updates go per block into the row's
 * lane block % 8, so they keep a vector of 8 outputs per lane and reduce the lanes once at the end.
 * On a Zen 4 EPYC (2 threads) SmolLM2-135M's passes (Q4_1, a tied Q8_0 head) took 0.66x the row
 * layout's time for 1 row and 0.61x for 4. */
#if defined(__x86_64__)

#include <immintrin.h>
#include <string.h>

#include "dot.h"
#include "dot_x86.h"
#include "pack.h"

#define X8 __attribute__((target("avx2,fma,f16c")))
#define X8_NAME(n) avx2_##n
#define X8_VNNI 0
#include "dot_x8.inc"

#endif
