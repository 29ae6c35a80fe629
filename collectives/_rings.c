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
 *
 * Messages (below): a communicator's blocking send and receive of a whole
 * message, run from C with the checks of both paths' common case.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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
#include "_numpy_head.h"

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

/* Append one whole message (the header's first five words hdr, then n
 * payload bytes) at head if it fits now: the head published, then the
 * receiver woken if it sleeps. Returns the new head, -1 when the ring lacks
 * room, -3 when head and the published tail disagree (nothing written). */
static long long put_message(char *ring, uint64_t size, uint64_t *head_word, const uint64_t *tail_word,
                             uint64_t *sleep_word, uint64_t head, const int64_t hdr[5], const char *src, uint64_t n) {
    uint64_t tail = load_acquire(tail_word), wire = (uint64_t)wire_bytes((Py_ssize_t)n);
    if (head < tail || head - tail > size) return -3;
    if (size - (head - tail) < wire) return -1;
    int64_t header[6] = {hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], 0};
    Py_ssize_t pos = (Py_ssize_t)(head & (size - 1));
    ring_write(ring, (Py_ssize_t)size, pos, (const char *)header, HEADER_BYTES);
    if (n) ring_write(ring, (Py_ssize_t)size, (pos + HEADER_BYTES) & (Py_ssize_t)(size - 1), src, (Py_ssize_t)n);
    __atomic_store_n(head_word, head + wire, __ATOMIC_RELEASE);
    /* the store before the load of the sleep word: a receiver that marked
     * itself asleep after looking at the head is never missed */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    wake_word(sleep_word);
    return (long long)(head + wire);
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
    uint64_t *words = (uint64_t *)q.buf;
    int64_t hdr[5] = {tag, (int64_t)pay.len, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2]};
    result = head < 0 ? -3 : put_message(ring.buf, (uint64_t)ring.len, &words[idx[0]], &words[idx[1]], &words[idx[2]],
                                         (uint64_t)head, hdr, pay.buf, (uint64_t)pay.len);
    if (result == -3)
        PyErr_Format(PyExc_ValueError, "ring head %lld and tail %llu disagree", head,
                     (unsigned long long)load_acquire(&words[idx[1]]));
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

/* Copy the message at tail into dst (n bytes) if its header is exactly want,
 * and publish the new tail: returns it. Waits for it at most spin_ns (0:
 * looks once), the GIL let go after HELD_SPIN_TURNS checks (call with it
 * held). -1: nothing whole there in time; -2: another message there
 * (nothing consumed). */
static long long take_message(const char *ring, uint64_t size, const uint64_t *head_word, uint64_t *tail_word,
                              uint64_t tail, const int64_t want[5], char *dst, uint64_t n, long long spin_ns) {
    Py_ssize_t wire = wire_bytes((Py_ssize_t)n);
    if ((uint64_t)wire > size) return -1;  /* never whole in the ring */
    int found = look(ring, (Py_ssize_t)size, head_word, tail, want, wire);
    for (int i = 0; !found && spin_ns > 0 && i < HELD_SPIN_TURNS; i++) {
        cpu_relax();
        found = look(ring, (Py_ssize_t)size, head_word, tail, want, wire);
    }
    if (!found && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        int64_t start = now_ns();
        for (unsigned turn = 1; !(found = look(ring, (Py_ssize_t)size, head_word, tail, want, wire)); turn++) {
            cpu_relax();
            if (turn % 32 == 0 && now_ns() - start >= spin_ns) break;
        }
        Py_END_ALLOW_THREADS
    }
    if (found != 1) return found == -2 ? -2 : -1;
    if (n) ring_read(dst, ring, (Py_ssize_t)size, (Py_ssize_t)((tail + HEADER_BYTES) & (size - 1)), (Py_ssize_t)n);
    __atomic_store_n(tail_word, tail + (uint64_t)wire, __ATOMIC_RELEASE);
    return (long long)(tail + (uint64_t)wire);
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
    uint64_t *words = (uint64_t *)q.buf;
    int64_t want[5] = {tag, (int64_t)dest.len, (int64_t)w[0], (int64_t)w[1], (int64_t)w[2]};
    result = take_message(ring.buf, (uint64_t)ring.len, &words[idx[0]], &words[idx[1]], (uint64_t)tail, want,
                          dest.buf, (uint64_t)dest.len, spin_ns);
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

/* ------------------------------------------------ Messages: send and receive */

/* Messages(transport, gate, lock, ndarray, dtypes, itemsizes, ring_bytes, whole_max, spin_ns, tx, rx, state):
 * a communicator's blocking send and receive of one whole message, run from
 * C before any Python of the call (the way _compiled's FastCalls runs
 * prepared collectives). It makes the checks of the Python path's common
 * case and the transport's, and takes the Python path (returns False,
 * nothing done) wherever one of them does not hold:
 *   - gate.open is not 0 (the communicator is neither closed nor aborted);
 *   - the buffer is an exact numpy array of one dimension, C-contiguous, of
 *     one of dtypes (by identity; writable to receive), of at most
 *     whole_max bytes (larger ones stream, from Python);
 *   - the rank an int in [0, ranks), the tag an int in [0, 2**27);
 *   - the transport's lock is free (taken without waiting) and its
 *     _closed is False;
 *   - a send: nothing queued for that peer, and room for the message now;
 *   - a receive: its message is next for it (none half copied out, no early
 *     message or earlier receive of its tag) and arrives whole within
 *     spin_ns, with exactly its tag and size and the point-to-point
 *     signature (0, 0, 0). Another message there is left to the Python
 *     path, which routes it and reports any disagreement; one that did not
 *     come in time is waited for there (a second spin, then the general
 *     wait).
 * tx[r] and rx[r]: (ring, head word, tail word, sleep word) addresses of
 * the ring to and from rank r, the sleep word being the receiver's (tx) or
 * the sender's (rx). state: the transport's lists (_tx_head, _tx_queue,
 * _rx_tail, _rx_cur, _posted, _unexpected), which both paths keep; a
 * message moved here is added to transport._moved as the Python path does.
 *   .send(buf, dst, tag) -> bool    .recv(buf, src, tag) -> bool
 *   .take(buf, src, tag) -> bool: recv without the spin (a nonblocking
 *       receive whose message is already there); send never waits, so
 *       a nonblocking send uses it as it is
 *   .head(array) -> (data, nd, size, dtype, flags), to check against numpy
 *   .sends, .recvs: the calls done here. */

#define P2P_TAGS (1LL << 27)
#define MAX_DTYPES 32

typedef struct {
    char *ring;
    uint64_t *head, *tail, *sleep;
} RingEnds;

typedef struct {
    PyObject_HEAD
    PyObject *transport, *gate, *acquire, *release, *dtypes;
    PyTypeObject *ndarray;
    PyObject *tx_head, *tx_queue, *rx_tail, *rx_cur, *posted, *unexpected;
    Py_ssize_t itemsize[MAX_DTYPES];
    int ndtypes, ranks;
    uint64_t ring_bytes;
    Py_ssize_t whole_max;
    long long spin_ns;
    RingEnds *tx, *rx;
    unsigned long long sends, recvs;
} MessagesObject;

static PyObject *str_open, *str_closed, *str_moved;

static void Messages_dealloc(MessagesObject *m) {
    Py_CLEAR(m->transport);
    Py_CLEAR(m->gate);
    Py_CLEAR(m->acquire);
    Py_CLEAR(m->release);
    Py_CLEAR(m->dtypes);
    Py_CLEAR(m->ndarray);
    Py_CLEAR(m->tx_head);
    Py_CLEAR(m->tx_queue);
    Py_CLEAR(m->rx_tail);
    Py_CLEAR(m->rx_cur);
    Py_CLEAR(m->posted);
    Py_CLEAR(m->unexpected);
    PyMem_Free(m->tx);
    PyMem_Free(m->rx);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* ends[r] from a tuple of (ring, head, tail, sleep) address tuples; 0 on error */
static int read_ends(PyObject *tuple, int ranks, RingEnds **out) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != ranks) {
        PyErr_SetString(PyExc_ValueError, "one (ring, head, tail, sleep) tuple of addresses per rank");
        return 0;
    }
    RingEnds *ends = PyMem_Calloc((size_t)ranks, sizeof *ends);
    if (!ends) { PyErr_NoMemory(); return 0; }
    for (int r = 0; r < ranks; r++) {
        PyObject *t = PyTuple_GET_ITEM(tuple, r);
        uintptr_t a[4];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_ValueError, "one (ring, head, tail, sleep) tuple of addresses per rank");
            PyMem_Free(ends);
            return 0;
        }
        for (int i = 0; i < 4; i++) a[i] = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
        if (PyErr_Occurred() || !a[0] || (a[1] & 7) || (a[2] & 7) || (a[3] & 7)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a ring and 8-byte aligned words");
            PyMem_Free(ends);
            return 0;
        }
        ends[r] = (RingEnds){(char *)a[0], (uint64_t *)a[1], (uint64_t *)a[2], (uint64_t *)a[3]};
    }
    *out = ends;
    return 1;
}

static int Messages_init(MessagesObject *m, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *transport, *gate, *lock, *ndarray, *dtypes, *itemsizes, *tx, *rx, *state;
    unsigned long long ring_bytes;
    Py_ssize_t whole_max;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "OOOO!O!O!KnLO!O!O!", &transport, &gate, &lock, &PyType_Type, &ndarray,
                          &PyTuple_Type, &dtypes, &PyTuple_Type, &itemsizes, &ring_bytes, &whole_max, &spin_ns,
                          &PyTuple_Type, &tx, &PyTuple_Type, &rx, &PyTuple_Type, &state))
        return -1;
    Py_ssize_t nd = PyTuple_GET_SIZE(dtypes);
    if (nd > MAX_DTYPES || PyTuple_GET_SIZE(itemsizes) != nd || PyTuple_GET_SIZE(state) != 6 || ring_bytes < 64 ||
            (ring_bytes & (ring_bytes - 1)) || whole_max < 0 || (uint64_t)wire_bytes(whole_max) > ring_bytes) {
        PyErr_SetString(PyExc_ValueError, "Messages: dtypes and their item sizes, six lists of state, a ring of a "
                        "power of two bytes and whole messages that fit it");
        return -1;
    }
    int ranks = (int)PyTuple_GET_SIZE(tx);
    PyObject *lists[6];
    for (int i = 0; i < 6; i++) {
        lists[i] = PyTuple_GET_ITEM(state, i);
        if (!PyList_Check(lists[i]) || PyList_GET_SIZE(lists[i]) != ranks) {
            PyErr_SetString(PyExc_ValueError, "Messages: each list of state has one entry per rank");
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        m->itemsize[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(itemsizes, i));
        if (m->itemsize[i] <= 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an item size is positive");
            return -1;
        }
    }
    RingEnds *txe = NULL, *rxe = NULL;
    if (!read_ends(tx, ranks, &txe)) return -1;
    if (!read_ends(rx, ranks, &rxe)) { PyMem_Free(txe); return -1; }
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire"), *release = PyObject_GetAttrString(lock, "release");
    if (!acquire || !release) {
        Py_XDECREF(acquire);
        Py_XDECREF(release);
        PyMem_Free(txe);
        PyMem_Free(rxe);
        return -1;
    }
    PyMem_Free(m->tx);
    PyMem_Free(m->rx);
    m->tx = txe, m->rx = rxe;
    Py_XSETREF(m->acquire, acquire);
    Py_XSETREF(m->release, release);
    Py_XSETREF(m->transport, Py_NewRef(transport));
    Py_XSETREF(m->gate, Py_NewRef(gate));
    Py_XSETREF(m->ndarray, (PyTypeObject *)Py_NewRef(ndarray));
    Py_XSETREF(m->dtypes, Py_NewRef(dtypes));
    PyObject **held[6] = {&m->tx_head, &m->tx_queue, &m->rx_tail, &m->rx_cur, &m->posted, &m->unexpected};
    for (int i = 0; i < 6; i++) Py_XSETREF(*held[i], Py_NewRef(lists[i]));
    m->ndtypes = (int)nd, m->ranks = ranks;
    m->ring_bytes = ring_bytes, m->whole_max = whole_max, m->spin_ns = spin_ns;
    m->sends = m->recvs = 0;
    return 0;
}

/* The bytes of a message buffer in the common case: an exact numpy array of
 * one dimension, C-contiguous, writable when asked, of a listed dtype. 1
 * with data and n set; 0: the Python path checks it. */
static int message_bytes(MessagesObject *m, PyObject *o, int writable, char **data, Py_ssize_t *n) {
    if (Py_TYPE(o) != m->ndarray) return 0;
    const ArrayHead *a = (const ArrayHead *)o;
    if (a->nd != 1 || !(a->flags & ARR_C_CONTIGUOUS) || (writable && !(a->flags & ARR_WRITEABLE))) return 0;
    for (int i = 0; i < m->ndtypes; i++) {
        if (PyTuple_GET_ITEM(m->dtypes, i) == a->descr) {
            *data = a->data;
            *n = a->dimensions[0] * m->itemsize[i];
            return 1;
        }
    }
    return 0;
}

/* An exact int in [0, limit): 1 and its value; 0 otherwise (no error set). */
static int index_in(PyObject *o, long long limit, long long *out) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v >= limit) return 0;
    *out = v;
    return 1;
}

/* The checks before the transport's lock: 1 the common case (buffer, rank
 * and tag read), 0 the Python path's, -1 an error. */
static int call_ready(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs, int writable, char **data,
                      Py_ssize_t *n, long long *peer, long long *tag) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(buf, dst, tag) / recv(buf, src, tag)");
        return -1;
    }
    PyObject *open = PyObject_GetAttr(m->gate, str_open);
    if (!open) return -1;
    int is_open = PyObject_IsTrue(open);
    Py_DECREF(open);
    if (is_open <= 0) return is_open;
    return message_bytes(m, args[0], writable, data, n) && *n <= m->whole_max && index_in(args[1], m->ranks, peer)
        && index_in(args[2], P2P_TAGS, tag);
}

/* Take the transport's lock without waiting: 1 taken, 0 held elsewhere, -1 error. */
static int lock_now(MessagesObject *m) {
    PyObject *no[1] = {Py_False};
    PyObject *got = PyObject_Vectorcall(m->acquire, no, 1, NULL);
    if (!got) return -1;
    int taken = got == Py_True;
    Py_DECREF(got);
    return taken;
}

/* Let go of the lock (an error already set is kept) and return result (NULL: that error). */
static PyObject *unlock(MessagesObject *m, PyObject *result) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(m->release);
    if (type) {
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (!r) return NULL;
    Py_DECREF(r);
    return Py_NewRef(result);
}

/* 1 when the transport is open (_closed is False), 0 when not, -1 error */
static int transport_open(MessagesObject *m) {
    PyObject *closed = PyObject_GetAttr(m->transport, str_closed);
    if (!closed) return -1;
    int open = closed == Py_False;
    Py_DECREF(closed);
    return open;
}

/* The start of a send or receive: the checks, the transport's lock, an open
 * transport. 1: go on, the lock held; 0: the Python path; -1: an error
 * (nothing held either way). */
static int begin_message(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs, int writable, char **data,
                         Py_ssize_t *n, long long *peer, long long *tag) {
    int ready = call_ready(m, args, nargs, writable, data, n, peer, tag);
    if (ready <= 0) return ready;
    int locked = lock_now(m);
    if (locked <= 0) return locked;
    int open = transport_open(m);
    if (open > 0) return 1;
    PyObject *back = unlock(m, open < 0 ? NULL : Py_False);
    Py_XDECREF(back);
    return back ? 0 : -1;
}

/* list[i] = value, and transport._moved += moved: the counters both paths keep */
static int count_moved(MessagesObject *m, PyObject *list, long long i, long long value, long long moved) {
    PyObject *v = PyLong_FromLongLong(value);
    if (!v || PyList_SetItem(list, (Py_ssize_t)i, v) < 0) return -1;
    PyObject *had = PyObject_GetAttr(m->transport, str_moved);
    if (!had) return -1;
    PyObject *k = PyLong_FromLongLong(moved), *now = k ? PyNumber_Add(had, k) : NULL;
    Py_DECREF(had);
    Py_XDECREF(k);
    if (!now) return -1;
    int rc = PyObject_SetAttr(m->transport, str_moved, now);
    Py_DECREF(now);
    return rc;
}

/* A counter of the lists of state, read as a non-negative integer; -1 with an error set */
static long long counter_at(PyObject *list, long long i) {
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, (Py_ssize_t)i));
    if (v < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a ring counter is never negative");
    return v;
}

static PyObject *Messages_send(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs) {
    char *data;
    Py_ssize_t n;
    long long dst, tag;
    int go = begin_message(m, args, nargs, 0, &data, &n, &dst, &tag);
    if (go <= 0) return go < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *result = Py_False;
    Py_ssize_t queued = PyObject_Length(PyList_GET_ITEM(m->tx_queue, (Py_ssize_t)dst));
    long long head = queued == 0 ? counter_at(m->tx_head, dst) : -1;
    if (head >= 0) {
        RingEnds *e = &m->tx[dst];
        int64_t hdr[5] = {tag * 2, (int64_t)n, 0, 0, 0};
        long long next = put_message(e->ring, m->ring_bytes, e->head, e->tail, e->sleep, (uint64_t)head, hdr, data,
                                     (uint64_t)n);
        if (next == -3)
            PyErr_Format(PyExc_ValueError, "ring head %lld to rank %lld and its tail disagree", head, dst);
        else if (next >= 0 && count_moved(m, m->tx_head, dst, next, next - head) == 0) {
            m->sends++;
            result = Py_True;
        }
    }
    return unlock(m, PyErr_Occurred() ? NULL : result);
}

/* Whether a dict of the lists of state (by tag, of deques) holds a non-empty
 * entry for tag: 1 (or anything but a dict there: the Python path decides), 0, -1 error */
static int holds(PyObject *list, long long peer, long long tag) {
    PyObject *by_tag = PyList_GET_ITEM(list, (Py_ssize_t)peer);
    if (!PyDict_Check(by_tag)) return 1;
    if (PyDict_GET_SIZE(by_tag) == 0) return 0;
    PyObject *key = PyLong_FromLongLong(tag);
    if (!key) return -1;
    PyObject *entry = PyDict_GetItemWithError(by_tag, key);
    Py_DECREF(key);
    if (!entry) return PyErr_Occurred() ? -1 : 0;
    return PyObject_IsTrue(entry);
}

/* recv (spin_ns: the object's) and take (0: one look) */
static PyObject *messages_receive(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs, long long spin_ns) {
    char *data;
    Py_ssize_t n;
    long long src, tag;
    int go = begin_message(m, args, nargs, 1, &data, &n, &src, &tag);
    if (go <= 0) return go < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *result = Py_False;
    long long wire_tag = tag * 2;
    int ahead = PyList_GET_ITEM(m->rx_cur, (Py_ssize_t)src) != Py_None;
    if (!ahead) ahead = holds(m->unexpected, src, wire_tag);
    if (!ahead) ahead = holds(m->posted, src, wire_tag);
    long long tail = ahead ? -1 : counter_at(m->rx_tail, src);
    if (tail >= 0) {
        RingEnds *e = &m->rx[src];
        int64_t want[5] = {wire_tag, (int64_t)n, 0, 0, 0};
        Py_INCREF(args[0]);  /* the array stays as it is while a wait lets go of the GIL */
        long long next = take_message(e->ring, m->ring_bytes, e->head, e->tail, (uint64_t)tail, want, data,
                                      (uint64_t)n, spin_ns);
        Py_DECREF(args[0]);
        if (next >= 0) {
            wake_word(e->sleep);  /* the sender may wait for room */
            if (count_moved(m, m->rx_tail, src, next, next - tail) == 0) {
                m->recvs++;
                result = Py_True;
            }
        }
    }
    return unlock(m, PyErr_Occurred() ? NULL : result);
}

static PyObject *Messages_recv(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs) {
    return messages_receive(m, args, nargs, m->spin_ns);
}

static PyObject *Messages_take(MessagesObject *m, PyObject *const *args, Py_ssize_t nargs) {
    return messages_receive(m, args, nargs, 0);
}

static PyObject *Messages_head(MessagesObject *m, PyObject *o) {
    if (Py_TYPE(o) != m->ndarray || ((ArrayHead *)o)->nd != 1) {
        PyErr_SetString(PyExc_TypeError, "head(array): a numpy array of one dimension");
        return NULL;
    }
    return array_head_tuple((ArrayHead *)o);
}

static PyMethodDef Messages_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Messages_send, METH_FASTCALL,
     "send(buf, dst, tag) -> bool: True when the message went into the ring here; False: nothing done."},
    {"recv", (PyCFunction)(void (*)(void))Messages_recv, METH_FASTCALL,
     "recv(buf, src, tag) -> bool: True when the message was taken into buf here; False: nothing done."},
    {"take", (PyCFunction)(void (*)(void))Messages_take, METH_FASTCALL,
     "take(buf, src, tag) -> bool: recv that only looks (for irecv: True when the message was there)."},
    {"head", (PyCFunction)Messages_head, METH_O,
     "head(array) -> (data, nd, size, dtype, flags) as send and recv read them (flags: C-contiguous 1, "
     "writable 0x400)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Messages_members[] = {
    {"sends", T_ULONGLONG, offsetof(MessagesObject, sends), READONLY, "sends done here"},
    {"recvs", T_ULONGLONG, offsetof(MessagesObject, recvs), READONLY, "receives done here"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MessagesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._rings.Messages",
    .tp_basicsize = sizeof(MessagesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Messages(transport, gate, lock, ndarray, dtypes, itemsizes, ring_bytes, whole_max, spin_ns, tx, rx, "
              "state): a communicator's send and receive of whole messages, run from C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Messages_init,
    .tp_dealloc = (destructor)Messages_dealloc,
    .tp_methods = Messages_methods,
    .tp_members = Messages_members,
};

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
    "Compiled path of the shared-memory rings' messages (put, take, send_stream, recv_stream, Messages).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rings(void) {
    str_open = PyUnicode_InternFromString("open");
    str_closed = PyUnicode_InternFromString("_closed");
    str_moved = PyUnicode_InternFromString("_moved");
    if (!str_open || !str_closed || !str_moved || PyType_Ready(&MessagesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0 ||
            PyModule_AddObject(m, "Messages", Py_NewRef((PyObject *)&MessagesType)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
