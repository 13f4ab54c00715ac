/*
 * Checksum and copy many chunks in one call, without the GIL.
 *
 * A model of 100,000 small tensors spends most of a sleep and a wake in
 * Python, a few microseconds per chunk of slicing, hashing, comparing and
 * copying, all under the GIL: the page faults of the copies then stall every
 * other thread too. These functions take a whole group of chunks at once and
 * do that work with the GIL released. hibernate/store/bulk.py holds the same
 * functions in Python, used where this module was not built, and the tests
 * hold the two to the same results.
 *
 * The hash is xxh3-64, the snapshot format's chunk checksum. It is not
 * compiled in: bind() takes it from the xxhash package's own extension
 * (XXH3_64bits, part of libxxhash's public API), so both sides of a snapshot
 * hash with the very same code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t (*hash_fn)(const void *, size_t);
static hash_fn xxh3_64 = NULL;

static const char HEX[] = "0123456789abcdef";

static PyObject *bind(PyObject *self, PyObject *arg) {
    if (xxh3_64 != NULL) Py_RETURN_NONE; /* bound once for the process's lifetime */
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(arg, &encoded)) return NULL;
    const char *path = PyBytes_AS_STRING(encoded);
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
        Py_DECREF(encoded);
        return NULL;
    }
    hash_fn found = (hash_fn)dlsym(handle, "XXH3_64bits");
    if (found == NULL) {
        dlclose(handle);
        PyErr_Format(PyExc_OSError, "%s has no XXH3_64bits", path);
        Py_DECREF(encoded);
        return NULL;
    }
    Py_DECREF(encoded);
    xxh3_64 = found; /* the handle stays open: the function lives in it */
    Py_RETURN_NONE;
}

static int require_bound(void) {
    if (xxh3_64 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() has not found xxh3 yet");
        return -1;
    }
    return 0;
}

static PyObject *digest_text(uint64_t value) {
    char text[16];
    for (int i = 15; i >= 0; i--) {
        text[i] = HEX[value & 0xf];
        value >>= 4;
    }
    return PyUnicode_FromStringAndSize(text, 16);
}

static PyObject *digest_list(const uint64_t *values, Py_ssize_t n) {
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *text = digest_text(values[i]);
        if (text == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, text);
    }
    return result;
}

/* A checksum's 16 lower-case hex digits as a number; 0 (matches nothing) for anything else. */
static int parse_digest(const char *chars, uint64_t *value) {
    uint64_t out = 0;
    for (int i = 0; i < 16; i++) {
        char c = chars[i];
        int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (digit < 0) return 0;
        out = out << 4 | (uint64_t)digit;
    }
    *value = out;
    return 1;
}

/* The buffers of n items, released together whatever happened. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t held;
} Held;

static int hold(Held *held, Py_ssize_t n) {
    held->held = 0;
    held->views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (held->views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int hold_one(Held *held, PyObject *object, int flags) {
    if (PyObject_GetBuffer(object, &held->views[held->held], flags) < 0) return -1;
    held->held++;
    return 0;
}

static void let_go(Held *held) {
    for (Py_ssize_t i = 0; i < held->held; i++) PyBuffer_Release(&held->views[i]);
    PyMem_Free(held->views);
}

static PyObject *checksums(PyObject *self, PyObject *arg) {
    if (require_bound() < 0) return NULL;
    /* An owned tuple, not the caller's list: holding a buffer may run Python code, which must not be
       able to shrink or free what is being read. */
    PyObject *items = PySequence_Tuple(arg);
    if (items == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *result = NULL;
    uint64_t *values = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    Held held;
    if (values == NULL) {
        PyErr_NoMemory();
        Py_DECREF(items);
        return NULL;
    }
    if (hold(&held, n) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (hold_one(&held, PyTuple_GET_ITEM(items, i), PyBUF_SIMPLE) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) values[i] = xxh3_64(held.views[i].buf, (size_t)held.views[i].len);
    Py_END_ALLOW_THREADS
    result = digest_list(values, n);
done:
    if (held.views != NULL) let_go(&held);
    PyMem_Free(values);
    Py_DECREF(items);
    return result;
}

typedef struct {
    Py_ssize_t position, padded, length;
    const char *source;
} Staged;

/* Entry `index` of `list`, which must be an int (no __index__: no Python code may run while the
   lists are read), as a Py_ssize_t; `name` says which list in an error. */
static int list_entry(PyObject *list, Py_ssize_t index, const char *name, Py_ssize_t *value) {
    if (index < 0 || index >= PyList_GET_SIZE(list)) {
        PyErr_Format(PyExc_IndexError, "chunk %zd is not in %s", index, name);
        return -1;
    }
    PyObject *item = PyList_GET_ITEM(list, index);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int", name, index);
        return -1;
    }
    *value = PyLong_AsSsize_t(item);
    if (*value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s[%zd] is out of range", name, index);
        return -1;
    }
    return 0;
}

/* stage_at(target, positions, paddeds, addresses, lengths): copy the lengths[i] bytes at
   addresses[i] to positions[i] of the target, zero them up to paddeds[i], and checksum the copy, so
   that what is recorded is what is written. Chunks are read from host memory at their addresses, not
   from buffer objects: a sleep of many small host tensors made a view of each region (a quarter of
   its staging time at 100,000 tensors), where an address is an int the region holds. The memory
   must stay mapped for the call, as with the targets of verify_copy_at: it is a region of the paused
   process. Items that do not fit are refused before anything is copied. */
static PyObject *stage_at(PyObject *self, PyObject *args) {
    Py_buffer target;
    PyObject *target_object, *positions, *paddeds, *addresses, *lengths;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!:stage_at", &target_object, &PyList_Type, &positions, &PyList_Type,
                          &paddeds, &PyList_Type, &addresses, &PyList_Type, &lengths))
        return NULL;
    if (require_bound() < 0) return NULL;
    if (PyObject_GetBuffer(target_object, &target, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *result = NULL;
    Staged *plan = NULL;
    uint64_t *values = NULL;
    Py_ssize_t n = PyList_GET_SIZE(positions);
    if (PyList_GET_SIZE(paddeds) != n || PyList_GET_SIZE(addresses) != n || PyList_GET_SIZE(lengths) != n) {
        PyErr_SetString(PyExc_ValueError, "the positions, paddeds, addresses and lengths must be as many");
        goto done;
    }
    plan = PyMem_Calloc(n ? n : 1, sizeof(Staged));
    values = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    if (plan == NULL || values == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t position, padded, address, length;
        if (list_entry(positions, i, "positions", &position) < 0 || list_entry(paddeds, i, "paddeds", &padded) < 0 ||
            list_entry(addresses, i, "addresses", &address) < 0 || list_entry(lengths, i, "lengths", &length) < 0)
            goto done;
        if (position < 0 || length < 0 || length > padded || padded > target.len - position) {
            PyErr_Format(PyExc_ValueError, "item %zd (%zd bytes padded to %zd at %zd) does not fit %zd bytes",
                         i, length, padded, position, target.len);
            goto done;
        }
        if (address <= 0 && length > 0) {
            PyErr_Format(PyExc_ValueError, "item %zd has no address", i);
            goto done;
        }
        plan[i] = (Staged){position, padded, length, (const char *)(uintptr_t)address};
    }
    Py_BEGIN_ALLOW_THREADS
    char *base = target.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *slot = base + plan[i].position;
        memmove(slot, plan[i].source, (size_t)plan[i].length);
        memset(slot + plan[i].length, 0, (size_t)(plan[i].padded - plan[i].length));
        values[i] = xxh3_64(slot, (size_t)plan[i].length);
    }
    Py_END_ALLOW_THREADS
    result = digest_list(values, n);
done:
    PyMem_Free(plan);
    PyMem_Free(values);
    PyBuffer_Release(&target);
    return result;
}

typedef struct {
    const char *bytes;
    size_t length;
    uint64_t expected;
    int comparable; /* the expected checksum was well formed */
    char *target;   /* NULL: verify only */
} Check;

static PyObject *verify_copy_at(PyObject *self, PyObject *args) {
    Py_buffer source;
    Py_ssize_t base, got;
    PyObject *group, *offsets, *lengths, *digests, *targets;
    if (require_bound() < 0) return NULL;
    if (!PyArg_ParseTuple(args, "y*nnO!O!O!UO!:verify_copy_at", &source, &base, &got, &PyList_Type, &group,
                          &PyList_Type, &offsets, &PyList_Type, &lengths, &digests, &PyList_Type, &targets))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(group), stop = n, failed = -1, digits = 0;
    int truncated = 0;
    PyObject *result = NULL;
    Check *plan = PyMem_Calloc(n ? n : 1, sizeof(Check));
    const char *text = PyUnicode_AsUTF8AndSize(digests, &digits);
    if (plan == NULL) PyErr_NoMemory();
    if (plan == NULL || text == NULL) goto done;
    if (!PyUnicode_IS_ASCII(digests)) {
        PyErr_SetString(PyExc_ValueError, "checksums must be hex digits");
        goto done;
    }
    if (base < 0 || got < 0 || got > source.len) {
        PyErr_Format(PyExc_ValueError, "%zd bytes read from file offset %zd into a %zd-byte source", got, base,
                     source.len);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t chunk, offset, length, address;
        if (list_entry(group, i, "the group", &chunk) < 0 || list_entry(offsets, chunk, "offsets", &offset) < 0 ||
            list_entry(lengths, chunk, "lengths", &length) < 0 ||
            list_entry(targets, chunk, "targets", &address) < 0)
            goto done;
        Py_ssize_t start = offset - base;
        if (start < 0 || length < 0 || chunk > digits / 16 - 1) {
            PyErr_Format(PyExc_ValueError, "chunk %zd (%zd bytes at file offset %zd) is not in the source", chunk,
                         length, offset);
            goto done;
        }
        if (length > got - start) { /* the read ended before it: the chunks before it are still checked */
            stop = i;
            truncated = 1;
            break;
        }
        plan[i] = (Check){(const char *)source.buf + start, (size_t)length, 0, 0, (char *)(intptr_t)address};
        plan[i].comparable = parse_digest(text + 16 * chunk, &plan[i].expected);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < stop; i++) {
        if (!plan[i].comparable || xxh3_64(plan[i].bytes, plan[i].length) != plan[i].expected) {
            failed = i;
            break;
        }
        if (plan[i].target != NULL) memmove(plan[i].target, plan[i].bytes, plan[i].length);
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0) truncated = 0;
    else if (truncated) failed = stop;
    result = Py_BuildValue("(nO)", failed, truncated ? Py_True : Py_False);
done:
    PyMem_Free(plan);
    PyBuffer_Release(&source);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Take XXH3_64bits from the shared object at this path."},
    {"checksums", checksums, METH_O, "The checksum of each buffer, as 16 hex digits."},
    {"stage_at", stage_at, METH_VARARGS,
     "Copy the bytes at each address into the target at its position, zero its padding; the checksums "
     "of the copies: (target, positions, paddeds, addresses, lengths)."},
    {"verify_copy_at", verify_copy_at, METH_VARARGS,
     "Check the group's chunks in the source in order and copy each to its target address; "
     "(position of the first that failed or -1, whether it failed for lack of bytes read)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bulk", NULL, -1, methods};

/* Raised whenever what a function does changes, so that bulk.py refuses a module built from an
   older _bulk.c (the build lands in the source tree of an editable install). */
#define BULK_VERSION 4

PyMODINIT_FUNC PyInit__bulk(void) {
    PyObject *made = PyModule_Create(&module);
    if (made != NULL && PyModule_AddIntConstant(made, "VERSION", BULK_VERSION) < 0) Py_CLEAR(made);
    return made;
}
