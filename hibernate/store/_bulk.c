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
#include <stdarg.h>
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

/* A call's (buffer, sequence of items) arguments, both held until release_call. */
static int open_call(PyObject *args, const char *format, int flags, const char *items_error, Py_buffer *buffer,
                     PyObject **items) {
    PyObject *buffer_object, *sequence;
    if (!PyArg_ParseTuple(args, format, &buffer_object, &sequence)) return -1;
    if (require_bound() < 0) return -1;
    if (PyObject_GetBuffer(buffer_object, buffer, flags) < 0) return -1;
    /* An owned tuple, not the caller's list: parsing an item may run Python code (__index__), which
       must not be able to shrink or free what is being read. */
    *items = PySequence_Tuple(sequence);
    if (*items == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, items_error);
        }
        PyBuffer_Release(buffer);
        return -1;
    }
    return 0;
}

static void release_call(Py_buffer *buffer, PyObject *items) {
    Py_DECREF(items);
    PyBuffer_Release(buffer);
}

/* Item i of a call: a tuple of exactly `size` values parsed by `format`. Numbers past what a
   Py_ssize_t holds are refused as ValueError, as the Python functions refuse them. */
static int parse_item(PyObject *items, Py_ssize_t i, Py_ssize_t size, const char *format, ...) {
    PyObject *item = PyTuple_GET_ITEM(items, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != size) {
        PyErr_Format(PyExc_TypeError, "item %zd must be a tuple of %zd values", i, size);
        return -1;
    }
    va_list values;
    va_start(values, format);
    int parsed = PyArg_VaParse(item, format, values);
    va_end(values);
    if (!parsed) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "item %zd holds a number out of range", i);
        }
        return -1;
    }
    return 0;
}

/* A checksum's 16 lower-case hex digits as a number; 0 for anything else, which matches nothing. */
static int parse_digest(PyObject *text, uint64_t *value) {
    Py_ssize_t length;
    const char *chars = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &length) : NULL;
    if (chars == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (length != 16) return 0;
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
    PyObject *items = PySequence_Tuple(arg); /* owned: see open_call */
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

static PyObject *stage(PyObject *self, PyObject *args) {
    Py_buffer target;
    PyObject *items;
    if (open_call(args, "OO:stage", PyBUF_WRITABLE, "stage() takes a sequence of (position, padded, view)",
                  &target, &items) < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *result = NULL;
    Staged *plan = PyMem_Calloc(n ? n : 1, sizeof(Staged));
    uint64_t *values = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    Held held = {NULL, 0};
    if (plan == NULL || values == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (hold(&held, n) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *view;
        Py_ssize_t position, padded;
        if (parse_item(items, i, 3, "nnO", &position, &padded, &view) < 0) goto done;
        if (hold_one(&held, view, PyBUF_SIMPLE) < 0) goto done;
        Py_ssize_t length = held.views[i].len;
        if (position < 0 || length > padded || padded > target.len - position) {
            PyErr_Format(PyExc_ValueError, "item %zd (%zd bytes padded to %zd at %zd) does not fit %zd bytes",
                         i, length, padded, position, target.len);
            goto done;
        }
        plan[i] = (Staged){position, padded, length, held.views[i].buf};
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
    if (held.views != NULL) let_go(&held);
    PyMem_Free(plan);
    PyMem_Free(values);
    release_call(&target, items);
    return result;
}

typedef struct {
    Py_ssize_t start, length;
    uint64_t expected;
    int comparable; /* the expected checksum was well formed */
    char *target;   /* NULL: verify only */
} Check;

static PyObject *verify_copy(PyObject *self, PyObject *args) {
    Py_buffer source;
    PyObject *items;
    if (open_call(args, "OO:verify_copy", PyBUF_SIMPLE,
                  "verify_copy() takes a sequence of (start, length, checksum, target)", &source, &items) < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items), failed = -1;
    PyObject *result = NULL;
    Check *plan = PyMem_Calloc(n ? n : 1, sizeof(Check));
    Held held = {NULL, 0};
    if (plan == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (hold(&held, n) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *expected, *target;
        Py_ssize_t start, length;
        if (parse_item(items, i, 4, "nnOO", &start, &length, &expected, &target) < 0) goto done;
        if (start < 0 || length < 0 || length > source.len - start) {
            PyErr_Format(PyExc_ValueError, "item %zd (%zd bytes at %zd) lies outside the %zd-byte source", i,
                         length, start, source.len);
            goto done;
        }
        plan[i] = (Check){start, length, 0, 0, NULL};
        plan[i].comparable = parse_digest(expected, &plan[i].expected);
        if (target != Py_None) {
            if (hold_one(&held, target, PyBUF_WRITABLE) < 0) goto done;
            if (held.views[held.held - 1].len != length) {
                PyErr_Format(PyExc_ValueError, "item %zd: a target of %zd bytes for %zd", i,
                             held.views[held.held - 1].len, length);
                goto done;
            }
            plan[i].target = held.views[held.held - 1].buf;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    const char *base = source.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *bytes = base + plan[i].start;
        if (!plan[i].comparable || xxh3_64(bytes, (size_t)plan[i].length) != plan[i].expected) {
            failed = i;
            break;
        }
        if (plan[i].target != NULL) memmove(plan[i].target, bytes, (size_t)plan[i].length);
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(failed);
done:
    if (held.views != NULL) let_go(&held);
    PyMem_Free(plan);
    release_call(&source, items);
    return result;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Take XXH3_64bits from the shared object at this path."},
    {"checksums", checksums, METH_O, "The checksum of each buffer, as 16 hex digits."},
    {"stage", stage, METH_VARARGS,
     "Copy each (position, padded, view) into the target, zero its padding; the checksums of the copies."},
    {"verify_copy", verify_copy, METH_VARARGS,
     "Check each (start, length, checksum, target) of the source in order and copy it to its target; "
     "the index of the first that does not match, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bulk", NULL, -1, methods};

/* Raised whenever what a function does changes, so that bulk.py refuses a module built from an
   older _bulk.c (the build lands in the source tree of an editable install). */
#define BULK_VERSION 2

PyMODINIT_FUNC PyInit__bulk(void) {
    PyObject *made = PyModule_Create(&module);
    if (made != NULL && PyModule_AddIntConstant(made, "VERSION", BULK_VERSION) < 0) Py_CLEAR(made);
    return made;
}
