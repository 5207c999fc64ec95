/* memspec.runtime._native: exact GGUF block matmuls for CPython (no numpy headers: every
 * array comes in through the buffer protocol). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

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

PyDoc_STRVAR(matmul_doc,
"matmul(weights, ggml_type, n, k, x, out, threads=1, *, isa=None)\n\n"
"out (M, n) float32 = x (M, k) float32 @ W.T, W the (n, k) matrix of GGUF type ggml_type whose\n"
"raw blocks `weights` holds (rows of blocks, any contiguous buffer).  Each output row depends\n"
"only on its row of x and on W, never on M, the other rows or `threads`.  isa forces a path\n"
"(\"scalar\", \"avx2\"); the default is isa().  Raises ValueError on bad arguments.");

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"weights", "ggml_type", "n", "k", "x", "out", "threads", "isa", NULL};
    PyObject *wobj, *xobj, *oobj;
    int type, threads = 1;
    Py_ssize_t n, k;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OinnOO|i$z", kwlist, &wobj, &type, &n, &k, &xobj, &oobj, &threads,
                                     &isa_name))
        return NULL;
    const struct type_info *t = check_args(type, n, k, threads);
    if (!t) return NULL;
    const struct dot_isa *isa = isa_name ? dot_isa_named(isa_name) : default_isa;
    if (!isa) return PyErr_Format(PyExc_ValueError, "isa='%s' is not available on this CPU", isa_name);

    Py_buffer wb, xb, ob;
    if (PyObject_GetBuffer(wobj, &wb, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        return PyErr_Format(PyExc_ValueError, "weights must be a contiguous buffer, got %s", Py_TYPE(wobj)->tp_name);
    }
    Py_ssize_t need = (Py_ssize_t)((size_t)n * (size_t)(k / t->block) * (size_t)t->bytes);
    if (wb.len < need) {
        PyErr_Format(PyExc_ValueError, "weights hold %zd bytes; a %s matrix of n=%zd rows, k=%zd needs %zd", wb.len,
                     t->name, n, k, need);
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (get_matrix(xobj, &xb, 0, "x", -1, k) != 0) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (get_matrix(oobj, &ob, PyBUF_WRITABLE, "out", xb.shape[0], n) != 0) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&xb);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul(isa, t, wb.buf, (int)n, (int)k, xb.buf, (int)xb.shape[0], ob.buf, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(default_isa->name); }

static PyObject *py_isas(PyObject *self, PyObject *unused) {
    return dot_isa_named("avx2") ? Py_BuildValue("(ss)", "scalar", "avx2") : Py_BuildValue("(s)", "scalar");
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS, matmul_doc},
    {"isa", py_isa, METH_NOARGS, "isa() -> str: the path matmul uses by default (\"avx2\", \"scalar\")."},
    {"isas", py_isas, METH_NOARGS, "isas() -> tuple of str: every path this CPU can run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "memspec.runtime._native",
                                    "Exact GGUF block matmul kernels (see memspec/runtime/native).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    const char *env = getenv("MEMSPEC_NATIVE_ISA");
    default_isa = env && *env ? dot_isa_named(env) : dot_isa_best();
    if (!default_isa)
        return PyErr_Format(PyExc_ImportError, "MEMSPEC_NATIVE_ISA='%s' is not a path this CPU can run (scalar%s)",
                            env, dot_isa_named("avx2") ? ", avx2" : "");
    return PyModule_Create(&module);
}
