/* memspec.runtime._native: exact GGUF block matmuls for CPython (no numpy headers: every
 * array comes in through the buffer protocol). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "matmul.h"
#include "model.h"

#include <pthread.h>

static const struct dot_isa *default_isa; /* chosen once at import: $MEMSPEC_NATIVE_ISA or the best */

static int is_float32(const Py_buffer *b) {
    return b->itemsize == 4 && b->format &&
           (!strcmp(b->format, "f") || !strcmp(b->format, "<f") || !strcmp(b->format, "=f"));
}

/* Get an (rows, cols) C-contiguous float32 buffer; `want_rows` < 0 accepts any row count. */
static int get_matrix(PyObject *obj, Py_buffer *b, int flags, const char *what, Py_ssize_t want_rows, Py_ssize_t cols) {
    if (PyObject_GetBuffer(obj, b, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s float32 array, got %s", what,
                     flags & PyBUF_WRITABLE ? ", writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!is_float32(b) || b->ndim != 2 || b->shape[1] != cols || (want_rows >= 0 && b->shape[0] != want_rows)) {
        char shape[64] = "";
        for (int i = 0; i < b->ndim && i < 4; i++)
            snprintf(shape + strlen(shape), sizeof(shape) - strlen(shape), "%s%zd", i ? ", " : "", b->shape[i]);
        if (want_rows >= 0)
            PyErr_Format(PyExc_ValueError, "%s must be float32 of shape (%zd, %zd), got format '%s' shape (%s)", what,
                         want_rows, cols, b->format ? b->format : "?", shape);
        else
            PyErr_Format(PyExc_ValueError, "%s must be float32 of shape (M, %zd), got format '%s' shape (%s)", what,
                         cols, b->format ? b->format : "?", shape);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* The type, shape and thread checks that need no buffer; NULL (exception set) if any fails. */
static const struct type_info *check_args(int type, Py_ssize_t n, Py_ssize_t k, int threads) {
    const struct type_info *t = type_info(type);
    if (!t) {
        PyErr_Format(PyExc_ValueError, "ggml type %d (%s) is not supported; supported: %s", type,
                     ggml_type_name(type), SUPPORTED_TYPES);
        return NULL;
    }
    if (n < 1 || k < 1 || n > INT_MAX || k > INT_MAX - CHUNK) {
        PyErr_Format(PyExc_ValueError, "n and k must be positive (and fit an int), got n=%zd, k=%zd", n, k);
        return NULL;
    }
    if (k % t->block) {
        PyErr_Format(PyExc_ValueError, "k=%zd is not a multiple of %s's block size %d", k, t->name, t->block);
        return NULL;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
        return NULL;
    }
    return t;
}

/* The raw blocks of an (n, k) matrix of type t, held in b. */
static int get_weights(PyObject *obj, Py_buffer *b, const struct type_info *t, Py_ssize_t n, Py_ssize_t k) {
    if (PyObject_GetBuffer(obj, b, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "weights must be a contiguous buffer, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t need = (Py_ssize_t)((size_t)n * row_bytes(t, (int)k));
    if (b->len < need) {
        PyErr_Format(PyExc_ValueError, "weights hold %zd bytes; a %s matrix of n=%zd rows, k=%zd needs %zd", b->len,
                     t->name, n, k, need);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(matmul_doc,
"matmul(weights, ggml_type, n, k, x, out, threads=1, *, isa=None, packed=None)\n\n"
"out (M, n) float32 = x (M, k) float32 @ W.T, W the (n, k) matrix of GGUF type ggml_type whose\n"
"raw blocks `weights` holds (rows of blocks, any contiguous buffer).  Each output row depends\n"
"only on its row of x and on W, never on M, the other rows, `threads` or the layout.  isa forces a\n"
"path (\"scalar\", \"avx2\", \"avx512\", \"neon\"); the default is isa().  packed: None interleaves W\n"
"for this call where the path multiplies its type that way (pack()); False keeps the row layout; a\n"
"buffer is pack()'s result for the same W and path.  Raises ValueError on bad arguments.");

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"weights", "ggml_type", "n", "k", "x", "out", "threads", "isa", "packed", NULL};
    PyObject *wobj, *xobj, *oobj, *pobj = Py_None;
    int type, threads = 1;
    Py_ssize_t n, k;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OinnOO|i$zO", kwlist, &wobj, &type, &n, &k, &xobj, &oobj, &threads,
                                     &isa_name, &pobj))
        return NULL;
    const struct type_info *t = check_args(type, n, k, threads);
    if (!t) return NULL;
    const struct dot_isa *isa = isa_name ? dot_isa_named(isa_name) : default_isa;
    if (!isa) return PyErr_Format(PyExc_ValueError, "isa='%s' is not available on this CPU", isa_name);

    Py_buffer wb, xb, ob;
    if (get_weights(wobj, &wb, t, n, k) != 0) return NULL;
    if (get_matrix(xobj, &xb, 0, "x", -1, k) != 0) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (get_matrix(oobj, &ob, PyBUF_WRITABLE, "out", xb.shape[0], n) != 0) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&xb);
        return NULL;
    }
    struct tensor w = {wb.buf, t, (int)n, (int)k, NULL};
    Py_buffer pb;
    int rc = -2, have_packed = 0;
    if (pobj != Py_None && pobj != Py_False) { /* pack()'s bytes for this matrix and path */
        size_t want = matmul_packs(isa, t, (int)n, (int)k) ? pack_bytes(t, (int)n, (int)k) : 0;
        if (PyObject_GetBuffer(pobj, &pb, PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "packed must be None, False or pack()'s buffer, got %s",
                         Py_TYPE(pobj)->tp_name);
            goto done;
        }
        have_packed = 1;
        if (!want || (size_t)pb.len != want) {
            PyErr_Format(PyExc_ValueError, "packed holds %zd bytes; path %s takes a %s matrix of n=%zd, k=%zd %s", pb.len,
                         isa->name, t->name, n, k, want ? "interleaved in pack()'s bytes" : "in its row layout only");
            goto done;
        }
        w.packed = pb.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    if (pobj == Py_None)
        rc = matmul(isa, t, w.data, w.n, w.k, xb.buf, (int)xb.shape[0], ob.buf, threads);
    else
        rc = matmul_tensor(isa, &w, xb.buf, (int)xb.shape[0], ob.buf, threads);
    Py_END_ALLOW_THREADS
    if (rc == -1) PyErr_NoMemory();
done:
    if (have_packed) PyBuffer_Release(&pb);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_doc,
"pack(weights, ggml_type, n, k, *, isa=None) -> bytearray or None\n\n"
"The (n, k) matrix `weights` interleaved as path `isa` (default isa()) multiplies it, for\n"
"matmul(..., packed=); None where that path keeps this type (or this n) in its row layout.");

static PyObject *py_pack(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"weights", "ggml_type", "n", "k", "isa", NULL};
    PyObject *wobj;
    int type;
    Py_ssize_t n, k;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oinn|$z", kwlist, &wobj, &type, &n, &k, &isa_name)) return NULL;
    const struct type_info *t = check_args(type, n, k, 1);
    if (!t) return NULL;
    const struct dot_isa *isa = isa_name ? dot_isa_named(isa_name) : default_isa;
    if (!isa) return PyErr_Format(PyExc_ValueError, "isa='%s' is not available on this CPU", isa_name);
    if (!matmul_packs(isa, t, (int)n, (int)k)) Py_RETURN_NONE;
    Py_buffer wb;
    if (get_weights(wobj, &wb, t, n, k) != 0) return NULL;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)pack_bytes(t, (int)n, (int)k));
    if (out) {
        Py_BEGIN_ALLOW_THREADS
        pack_rows(t, wb.buf, (int)n, (int)k, (uint8_t *)PyByteArray_AS_STRING(out));
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&wb);
    return out;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(default_isa->name); }

static PyObject *py_isas(PyObject *self, PyObject *unused) {
    const struct dot_isa *all[4];
    int n = dot_isas(all);
    PyObject *names = PyTuple_New(n);
    for (int i = 0; names && i < n; i++) {
        PyObject *name = PyUnicode_FromString(all[i]->name);
        if (!name) {
            Py_DECREF(names);
            return NULL;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    return names;
}


/* ---- Model: a decoder over one memory-mapped GGUF (model.h) ---- */

typedef struct {
    PyObject_HEAD
    Py_buffer file;     /* the mapped GGUF; every tensor points into it */
    int have_file;
    struct model m;
    uint8_t *packed;          /* the matrices the path multiplies interleaved, repacked at load (pack.h) */
    Py_ssize_t packed_bytes;
    PyObject *packed_ranges;  /* ((offset, bytes), ...): the file ranges those matrices no longer read */
    pthread_mutex_t lock; /* one pass at a time: the pool serves one */
} ModelObject;

/* A tensor from (offset, ggml_type, n, k) into the file, or none from None. */
static int parse_tensor(ModelObject *self, PyObject *spec, struct tensor *out, const char *what, int optional) {
    memset(out, 0, sizeof(*out));
    if (spec == Py_None && optional) return 0;
    Py_ssize_t offset, n, k;
    int type;
    if (!PyArg_ParseTuple(spec, "ninn", &offset, &type, &n, &k)) {
        PyErr_Format(PyExc_ValueError, "%s: the spec must be (offset, ggml_type, n, k)", what);
        return -1;
    }
    const struct type_info *t = type_info(type);
    if (!t) {
        PyErr_Format(PyExc_ValueError, "tensor %s is of ggml type %d (%s), which memspec's native engine does not "
                     "run; supported: %s", what, type, ggml_type_name(type), SUPPORTED_TYPES);
        return -1;
    }
    if (n < 1 || k < 1 || n > INT_MAX || k > INT_MAX - CHUNK || k % t->block) {
        PyErr_Format(PyExc_ValueError, "tensor %s: shape (%zd, %zd) does not fit %s blocks of %d", what, n, k, t->name,
                     t->block);
        return -1;
    }
    size_t bytes = (size_t)n * row_bytes(t, (int)k);
    if (offset < 0 || (size_t)offset + bytes > (size_t)self->file.len) {
        PyErr_Format(PyExc_ValueError, "tensor %s: %zu bytes at offset %zd run past the file's %zd bytes (truncated?)",
                     what, bytes, offset, self->file.len);
        return -1;
    }
    *out = (struct tensor){(const uint8_t *)self->file.buf + offset, t, (int)n, (int)k};
    return 0;
}

static int expect_vector(const struct tensor *v, int n, const char *what) {
    if (!v->data) return 0;
    if (v->t->id != TYPE_F32 || v->n != n || v->k != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be an F32 vector of %d values, got %s (%d, %d)", what, n, v->t->name,
                     v->n, v->k);
        return -1;
    }
    return 0;
}

static int expect_matrix(const struct tensor *w, int n, int k, const char *what) {
    if (w->n != n || w->k != k) {
        PyErr_Format(PyExc_ValueError, "%s must be (%d, %d), got (%d, %d)", what, n, k, w->n, w->k);
        return -1;
    }
    return 0;
}

static int check_layer(const struct model *m, const struct layer *L, int l) {
    char what[64];
    int H = m->hidden, q = m->n_heads * m->head_dim, kv = m->n_kv_heads * m->head_dim, F = m->ffn;
#define CHECK(expr, name) do { snprintf(what, sizeof(what), "blk.%d.%s", l, name); if (expr) return -1; } while (0)
    CHECK(!L->attn_norm.data || expect_vector(&L->attn_norm, H, what), "attn_norm.weight");
    CHECK(!L->ffn_norm.data || expect_vector(&L->ffn_norm, H, what), "ffn_norm.weight");
    CHECK(expect_matrix(&L->wq, q, H, what), "attn_q.weight");
    CHECK(expect_matrix(&L->wk, kv, H, what), "attn_k.weight");
    CHECK(expect_matrix(&L->wv, kv, H, what), "attn_v.weight");
    CHECK(expect_matrix(&L->wo, H, q, what), "attn_output.weight");
    CHECK(expect_matrix(&L->wg, F, H, what), "ffn_gate.weight");
    CHECK(expect_matrix(&L->wu, F, H, what), "ffn_up.weight");
    CHECK(expect_matrix(&L->wd, H, F, what), "ffn_down.weight");
    CHECK(expect_vector(&L->bq, q, what), "attn_q.bias");
    CHECK(expect_vector(&L->bk, kv, what), "attn_k.bias");
    CHECK(expect_vector(&L->bv, kv, what), "attn_v.bias");
#undef CHECK
    return 0;
}

/* The matrices a pass multiplies: each layer's seven and the head.  A head that is also the
 * embedding only where the lookup can read its rows back from the interleaved copy (pack_unpacks),
 * so that the file's pages are not read again. */
static int model_matrices(struct model *m, struct tensor **out) {
    int n = 0;
    for (int l = 0; l < m->n_layers; l++) {
        struct layer *L = &m->layers[l];
        struct tensor *w[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wg, &L->wu, &L->wd};
        for (int j = 0; j < 7; j++) out[n++] = w[j];
    }
    if (m->output.data != m->embd.data || pack_unpacks(m->output.t)) out[n++] = &m->output;
    return n;
}

/* One matrix to repack (pack_share): its rows, where the copy goes, whether to drop the rows' pages. */
struct pack_job {
    struct tensor *w;
    uint8_t *out;
    int release;
};

/* Drop the whole pages inside [p, p + bytes) of a shared file mapping (read again if touched). */
static void release_pages(const uint8_t *p, size_t bytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), lo = (uintptr_t)p, hi = lo + bytes;
    lo = (lo + page - 1) / page * page, hi = hi / page * page;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* Thread i of n repacks its share of the matrix's groups of PACK_ROWS rows (pool_fn). */
static void pack_share(void *arg, int i, int n) {
    const struct pack_job *job = arg;
    const struct tensor *w = job->w;
    int lo, hi;
    pool_range(w->n / PACK_ROWS, i, n, &lo, &hi);
    size_t row = row_bytes(w->t, w->k), group = pack_bytes(w->t, PACK_ROWS, w->k);
    const uint8_t *rows = w->data + (size_t)lo * PACK_ROWS * row;
    pack_rows(w->t, rows, (hi - lo) * PACK_ROWS, w->k, job->out + (size_t)lo * group);
    if (job->release) release_pages(rows, (size_t)(hi - lo) * PACK_ROWS * row);
}

/* Repack every matrix the path multiplies interleaved into one buffer, the pool's threads sharing
 * each; with `release` (the file is a shared mapping of the GGUF: its pages can be read again),
 * drop each share's mapped pages once repacked, so that the load never holds both copies.  0, or
 * -1 out of memory. */
static int model_pack(ModelObject *self, int release) {
    struct model *m = &self->m;
    struct tensor **all = malloc(sizeof(*all) * (size_t)(7 * m->n_layers + 1));
    if (!all) return -1;
    int count = model_matrices(m, all), packs = 0;
    size_t total = 0;
    for (int i = 0; i < count; i++) /* keep the matrices the path packs, in order */
        if (matmul_packs(m->isa, all[i]->t, all[i]->n, all[i]->k)) {
            total += pack_bytes(all[i]->t, all[i]->n, all[i]->k);
            all[packs++] = all[i];
        }
    if ((total && posix_memalign((void **)&self->packed, 64, total) != 0) ||
        !(self->packed_ranges = PyTuple_New(packs))) {
        free(all);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *at = self->packed;
    for (int i = 0; i < packs; i++) {
        struct tensor *w = all[i];
        struct pack_job job = {w, at, release};
        pool_run(m->pool, pack_share, &job);
        if (release) release_pages(w->data, (size_t)w->n * row_bytes(w->t, w->k)); /* the pages shares straddle */
        w->packed = at;
        if (w == &m->output && m->embd.data == w->data) m->embd.packed = at; /* a tied head: the lookup's rows */
        at += pack_bytes(w->t, w->n, w->k);
    }
    Py_END_ALLOW_THREADS
    self->packed_bytes = (Py_ssize_t)total;
    for (int i = 0; i < packs; i++) {
        Py_ssize_t offset = (const uint8_t *)all[i]->data - (const uint8_t *)self->file.buf;
        PyObject *range = Py_BuildValue("(nn)", offset, (Py_ssize_t)((size_t)all[i]->n * row_bytes(all[i]->t, all[i]->k)));
        if (!range) {
            free(all);
            return -1;
        }
        PyTuple_SET_ITEM(self->packed_ranges, i, range);
    }
    free(all);
    return 0;
}

static void model_dealloc(ModelObject *self) {
    if (self->m.pool) pool_free(self->m.pool);
    free(self->packed);
    Py_XDECREF(self->packed_ranges);
    free(self->m.layers);
    if (self->have_file) PyBuffer_Release(&self->file);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const LAYER_TENSORS[12] = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                             "attn_output.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                                             "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"};

static int model_init(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"file", "config", "embd", "out_norm", "output", "layers", "threads", "isa",
                             "release_packed", "kv", NULL};
    PyObject *file, *config, *embd, *out_norm, *output, *layers;
    int threads = 1, release = 0;
    const char *isa_name = NULL, *kv = "f16";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|i$zps", kwlist, &file, &config, &embd, &out_norm, &output,
                                     &layers, &threads, &isa_name, &release, &kv))
        return -1;
    if (strcmp(kv, "f16") != 0 && strcmp(kv, "q8") != 0) {
        PyErr_Format(PyExc_ValueError, "kv='%s' is not a KV cache format; the engine stores \"f16\" or \"q8\"", kv);
        return -1;
    }
    self->m.kv_type = strcmp(kv, "q8") == 0 ? KV_Q8 : KV_F16;
    self->m.fetch_ahead = 1;
    pthread_mutex_init(&self->lock, NULL);
    if (PyObject_GetBuffer(file, &self->file, PyBUF_SIMPLE) != 0) return -1;
    self->have_file = 1;
    struct model *m = &self->m;
    if (!PyArg_ParseTuple(config, "iiiiiiiiff;config must be (n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, "
                          "vocab, rope_neox, rope_theta, rms_eps)", &m->n_layers, &m->hidden, &m->n_heads,
                          &m->n_kv_heads, &m->head_dim, &m->ffn, &m->vocab, &m->rope_neox, &m->rope_theta,
                          &m->rms_eps))
        return -1;
    if (m->n_layers < 1 || m->hidden < 1 || m->n_heads < 1 || m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads ||
        m->head_dim < 8 || m->head_dim % 8 || m->ffn < 1 || m->vocab < 1) {
        PyErr_Format(PyExc_ValueError, "config: %d layers, hidden %d, %d heads over %d KV heads of %d, ffn %d, vocab %d "
                     "is not a decoder this engine runs (heads a multiple of KV heads, head_dim a multiple of 8)",
                     m->n_layers, m->hidden, m->n_heads, m->n_kv_heads, m->head_dim, m->ffn, m->vocab);
        return -1;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
        return -1;
    }
    m->isa = isa_name ? dot_isa_named(isa_name) : default_isa;
    if (!m->isa) {
        PyErr_Format(PyExc_ValueError, "isa='%s' is not available on this CPU", isa_name);
        return -1;
    }
    m->attn = attn_isa_for(m->isa->name);
    m->fops = float_isa_for(m->isa->name);
    if (parse_tensor(self, embd, &m->embd, "token_embd.weight", 0) || parse_tensor(self, out_norm, &m->out_norm,
        "output_norm.weight", 0) || parse_tensor(self, output, &m->output, "output.weight", 0))
        return -1;
    if (expect_matrix(&m->embd, m->vocab, m->hidden, "token_embd.weight") ||
        expect_vector(&m->out_norm, m->hidden, "output_norm.weight") ||
        expect_matrix(&m->output, m->vocab, m->hidden, "output.weight"))
        return -1;
    if (!PySequence_Check(layers) || PySequence_Size(layers) != m->n_layers) {
        PyErr_Format(PyExc_ValueError, "layers must be a sequence of %d layers", m->n_layers);
        return -1;
    }
    m->layers = calloc((size_t)m->n_layers, sizeof(struct layer));
    if (!m->layers) {
        PyErr_NoMemory();
        return -1;
    }
    for (int l = 0; l < m->n_layers; l++) {
        PyObject *specs = PySequence_GetItem(layers, l);
        if (!specs) return -1;
        struct tensor *slots = (struct tensor *)&m->layers[l];
        int bad = !PySequence_Check(specs) || PySequence_Size(specs) != 12;
        for (int j = 0; j < 12 && !bad; j++) {
            char what[64];
            snprintf(what, sizeof(what), "blk.%d.%s", l, LAYER_TENSORS[j]);
            PyObject *spec = PySequence_GetItem(specs, j);
            bad = !spec || parse_tensor(self, spec, &slots[j], what, j >= 5 && j <= 7);
            Py_XDECREF(spec);
        }
        Py_DECREF(specs);
        if (bad) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "layer %d must be 12 tensor specs", l);
            return -1;
        }
        if (check_layer(m, &m->layers[l], l) != 0) return -1;
    }
    m->pool = pool_new(threads);
    if (!m->pool || model_pack(self, release) != 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A 1-D int32 buffer of `n` values (n < 0: any), held in b. */
static int get_ints(PyObject *obj, Py_buffer *b, const char *what, Py_ssize_t n) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous int32 array", what);
        return -1;
    }
    int ok = b->itemsize == 4 && b->format && strchr("iIl", b->format[strlen(b->format) - 1]) && b->ndim == 1 &&
             (n < 0 || b->shape[0] == n);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D int32 array%s, got format '%s' with %d dimensions", what,
                     n >= 0 ? " of the batch's length" : "", b->format ? b->format : "?", b->ndim);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(forward_doc,
"forward(caches, capacities, ids, pos, seq, keep, logits, parent=None, features=None, feature_index=None)\n\n"
"One pass: row t feeds ids[t] of sequence seq[t] at position pos[t] (int32 arrays of T), its key and\n"
"value written into caches[seq[t]] (writable buffers of n_layers*2*n_kv_heads*capacity rows of\n"
"kv_row_bytes: head_dim float16s, or for kv \"q8\" head_dim int8s and a float32 scale); logits (len(keep), vocab) float32 receives the rows keep[j].  The GIL is released while it\n"
"runs.  parent (int32 of T, optional): a token tree, each row's parent row or -1 (model.h's struct\n"
"batch).  features (float32 (len(keep), len(feature_index) * hidden)) and feature_index (int32, each\n"
"in 0..n_layers), both or neither: each kept row's hidden states, numbered as a Hugging Face model's\n"
"hidden_states (0 the embedding, i the residual after layer i-1, n_layers the final norm's output),\n"
"copied out of the pass (model.h's struct batch).  ValueError on a bad batch.");

static PyObject *model_forward_py(ModelObject *self, PyObject *args) {
    PyObject *caches, *caps, *ids_o, *pos_o, *seq_o, *keep_o, *logits_o, *parent_o = Py_None;
    PyObject *features_o = Py_None, *index_o = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOOOO|OOO", &caches, &caps, &ids_o, &pos_o, &seq_o, &keep_o, &logits_o, &parent_o,
                          &features_o, &index_o))
        return NULL;
    if ((features_o == Py_None) != (index_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "features and feature_index go together: give both or neither");
        return NULL;
    }
    struct model *m = &self->m;
    Py_ssize_t s = PySequence_Check(caches) ? PySequence_Size(caches) : -1;
    if (s < 1 || !PySequence_Check(caps) || PySequence_Size(caps) != s) {
        PyErr_SetString(PyExc_ValueError, "caches and capacities must be sequences of one or more, of equal length");
        return NULL;
    }
    Py_buffer ids, pos, seq, keep, logits, parent, features, index;
    int have_features = 0;
    Py_buffer *bufs = calloc((size_t)s, sizeof(Py_buffer));
    struct kv *kvs = calloc((size_t)s, sizeof(struct kv));
    int held = 0, have = 0;
    PyObject *result = NULL;
    if (!bufs || !kvs) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < s; held++) {
        PyObject *c = PySequence_GetItem(caches, held), *cap = PySequence_GetItem(caps, held);
        long capacity = cap ? PyLong_AsLong(cap) : -1;
        int got = c && capacity > 0 && PyObject_GetBuffer(c, &bufs[held], PyBUF_WRITABLE) == 0;
        Py_XDECREF(c);
        Py_XDECREF(cap);
        if (!got) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "cache %d must be a writable buffer with a positive capacity", held);
            goto done;
        }
        size_t need = (size_t)m->n_layers * 2 * m->n_kv_heads * (size_t)capacity * kv_row_bytes(m->kv_type, m->head_dim);
        if ((size_t)bufs[held].len < need) {
            PyErr_Format(PyExc_ValueError, "cache %d holds %zd bytes; a capacity of %ld needs %zu", held,
                         bufs[held].len, capacity, need);
            held++;
            goto done;
        }
        kvs[held] = (struct kv){bufs[held].buf, (int)capacity};
    }
    if (get_ints(ids_o, &ids, "ids", -1)) goto done;
    have = 1;
    if (get_ints(pos_o, &pos, "pos", ids.shape[0])) goto done;
    have = 2;
    if (get_ints(seq_o, &seq, "seq", ids.shape[0])) goto done;
    have = 3;
    if (get_ints(keep_o, &keep, "keep", -1)) goto done;
    have = 4;
    if (get_matrix(logits_o, &logits, PyBUF_WRITABLE, "logits", keep.shape[0], m->vocab)) goto done;
    have = 5;
    if (parent_o != Py_None) {
        if (get_ints(parent_o, &parent, "parent", ids.shape[0])) goto done;
        have = 6;
    }
    if (index_o != Py_None) {
        if (get_ints(index_o, &index, "feature_index", -1)) goto done;
        have_features = 1;
        if (get_matrix(features_o, &features, PyBUF_WRITABLE, "features", keep.shape[0],
                       index.shape[0] * (Py_ssize_t)m->hidden))
            goto done;
        have_features = 2;
    }
    struct batch b = {(int)ids.shape[0], (int)s, (int)keep.shape[0], ids.buf, pos.buf, seq.buf, keep.buf,
                      have == 6 ? parent.buf : NULL, kvs, logits.buf,
                      have_features ? (int)index.shape[0] : 0, have_features ? index.buf : NULL,
                      have_features ? features.buf : NULL};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    rc = model_forward(m, &b);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (rc == -1) PyErr_NoMemory();
    else if (rc == -2)
        PyErr_SetString(PyExc_ValueError, "a bad batch: a token id outside the vocabulary, a position outside its "
                        "cache, a sequence or kept row out of range, no rows, a tree row whose parent is not an earlier row of its "
                        "tree one position before it, or a feature index outside 0..n_layers");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    if (have_features >= 2) PyBuffer_Release(&features);
    if (have_features >= 1) PyBuffer_Release(&index);
    if (have >= 6) PyBuffer_Release(&parent);
    if (have >= 5) PyBuffer_Release(&logits);
    if (have >= 4) PyBuffer_Release(&keep);
    if (have >= 3) PyBuffer_Release(&seq);
    if (have >= 2) PyBuffer_Release(&pos);
    if (have >= 1) PyBuffer_Release(&ids);
    for (int i = 0; i < held && bufs; i++) PyBuffer_Release(&bufs[i]);
    free(bufs);
    free(kvs);
    return result;
}

static PyMethodDef model_methods[] = {
    {"forward", (PyCFunction)model_forward_py, METH_VARARGS, forward_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *model_kv(ModelObject *self, void *unused) {
    return PyUnicode_FromString(self->m.kv_type == KV_Q8 ? "q8" : "f16");
}

static PyObject *model_kv_row_bytes(ModelObject *self, void *unused) {
    return PyLong_FromSize_t(kv_row_bytes(self->m.kv_type, self->m.head_dim));
}

static PyObject *model_fetch_ahead(ModelObject *self, void *unused) { return PyBool_FromLong(self->m.fetch_ahead); }

static int model_set_fetch_ahead(ModelObject *self, PyObject *value, void *unused) {
    int on = value ? PyObject_IsTrue(value) : -1;
    if (on < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "fetch_ahead cannot be deleted");
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS /* not under a pass: wait for one to end */
    pthread_mutex_lock(&self->lock);
    self->m.fetch_ahead = on;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return 0;
}

static PyGetSetDef model_getset[] = {
    {"fetch_ahead", (getter)model_fetch_ahead, (setter)model_set_fetch_ahead,
     "whether a one-row pass's kernels fetch their weights ahead themselves (True) or leave it to the "
     "matmul driver's bursts (False): the same bits, and which is faster depends on the machine", NULL},
    {"kv", (getter)model_kv, NULL, "the KV cache's format: \"f16\" or \"q8\" (attention.h)", NULL},
    {"kv_row_bytes", (getter)model_kv_row_bytes, NULL,
     "bytes of one cache row (a position's key or value for one KV head): 2*head_dim, or head_dim + 4 for q8", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef model_members[] = {
    {"packed_bytes", T_PYSSIZET, offsetof(ModelObject, packed_bytes), READONLY,
     "bytes of the matrices repacked at load for the path's interleaved kernels (pack.h), 0 if none"},
    {"packed_ranges", T_OBJECT, offsetof(ModelObject, packed_ranges), READONLY,
     "((offset, bytes), ...): the file ranges of the repacked matrices, which passes no longer read"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memspec.runtime._native.Model",
    .tp_basicsize = sizeof(ModelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Model(file, config, embd, out_norm, output, layers, threads=1, *, isa=None, release_packed=False, kv='f16'): "
              "a llama/qwen2 decoder over a mapped GGUF (memspec.runtime.native_target builds it).  release_packed: "
              "file is a shared mapping of the GGUF, whose pages under the matrices repacked at load may be dropped.  "
              "kv: the caches' format, 'f16' or 'q8' (int8 with a scale per position and head).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)model_init,
    .tp_dealloc = (destructor)model_dealloc,
    .tp_methods = model_methods,
    .tp_members = model_members,
    .tp_getset = model_getset,
};

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS, matmul_doc},
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_VARARGS | METH_KEYWORDS, pack_doc},
    {"isa", py_isa, METH_NOARGS, "isa() -> str: the path matmul uses by default (\"avx512\", \"avx2\", \"neon\", \"scalar\")."},
    {"isas", py_isas, METH_NOARGS, "isas() -> tuple of str: every path this CPU can run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "memspec.runtime._native",
                                    "Exact GGUF block matmul kernels (see memspec/runtime/native).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    const char *env = getenv("MEMSPEC_NATIVE_ISA");
    default_isa = env && *env ? dot_isa_named(env) : dot_isa_best();
    if (!default_isa) {
        const struct dot_isa *all[4];
        char names[64] = "";
        for (int i = 0, n = dot_isas(all); i < n; i++) {
            if (i) strcat(names, ", ");
            strcat(names, all[i]->name);
        }
        return PyErr_Format(PyExc_ImportError, "MEMSPEC_NATIVE_ISA='%s' is not a path this CPU can run (%s)", env,
                            names);
    }
    if (PyType_Ready(&ModelType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    Py_INCREF(&ModelType);
    if (PyModule_AddObject(mod, "Model", (PyObject *)&ModelType) < 0) {
        Py_DECREF(&ModelType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
