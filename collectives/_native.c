/* The native fast path of the shared-memory window (optional; the library
 * runs without it, in Python, when it is not built).
 *
 * What it does is what collectives.transports.shm.ShmWindow does in Python,
 * minus the interpreter: a fence over per-rank epoch counters (each written
 * by its owner only), waking peers that sleep on their futex word, and the
 * one-fence allreduce of small vectors (copy in, fence, reduce every rank's
 * slot in rank order, so every rank gets the same bits as numpy's ufuncs
 * would give). Waits here are bounded (spin, then sched_yield); when they run
 * out the caller blocks in Python, where timeouts and dead peers are handled.
 *
 *   Window(epochs, sleeps, rank, spin_ns, yield_ns)
 *       epochs, sleeps: addresses of every rank's epoch counter (uint64) and
 *       futex sleep word, in shared memory.
 *   Window.fence(epoch) -> bool
 *       publish this rank's epoch, ring sleeping peers that already arrived,
 *       wait (bounded) for every peer to reach it; True when all have.
 *   Window.small_allreduce(slots0, slots1, nbytes, dtype, op) -> SmallAllreduce
 *       slotsH: addresses of every rank's slot in half H of the window.
 *   SmallAllreduce.run(buf, half, epoch) -> bool
 *       copy buf into this rank's slot of ``half``, fence; when the fence
 *       completed, buf = slot0 op slot1 op ... and True; else False (the
 *       caller waits, then calls .reduce(buf, half)).
 *   reduce_into(out, srcs, dtype, op): out = srcs[0] op srcs[1] op ...
 *       (addresses; out may be srcs[0]).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { DT_F32, DT_F64, DT_I8, DT_I16, DT_I32, DT_I64, DT_U8, DT_U16, DT_U32, DT_U64, DT_COUNT };
enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR, OP_COUNT };

typedef void (*binop_fn)(void *out, const void *a, const void *b, Py_ssize_t n);

/* ------------------------------------------------------------- kernels */
/* Integer sums and products wrap as numpy's do (unsigned arithmetic, no UB).
 * min and max follow numpy's minimum and maximum: a NaN in either operand
 * gives NaN, and of two equal values the second is taken. */

#define INT_KERNELS(NAME, T, UT)                                                       \
    static void sum_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (T)((UT)x[i] + (UT)y[i]);          \
    }                                                                                  \
    static void prod_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (T)((UT)x[i] * (UT)y[i]);          \
    }                                                                                  \
    static void min_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] < y[i] ? x[i] : y[i];         \
    }                                                                                  \
    static void max_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] > y[i] ? x[i] : y[i];         \
    }                                                                                  \
    static void band_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] & y[i];                       \
    }                                                                                  \
    static void bor_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] | y[i];                       \
    }                                                                                  \
    static void bxor_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] ^ y[i];                       \
    }

#define FLOAT_KERNELS(NAME, T)                                                         \
    static void sum_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] + y[i];                       \
    }                                                                                  \
    static void prod_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] * y[i];                       \
    }                                                                                  \
    static void min_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T u = x[i], v = y[i];                                                      \
            out[i] = (u != u) ? u : (u < v ? u : v);                                   \
        }                                                                              \
    }                                                                                  \
    static void max_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T u = x[i], v = y[i];                                                      \
            out[i] = (u != u) ? u : (u > v ? u : v);                                   \
        }                                                                              \
    }

FLOAT_KERNELS(f32, float)
FLOAT_KERNELS(f64, double)
INT_KERNELS(i8, int8_t, uint8_t)
INT_KERNELS(i16, int16_t, uint16_t)
INT_KERNELS(i32, int32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t)
INT_KERNELS(u8, uint8_t, uint8_t)
INT_KERNELS(u16, uint16_t, uint16_t)
INT_KERNELS(u32, uint32_t, uint32_t)
INT_KERNELS(u64, uint64_t, uint64_t)

#define INT_ROW(N) {sum_##N, prod_##N, min_##N, max_##N, band_##N, bor_##N, bxor_##N}
#define FLOAT_ROW(N) {sum_##N, prod_##N, min_##N, max_##N, NULL, NULL, NULL}

static const binop_fn KERNELS[DT_COUNT][OP_COUNT] = {
    FLOAT_ROW(f32), FLOAT_ROW(f64),
    INT_ROW(i8), INT_ROW(i16), INT_ROW(i32), INT_ROW(i64),
    INT_ROW(u8), INT_ROW(u16), INT_ROW(u32), INT_ROW(u64),
};
static const int ITEMSIZE[DT_COUNT] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8};

static binop_fn kernel(int dtype, int op) {
    if (dtype < 0 || dtype >= DT_COUNT || op < 0 || op >= OP_COUNT) return NULL;
    return KERNELS[dtype][op];
}

/* out = srcs[0] op srcs[1] op ... op srcs[p-1], in that order (p >= 2).
 * Chunk by chunk, so that the partial result stays in the L1 cache while the
 * sources stream past once: p reads and one write of memory per element
 * instead of the 2(p-1) reads and p-1 writes of whole-vector passes. Each
 * element sees the same operations in the same order, so the bits are those
 * of the passes (and of numpy's ufuncs). */
#define CHUNK_BYTES 8192
static void reduce_all(binop_fn f, char *out, char *const *srcs, int p, Py_ssize_t count, int itemsize) {
    Py_ssize_t step = CHUNK_BYTES / itemsize;
    for (Py_ssize_t lo = 0; lo < count; lo += step) {
        Py_ssize_t n = count - lo < step ? count - lo : step;
        Py_ssize_t off = lo * itemsize;
        f(out + off, srcs[0] + off, srcs[1] + off, n);
        for (int r = 2; r < p; r++) f(out + off, out + off, srcs[r] + off, n);
    }
}

/* --------------------------------------------------------------- waiting */

static inline uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef struct {
    PyObject_HEAD
    int size, rank;
    int64_t spin_ns, yield_ns;
    uint64_t **epochs;   /* every rank's epoch counter */
    uint64_t **sleeps;   /* every rank's sleep word (a futex on its low 32 bits) */
} WindowObject;

/* Publish ``e`` and wake peers already at this fence that sleep (they wait
 * for this rank). The full fence orders the epoch store before the loads of
 * the sleep words, so a peer that marked itself asleep is never missed. */
static void arrive(WindowObject *w, uint64_t e) {
    __atomic_store_n(w->epochs[w->rank], e, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < w->size; r++) {
        if (r == w->rank) continue;
        if (load_acquire(w->epochs[r]) >= e && load_acquire(w->sleeps[r])) {
            __atomic_store_n(w->sleeps[r], 0, __ATOMIC_RELEASE);
            syscall(SYS_futex, (uint32_t *)w->sleeps[r], FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        }
    }
}

/* The first rank not yet at epoch ``e`` from ``start`` on, or size. */
static inline int first_late(WindowObject *w, uint64_t e, int start) {
    int r = start;
    while (r < w->size && (r == w->rank || load_acquire(w->epochs[r]) >= e)) r++;
    return r;
}

/* Wait (spin, then yield) until every peer reached ``e``; 1 if they all
 * did, 0 when the time ran out. Releases the GIL while it waits. */
static int wait_peers(WindowObject *w, uint64_t e) {
    int r = first_late(w, e, 0);
    if (r == w->size) return 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t start = now_ns();
    for (;;) {
        r = first_late(w, e, r);
        if (r == w->size) break;
        int64_t waited = now_ns() - start;
        if (waited < w->spin_ns) {
            for (int i = 0; i < 16; i++) cpu_relax();
        } else if (waited < w->spin_ns + w->yield_ns) {
            sched_yield();
        } else {
            break;
        }
    }
    Py_END_ALLOW_THREADS
    return r == w->size;
}

static int fill_addresses(PyObject *seq, int size, uint64_t ***out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != size) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: expected %d addresses", what, size);
        return -1;
    }
    uint64_t **arr = PyMem_Calloc((size_t)size, sizeof(uint64_t *));
    if (!arr) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (int i = 0; i < size; i++) {
        arr[i] = (uint64_t *)PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) { PyMem_Free(arr); Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    *out = arr;
    return 0;
}

static void Window_dealloc(WindowObject *w) {
    PyMem_Free(w->epochs);
    PyMem_Free(w->sleeps);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static int Window_init(WindowObject *w, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"epochs", "sleeps", "rank", "spin_ns", "yield_ns", NULL};
    PyObject *epochs, *sleeps;
    long long spin_ns, yield_ns;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOiLL", kwlist, &epochs, &sleeps, &w->rank,
                                     &spin_ns, &yield_ns))
        return -1;
    Py_ssize_t n = PySequence_Size(epochs);
    if (n < 1 || n > INT_MAX) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "epochs: at least one address");
        return -1;
    }
    w->size = (int)n;
    if (w->rank < 0 || w->rank >= w->size) {
        PyErr_SetString(PyExc_ValueError, "rank out of range");
        return -1;
    }
    w->spin_ns = spin_ns;
    w->yield_ns = yield_ns;
    PyMem_Free(w->epochs);
    PyMem_Free(w->sleeps);
    w->epochs = w->sleeps = NULL;
    if (fill_addresses(epochs, w->size, &w->epochs, "epochs") < 0) return -1;
    if (fill_addresses(sleeps, w->size, &w->sleeps, "sleeps") < 0) return -1;
    return 0;
}

static PyObject *Window_fence(WindowObject *w, PyObject *arg) {
    unsigned long long e = PyLong_AsUnsignedLongLong(arg);
    if (e == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    arrive(w, e);
    return PyBool_FromLong(wait_peers(w, e));
}

static PyObject *Window_wake_sleepers(WindowObject *w, PyObject *Py_UNUSED(ignored)) {
    for (int r = 0; r < w->size; r++) {
        if (r != w->rank && load_acquire(w->sleeps[r])) {
            __atomic_store_n(w->sleeps[r], 0, __ATOMIC_RELEASE);
            syscall(SYS_futex, (uint32_t *)w->sleeps[r], FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        }
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------- small allreduce */

typedef struct {
    PyObject_HEAD
    WindowObject *window;
    binop_fn f;
    Py_ssize_t nbytes, count;
    int itemsize;
    char **slots[2];
} SmallObject;

static PyTypeObject SmallType;

static PyObject *Window_small_allreduce(WindowObject *w, PyObject *args) {
    PyObject *s0, *s1;
    Py_ssize_t nbytes;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOnii", &s0, &s1, &nbytes, &dtype, &op)) return NULL;
    binop_fn f = kernel(dtype, op);
    if (!f) {
        PyErr_SetString(PyExc_ValueError, "no native kernel for this dtype and op");
        return NULL;
    }
    if (nbytes <= 0 || nbytes % ITEMSIZE[dtype]) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be a positive multiple of the item size");
        return NULL;
    }
    SmallObject *s = PyObject_New(SmallObject, &SmallType);
    if (!s) return NULL;
    s->slots[0] = s->slots[1] = NULL;
    Py_INCREF(w);
    s->window = w;
    s->f = f;
    s->nbytes = nbytes;
    s->count = nbytes / ITEMSIZE[dtype];
    s->itemsize = ITEMSIZE[dtype];
    if (fill_addresses(s0, w->size, (uint64_t ***)&s->slots[0], "slots0") < 0 ||
        fill_addresses(s1, w->size, (uint64_t ***)&s->slots[1], "slots1") < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void Small_dealloc(SmallObject *s) {
    PyMem_Free(s->slots[0]);
    PyMem_Free(s->slots[1]);
    Py_XDECREF(s->window);
    PyObject_Free(s);
}

static int get_buffer(SmallObject *s, PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != s->nbytes) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "buffer has %zd bytes, the plan %zd", view->len, s->nbytes);
        return -1;
    }
    return 0;
}

static int parse_half(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int *half) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments", want);
        return -1;
    }
    long h = PyLong_AsLong(args[1]);
    if (h == -1 && PyErr_Occurred()) return -1;
    if (h != 0 && h != 1) {
        PyErr_SetString(PyExc_ValueError, "half must be 0 or 1");
        return -1;
    }
    *half = (int)h;
    return 0;
}

/* .run(buf, half, epoch) -> bool */
static PyObject *Small_run(SmallObject *s, PyObject *const *args, Py_ssize_t nargs) {
    int half;
    if (parse_half(args, nargs, 3, &half) < 0) return NULL;
    unsigned long long e = PyLong_AsUnsignedLongLong(args[2]);
    if (e == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (get_buffer(s, args[0], &view) < 0) return NULL;
    WindowObject *w = s->window;
    char **slots = s->slots[half];
    memcpy(slots[w->rank], view.buf, (size_t)s->nbytes);
    arrive(w, e);
    int done = wait_peers(w, e);
    if (done) reduce_all(s->f, view.buf, slots, w->size, s->count, s->itemsize);
    PyBuffer_Release(&view);
    return PyBool_FromLong(done);
}

/* .reduce(buf, half): the reduction alone, after the caller's wait */
static PyObject *Small_reduce(SmallObject *s, PyObject *const *args, Py_ssize_t nargs) {
    int half;
    if (parse_half(args, nargs, 2, &half) < 0) return NULL;
    Py_buffer view;
    if (get_buffer(s, args[0], &view) < 0) return NULL;
    reduce_all(s->f, view.buf, s->slots[half], s->window->size, s->count, s->itemsize);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------- module level */

/* reduce_into(out, srcs, count, dtype, op): addresses; out = srcs[0] op srcs[1] op ... */
static PyObject *native_reduce_into(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *out_obj, *srcs;
    Py_ssize_t count;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOnii", &out_obj, &srcs, &count, &dtype, &op)) return NULL;
    binop_fn f = kernel(dtype, op);
    if (!f) {
        PyErr_SetString(PyExc_ValueError, "no native kernel for this dtype and op");
        return NULL;
    }
    char *out = PyLong_AsVoidPtr(out_obj);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t p = PySequence_Size(srcs);
    if (p < 1 || p > INT_MAX) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "srcs: at least one address");
        return NULL;
    }
    uint64_t **addrs;
    if (fill_addresses(srcs, (int)p, &addrs, "srcs") < 0) return NULL;
    if (count > 0) {
        if (p == 1) {
            if ((char *)addrs[0] != out) memmove(out, addrs[0], (size_t)(count * ITEMSIZE[dtype]));
        } else {
            reduce_all(f, out, (char *const *)addrs, (int)p, count, ITEMSIZE[dtype]);
        }
    }
    PyMem_Free(addrs);
    Py_RETURN_NONE;
}

static PyMethodDef Window_methods[] = {
    {"fence", (PyCFunction)Window_fence, METH_O,
     "fence(epoch) -> bool: publish epoch, wake sleeping peers, wait (bounded) for all."},
    {"wake_sleepers", (PyCFunction)Window_wake_sleepers, METH_NOARGS, "Wake every sleeping peer."},
    {"small_allreduce", (PyCFunction)Window_small_allreduce, METH_VARARGS,
     "small_allreduce(slots0, slots1, nbytes, dtype, op) -> SmallAllreduce plan."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._native.Window",
    .tp_basicsize = sizeof(WindowObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Window(epochs, sleeps, rank, spin_ns, yield_ns): fences over shared epoch counters.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Window_init,
    .tp_dealloc = (destructor)Window_dealloc,
    .tp_methods = Window_methods,
};

static PyMethodDef Small_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Small_run, METH_FASTCALL,
     "run(buf, half, epoch) -> bool: copy in, fence, reduce; False: the fence is not complete yet."},
    {"reduce", (PyCFunction)(void (*)(void))Small_reduce, METH_FASTCALL,
     "reduce(buf, half): buf = every rank's slot of half, reduced in rank order."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SmallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._native.SmallAllreduce",
    .tp_basicsize = sizeof(SmallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The one-fence allreduce of a small vector (see run and reduce).",
    .tp_dealloc = (destructor)Small_dealloc,
    .tp_methods = Small_methods,
};

static PyMethodDef module_methods[] = {
    {"reduce_into", native_reduce_into, METH_VARARGS,
     "reduce_into(out, srcs, count, dtype, op): out = srcs[0] op srcs[1] op ... (addresses)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "collectives._native",
    "Native fast path of the shared-memory window (fences, small allreduce, reductions).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&WindowType) < 0 || PyType_Ready(&SmallType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&WindowType);
    if (PyModule_AddObject(m, "Window", (PyObject *)&WindowType) < 0) {
        Py_DECREF(&WindowType);
        Py_DECREF(m);
        return NULL;
    }
    const char *names[] = {"DT_F32", "DT_F64", "DT_I8", "DT_I16", "DT_I32", "DT_I64",
                           "DT_U8", "DT_U16", "DT_U32", "DT_U64"};
    for (int i = 0; i < DT_COUNT; i++) PyModule_AddIntConstant(m, names[i], i);
    const char *ops[] = {"OP_SUM", "OP_PROD", "OP_MIN", "OP_MAX", "OP_BAND", "OP_BOR", "OP_BXOR"};
    for (int i = 0; i < OP_COUNT; i++) PyModule_AddIntConstant(m, ops[i], i);
    return m;
}
