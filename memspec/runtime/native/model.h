/* A llama / qwen2 decoder over GGUF tensors as they are, and its forward pass.
 *
 * The weights are pointers into the memory-mapped GGUF (the Python side keeps the mapping
 * alive); nothing is converted, and matrices the path multiplies interleaved (pack.h) are
 * repacked once at load, losslessly.  A pass takes T rows (tokens) from S sequences, each row with
 * its sequence and position, writes their keys and values into the sequences' caches and
 * returns the logits of the rows asked for.  A row's logits depend only on its sequence's
 * tokens up to it and on the weights: not on T, S, the other rows or the thread count.
 * Matrix multiplies are memspec's exact kernels (matmul.h); every other step works on one
 * row (or one row and head) at a time, in a fixed order. */
#ifndef MEMSPEC_MODEL_H
#define MEMSPEC_MODEL_H

#include <stdint.h>

#include "attention.h"
#include "dot.h"
#include "floatops.h"
#include "matmul.h"
#include "pool.h"

struct layer {
    struct tensor attn_norm, wq, wk, wv, wo, bq, bk, bv, ffn_norm, wg, wu, wd; /* biases: data NULL if none */
};

struct model {
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab;
    int rope_neox;   /* 1: rotate pairs (i, i + d/2) (qwen2); 0: adjacent pairs (2i, 2i+1) (llama's GGUF order) */
    float rope_theta, rms_eps;
    struct tensor embd, out_norm, output; /* output = embd when the head is tied */
    struct layer *layers;
    const struct dot_isa *isa;
    const struct attn_isa *attn; /* attention's loops on the same path as isa */
    const struct float_isa *fops; /* the softmax's and SiLU's exponentials on the same path */
    int kv_type;                  /* the caches' format: KV_F16 or KV_Q8 (attention.h) */
    int fetch_ahead;              /* a one-row pass's kernels fetch their weights ahead (struct acts' ahead) */
    struct pool *pool;
};

/* One sequence's KV cache: [layer][K, V][kv head][capacity] rows of the model's kv_type
 * (attention.h: head_dim float16s, or head_dim int8s and their scale).  A row is written once, when
 * its position is fed, from that row's values alone. */
struct kv {
    uint8_t *data;
    int capacity;
};

/* One pass.  Row t feeds token ids[t] of sequence seq[t] at position pos[t]; a sequence's rows
 * come in increasing positions and every position below them is in its cache already (or fed
 * earlier in this pass).  logits (n_keep, vocab) for rows keep[0..n_keep-1].
 *
 * A token tree: parent (NULL: none) gives each row its parent row in the pass, or -1 for a row
 * that attends its cache's positions 0..pos[t] (every row without a tree).  A tree is a root (-1)
 * and the rows after it whose parents lead back to it, in the batch's order (a parent before its
 * children); a tree row sits at its parent's position + 1, its key and value go to slot
 * pos[root] + (t - root) of the cache, and it attends positions 0..pos[root] and then its
 * ancestors' slots and its own, in position order: the keys the same tokens fed as one chain
 * would attend, in the same order, so its logits are that chain's bit for bit.  A sequence's
 * trees come after its chain rows. */
struct batch {
    int t, s, n_keep;
    const int32_t *ids, *pos, *seq, *keep, *parent;
    struct kv *caches; /* s of them */
    float *logits;
    /* Features (n_features 0: none): hidden states of the kept rows, copied out of the pass's own
     * rows (no extra work, the same bits as the row's logits at any T and thread count).  For kept
     * row j and f < n_features, features[(j * n_features + f) * hidden ...] gets hidden state
     * feature_index[f], numbered as a Hugging Face model's hidden_states: 0 the token's embedding,
     * i in 1..n_layers-1 the residual stream after layer i-1, n_layers the final norm's output
     * (the head's input). */
    int n_features;
    const int32_t *feature_index;
    float *features;
};

/* 0 on success; -1 out of memory; -2 a bad batch (ids, positions, sequences or feature indices out of range). */
int model_forward(const struct model *m, const struct batch *b);

#endif
