/* The forward pass (model.h).  Shapes in comments: T rows in the pass, H hidden, nh query
 * heads, kvh KV heads, hd head width, F the MLP width, V the vocabulary. */
#include "model.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

/* ---- one row at a time ---- */

static void rms_norm(const float *x, const struct tensor *w, int h, float eps, float *y) {
    double sum = 0.0;
    for (int i = 0; i < h; i++) sum += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(sum / h) + eps);
    const float *g = (const float *)w->data;
    for (int i = 0; i < h; i++) y[i] = (x[i] * scale) * g[i];
}

static void add_bias(float *y, const struct tensor *b, int n) {
    if (!b->data) return;
    const float *v = (const float *)b->data;
    for (int i = 0; i < n; i++) y[i] += v[i];
}

/* Rotate each head of v (heads x hd) by the row's angles (cs: hd/2 cosines then hd/2 sines). */
static void rope(float *v, int heads, int hd, const float *cs, int neox) {
    const float *c = cs, *s = cs + hd / 2;
    for (int h = 0; h < heads; h++) {
        float *x = v + (size_t)h * hd;
        for (int i = 0; i < hd / 2; i++) {
            int a = neox ? i : 2 * i, b = neox ? i + hd / 2 : 2 * i + 1;
            float x0 = x[a], x1 = x[b];
            x[a] = x0 * c[i] - x1 * s[i];
            x[b] = x0 * s[i] + x1 * c[i];
        }
    }
}

/* ---- the pass ---- */

/* A pass of ROWS_SHARED rows or more runs its row steps (norms, rotations, activation
 * quantization) on the pool, a contiguous range of rows per thread; fewer run them on the caller,
 * where a pool run would cost more than the step.  A row's step is the same arithmetic whoever
 * runs it. */
#define ROWS_SHARED 2

/* A matmul run deals each matrix's outputs in chunks of CHUNK_OUTPUTS (a multiple of PACK_ROWS):
 * thread i takes the chunks of its own contiguous share from the front, then, with its share done,
 * the last chunks of another's share from the back.  A thread that started late or was slowed (a
 * vCPU taken by the host, a busier core) is helped instead of waited for, and each thread still
 * streams a contiguous run of weights while the shares last.  Who computes a chunk changes nothing
 * in it. */
#define CHUNK_OUTPUTS 64
#define DEAL_THREADS 64 /* shares a deal has room for; in a larger pool, threads past it share them */

struct deal {
    int chunks, n;                          /* chunks in all, threads */
    _Atomic uint64_t share[DEAL_THREADS];   /* thread i's share: next chunk (low 32 bits), end (high) */
};

static void deal_init(struct deal *d, int outputs, int threads) {
    d->chunks = (outputs + CHUNK_OUTPUTS - 1) / CHUNK_OUTPUTS;
    d->n = threads < DEAL_THREADS ? threads : DEAL_THREADS;
    for (int i = 0; i < d->n; i++) {
        int lo, hi;
        pool_range(d->chunks, i, d->n, &lo, &hi);
        atomic_store_explicit(&d->share[i], (uint64_t)lo | (uint64_t)hi << 32, memory_order_relaxed);
    }
}

/* The next chunk for thread i, or -1 when every share is taken (every take is one CAS, so any number
 * of threads may take from one share). */
static int deal_next(struct deal *d, int i) {
    for (int step = 0; step < d->n; step++) {
        _Atomic uint64_t *s = &d->share[(i + step) % d->n];
        uint64_t v = atomic_load_explicit(s, memory_order_relaxed);
        for (;;) {
            uint32_t next = (uint32_t)v, end = (uint32_t)(v >> 32);
            if (next >= end) break;
            uint64_t taken = step == 0 ? v + 1 : (uint64_t)next | (uint64_t)(end - 1) << 32;
            if (atomic_compare_exchange_weak_explicit(s, &v, taken, memory_order_relaxed, memory_order_relaxed))
                return (int)(step == 0 ? next : end - 1);
        }
    }
    return -1;
}

/* The activations of x (rows x k) quantized for each weight family that reads them. */
struct quantized {
    const float *x;
    int rows, k;
    struct acts a[3]; /* floats, 32-blocks, 256-blocks */
    int ready[3];
};

struct pass {
    const struct model *m;
    const struct batch *b;
    const struct layer *L;
    int layer;
    float *x, *h, *q, *k, *v, *att, *o, *g, *u; /* (T, H), (T, H), (T, nh hd), (T, kvh hd) x2, (T, nh hd), (T, H), (T, F) x2 */
    float *rot;                                 /* (T, hd): each row's cosines and sines */
    float *scores;                              /* (threads, UNIT_QUERIES, stride): attention weights */
    int longest, stride;                        /* the longest context, and it rounded up to ATTN_PAD */
    int *order;                                 /* (T): rows by sequence */
    int *root, *slot;                           /* (T): each row's tree root (itself without a tree), cache slot */
    struct unit *units;                         /* attention's units (plan_attention) */
    int n_units;
    atomic_int next_unit;                       /* the next unit a thread takes */
    /* the stage in flight (stage()): a row step, the matrices its output feeds, an epilogue */
    void (*row)(struct pass *p, int t);           /* row t's step before its activations are quantized */
    struct quantized z;
    struct mm { const struct tensor *w; const struct acts *a; float *out; } mm[3];
    int n_mm;
    void (*after)(struct pass *p, int lo, int hi); /* on a thread's outputs [lo, hi) of mm[0], all rows */
    int joint;                                     /* the matrices share one deal (the same outputs) */
    struct deal deals[3];                          /* mm[j]'s chunks, or all of them in deals[0] when joint */
};

/* The byte offset of a cache row (struct kv). */
static size_t kv_at(const struct model *m, const struct kv *c, int layer, int which, int head, int pos) {
    return ((((size_t)layer * 2 + which) * m->n_kv_heads + head) * c->capacity + pos) * kv_row_bytes(m->kv_type, m->head_dim);
}

static void run_rows(struct pass *p, int rows, pool_fn fn) {
    if (rows >= ROWS_SHARED) pool_run(p->m->pool, fn, p);
    else fn(p, 0, 1);
}

/* Threads take each matrix's outputs chunk by chunk (struct deal); where the matrices have the
 * same outputs (gate and up) a chunk is those outputs of every matrix, then the epilogue on them. */
static void run_matmuls(void *arg, int i, int n) {
    struct pass *p = arg;
    (void)n;
    for (int j = 0; j < (p->joint ? 1 : p->n_mm); j++) {
        int c, outputs = p->mm[j].w->n;
        while ((c = deal_next(&p->deals[j], i)) >= 0) {
            int lo = c * CHUNK_OUTPUTS, hi = lo + CHUNK_OUTPUTS < outputs ? lo + CHUNK_OUTPUTS : outputs;
            for (int jj = j; jj < (p->joint ? p->n_mm : j + 1); jj++)
                matmul_outputs(p->m->isa, p->mm[jj].w, p->mm[jj].a, p->mm[jj].out, lo, hi);
            if (p->joint && p->after) p->after(p, lo, hi);
        }
    }
}

/* The epilogue alone, threads splitting mm[0]'s outputs. */
static void run_after(void *arg, int i, int n) {
    struct pass *p = arg;
    int lo, hi;
    pool_range(p->mm[0].w->n, i, n, &lo, &hi);
    p->after(p, lo, hi);
}

/* Threads split the rows of the stage: each row's step, then its quantized activations. */
static void run_stage_rows(void *arg, int i, int n) {
    struct pass *p = arg;
    struct quantized *z = &p->z;
    int lo, hi;
    pool_range(z->rows, i, n, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        if (p->row) p->row(p, t);
        for (int kind = 0; kind < 3; kind++)
            if (z->ready[kind]) acts_fill(&z->a[kind], z->x, z->k, t, t + 1, p->m->fops->quantize);
    }
}

/* out_j = x @ w_j^T for up to three matrices that read x (rows x k), after `row` has made each
 * row of x, and `after` on each thread's outputs: one row run, then one matmul run. */
static int stage(struct pass *p, void (*row)(struct pass *, int), const float *x, int rows, int k,
                 const struct tensor *const *w, float *const *out, int count,
                 void (*after)(struct pass *, int, int)) {
    struct quantized *z = &p->z;
    *z = (struct quantized){x, rows, k, {{0}}, {0}};
    int failed = 0;
    for (int j = 0; j < count && !failed; j++) {
        const struct type_info *t = w[j]->t;
        int kind = t->family == FAM_FLOAT ? 0 : t->block == QK ? 1 : 2;
        if (!z->ready[kind]) {
            failed = acts_alloc(&z->a[kind], t, rows, k) != 0;
            z->a[kind].ahead = p->m->fetch_ahead;
            z->ready[kind] = !failed;
        }
        p->mm[j] = (struct mm){w[j], &z->a[kind], out[j]};
    }
    if (!failed) {
        /* the epilogue rides on the matmul run only where every matrix splits its outputs alike */
        int alike = 1;
        for (int j = 1; j < count; j++)
            alike &= w[j]->n == w[0]->n && !w[j]->packed == !w[0]->packed;
        p->row = row, p->n_mm = count, p->after = alike ? after : NULL, p->joint = alike;
        for (int j = 0; j < (alike ? 1 : count); j++) deal_init(&p->deals[j], w[j]->n, pool_threads(p->m->pool));
        run_rows(p, rows, run_stage_rows);
        pool_run(p->m->pool, run_matmuls, p);
        if (after && !alike) {
            p->after = after;
            pool_run(p->m->pool, run_after, p);
        }
    }
    for (int kind = 0; kind < 3; kind++)
        if (z->ready[kind]) acts_free(&z->a[kind]);
    return failed ? -1 : 0;
}

/* Attention runs in units: some rows of one sequence and some query heads of one KV head, so
 * that each cached key and value is converted once for all of their queries (attention.h).  A
 * unit holds at most UNIT_QUERIES queries; threads take units in turn.  Smaller units share the
 * work out more evenly but convert the same keys and values more often, and at long context that
 * conversion (the cache's bytes read) costs about UNIT_READ queries' arithmetic: the plan is the
 * shape, of those halving the rows and then the heads, whose units the threads finish first by
 * that measure (plan_cost).  A query's arithmetic is the same in any unit, on any thread: the
 * same bits. */
#define UNIT_QUERIES 24
#define UNIT_READ 4 /* a unit's cost: its positions x (UNIT_READ + its queries) (bench/attention_harness.c) */

struct unit {
    int r0, r1, g, h0, h1; /* rows order[r0..r1) of one sequence, KV head g, query heads [h0, h1) */
};

/* Units of up to `rows` rows of a sequence and `heads` heads of a group, written to p->units if it is
 * set; their count either way.  cost (if set): the time threads taking them in turn end at, by the
 * measure above. */
static int plan_units(struct pass *p, int rows, int heads, int threads, double *cost) {
    const struct model *m = p->m;
    int group = m->n_heads / m->n_kv_heads, count = 0, T = p->b->t;
    double busy[64] = {0};
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    for (int r0 = 0; r0 < T;) {
        int end = r0, longest = 0;
        while (end < T && p->b->seq[p->order[end]] == p->b->seq[p->order[r0]] && end - r0 < rows) {
            int n = p->b->pos[p->order[end]] + 1;
            longest = n > longest ? n : longest;
            end++;
        }
        for (int g = 0; g < m->n_kv_heads; g++)
            for (int h = 0; h < group; h += heads, count++) {
                int h1 = h + heads < group ? h + heads : group;
                if (p->units) p->units[count] = (struct unit){r0, end, g, g * group + h, g * group + h1};
                if (cost) { /* the next unit goes to the thread free first */
                    int free = 0;
                    for (int i = 1; i < threads; i++) free = busy[i] < busy[free] ? i : free;
                    busy[free] += (double)longest * (UNIT_READ + (end - r0) * (h1 - h));
                }
            }
        r0 = end;
    }
    if (cost) {
        *cost = 0;
        for (int i = 0; i < threads; i++) *cost = busy[i] > *cost ? busy[i] : *cost;
    }
    return count;
}

/* The pass's rows by sequence (each sequence's rows in the batch's order: increasing positions),
 * and its attention units.  -1 when out of memory. */
static int plan_attention(struct pass *p, int threads) {
    const struct batch *b = p->b;
    int group = p->m->n_heads / p->m->n_kv_heads, T = b->t, at = 0;
    for (int s = 0; s < b->s; s++) /* sequences are few (a batch's requests): a pass over the rows each */
        for (int t = 0; t < T; t++)
            if (b->seq[t] == s) p->order[at++] = t;
    int heads = group < UNIT_QUERIES ? group : UNIT_QUERIES, rows = UNIT_QUERIES / heads;
    int best_rows = rows, best_heads = heads;
    double best, cost;
    plan_units(p, rows, heads, threads, &best);
    while (rows > 1 || heads > 1) { /* halve the rows, then the heads; the first of equal costs (larger units) */
        if (rows > 1) rows = (rows + 1) / 2;
        else heads = (heads + 1) / 2;
        plan_units(p, rows, heads, threads, &cost);
        if (cost < best) best = cost, best_rows = rows, best_heads = heads;
    }
    p->n_units = plan_units(p, best_rows, best_heads, threads, NULL);
    if (!(p->units = malloc(sizeof(struct unit) * (size_t)p->n_units))) return -1;
    plan_units(p, best_rows, best_heads, threads, NULL);
    return 0;
}

/* Each query's softmax numerators in place, and their sums: top = the largest score, w[j] =
 * e^(w[j] - top), sum in order of j.  Four queries' chains at a time, each in its own order. */
static void softmax_queries(const struct model *m, const struct attn_query *qs, int nq, float *sums) {
    for (int i0 = 0; i0 < nq; i0 += 4) {
        int k = nq - i0 < 4 ? nq - i0 : 4, common = qs[i0].n, j;
        for (int u = 1; u < k; u++) common = qs[i0 + u].n < common ? qs[i0 + u].n : common;
        float top[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (k == 4)
            for (j = 0; j < common; j++)
                for (int u = 0; u < 4; u++) top[u] = qs[i0 + u].w[j] > top[u] ? qs[i0 + u].w[j] : top[u];
        for (int u = 0; u < k; u++)
            for (j = k == 4 ? common : 0; j < qs[i0 + u].n; j++) top[u] = qs[i0 + u].w[j] > top[u] ? qs[i0 + u].w[j] : top[u];
        for (int u = 0; u < k; u++) m->fops->exp_shifted(qs[i0 + u].w, qs[i0 + u].n, top[u]);
        if (k == 4)
            for (j = 0; j < common; j++)
                for (int u = 0; u < 4; u++) sum[u] += qs[i0 + u].w[j];
        for (int u = 0; u < k; u++)
            for (j = k == 4 ? common : 0; j < qs[i0 + u].n; j++) sum[u] += qs[i0 + u].w[j];
        for (int u = 0; u < k; u++) sums[i0 + u] = sum[u];
    }
}

/* Whether row a is row t or one of its ancestors in a tree (parents come before children). */
static int on_path(const struct batch *b, int a, int t) {
    while (t > a && b->parent[t] >= 0) t = b->parent[t];
    return t == a;
}

/* A tree's keys past its root: for each tree row a of the unit's sequence, in the batch's order
 * (an ancestor before its descendants, so each query's keys come in position order), the queries
 * whose row is a or descends from it get a's score at w[pos[a]] (which = 0: scores), or add a's
 * weighted value to their output (mix).  One key per call: a query's arithmetic on a key is the
 * same whatever else a call holds (attention.h), and mix adds each key in turn, so a query's sums
 * are those of one call over its keys in order. */
static void attend_tree(struct pass *p, const struct unit *u, struct attn_query *qs, int nq, const int *rows,
                        int which) {
    const struct model *m = p->m;
    const struct batch *b = p->b;
    int hd = m->head_dim, s = b->seq[rows[0]];
    const struct kv *c = &b->caches[s];
    struct attn_query one[UNIT_QUERIES];
    float scratch[UNIT_QUERIES][ATTN_PAD];
    for (int a = 0; a < b->t; a++) {
        if (b->seq[a] != s || b->parent[a] < 0) continue;
        int k = 0, at[UNIT_QUERIES];
        for (int i = 0; i < nq; i++)
            if (on_path(b, a, rows[i])) {
                one[k] = which == 0 ? (struct attn_query){qs[i].q, 1, scratch[k], NULL}
                                    : (struct attn_query){qs[i].q, 1, qs[i].w + b->pos[a], qs[i].out};
                at[k++] = i;
            }
        if (!k) continue;
        const uint8_t *kv = c->data + kv_at(m, c, p->layer, which, u->g, p->slot[a]);
        if (which == 0) {
            m->attn->scores(one, k, kv, m->kv_type, hd, 1.0f / sqrtf((float)hd));
            for (int j = 0; j < k; j++) qs[at[j]].w[b->pos[a]] = scratch[j][0];
        } else {
            m->attn->mix(one, k, kv, m->kv_type, hd);
        }
    }
}

/* One unit: every query's scores over positions 0..pos of its sequence's cache (a tree row: its
 * root's and those before, then its ancestors' slots: attend_tree), softmax, the weighted values,
 * scaled by 1/sum. */
static void attend(struct pass *p, const struct unit *u, struct attn_query *qs, float *w) {
    const struct model *m = p->m;
    const struct batch *b = p->b;
    int nh = m->n_heads, hd = m->head_dim, nq = 0, tree = 0;
    int rows[UNIT_QUERIES], base[UNIT_QUERIES]; /* each query's row, and the positions it reads from slot 0 on */
    const struct kv *c = &b->caches[b->seq[p->order[u->r0]]];
    for (int r = u->r0; r < u->r1; r++) {
        int t = p->order[r];
        tree |= p->root[t] != t;
        for (int h = u->h0; h < u->h1; h++, nq++) {
            size_t at = (size_t)t * nh * hd + (size_t)h * hd;
            rows[nq] = t, base[nq] = b->pos[p->root[t]] + 1;
            qs[nq] = (struct attn_query){p->q + at, base[nq], w + (size_t)nq * p->stride, p->att + at};
            memset(qs[nq].out, 0, sizeof(float) * hd);
        }
    }
    float sums[UNIT_QUERIES];
    m->attn->scores(qs, nq, c->data + kv_at(m, c, p->layer, 0, u->g, 0), m->kv_type, hd, 1.0f / sqrtf((float)hd));
    if (tree) {
        attend_tree(p, u, qs, nq, rows, 0);
        for (int i = 0; i < nq; i++) qs[i].n = b->pos[rows[i]] + 1;
    }
    softmax_queries(m, qs, nq, sums);
    if (tree)
        for (int i = 0; i < nq; i++) qs[i].n = base[i];
    m->attn->mix(qs, nq, c->data + kv_at(m, c, p->layer, 1, u->g, 0), m->kv_type, hd);
    if (tree) attend_tree(p, u, qs, nq, rows, 1);
    for (int i = 0; i < nq; i++) {
        float inv = 1.0f / sums[i];
        for (int d = 0; d < hd; d++) qs[i].out[d] *= inv;
    }
}

static void run_attention(void *arg, int i, int n) {
    struct pass *p = arg;
    struct attn_query qs[UNIT_QUERIES];
    float *w = p->scores + (size_t)i * UNIT_QUERIES * p->stride;
    int u;
    (void)n;
    while ((u = atomic_fetch_add_explicit(&p->next_unit, 1, memory_order_relaxed)) < p->n_units) attend(p, &p->units[u], qs, w);
}

/* ---- the row steps ---- */

/* Row t enters a layer: the last layer's MLP output added (none before the first), then normed. */
static void attn_in(struct pass *p, int t) {
    int H = p->m->hidden;
    float *x = p->x + (size_t)t * H, *o = p->o + (size_t)t * H;
    if (p->layer > 0)
        for (int i = 0; i < H; i++) x[i] += o[i];
    rms_norm(x, &p->L->attn_norm, H, p->m->rms_eps, p->h + (size_t)t * H);
}

/* Row t's query, key and value: biases, rotation, and its key and value into its cache (quantized
 * there, for KV_Q8: the row itself attends them as read back, as every later row will). */
static void qkv_out(void *arg, int i, int n) {
    struct pass *p = arg;
    const struct model *m = p->m;
    const struct batch *b = p->b;
    const struct layer *L = p->L;
    int hd = m->head_dim, nh = m->n_heads, kvh = m->n_kv_heads, lo, hi;
    pool_range(b->t, i, n, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        float *q = p->q + (size_t)t * nh * hd, *k = p->k + (size_t)t * kvh * hd, *v = p->v + (size_t)t * kvh * hd;
        add_bias(q, &L->bq, nh * hd);
        add_bias(k, &L->bk, kvh * hd);
        add_bias(v, &L->bv, kvh * hd);
        rope(q, nh, hd, p->rot + (size_t)t * hd, m->rope_neox);
        rope(k, kvh, hd, p->rot + (size_t)t * hd, m->rope_neox);
        struct kv *c = &b->caches[b->seq[t]];
        for (int g = 0; g < kvh; g++) {
            uint8_t *kd = c->data + kv_at(m, c, p->layer, 0, g, p->slot[t]);
            uint8_t *vd = c->data + kv_at(m, c, p->layer, 1, g, p->slot[t]);
            if (m->kv_type == KV_Q8) {
                kv_q8_key(k + g * hd, L->bk.data ? (const float *)L->bk.data + g * hd : NULL, hd, kd);
                kv_q8_row(v + g * hd, hd, vd);
            } else {
                m->fops->to_f16(k + g * hd, (uint16_t *)kd, hd);
                m->fops->to_f16(v + g * hd, (uint16_t *)vd, hd);
            }
        }
    }
}

/* Row t after attention: the attention output projected and added, then normed for the MLP. */
static void ffn_in(struct pass *p, int t) {
    int H = p->m->hidden;
    float *x = p->x + (size_t)t * H, *o = p->o + (size_t)t * H;
    for (int i = 0; i < H; i++) x[i] += o[i];
    rms_norm(x, &p->L->ffn_norm, H, p->m->rms_eps, p->h + (size_t)t * H);
}

/* The gate's outputs [lo, hi) of every row: silu(gate) * up, on the thread that computed them. */
static void swiglu(struct pass *p, int lo, int hi) {
    int F = p->m->ffn;
    for (int t = 0; t < p->b->t; t++) p->m->fops->silu_mul(p->g + (size_t)t * F + lo, p->u + (size_t)t * F + lo, hi - lo);
}

/* Row t leaves the last layer: its MLP output added. */
static void last_out(void *arg, int i, int n) {
    struct pass *p = arg;
    int H = p->m->hidden, lo, hi;
    pool_range(p->b->t, i, n, &lo, &hi);
    for (size_t e = (size_t)lo * H; e < (size_t)hi * H; e++) p->x[e] += p->o[e];
}

/* Kept row j (batch row keep[j]), normed for the head. */
static void head_in(struct pass *p, int j) {
    int H = p->m->hidden;
    rms_norm(p->x + (size_t)p->b->keep[j] * H, &p->m->out_norm, H, p->m->rms_eps, p->h + (size_t)j * H);
}

/* Hidden state `index` (struct batch's numbering) of every kept row into the features, where the
 * batch asks for it: the embedding (index 0) is x; the residual stream after layer index-1 is x plus
 * that layer's MLP output in o, added as the next layer adds it (attn_in, last_out); the head's
 * input is h, kept row j at row j (head_in). */
static void take_features(struct pass *p, int index) {
    const struct batch *b = p->b;
    int H = p->m->hidden, n = b->n_features;
    for (int f = 0; f < n; f++) {
        if (b->feature_index[f] != index) continue;
        for (int j = 0; j < b->n_keep; j++) {
            float *y = b->features + ((size_t)j * n + f) * H;
            const float *x = p->x + (size_t)b->keep[j] * H, *o = p->o + (size_t)b->keep[j] * H;
            if (index == p->m->n_layers) memcpy(y, p->h + (size_t)j * H, sizeof(float) * H);
            else if (index == 0) memcpy(y, x, sizeof(float) * H);
            else
                for (int i = 0; i < H; i++) y[i] = x[i] + o[i];
        }
    }
}

static int layer_forward(struct pass *p) {
    const struct model *m = p->m;
    const struct layer *L = p->L;
    int T = p->b->t, H = m->hidden, F = m->ffn;
    const struct tensor *qkv[3] = {&L->wq, &L->wk, &L->wv}, *wo[1] = {&L->wo}, *gu[2] = {&L->wg, &L->wu},
                        *wd[1] = {&L->wd};
    float *qkv_outs[3] = {p->q, p->k, p->v}, *o_out[1] = {p->o}, *gu_out[2] = {p->g, p->u};
    if (stage(p, attn_in, p->h, T, H, qkv, qkv_outs, 3, NULL) != 0) return -1;
    run_rows(p, T, qkv_out);
    atomic_store_explicit(&p->next_unit, 0, memory_order_relaxed);
    pool_run(m->pool, run_attention, p);
    if (stage(p, NULL, p->att, T, m->n_heads * m->head_dim, wo, o_out, 1, NULL) != 0) return -1;
    if (stage(p, ffn_in, p->h, T, H, gu, gu_out, 2, swiglu) != 0) return -1;
    return stage(p, NULL, p->g, T, F, wd, o_out, 1, NULL); /* added at the next layer's attn_in */
}

/* The batch's checks, and each row's tree root and cache slot (struct batch). */
static int check_batch(const struct model *m, const struct batch *b, int *root, int *slot) {
    if (b->t < 1 || b->s < 1 || b->n_keep < 0 || b->n_keep > b->t) return -2;
    for (int t = 0; t < b->t; t++) {
        if (b->ids[t] < 0 || b->ids[t] >= m->vocab || b->seq[t] < 0 || b->seq[t] >= b->s) return -2;
        if (b->pos[t] < 0 || b->pos[t] >= b->caches[b->seq[t]].capacity) return -2;
        int a = b->parent ? b->parent[t] : -1;
        root[t] = t, slot[t] = b->pos[t];
        if (a >= 0) { /* a tree row: after its parent, and the rows since its root are the tree's */
            if (a >= t || b->seq[a] != b->seq[t] || b->pos[t] != b->pos[a] + 1 || root[t - 1] != root[a]) return -2;
            root[t] = root[a], slot[t] = b->pos[root[t]] + (t - root[t]);
            if (slot[t] >= b->caches[b->seq[t]].capacity) return -2;
        } else if (a != -1) {
            return -2;
        } else if (b->parent) {
            for (int e = 0; e < t; e++) /* a row that attends its cache: none of its sequence's trees before it */
                if (b->seq[e] == b->seq[t] && root[e] != e) return -2;
        }
    }
    for (int j = 0; j < b->n_keep; j++)
        if (b->keep[j] < 0 || b->keep[j] >= b->t) return -2;
    if (b->n_features < 0 || (b->n_features > 0 && (!b->feature_index || !b->features))) return -2;
    for (int f = 0; f < b->n_features; f++)
        if (b->feature_index[f] < 0 || b->feature_index[f] > m->n_layers) return -2;
    return 0;
}

/* Row `id` of a (V, H) matrix of any supported type, as float32: from the file's rows, or block by
 * block from the interleaved copy where the matrix is also the (packed) head, with the same bits. */
static void embed_row(const struct tensor *e, int id, float *out) {
    if (!e->packed) {
        dequantize_row(e->t, e->data + (size_t)id * row_bytes(e->t, e->k), e->k, out);
        return;
    }
    uint8_t raw[64]; /* one small block (pack_unpacks) */
    for (int p = 0; p < e->k / e->t->block; p++) {
        unpack_block(e->t, e->packed, e->k, id, p, raw);
        dequantize_row(e->t, raw, e->t->block, out + (size_t)p * e->t->block);
    }
}

int model_forward(const struct model *m, const struct batch *b) {
    int T = b->t, H = m->hidden, hd = m->head_dim, F = m->ffn;
    int qd = m->n_heads * hd, kd = m->n_kv_heads * hd, threads = pool_threads(m->pool);
    struct pass p = {.m = m, .b = b};
    if (T < 1) return -2;
    if (!(p.root = malloc(sizeof(int) * 2 * (size_t)T))) return -1;
    p.slot = p.root + T;
    int rc = check_batch(m, b, p.root, p.slot);
    if (rc) {
        free(p.root);
        return rc;
    }
    for (int t = 0; t < T; t++) p.longest = b->pos[t] + 1 > p.longest ? b->pos[t] + 1 : p.longest;
    p.stride = (p.longest + ATTN_PAD - 1) / ATTN_PAD * ATTN_PAD;
    size_t floats = (size_t)T * (3 * H + 2 * qd + 2 * kd + 2 * F + hd) + (size_t)threads * UNIT_QUERIES * p.stride;
    float *arena = malloc(floats * sizeof(float));
    p.order = malloc(sizeof(int) * (size_t)T);
    if (!arena || !p.order || plan_attention(&p, threads) != 0) {
        free(arena);
        free(p.order);
        free(p.units);
        free(p.root);
        return -1;
    }
    float *at = arena;
    p.x = at, at += (size_t)T * H;
    p.h = at, at += (size_t)T * H;
    p.o = at, at += (size_t)T * H;
    p.q = at, at += (size_t)T * qd;
    p.att = at, at += (size_t)T * qd;
    p.k = at, at += (size_t)T * kd;
    p.v = at, at += (size_t)T * kd;
    p.g = at, at += (size_t)T * F;
    p.u = at, at += (size_t)T * F;
    p.rot = at, at += (size_t)T * hd;
    p.scores = at;
    for (int t = 0; t < T; t++) {
        embed_row(&m->embd, b->ids[t], p.x + (size_t)t * H);
        for (int i = 0; i < hd / 2; i++) { /* angle = pos * theta^(-2i/hd), in double */
            double angle = (double)b->pos[t] * pow((double)m->rope_theta, -2.0 * i / hd);
            p.rot[(size_t)t * hd + i] = (float)cos(angle);
            p.rot[(size_t)t * hd + hd / 2 + i] = (float)sin(angle);
        }
    }
    take_features(&p, 0);
    for (int l = 0; l < m->n_layers && rc == 0; l++) {
        p.layer = l, p.L = &m->layers[l];
        rc = layer_forward(&p);
        if (rc == 0 && l + 1 < m->n_layers) take_features(&p, l + 1);
    }
    if (rc == 0 && b->n_keep > 0) { /* the last MLP output added, the final norm and the head, for the kept rows */
        run_rows(&p, T, last_out);
        const struct tensor *head[1] = {&m->output};
        float *out[1] = {b->logits};
        rc = stage(&p, head_in, p.h, b->n_keep, H, head, out, 1, NULL);
        if (rc == 0) take_features(&p, m->n_layers);
    }
    pool_park(m->pool);
    free(arena);
    free(p.order);
    free(p.units);
    free(p.root);
    return rc;
}
