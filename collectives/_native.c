/* The native fast path of the shared-memory window (optional; the library
 * runs without it, in Python, when it is not built).
 *
 * What it does is what collectives.transports.shm.ShmWindow does in Python,
 * minus the interpreter: a fence over per-rank epoch counters (each written
 * by its owner only), waking peers that sleep on their futex word, and the
 * small cases of the window collectives as plans (copy in, fence, copy out
 * or reduce every rank's slot in rank order, with the bits numpy's ufuncs
 * would give). Waits here are bounded (spin, then sched_yield); when they run
 * out the caller blocks in Python, where timeouts and dead peers are handled.
 *
 *   Window(epochs, sleeps, rank, spin_ns, yield_ns)
 *       epochs, sleeps: addresses of every rank's epoch counter (uint64) and
 *       futex sleep word, in shared memory.
 *   Window.epoch, Window.turn
 *       fences passed, and steps taken through the window's halves (the
 *       caller's count, which plans advance too).
 *   Window.fence() -> bool
 *       publish the next epoch, ring sleeping peers that already arrived,
 *       wait (bounded) for every peer to reach it; True when all have.
 *   Window.plan(narrays, before, after, reduce) -> Plan
 *       a collective's small case as data: copies before the fence, copies
 *       and one reduction after it, between the call's arrays and the
 *       window's halves (see Window_plan).
 *   Plan.run(arrays) -> bool
 *       take the next half (turn) and epoch; before, fence; when the fence
 *       completed within the bounded wait, after, and True; else False (the
 *       caller waits for the epoch, then calls .finish(arrays)).
 *   reduce_into(out, srcs, dtype, op): out = srcs[0] op srcs[1] op ...
 *       (buffers of one length; out may be srcs[0]).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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
    unsigned long long epoch;  /* fences this rank has passed */
    unsigned long long turn;   /* steps taken through the window's halves (the caller's count) */
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
    w->epoch = w->turn = 0;
    PyMem_Free(w->epochs);
    PyMem_Free(w->sleeps);
    w->epochs = w->sleeps = NULL;
    if (fill_addresses(epochs, w->size, &w->epochs, "epochs") < 0) return -1;
    if (fill_addresses(sleeps, w->size, &w->sleeps, "sleeps") < 0) return -1;
    return 0;
}

static PyObject *Window_fence(WindowObject *w, PyObject *Py_UNUSED(ignored)) {
    uint64_t e = ++w->epoch;
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

/* ------------------------------------------------------------ move plans */
/* A plan: copies before the fence, the fence, copies and one reduction
 * after it; the places are in the call's buffers or in the window's halves.
 * A Loc is arrays[idx] + a0 (idx >= 0) or, in the window, the absolute
 * address a0 in half 0 and a1 in half 1 (idx < 0). */

typedef struct {
    int idx;
    Py_ssize_t a0, a1;
} Loc;

typedef struct {
    Loc src, dst;
    Py_ssize_t n;
} Copy;

#define MAX_ARRAYS 4

typedef struct {
    PyObject_HEAD
    WindowObject *window;
    int narrays;
    int last_half;                /* the half of the last run, for finish */
    Py_ssize_t need[MAX_ARRAYS];  /* bytes each array must hold; -1: unused (may be None) */
    int writes[MAX_ARRAYS];
    int nbefore, nafter, nsrc;
    Copy *before, *after;
    binop_fn f;                   /* NULL: no reduction */
    Py_ssize_t count;
    int itemsize;
    Loc rdst;
    Loc *rsrc;
} PlanObject;

static PyTypeObject PlanType;

static inline char *where(const Loc *l, char *const *bases, int half) {
    if (l->idx >= 0) return bases[l->idx] + l->a0;
    return (char *)(half ? l->a1 : l->a0);
}

static int parse_loc(PyObject *t, Loc *l, int narrays, Py_ssize_t *need, Py_ssize_t extent) {
    if (!PyArg_ParseTuple(t, "inn", &l->idx, &l->a0, &l->a1)) return -1;
    if (l->idx >= narrays) {
        PyErr_SetString(PyExc_ValueError, "array index out of range");
        return -1;
    }
    if (l->idx >= 0) {
        if (l->a0 < 0 || extent < 0) {
            PyErr_SetString(PyExc_ValueError, "negative offset or length");
            return -1;
        }
        if (need[l->idx] < l->a0 + extent) need[l->idx] = l->a0 + extent;
    }
    return 0;
}

static int parse_copies(PyObject *seq, Copy **out, int *n, int narrays, Py_ssize_t *need, int *writes) {
    PyObject *fast = PySequence_Fast(seq, "copies must be a sequence");
    if (!fast) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    *out = PyMem_Calloc((size_t)(len ? len : 1), sizeof(Copy));
    if (!*out) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *src, *dst;
        Copy *c = &(*out)[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOn", &src, &dst, &c->n) ||
            parse_loc(src, &c->src, narrays, need, c->n) < 0 || parse_loc(dst, &c->dst, narrays, need, c->n) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        if (c->dst.idx >= 0) writes[c->dst.idx] = 1;
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

/* Window.plan(narrays, before, after, reduce) -> Plan
 *   before, after: [((idx, a0, a1), (idx, a0, a1), nbytes), ...]
 *   reduce: None or ((idx, a0, a1) dst, [(idx, a0, a1) src, ...], count, dtype, op) */
static PyObject *Window_plan(WindowObject *w, PyObject *args) {
    int narrays;
    PyObject *before, *after, *reduce;
    if (!PyArg_ParseTuple(args, "iOOO", &narrays, &before, &after, &reduce)) return NULL;
    if (narrays < 0 || narrays > MAX_ARRAYS) {
        PyErr_SetString(PyExc_ValueError, "too many arrays");
        return NULL;
    }
    PlanObject *pl = PyObject_New(PlanObject, &PlanType);
    if (!pl) return NULL;
    pl->before = pl->after = NULL;
    pl->rsrc = NULL;
    pl->f = NULL;
    pl->nsrc = pl->nbefore = pl->nafter = 0;
    Py_INCREF(w);
    pl->window = w;
    pl->narrays = narrays;
    pl->last_half = 0;
    for (int i = 0; i < MAX_ARRAYS; i++) { pl->need[i] = -1; pl->writes[i] = 0; }
    if (parse_copies(before, &pl->before, &pl->nbefore, narrays, pl->need, pl->writes) < 0 ||
        parse_copies(after, &pl->after, &pl->nafter, narrays, pl->need, pl->writes) < 0) {
        Py_DECREF(pl);
        return NULL;
    }
    if (reduce != Py_None) {
        PyObject *dst, *srcs;
        int dtype, op;
        if (!PyArg_ParseTuple(reduce, "OOnii", &dst, &srcs, &pl->count, &dtype, &op)) { Py_DECREF(pl); return NULL; }
        binop_fn f = kernel(dtype, op);
        PyObject *fast = f ? PySequence_Fast(srcs, "reduce sources must be a sequence") : NULL;
        if (!f) PyErr_SetString(PyExc_ValueError, "no native kernel for this dtype and op");
        if (!fast) { Py_DECREF(pl); return NULL; }
        Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(fast);
        Py_ssize_t extent = pl->count * ITEMSIZE[dtype];
        pl->rsrc = PyMem_Calloc((size_t)(nsrc ? nsrc : 1), sizeof(Loc));
        int bad = nsrc < 2 || nsrc > 4096 || !pl->rsrc || parse_loc(dst, &pl->rdst, narrays, pl->need, extent) < 0;
        for (Py_ssize_t i = 0; !bad && i < nsrc; i++)
            bad = parse_loc(PySequence_Fast_GET_ITEM(fast, i), &pl->rsrc[i], narrays, pl->need, extent) < 0;
        Py_DECREF(fast);
        if (bad) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a reduction needs 2 or more sources");
            Py_DECREF(pl);
            return NULL;
        }
        if (pl->rdst.idx >= 0) pl->writes[pl->rdst.idx] = 1;
        pl->nsrc = (int)nsrc;
        pl->itemsize = ITEMSIZE[dtype];
        pl->f = f;
    }
    return (PyObject *)pl;
}

static void Plan_dealloc(PlanObject *pl) {
    PyMem_Free(pl->before);
    PyMem_Free(pl->after);
    PyMem_Free(pl->rsrc);
    Py_XDECREF(pl->window);
    PyObject_Free(pl);
}

/* Take the call's buffers (a tuple of narrays objects) as bases; -1 on error. */
static int take_buffers(PlanObject *pl, PyObject *arrays, Py_buffer *views, char **bases) {
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) != pl->narrays) {
        PyErr_Format(PyExc_TypeError, "expected a tuple of %d arrays", pl->narrays);
        return -1;
    }
    int i;
    for (i = 0; i < pl->narrays; i++) {
        views[i].obj = NULL;
        bases[i] = NULL;
        if (pl->need[i] < 0) continue;
        int flags = PyBUF_C_CONTIGUOUS | (pl->writes[i] ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, i), &views[i], flags) < 0) goto fail;
        if (views[i].len < pl->need[i]) {
            PyErr_Format(PyExc_ValueError, "array %d holds %zd bytes, the plan needs %zd", i, views[i].len,
                         pl->need[i]);
            PyBuffer_Release(&views[i]);
            goto fail;
        }
        bases[i] = views[i].buf;
    }
    return 0;
fail:
    while (--i >= 0)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    return -1;
}

static void release_buffers(PlanObject *pl, Py_buffer *views) {
    for (int i = 0; i < pl->narrays; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
}

static void do_copies(const Copy *c, int n, char *const *bases, int half) {
    for (int i = 0; i < n; i++) memmove(where(&c[i].dst, bases, half), where(&c[i].src, bases, half), (size_t)c[i].n);
}

static void do_after(PlanObject *pl, char *const *bases, int half) {
    do_copies(pl->after, pl->nafter, bases, half);
    if (pl->f) {
        char *srcs[pl->nsrc];
        for (int i = 0; i < pl->nsrc; i++) srcs[i] = where(&pl->rsrc[i], bases, half);
        reduce_all(pl->f, where(&pl->rdst, bases, half), srcs, pl->nsrc, pl->count, pl->itemsize);
    }
}
/* .run(arrays) -> bool: take the next half and epoch, the copies before, the
 * fence, and, when every peer arrived within the bounded wait, what comes
 * after; False: the caller waits for the fence (the window's epoch), then
 * calls .finish(arrays). */
static PyObject *Plan_run(PlanObject *pl, PyObject *arrays) {
    Py_buffer views[MAX_ARRAYS];
    char *bases[MAX_ARRAYS];
    if (take_buffers(pl, arrays, views, bases) < 0) return NULL;
    WindowObject *w = pl->window;
    int half = pl->last_half = (int)(w->turn & 1);
    w->turn++;
    uint64_t e = ++w->epoch;
    do_copies(pl->before, pl->nbefore, bases, half);
    arrive(w, e);
    int done = wait_peers(w, e);
    if (done) do_after(pl, bases, half);
    release_buffers(pl, views);
    return PyBool_FromLong(done);
}

/* .finish(arrays): what comes after the fence of the last run */
static PyObject *Plan_finish(PlanObject *pl, PyObject *arrays) {
    Py_buffer views[MAX_ARRAYS];
    char *bases[MAX_ARRAYS];
    if (take_buffers(pl, arrays, views, bases) < 0) return NULL;
    do_after(pl, bases, pl->last_half);
    release_buffers(pl, views);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------- module level */

/* reduce_into(out, srcs, dtype, op): out = srcs[0] op srcs[1] op ...; every
 * one a C-contiguous buffer of out's length, out writable (it may be
 * srcs[0], no other). */
static PyObject *native_reduce_into(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *out_obj, *srcs;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOii", &out_obj, &srcs, &dtype, &op)) return NULL;
    binop_fn f = kernel(dtype, op);
    if (!f) {
        PyErr_SetString(PyExc_ValueError, "no native kernel for this dtype and op");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(srcs, "srcs must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t p = PySequence_Fast_GET_SIZE(fast);
    if (p < 2 || p > 4096) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "srcs: 2 to 4096 buffers");
        return NULL;
    }
    Py_buffer out, views[p];
    char *bases[p];
    Py_ssize_t got = 0;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(fast);
        return NULL;
    }
    for (; got < p; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got], PyBUF_C_CONTIGUOUS) < 0) break;
        bases[got] = views[got].buf;
        if (views[got].len != out.len) {
            PyErr_SetString(PyExc_ValueError, "every source must have the output's length");
            got++;
            break;
        }
    }
    if (!PyErr_Occurred() && out.len % ITEMSIZE[dtype])
        PyErr_SetString(PyExc_ValueError, "the length is not a whole number of items");
    if (!PyErr_Occurred())
        reduce_all(f, out.buf, bases, (int)p, out.len / ITEMSIZE[dtype], ITEMSIZE[dtype]);
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&out);
    Py_DECREF(fast);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Window_methods[] = {
    {"fence", (PyCFunction)Window_fence, METH_NOARGS,
     "fence() -> bool: publish the next epoch, wake sleeping peers, wait (bounded) for all."},
    {"wake_sleepers", (PyCFunction)Window_wake_sleepers, METH_NOARGS, "Wake every sleeping peer."},
    {"plan", (PyCFunction)Window_plan, METH_VARARGS,
     "plan(narrays, before, after, reduce) -> Plan: copies, a fence, copies and a reduction."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Window_members[] = {
    {"epoch", T_ULONGLONG, offsetof(WindowObject, epoch), 0, "fences this rank has passed"},
    {"turn", T_ULONGLONG, offsetof(WindowObject, turn), 0, "steps taken through the halves"},
    {NULL, 0, 0, 0, NULL},
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
    .tp_members = Window_members,
};

static PyMethodDef Plan_methods[] = {
    {"run", (PyCFunction)Plan_run, METH_O,
     "run(arrays) -> bool: next half and epoch, before, fence, after; False: the fence is not complete yet."},
    {"finish", (PyCFunction)Plan_finish, METH_O,
     "finish(arrays): the copies and the reduction after the fence of the last run."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._native.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copies, a fence, copies and a reduction (see run and finish).",
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
};

static PyMethodDef module_methods[] = {
    {"reduce_into", native_reduce_into, METH_VARARGS,
     "reduce_into(out, srcs, dtype, op): out = srcs[0] op srcs[1] op ... (buffers of one length)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "collectives._native",
    "Native fast path of the shared-memory window (fences, small allreduce, reductions).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&WindowType) < 0 || PyType_Ready(&PlanType) < 0) return NULL;
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
