/* Dynamo's block sequence hashes in one call (kvcr/proto/tokenhash.py): each complete block's
 * XXH3-64 of its tokens (little-endian u32, the LoRA/namespace seed), chained with its parent's
 * as XXH3-64 of the pair (u64 LE, seed 1337). The Python functions there are the reference and
 * the fallback on a host without a compiler or xxhash's header; tests hold both to the vectors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define DYNAMO_SEED 1337

#if PY_LITTLE_ENDIAN != 1
#error "tokens and the pair hash are read as little-endian, as the wire and Dynamo have them"
#endif

/* sequence_hashes(tokens, block_size, seed, parent): tokens a buffer of u32 (an array("I")) */
static PyObject *sequence_hashes(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    Py_ssize_t block_size;
    unsigned long long seed;
    PyObject *parent;
    if (!PyArg_ParseTuple(args, "y*nKO:sequence_hashes", &buf, &block_size, &seed, &parent))
        return NULL;
    PyObject *out = NULL;
    if (buf.itemsize != 4 || block_size < 1) {
        PyErr_Format(PyExc_ValueError, "tokens must be 4-byte items and block_size >= 1 (got %zd, %zd)",
                     buf.itemsize, block_size);
        goto done;
    }
    int have_prev = parent != Py_None;
    uint64_t prev = 0;
    if (have_prev) {
        prev = PyLong_AsUnsignedLongLong(parent);
        if (prev == (uint64_t)-1 && PyErr_Occurred())
            goto done;
    }
    Py_ssize_t blocks = buf.len / 4 / block_size;
    out = PyList_New(blocks);
    if (out == NULL)
        goto done;
    const char *tokens = buf.buf;
    size_t block_bytes = (size_t)block_size * 4;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        uint64_t local = XXH3_64bits_withSeed(tokens + i * block_bytes, block_bytes, seed);
        if (have_prev) {
            unsigned char pair[16];  /* struct "<QQ": x86-64 is little-endian, as the wire */
            memcpy(pair, &prev, 8);
            memcpy(pair + 8, &local, 8);
            prev = XXH3_64bits_withSeed(pair, 16, DYNAMO_SEED);
        } else {
            prev = local;
            have_prev = 1;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(prev);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"sequence_hashes", sequence_hashes, METH_VARARGS,
     "Dynamo sequence hashes of a buffer of u32 tokens' complete blocks, continuing from parent (or None)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tokenhash", "Dynamo's block sequence hashes.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tokenhash(void)
{
    return PyModule_Create(&module);
}
