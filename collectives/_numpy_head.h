/* numpy's array object as its C API lays it out: the fields every numpy
 * keeps at these places (1.x and 2.x). The extensions read arrays through
 * it without numpy's headers; each checks it against numpy at start
 * (collectives/fast_calls.py, _reads_numpy_right). */
#ifndef COLLECTIVES_NUMPY_HEAD_H
#define COLLECTIVES_NUMPY_HEAD_H

#include <Python.h>

typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} ArrayHead;
#define ARR_C_CONTIGUOUS 0x0001
#define ARR_WRITEABLE 0x0400

/* (data, nd, size, dtype, flags) of a one-dimensional array, as the
 * extensions read them (flags: C-contiguous 1, writable 0x400). */
static inline PyObject *array_head_tuple(const ArrayHead *a) {
    return Py_BuildValue("(KinOi)", (unsigned long long)(uintptr_t)a->data, a->nd, a->dimensions[0], a->descr,
                         a->flags & (ARR_C_CONTIGUOUS | ARR_WRITEABLE));
}

#endif
