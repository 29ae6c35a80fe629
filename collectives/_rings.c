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
 *   send_stream(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload, sent, limit, chunk,
 *               spin_ns) -> int
 *       a message of any size, streamed: the header once 48 bytes are free
 *       (unless sent, the wire bytes of it already in the ring, says it is
 *       there: 0, or 48 up to the whole), then the rest of the payload (and
 *       its padding) as room frees up, the head
 *       published (and the receiver woken) after each chunk of at most
 *       chunk bytes. Stops when the message is in, when it has put limit
 *       bytes (0: no limit), or after spin_ns without room; returns the new
 *       head (the caller goes on from there).
 *   recv_stream(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, taken, sender_q, sleep_i, chunk,
 *               spin_ns) -> int
 *       the receiving side: once the header is there and is exactly (tag,
 *       len(dest), w0, w1, w2) (unless taken, the wire bytes of the message
 *       already taken out: 0, or 48 up to the whole, says it was), copy the
 *       rest of the payload out as it arrives, the tail
 *       published (and the sender woken through sender_q[sleep_i]) after
 *       each chunk. Stops when the message is out, or after spin_ns with
 *       nothing new; returns the new tail (unchanged: nothing there), or -2
 *       when the header there is another message's (nothing consumed).
 *   Both let go of the GIL throughout; a stop part way is not an error.
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

#include "_waiting.h"

/* Wake the rank that sleeps on this word (a futex on its low 32 bits), if it does. */
static inline void wake_word(uint64_t *sleep) {
    if (load_acquire(sleep)) {
        __atomic_store_n(sleep, 0, __ATOMIC_RELEASE);
        syscall(SYS_futex, (uint32_t *)sleep, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

/* Release the buffers taken (those with an owner; NULL: none) and return
 * result, or NULL when an error is set. */
static PyObject *finish(long long result, Py_buffer *a, Py_buffer *b, Py_buffer *c, Py_buffer *d) {
    Py_buffer *all[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++)
        if (all[i] && all[i]->obj) PyBuffer_Release(all[i]);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(result);
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
    wake_word(&words[idx[2]]);
done:
    return finish(result, &pay, &q, &ring, NULL);
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
    return finish(result, &dest, &q, &ring, NULL);
}

/* Whether a bounded wait goes on: progress restarts its clock (start). */
static inline int still_waiting(int64_t *start, unsigned *turn, int64_t spin_ns, int moved) {
    if (moved) {
        *start = now_ns();
        *turn = 0;
        return 1;
    }
    cpu_relax();
    return ++*turn % 32 || now_ns() - *start < spin_ns;
}

static PyObject *rings_send_stream(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "send_stream(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, "
                                         "payload, sent, limit, chunk, spin_ns)");
        return NULL;
    }
    Py_ssize_t idx[3];
    unsigned long long w[3];
    for (int i = 0; i < 3; i++) {
        idx[i] = PyLong_AsSsize_t(args[2 + i]);
        w[i] = PyLong_AsUnsignedLongLong(args[7 + i]);
    }
    long long head = PyLong_AsLongLong(args[5]), tag = PyLong_AsLongLong(args[6]);
    Py_ssize_t already = PyLong_AsSsize_t(args[11]), limit = PyLong_AsSsize_t(args[12]);
    Py_ssize_t chunk = PyLong_AsSsize_t(args[13]);
    long long spin_ns = PyLong_AsLongLong(args[14]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ring = {0}, q = {0}, pay = {0};
    long long result = head;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_WRITABLE) < 0 || PyObject_GetBuffer(args[1], &q, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(args[10], &pay, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (!check_ring(&ring, &q, idx, 3)) goto done;
    if (chunk < 16 || limit < 0 || already < 0 || (already > 0 && already < HEADER_BYTES) || already > wire_bytes(pay.len)) {
        PyErr_Format(PyExc_ValueError, "a chunk is 16 bytes or more (%zd), and the bytes sent 0 or from the header's "
                     "48 to the message's %zd (%zd)", chunk, wire_bytes(pay.len), already);
        goto done;
    }
    uint64_t *words = (uint64_t *)q.buf, *sleep = &words[idx[2]];
    uint64_t h = (uint64_t)head, tail = load_acquire(&words[idx[1]]);
    if (head < 0 || h < tail || h - tail > (uint64_t)ring.len) {
        PyErr_Format(PyExc_ValueError, "ring head %lld and tail %llu disagree", head, (unsigned long long)tail);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    uint64_t size = (uint64_t)ring.len, n = (uint64_t)pay.len, end = (uint64_t)wire_bytes(pay.len) - HEADER_BYTES;
    uint64_t sent = already ? (uint64_t)already - HEADER_BYTES : 0;  /* of the payload and padding */
    char *base = ring.buf;
    const char *src = pay.buf;
    int64_t start = now_ns();
    unsigned turn = 0;
    int header = already > 0, moved = 0;
    uint64_t stop = limit ? h + (uint64_t)limit : UINT64_MAX;  /* the head this call stops at */
    do {
        uint64_t free = size - (h - tail);
        if (free > stop - h) free = stop - h;
        moved = 0;
        if (!header && free >= HEADER_BYTES) {
            int64_t hd[6] = {tag, (int64_t)n, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2], 0};
            ring_write(base, (Py_ssize_t)size, (Py_ssize_t)(h & (size - 1)), (const char *)hd, HEADER_BYTES);
            h += HEADER_BYTES, free -= HEADER_BYTES, header = moved = 1;
        }
        if (header && free) {
            uint64_t k = end - sent < free ? end - sent : free;
            if (k > (uint64_t)chunk) k = (uint64_t)chunk;
            uint64_t data = sent < n ? (n - sent < k ? n - sent : k) : 0;  /* the rest is padding */
            if (data) ring_write(base, (Py_ssize_t)size, (Py_ssize_t)(h & (size - 1)), src + sent, (Py_ssize_t)data);
            h += k, sent += k, moved = moved || k;
        }
        if (moved) {
            __atomic_store_n(&words[idx[0]], h, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            wake_word(sleep);
        }
        if ((header && sent == end) || h >= stop) break;
        tail = load_acquire(&words[idx[1]]);
    } while (still_waiting(&start, &turn, spin_ns, moved));
    Py_END_ALLOW_THREADS
    result = (long long)h;
done:
    return finish(result, &pay, &q, &ring, NULL);
}

static PyObject *rings_recv_stream(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "recv_stream(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, "
                                         "taken, sender_q, sleep_i, chunk, spin_ns)");
        return NULL;
    }
    Py_ssize_t idx[2] = {PyLong_AsSsize_t(args[2]), PyLong_AsSsize_t(args[3])}, sleep_i = PyLong_AsSsize_t(args[12]);
    Py_ssize_t taken = PyLong_AsSsize_t(args[10]);
    long long tail = PyLong_AsLongLong(args[4]), tag = PyLong_AsLongLong(args[5]);
    unsigned long long w[3] = {PyLong_AsUnsignedLongLong(args[6]), PyLong_AsUnsignedLongLong(args[7]),
                               PyLong_AsUnsignedLongLong(args[8])};
    Py_ssize_t chunk = PyLong_AsSsize_t(args[13]);
    long long spin_ns = PyLong_AsLongLong(args[14]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer ring = {0}, q = {0}, dest = {0}, sq = {0};
    long long result = -1;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(args[1], &q, PyBUF_WRITABLE) < 0
            || PyObject_GetBuffer(args[9], &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
            || PyObject_GetBuffer(args[11], &sq, PyBUF_WRITABLE) < 0)
        goto done;
    if (!check_ring(&ring, &q, idx, 2) || !check_ring(&ring, &sq, &sleep_i, 1)) goto done;
    if (tail < 0 || chunk < 16 || taken < 0 || (taken > 0 && taken < HEADER_BYTES) || taken > wire_bytes(dest.len)) {
        PyErr_Format(PyExc_ValueError, "a ring's tail is never negative (%lld), a chunk 16 bytes or more (%zd), "
                     "and the bytes taken 0 or from the header's 48 to the message's %zd (%zd)",
                     tail, chunk, wire_bytes(dest.len), taken);
        goto done;
    }
    uint64_t *words = (uint64_t *)q.buf, *sleep = (uint64_t *)sq.buf + sleep_i;
    const uint64_t *head_word = &words[idx[0]];
    uint64_t size = (uint64_t)ring.len, n = (uint64_t)dest.len, t = (uint64_t)tail;
    uint64_t end = (uint64_t)wire_bytes(dest.len) - HEADER_BYTES;
    uint64_t got = taken ? (uint64_t)taken - HEADER_BYTES : 0;  /* of the payload and padding */
    int64_t want[5] = {tag, (int64_t)n, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2]};
    int header = taken > 0;
    Py_BEGIN_ALLOW_THREADS
    const char *base = ring.buf;
    char *dst = dest.buf;
    int64_t start = now_ns();
    unsigned turn = 0;
    int moved = 0;
    do {
        uint64_t avail = load_acquire(head_word) - t;
        moved = 0;
        if (!header && avail >= HEADER_BYTES) {
            int64_t hd[5];
            ring_read((char *)hd, base, (Py_ssize_t)size, (Py_ssize_t)(t & (size - 1)), (Py_ssize_t)sizeof hd);
            if (memcmp(hd, want, sizeof hd)) {
                header = -1;  /* another message: leave it */
                break;
            }
            t += HEADER_BYTES, avail -= HEADER_BYTES, header = moved = 1;
        }
        if (header && avail) {
            uint64_t k = end - got < avail ? end - got : avail;
            if (k > (uint64_t)chunk) k = (uint64_t)chunk;
            uint64_t data = got < n ? (n - got < k ? n - got : k) : 0;
            if (data) ring_read(dst + got, base, (Py_ssize_t)size, (Py_ssize_t)(t & (size - 1)), (Py_ssize_t)data);
            t += k, got += k, moved = moved || k;
        }
        if (moved) {
            __atomic_store_n(&words[idx[1]], t, __ATOMIC_RELEASE);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            wake_word(sleep);  /* the sender may wait for room */
        }
        if (header && got == end) break;
    } while (still_waiting(&start, &turn, spin_ns, moved));
    Py_END_ALLOW_THREADS
    result = header < 0 ? -2 : (long long)t;
done:
    return finish(result, &sq, &dest, &q, &ring);
}

static PyMethodDef module_methods[] = {
    {"put", (PyCFunction)(void (*)(void))rings_put, METH_FASTCALL,
     "put(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload) -> new head, or -1 (no room)."},
    {"take", (PyCFunction)(void (*)(void))rings_take, METH_FASTCALL,
     "take(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, spin_ns) -> new tail; -1 not there in time, "
     "-2 another message there."},
    {"send_stream", (PyCFunction)(void (*)(void))rings_send_stream, METH_FASTCALL,
     "send_stream(ring, q, head_i, tail_i, sleep_i, head, tag, w0, w1, w2, payload, sent, limit, chunk, spin_ns) "
     "-> new head."},
    {"recv_stream", (PyCFunction)(void (*)(void))rings_recv_stream, METH_FASTCALL,
     "recv_stream(ring, q, head_i, tail_i, tail, tag, w0, w1, w2, dest, taken, sender_q, sleep_i, chunk, spin_ns) "
     "-> new tail, or -2 (another message there)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "collectives._rings",
    "Compiled path of the shared-memory rings' messages (put, take, send_stream, recv_stream).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rings(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m) PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES);
    return m;
}
