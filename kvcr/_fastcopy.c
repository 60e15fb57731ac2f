/* Bulk copies of KV pages with the GIL released, optionally with non-temporal stores.
 *
 * A pulled page is not read by this CPU again soon (it goes to a GPU or waits in a pool), so
 * streaming stores skip the read-for-ownership of every destination line and keep the cache
 * for the engine. glibc's memcpy only streams above a threshold derived from the L3 size, which
 * a single 1 MiB page never reaches (and which VMs often misreport). Design notes: docs/peer.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVCR_HAVE_STREAM 1
#else
#define KVCR_HAVE_STREAM 0
#endif

typedef struct {  /* the order Python passes them: (dst, nbytes, src), as kvcr's GET ops */
    char *dst;
    size_t nbytes;
    const char *src;
} copy_op;

#if KVCR_HAVE_STREAM
static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;  /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
#endif

/* One (dst, nbytes, src) op: three non-negative ints, no address 0 under a non-empty copy. */
static int parse_op(PyObject *obj, Py_ssize_t i, unsigned long long v[3])
{
    PyObject *op = PySequence_Fast(obj, "each op is (dst, nbytes, src)");
    if (op == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(op) != 3) {
        PyErr_Format(PyExc_TypeError, "each op is (dst, nbytes, src); op %zd has %zd items", i,
                     PySequence_Fast_GET_SIZE(op));
        Py_DECREF(op);
        return -1;
    }
    for (int k = 0; k < 3; k++) {
        v[k] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(op, k));
        if (v[k] == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "op %zd: dst, nbytes and src must be non-negative integers", i);
            Py_DECREF(op);
            return -1;
        }
    }
    Py_DECREF(op);
    if (v[1] > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_Format(PyExc_ValueError, "op %zd copies %llu bytes: more than any buffer", i, v[1]);
        return -1;
    }
    if (v[1] && (v[0] == 0 || v[2] == 0)) {
        PyErr_Format(PyExc_ValueError, "op %zd copies %llu bytes from or to address 0", i, v[1]);
        return -1;
    }
    return 0;
}

static int parse_ops(PyObject *seq, copy_op **out, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, "ops must be a sequence of (dst, nbytes, src)");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    copy_op *ops = PyMem_Calloc(n ? (size_t)n : 1, sizeof(copy_op));
    if (ops == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v[3];
        if (parse_op(PySequence_Fast_GET_ITEM(fast, i), i, v) < 0) {
            PyMem_Free(ops);
            Py_DECREF(fast);
            return -1;
        }
        ops[i].dst = (char *)(uintptr_t)v[0];
        ops[i].nbytes = (size_t)v[1];
        ops[i].src = (const char *)(uintptr_t)v[2];
    }
    Py_DECREF(fast);
    *out = ops;
    *count = n;
    return 0;
}

static PyObject *fastcopy_copy(PyObject *self, PyObject *args)
{
    PyObject *seq;
    unsigned long long stream_min;
    if (!PyArg_ParseTuple(args, "OK:copy", &seq, &stream_min))
        return NULL;
    copy_op *ops;
    Py_ssize_t n;
    if (parse_ops(seq, &ops, &n) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
#if KVCR_HAVE_STREAM
        if (ops[i].nbytes >= stream_min) {
            stream_copy(ops[i].dst, ops[i].src, ops[i].nbytes);
            streamed = 1;
            continue;
        }
#endif
        memcpy(ops[i].dst, ops[i].src, ops[i].nbytes);
    }
#if KVCR_HAVE_STREAM
    if (streamed)
        _mm_sfence();  /* streamed stores are weakly ordered: visible before we return */
#else
    (void)streamed;
#endif
    Py_END_ALLOW_THREADS
    PyMem_Free(ops);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", fastcopy_copy, METH_VARARGS,
     "copy(ops, stream_min): memcpy each (dst, nbytes, src) with the GIL released; ops of at least\n"
     "stream_min bytes use non-temporal stores where the CPU has them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvcr._fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "STREAMS", KVCR_HAVE_STREAM) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
