/* The forward pass (model.h).  Shapes in comments: T rows in the pass, H hidden, nh query
 * heads, kvh KV heads, hd head width, F the MLP width, V the vocabulary. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

/* ---- float16 (the KV cache) ---- */

/* float32 -> float16, rounding to nearest even (IEEE), with subnormals, inf and nan. */
static uint16_t f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t sign = (v.u >> 16) & 0x8000, e = (v.u >> 23) & 0xFF, man = v.u & 0x7FFFFF;
    if (e == 0xFF) return (uint16_t)(sign | 0x7C00 | (man ? 0x200 : 0));
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

struct pass {
    const struct model *m;
    const struct batch *b;
    int layer;
    float *x, *h, *q, *k, *v, *att, *o, *g, *u; /* (T, H), (T, H), (T, nh hd), (T, kvh hd) x2, (T, nh hd), (T, H), (T, F) x2 */
    float *rot;                                 /* (T, hd): each row's cosines and sines */
    float *scores;                              /* (threads, longest context): attention weights */
    int longest;
    struct mm { const struct tensor *w; const struct acts *a; float *out; } mm[3];
    int n_mm;
};

static size_t kv_at(const struct model *m, const struct kv *c, int layer, int which, int head, int pos) {
    return ((((size_t)layer * 2 + which) * m->n_kv_heads + head) * c->capacity + pos) * m->head_dim;
}

/* Threads split each matrix's outputs. */
static void run_matmuls(void *arg, int i, int n) {
    struct pass *p = arg;
    for (int j = 0; j < p->n_mm; j++) {
        const struct tensor *w = p->mm[j].w;
        int lo, hi;
        matmul_range(w, i, n, &lo, &hi);
        matmul_outputs(p->m->isa, w, p->mm[j].a, p->mm[j].out, lo, hi);
    }
}

/* Threads split the (row, query head) pairs; each pair is one fixed computation over its
 * sequence's cache, positions 0..pos in order. */
static void run_attention(void *arg, int i, int n) {
    struct pass *p = arg;
    const struct model *m = p->m;
    const struct batch *b = p->b;
    int nh = m->n_heads, hd = m->head_dim, group = nh / m->n_kv_heads;
    float scale = 1.0f / sqrtf((float)hd), *w = p->scores + (size_t)i * p->longest;
    int lo, hi;
    pool_range(b->t * nh, i, n, &lo, &hi);
    for (int task = lo; task < hi; task++) {
        int t = task / nh, h = task % nh, pos = b->pos[t];
        const struct kv *c = &b->caches[b->seq[t]];
        const float *q = p->q + (size_t)t * nh * hd + (size_t)h * hd;
        const uint16_t *keys = c->data + kv_at(m, c, p->layer, 0, h / group, 0);
        const uint16_t *vals = c->data + kv_at(m, c, p->layer, 1, h / group, 0);
        m->attn->scores(q, keys, pos + 1, hd, scale, w);
        float top = -INFINITY, sum = 0.0f;
        for (int j = 0; j <= pos; j++) top = w[j] > top ? w[j] : top;
        for (int j = 0; j <= pos; j++) {
            w[j] = expf(w[j] - top);
            sum += w[j];
        }
        float *out = p->att + (size_t)t * nh * hd + (size_t)h * hd;
        memset(out, 0, sizeof(float) * hd);
        m->attn->mix(w, vals, pos + 1, hd, out);
        float inv = 1.0f / sum;
        for (int d = 0; d < hd; d++) out[d] *= inv;
    }
}

/* The activations of x (rows x k) quantized for each weight family that reads them, made once. */
struct quantized {
    const float *x;
    int rows, k, failed;
    struct acts a[3]; /* floats, 32-blocks, 256-blocks */
    int ready[3];
};

static const struct acts *quantized_for(struct quantized *z, const struct type_info *t) {
    int kind = t->family == FAM_FLOAT ? 0 : t->block == QK ? 1 : 2;
    if (!z->ready[kind]) {
        if (acts_init(&z->a[kind], t, z->x, z->rows, z->k) != 0) {
            z->failed = 1;
            return NULL;
        }
        z->ready[kind] = 1;
    }
    return &z->a[kind];
}

static void quantized_free(struct quantized *z) {
    for (int i = 0; i < 3; i++)
        if (z->ready[i]) acts_free(&z->a[i]);
}

/* out_j = x @ w_j^T for up to three matrices that read the same x (rows x k), in one pool run. */
static int project(struct pass *p, const float *x, int rows, int k, const struct tensor *const *w, float *const *out,
                   int count) {
    struct quantized z = {x, rows, k, 0, {{0}}, {0}};
    for (int j = 0; j < count; j++) p->mm[j] = (struct mm){w[j], quantized_for(&z, w[j]->t), out[j]};
    p->n_mm = count;
    if (!z.failed) pool_run(p->m->pool, run_matmuls, p);
    quantized_free(&z);
    return z.failed ? -1 : 0;
}

static int layer_forward(struct pass *p, const struct layer *L) {
    const struct model *m = p->m;
    const struct batch *b = p->b;
    int T = b->t, H = m->hidden, hd = m->head_dim, nh = m->n_heads, kvh = m->n_kv_heads, F = m->ffn;
    for (int t = 0; t < T; t++) rms_norm(p->x + (size_t)t * H, &L->attn_norm, H, m->rms_eps, p->h + (size_t)t * H);
    const struct tensor *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {p->q, p->k, p->v};
    if (project(p, p->h, T, H, qkv, qkv_out, 3) != 0) return -1;
    for (int t = 0; t < T; t++) {
        float *q = p->q + (size_t)t * nh * hd, *k = p->k + (size_t)t * kvh * hd, *v = p->v + (size_t)t * kvh * hd;
        add_bias(q, &L->bq, nh * hd);
        add_bias(k, &L->bk, kvh * hd);
        add_bias(v, &L->bv, kvh * hd);
        rope(q, nh, hd, p->rot + (size_t)t * hd, m->rope_neox);
        rope(k, kvh, hd, p->rot + (size_t)t * hd, m->rope_neox);
        struct kv *c = &b->caches[b->seq[t]];
        for (int g = 0; g < kvh; g++) {
            uint16_t *kd = c->data + kv_at(m, c, p->layer, 0, g, b->pos[t]);
            uint16_t *vd = c->data + kv_at(m, c, p->layer, 1, g, b->pos[t]);
            for (int d = 0; d < hd; d++) {
                kd[d] = f32_to_f16(k[g * hd + d]);
                vd[d] = f32_to_f16(v[g * hd + d]);
            }
        }
    }
    pool_run(m->pool, run_attention, p);
    const struct tensor *wo[1] = {&L->wo};
    float *o_out[1] = {p->o};
    if (project(p, p->att, T, nh * hd, wo, o_out, 1) != 0) return -1;
    for (size_t i = 0; i < (size_t)T * H; i++) p->x[i] += p->o[i];
    for (int t = 0; t < T; t++) rms_norm(p->x + (size_t)t * H, &L->ffn_norm, H, m->rms_eps, p->h + (size_t)t * H);
    const struct tensor *gu[2] = {&L->wg, &L->wu};
    float *gu_out[2] = {p->g, p->u};
    if (project(p, p->h, T, H, gu, gu_out, 2) != 0) return -1;
    for (size_t i = 0; i < (size_t)T * F; i++) p->g[i] = p->g[i] / (1.0f + expf(-p->g[i])) * p->u[i];
    const struct tensor *wd[1] = {&L->wd};
    if (project(p, p->g, T, F, wd, o_out, 1) != 0) return -1;
    for (size_t i = 0; i < (size_t)T * H; i++) p->x[i] += p->o[i];
    return 0;
}

static int check_batch(const struct model *m, const struct batch *b) {
    if (b->t < 1 || b->s < 1 || b->n_keep < 0) return -2;
    for (int t = 0; t < b->t; t++) {
        if (b->ids[t] < 0 || b->ids[t] >= m->vocab || b->seq[t] < 0 || b->seq[t] >= b->s) return -2;
        if (b->pos[t] < 0 || b->pos[t] >= b->caches[b->seq[t]].capacity) return -2;
    }
    for (int j = 0; j < b->n_keep; j++)
        if (b->keep[j] < 0 || b->keep[j] >= b->t) return -2;
    return 0;
}

/* Row `id` of a (V, H) matrix of any supported type, as float32. */
static void embed_row(const struct tensor *e, int id, float *out) {
    dequantize_row(e->t, e->data + (size_t)id * row_bytes(e->t, e->k), e->k, out);
}

int model_forward(const struct model *m, const struct batch *b) {
    int rc = check_batch(m, b);
    if (rc) return rc;
    int T = b->t, H = m->hidden, hd = m->head_dim, F = m->ffn;
    int qd = m->n_heads * hd, kd = m->n_kv_heads * hd, threads = pool_threads(m->pool);
    struct pass p = {.m = m, .b = b};
    for (int t = 0; t < T; t++) p.longest = b->pos[t] + 1 > p.longest ? b->pos[t] + 1 : p.longest;
    size_t floats = (size_t)T * (3 * H + 2 * qd + 2 * kd + 2 * F + hd) + (size_t)threads * p.longest;
    float *arena = malloc(floats * sizeof(float));
    if (!arena) return -1;
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
    for (int l = 0; l < m->n_layers && rc == 0; l++) {
        p.layer = l;
        rc = layer_forward(&p, &m->layers[l]);
    }
    if (rc == 0 && b->n_keep > 0) { /* the final norm and the head, for the kept rows only */
        for (int j = 0; j < b->n_keep; j++)
            rms_norm(p.x + (size_t)b->keep[j] * H, &m->out_norm, H, m->rms_eps, p.h + (size_t)j * H);
        const struct tensor *head[1] = {&m->output};
        float *out[1] = {b->logits};
        rc = project(&p, p.h, b->n_keep, H, head, out, 1);
    }
    free(arena);
    return rc;
}
