/* The compiled path of the shared-memory rings' whole messages (optional; the
 * transport does the same in Python when it is not built).
 *
 * A ring carries messages from one sender to one receiver: a 48-byte header
 * (tag, payload bytes, the call's three signature words, padding; each an
 * 8-byte little-endian word), the payload, and padding to 16 bytes. The
 * sender owns the head counter, the receiver the tail counter; both count
 * bytes from the start, so a position in the ring is the counter modulo its
 * size (a power of two). See transports/shm/rings.py.
 *
 *   put(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload) -> int
 *       append one whole message if it fits now: header and payload, then
 *       the new head published (q[head_i]), then the receiver woken if it
 *       sleeps (q[sleep_i], a futex on its low 32 bits). Returns the new head,
 *       or -1 when the ring lacks room (nothing written).
 *   take(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, spin_ns) -> int
 *       copy the message at the ring's tail into dest and publish the new
 *       tail (q[tail_i]), if its header is exactly (tag, len(dest), w0, w1,
 *       w2). Waits for it at most spin_ns (0: looks once), the GIL let go
 *       after a short spin. Returns the new tail; -1 when nothing whole is
 *       there in time; -2 when the message there is another one (another
 *       tag, size or signature: the caller routes it, and reports a
 *       disagreement). Nothing is read past the bytes the sender published.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HEADER_BYTES 48
/* Checks made holding the GIL before a wait lets it go (a pause apart). */
#define HELD_SPIN_TURNS 64

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

static inline Py_ssize_t wire_bytes(Py_ssize_t nbytes) { return HEADER_BYTES + ((nbytes + 15) & ~(Py_ssize_t)15); }

/* n bytes of src into the ring from byte pos on, wrapping at its end. */
static void ring_write(char *ring, Py_ssize_t size, Py_ssize_t pos, const char *src, Py_ssize_t n) {
    Py_ssize_t first = size - pos < n ? size - pos : n;
    memcpy(ring + pos, src, (size_t)first);
    if (first < n) memcpy(ring, src + first, (size_t)(n - first));
}

/* n bytes of the ring from byte pos on into dst, wrapping at its end. */
static void ring_read(char *dst, const char *ring, Py_ssize_t size, Py_ssize_t pos, Py_ssize_t n) {
    Py_ssize_t first = size - pos < n ? size - pos : n;
    memcpy(dst, ring + pos, (size_t)first);
    if (first < n) memcpy(dst + first, ring, (size_t)(n - first));
}

/* The ring and the control words: a writable ring whose size is a power of
 * two, word indices inside q. Fills err and returns 0 when they are not. */
static int check_ring(Py_buffer *ring, Py_buffer *q, const Py_ssize_t *idx, int nidx) {
    if (ring->len < 64 || (ring->len & (ring->len - 1))) {
        PyErr_SetString(PyExc_ValueError, "the ring's size must be a power of two of 64 bytes or more");
        return 0;
    }
    for (int i = 0; i < nidx; i++) {
        if (idx[i] < 0 || (idx[i] + 1) * 8 > q->len) {
            PyErr_Format(PyExc_IndexError, "control word %zd outside the %zd control bytes", idx[i], q->len);
            return 0;
        }
    }
    if ((uintptr_t)q->buf & 7) {
        PyErr_SetString(PyExc_ValueError, "the control words are not 8-byte aligned");
        return 0;
    }
    return 1;
}

static PyObject *rings_put(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "put(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload)");
        return NULL;
    }
    Py_ssize_t idx[3];
    long long head, tag;
    unsigned long long w[3];
    for (int i = 0; i < 3; i++) {
        idx[i] = PyLong_AsSsize_t(args[2 + i]);
        w[i] = PyLong_AsUnsignedLongLong(args[7 + i]);
    }
    head = PyLong_AsLongLong(args[5]);
    tag = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ring = {0}, q = {0}, pay = {0};
    long long result = -1;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_WRITABLE) < 0 || PyObject_GetBuffer(args[1], &q, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(args[10], &pay, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (!check_ring(&ring, &q, idx, 3)) goto done;
    Py_ssize_t size = ring.len, n = pay.len, wire = wire_bytes(n);
    uint64_t *words = (uint64_t *)q.buf;
    uint64_t tail = load_acquire(&words[idx[1]]);
    if (head < 0 || (uint64_t)head < tail || (uint64_t)head - tail > (uint64_t)size) {
        PyErr_Format(PyExc_ValueError, "ring head %lld and tail %llu disagree", head, (unsigned long long)tail);
        goto done;
    }
    if ((uint64_t)size - ((uint64_t)head - tail) < (uint64_t)wire) goto done;  /* no room: -1 */
    int64_t header[6] = {tag, (int64_t)n, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2], 0};
    Py_ssize_t pos = (Py_ssize_t)((uint64_t)head & (uint64_t)(size - 1));
    ring_write(ring.buf, size, pos, (const char *)header, HEADER_BYTES);
    ring_write(ring.buf, size, (pos + HEADER_BYTES) & (size - 1), pay.buf, n);
    result = head + wire;
    __atomic_store_n(&words[idx[0]], (uint64_t)result, __ATOMIC_RELEASE);
    /* the store before the load of the sleep word: a receiver that marked
     * itself asleep after looking at the head is never missed */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t *sleep = &words[idx[2]];
    if (load_acquire(sleep)) {
        __atomic_store_n(sleep, 0, __ATOMIC_RELEASE);
        syscall(SYS_futex, (uint32_t *)sleep, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
done:
    if (pay.obj) PyBuffer_Release(&pay);
    if (q.obj) PyBuffer_Release(&q);
    if (ring.obj) PyBuffer_Release(&ring);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(result);
}

/* What the message at the tail is for a receive of header want:
 * 1 it (whole), 0 not all there yet, -2 another message. */
static int look(const char *ring, Py_ssize_t size, const uint64_t *head_word, uint64_t tail,
                const int64_t *want, Py_ssize_t wire) {
    uint64_t avail = load_acquire(head_word) - tail;
    if (avail < HEADER_BYTES) return 0;
    int64_t got[5];
    ring_read((char *)got, ring, size, (Py_ssize_t)(tail & (uint64_t)(size - 1)), (Py_ssize_t)sizeof got);
    if (memcmp(got, want, sizeof got)) return -2;
    return avail >= (uint64_t)wire ? 1 : 0;
}

static PyObject *rings_take(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "take(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, spin_ns)");
        return NULL;
    }
    Py_ssize_t idx[2] = {PyLong_AsSsize_t(args[2]), PyLong_AsSsize_t(args[3])};
    long long tail = PyLong_AsLongLong(args[4]), tag = PyLong_AsLongLong(args[5]);
    unsigned long long w[3] = {PyLong_AsUnsignedLongLong(args[6]), PyLong_AsUnsignedLongLong(args[7]),
                               PyLong_AsUnsignedLongLong(args[8])};
    long long spin_ns = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ring = {0}, q = {0}, dest = {0};
    long long result = -1;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(args[1], &q, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(args[9], &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (!check_ring(&ring, &q, idx, 2)) goto done;
    if (tail < 0) {
        PyErr_SetString(PyExc_ValueError, "a ring's tail is never negative");
        goto done;
    }
    Py_ssize_t size = ring.len, n = dest.len, wire = wire_bytes(n);
    if (wire > size) goto done;  /* never whole in the ring: -1 */
    uint64_t *words = (uint64_t *)q.buf;
    const uint64_t *head_word = &words[idx[0]];
    int64_t want[5] = {tag, (int64_t)n, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2]};
    int found = look(ring.buf, size, head_word, (uint64_t)tail, want, wire);
    for (int i = 0; !found && spin_ns > 0 && i < HELD_SPIN_TURNS; i++) {
        cpu_relax();
        found = look(ring.buf, size, head_word, (uint64_t)tail, want, wire);
    }
    if (!found && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        int64_t start = now_ns();
        for (unsigned turn = 1; !(found = look(ring.buf, size, head_word, (uint64_t)tail, want, wire)); turn++) {
            cpu_relax();
            if (turn % 32 == 0 && now_ns() - start >= spin_ns) break;
        }
        Py_END_ALLOW_THREADS
    }
    if (found == -2) {
        result = -2;
    } else if (found == 1) {
        Py_ssize_t pos = (Py_ssize_t)(((uint64_t)tail + HEADER_BYTES) & (uint64_t)(size - 1));
        ring_read(dest.buf, ring.buf, size, pos, n);
        result = tail + wire;
        __atomic_store_n(&words[idx[1]], (uint64_t)result, __ATOMIC_RELEASE);
    }
done:
    if (dest.obj) PyBuffer_Release(&dest);
    if (q.obj) PyBuffer_Release(&q);
    if (ring.obj) PyBuffer_Release(&ring);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(result);
}

static PyMethodDef module_methods[] = {
    {"put", (PyCFunction)(void (*)(void))rings_put, METH_FASTCALL,
     "put(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload) -> new head, or -1 (no room)."},
    {"take", (PyCFunction)(void (*)(void))rings_take, METH_FASTCALL,
     "take(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, spin_ns) -> new tail; -1 not there in time, "
     "-2 another message there."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "collectives._rings",
    "Compiled path of the shared-memory rings' whole messages (put, take).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rings(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m) PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES);
    return m;
}
