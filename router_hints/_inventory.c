/* The inventory index's per-block ingest loops (router_hints/index.py), run in C over the
 * index's own dicts and lists. The Python loops in index.py are the reference and the fallback
 * on a host that had no compiler at install; tests/test_router_index.py keeps the two equal.
 *
 * A held entry is a list [external hash, one refcount per tier (index.py's _NUM_TIERS: device,
 * host, dram, disk, shared)]; `slot` is 1..NUM_TIERS.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NUM_TIERS 5                  /* index.py's _NUM_TIERS */
#define ENTRY_LEN (NUM_TIERS + 1)
#define NUM_PRESENT (1 << NUM_TIERS) /* drops: one entry per set of tiers still holding a block */

/* masks[seq] |= lanes */
static int mask_set(PyObject *masks, PyObject *seq, PyObject *lanes)
{
    PyObject *old = PyDict_GetItemWithError(masks, seq);  /* borrowed */
    if (old == NULL) {
        if (PyErr_Occurred())
            return -1;
        return PyDict_SetItem(masks, seq, lanes);
    }
    PyObject *merged = PyNumber_Or(old, lanes);
    if (merged == NULL)
        return -1;
    int rc = PyDict_SetItem(masks, seq, merged);
    Py_DECREF(merged);
    return rc;
}

/* masks[seq] &= ~bits, the entry gone when nothing is left (index.py's _clear_bit) */
static int mask_clear(PyObject *masks, PyObject *seq, PyObject *bits)
{
    PyObject *old = PyDict_GetItemWithError(masks, seq);
    if (old == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *inverted = PyNumber_Invert(bits);
    if (inverted == NULL)
        return -1;
    PyObject *left = PyNumber_And(old, inverted);
    Py_DECREF(inverted);
    if (left == NULL)
        return -1;
    int truth = PyObject_IsTrue(left), rc;
    if (truth < 0)
        rc = -1;
    else if (truth)
        rc = PyDict_SetItem(masks, seq, left);
    else
        rc = PyDict_DelItem(masks, seq);
    Py_DECREF(left);
    return rc;
}

/* A refcount in a held entry; -1 with an error set when the entry is not what the index makes. */
static long held_count(PyObject *held, Py_ssize_t slot)
{
    if (!PyList_CheckExact(held) || PyList_GET_SIZE(held) != ENTRY_LEN) {
        PyErr_SetString(PyExc_TypeError, "a held entry is a list [external, one refcount per tier]");
        return -1;
    }
    return PyLong_AsLong(PyList_GET_ITEM(held, slot));
}

static int held_put(PyObject *held, Py_ssize_t slot, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    return PyList_SetItem(held, slot, v);  /* steals v */
}

static int check_slot(Py_ssize_t slot)
{
    if (slot < 1 || slot > NUM_TIERS) {
        PyErr_Format(PyExc_ValueError, "slot %zd is not a tier's refcount (1..%d)", slot, NUM_TIERS);
        return -1;
    }
    return 0;
}

/* stored(holding, masks, externals, seqs, slot, lanes): each block's copy in the tier counted;
 * a tier's first copy of a block sets the worker's lanes in its mask. */
static PyObject *stored(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *holding, *masks, *externals, *seqs, *lanes;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "O!O!OOnO:stored", &PyDict_Type, &holding, &PyDict_Type, &masks, &externals,
                          &seqs, &slot, &lanes) || check_slot(slot) < 0)
        return NULL;
    PyObject *ext = PySequence_Fast(externals, "externals must be a sequence");
    if (ext == NULL)
        return NULL;
    PyObject *seq = PySequence_Fast(seqs, "seqs must be a sequence");
    if (seq == NULL) {
        Py_DECREF(ext);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ext);
    if (PySequence_Fast_GET_SIZE(seq) < n)
        n = PySequence_Fast_GET_SIZE(seq);  /* zip() stops at the shorter */
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(ext, i), *s = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *held = PyDict_GetItemWithError(holding, s);
        if (held == NULL) {
            if (PyErr_Occurred()) {
                ok = 0;
                break;
            }
            PyObject *entry = PyList_New(ENTRY_LEN);
            if (entry == NULL) {
                ok = 0;
                break;
            }
            Py_INCREF(e);
            PyList_SET_ITEM(entry, 0, e);
            for (Py_ssize_t k = 1; k < ENTRY_LEN; k++)
                PyList_SET_ITEM(entry, k, PyLong_FromLong(k == slot));  /* 0 and 1: cached, never NULL */
            ok = PyDict_SetItem(holding, s, entry) == 0;
            Py_DECREF(entry);
        } else {
            long count = held_count(held, slot);
            if (count == -1 && PyErr_Occurred()) {
                ok = 0;
                break;
            }
            ok = held_put(held, slot, count + 1) == 0;
            if (count)
                continue;  /* the tier held it already: its classes are set */
        }
        ok = ok && mask_set(masks, s, lanes) == 0;
    }
    Py_DECREF(ext);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* removed(by_external, holding, masks, externals, slot, bit, drops): each block's copy in the
 * tier uncounted; the tier's last copy clears the lanes no other tier fills (drops[present] *
 * bit), and a block no tier holds is forgotten. */
static PyObject *removed(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *by_external, *holding, *masks, *externals, *bit, *drops;
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "O!O!O!OnOO!:removed", &PyDict_Type, &by_external, &PyDict_Type, &holding,
                          &PyDict_Type, &masks, &externals, &slot, &bit, &PyTuple_Type, &drops)
        || check_slot(slot) < 0)
        return NULL;
    if (PyTuple_GET_SIZE(drops) != NUM_PRESENT) {
        PyErr_Format(PyExc_ValueError, "drops has one entry per set of present tiers (%d)", NUM_PRESENT);
        return NULL;
    }
    PyObject *ext = PySequence_Fast(externals, "externals must be a sequence");
    if (ext == NULL)
        return NULL;
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(ext); i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(ext, i);
        PyObject *s = PyDict_GetItemWithError(by_external, e);
        if (s == NULL) {
            ok = !PyErr_Occurred();
            continue;
        }
        PyObject *held = PyDict_GetItemWithError(holding, s);
        long count = held == NULL ? 0 : held_count(held, slot);
        if (held == NULL || count <= 0) {
            ok = !PyErr_Occurred();
            continue;
        }
        Py_INCREF(s);  /* both entries may go below */
        Py_INCREF(held);
        ok = held_put(held, slot, count - 1) == 0;
        if (ok && count == 1) {  /* the tier's last copy went */
            long present = 0;
            for (Py_ssize_t t = 1; ok && t < ENTRY_LEN; t++) {
                long c = PyLong_AsLong(PyList_GET_ITEM(held, t));
                ok = !(c == -1 && PyErr_Occurred());
                present |= (long)(c > 0) << (t - 1);
            }
            PyObject *bits = ok ? PyNumber_Multiply(bit, PyTuple_GET_ITEM(drops, present)) : NULL;
            ok = bits != NULL && mask_clear(masks, s, bits) == 0;
            Py_XDECREF(bits);
            if (ok && !present)
                ok = PyDict_DelItem(holding, s) == 0 && PyDict_DelItem(by_external, e) == 0;
        }
        Py_DECREF(held);
        Py_DECREF(s);
    }
    Py_DECREF(ext);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stored", stored, METH_VARARGS, "Count a stored run's blocks in a tier and set the lanes its first copies open."},
    {"removed", removed, METH_VARARGS, "Uncount removed blocks in a tier; clear lanes and forget blocks as they go."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_inventory", "The inventory index's ingest loops.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__inventory(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NUM_TIERS", NUM_TIERS) < 0)
        Py_CLEAR(m);
    return m;  /* index.py uses these loops only when NUM_TIERS is its own */
}
