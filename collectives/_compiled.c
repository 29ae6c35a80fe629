/* The compiled fast path of the shared-memory window (optional; the library
 * runs without it, in Python, when it is not built).
 *
 * Every rank keeps counters in its control page, each written by its owner
 * only: the fence epoch, and the last step through the window's halves whose
 * data it has posted and the last it is done reading. A rank that blocks
 * sleeps on a futex word of its own, which peers ring after they change a
 * counter. Waits here are bounded (spin, then sched_yield); when they run
 * out, the caller blocks in Python, where timeouts and lost peers are
 * handled, and resumes.
 *
 *   Window(epochs, posts, dones, sleeps, rank, spin_ns, yield_ns, inbox, checks=True)
 *       addresses of every rank's counters and sleep word, in shared memory,
 *       and of this rank's abort inbox (peers that abort write rank + 1);
 *       checks=False leaves the signature records alone (for measuring).
 *   Window.epoch, Window.turn
 *       fences passed, and steps taken through the halves.
 *   Window.fence() -> bool
 *       publish the next epoch, wait (bounded) for every peer to reach it.
 *   Window.step() -> None or (rank, kind, value)
 *       the next step of an algorithm that writes its half and fences: the
 *       half is free once every peer is done with the step before the last.
 *   Window.arrive(seq) -> None or (rank, kind, value)
 *       the first synchronisation of call ``seq`` on a path that fences:
 *       post the current step, wait (bounded) for every rank's post of it,
 *       verify every rank's signature record.
 *   Window.verify(seq) -> int
 *       -1 when every rank's signature record of call ``seq`` equals this
 *       rank's (or the rank has passed the call), else the first that does
 *       not (or that refused).
 *   Window.compile(narrays, before, after, reduce, sources[, piece, regions, then]) -> Call
 *       a collective's small case as data: copies before posting, then,
 *       once every rank posted (and every signature record agrees), copies
 *       and one reduction, between the call's arrays and the window's
 *       halves (reading only the sources' regions). With piece bytes and
 *       every rank's region, in pieces: a reader copies or reduces each
 *       piece as soon as its writer has filled it (see progress_of). With
 *       then = (before, after), a second step through the other half:
 *       its copies before its post, and after every rank's post (a call
 *       of two steps runs whole); then = (before, after, 0): it does not
 *       wait for the others' posts of the second step (nothing after).
 *       With direct = (pids, metas, readers, shared), a direct call: every
 *       rank publishes its arrays shared (address and bytes, in its
 *       metadata block metas[rank]); after copies from peers' places
 *       (PEER_ARRAY) read those arrays by cross-memory attach, each read
 *       inside the array as published; the run ends once every rank in
 *       readers is done with the step (see direct_after). With direct =
 *       (pids, metas, readers, shared, copies_in), a direct call with a
 *       fallback on the window, source by source: each rank also publishes
 *       whether its arrays lie in huge pages (in_huge_pages); one whose do
 *       not makes copies_in (into its region) before its post instead of
 *       waiting for its readers, and a reader takes what it would read from
 *       such a rank from the window instead: from each after copy's fourth
 *       place, (src, dst, nbytes, window place), which every after copy
 *       that reads a peer then has. With direct = (..., copies_in, pools,
 *       pooler, pool_from[, pool_first]) (copies_in may be None: no fallback), an array
 *       outside huge pages that lies in its rank's shared pool (pools:
 *       every rank's (address, bytes) here; wholly, or the part
 *       pooler(address, nbytes) names, asked from pool_from bytes on) is
 *       neither copied in nor read across: its readers copy that part out
 *       of their mapping of the pool. With pool_first (bytes) too, an
 *       array of that size or more is read from its pool even where it
 *       lies in huge pages (the pool may adopt it: a copy runs faster
 *       than a cross-memory read of huge pages).
 *   Call.run(arrays, seq, sig) -> None or (rank, kind, value); Call.resume(arrays)
 *       the next step of call ``seq`` whose signature is ``sig`` (three
 *       words, without the sequence number), as far as it goes; what to wait
 *       for before resuming. A kind of K_VERDICT says the signatures
 *       disagree (at that rank), K_ABORTED that that rank aborted: the run
 *       is over then, nothing read from any peer; K_OUTSIDE that a direct
 *       read would leave rank's published array (value: its bytes),
 *       K_WRITE_OUTSIDE that a direct write would, K_LOST that the kernel
 *       refused either (value: the errno). A direct call's after copy may
 *       also write a peer's published array (its destination a peer's
 *       place): inside the array as published, out of the pool or across
 *       as a read, WRITE_BYTES at a time with a look at the abort inbox
 *       before each.
 *
 * Signature records: beside its post counter (the same cache line, so a
 * peer reading the post reads them for free) every rank keeps the
 * signatures of its last two calls, in slots by the call number's parity:
 * three words each, the first holding the sequence number (see
 * collectives.signature).
 *   reduce_into(out, srcs, dtype, op[, copies]): out = srcs[0] op srcs[1]
 *       op ... (buffers of one length; out may be srcs[0]), and the result
 *       also into each of copies, with stores that bypass the cache.
 *   copy(dst, src): dst = src (buffers of one length), as every copy here:
 *       see copy_bytes.
 *   vm_move(pid, address, buffer, write): the buffer read from (or written
 *       to) address in another process, by cross-memory attach; 0 or errno.
 *
 * Reductions give the bits numpy's ufuncs give, applied in rank order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <emmintrin.h>
#endif

enum { DT_F32, DT_F64, DT_I8, DT_I16, DT_I32, DT_I64, DT_U8, DT_U16, DT_U32, DT_U64, DT_COUNT };
enum { OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR, OP_COUNT };

typedef void (*binop_fn)(void *out, const void *a, const void *b, Py_ssize_t n);

/* ------------------------------------------------------------- kernels */
/* Integer sums and products wrap as numpy's do (unsigned arithmetic, no UB).
 * min and max follow numpy's minimum and maximum: a NaN in either operand
 * gives NaN, and of two equal values the second is taken. */

/* The kernels are built twice where the compiler can (GCC on x86-64): for
 * AVX2 and for the baseline, the loader picking one for the processor it
 * runs on. Each element sees the same operation either way, so the bits
 * are the same. 2 ranks, shared window (collectives bench reduce -n 2, the
 * two builds in turns): reduce of 64 KiB 1.77-2.00 -> 1.50-1.62 us, of
 * 1 MiB 21.9-24.5 -> 18.7-20.8 us; reduce_scatter of 256 KiB 5.3-5.6 ->
 * 4.9-5.1 us. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef KERNEL
#define KERNEL
#endif

#define INT_KERNELS(NAME, T, UT)                                                       \
    KERNEL static void sum_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (T)((UT)x[i] + (UT)y[i]);          \
    }                                                                                  \
    KERNEL static void prod_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (T)((UT)x[i] * (UT)y[i]);          \
    }                                                                                  \
    KERNEL static void min_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] < y[i] ? x[i] : y[i];         \
    }                                                                                  \
    KERNEL static void max_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] > y[i] ? x[i] : y[i];         \
    }                                                                                  \
    KERNEL static void band_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] & y[i];                       \
    }                                                                                  \
    KERNEL static void bor_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] | y[i];                       \
    }                                                                                  \
    KERNEL static void bxor_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] ^ y[i];                       \
    }

#define FLOAT_KERNELS(NAME, T)                                                         \
    KERNEL static void sum_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] + y[i];                       \
    }                                                                                  \
    KERNEL static void prod_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {     \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] * y[i];                       \
    }                                                                                  \
    KERNEL static void min_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
        T *out = o; const T *x = a, *y = b;                                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T u = x[i], v = y[i];                                                      \
            out[i] = (u != u) ? u : (u < v ? u : v);                                   \
        }                                                                              \
    }                                                                                  \
    KERNEL static void max_##NAME(void *o, const void *a, const void *b, Py_ssize_t n) {      \
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

/* dst = src, with stores that bypass the cache where the processor has them
 * (x86-64): for copies into memory this process will not read soon (another
 * rank's buffer), they skip reading each destination line first and leave
 * the cache to the data still in use. Call stream_done() before publishing. */
static void stream_bytes(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;  /* whole cache lines: partial ones are slow */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
#endif
    memcpy(dst, src, n);
}

static void stream_done(void) {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* out = srcs[0] op srcs[1] op ... op srcs[p-1], in that order (p >= 2), and
 * the result also into each of ``ncopies`` buffers (stream_bytes). out may
 * be one of the sources (in place; a later one is kept chunk by chunk
 * before the first operation overwrites it).
 * Chunk by chunk, so that the partial result stays in the L1 cache while the
 * sources stream past once: p reads and one write of memory per element
 * instead of the 2(p-1) reads and p-1 writes of whole-vector passes, and the
 * copies read the result from the cache. Each element sees the same
 * operations in the same order, so the bits are those of the passes (and of
 * numpy's ufuncs). */
#define CHUNK_BYTES 8192
static void reduce_all(binop_fn f, char *out, char *const *srcs, int p, Py_ssize_t count, int itemsize,
                       char *const *copies, int ncopies) {
    Py_ssize_t step = CHUNK_BYTES / itemsize;
    /* chunks end on the first copy's cache lines: a line written half by
     * one chunk's streaming stores and half by the next's would be read in */
    size_t skew = ncopies ? (size_t)((uintptr_t)copies[0] & 63) : 0;
    Py_ssize_t len = skew % (size_t)itemsize ? step : (Py_ssize_t)((CHUNK_BYTES - skew) / (size_t)itemsize);
    int later = 0;  /* a source after the first two that is out itself */
    for (int r = 2; r < p && !later; r++) later = srcs[r] == out ? r : 0;
    _Alignas(64) char kept[later ? CHUNK_BYTES : 1];
    for (Py_ssize_t lo = 0; lo < count; lo += len, len = step) {
        Py_ssize_t n = count - lo < len ? count - lo : len;
        Py_ssize_t off = lo * itemsize;
        if (later) memcpy(kept, out + off, (size_t)(n * itemsize));
        f(out + off, srcs[0] + off, srcs[1] + off, n);
        for (int r = 2; r < p; r++) f(out + off, out + off, r == later ? kept : srcs[r] + off, n);
        for (int c = 0; c < ncopies; c++) stream_bytes(copies[c] + off, out + off, (size_t)(n * itemsize));
    }
    if (ncopies) stream_done();
}

/* --------------------------------------------------------------- waiting */

#include "_waiting.h"
#include "_numpy_head.h"

/* The counters every rank keeps in its control page, each written by its
 * owner only: the fence epoch, and for compiled calls and steps through the halves,
 * the last step whose data this rank has posted and the last step it has
 * done reading. */
enum { K_EPOCH = 0, K_POST = 1, K_DONE = 2, K_COUNT = 3 };
/* Not counters: what a run reports when it stops for good. */
enum { K_VERDICT = -1, K_ABORTED = -2, K_OUTSIDE = -3, K_LOST = -4, K_WRITE_OUTSIDE = -5 };

/* Signature words (collectives.signature): the refused bit and the call
 * number's field in word 0. */
#define SIG_REFUSED (1ULL << 63)
#define SIG_SEQ_SHIFT 40
#define SIG_SEQ_MASK ((1ULL << 23) - 1)

typedef struct {
    PyObject_HEAD
    int size, rank;
    unsigned long long epoch;  /* fences this rank has passed */
    unsigned long long turn;   /* steps taken through the window's halves */
    int64_t spin_ns, yield_ns;
    uint64_t **counters[K_COUNT];  /* every rank's counter of each kind */
    uint64_t **sleeps;             /* every rank's sleep word (a futex on its low 32 bits) */
    uint64_t *inbox;               /* this rank's abort inbox: rank + 1 of a peer that aborted */
    int checks;                    /* 0: no signature records (to measure what they cost) */
    double *t_calls;               /* the flight recorder's ring (NULL: none): a cache line per call, */
    uint64_t t_mask;               /* [start, end, signature x 3, ...]; its length - 1 (a power of two) */
    PyObject *t_owner;             /* keeps the arrays alive */
} WindowObject;

static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The flight recorder's clock: seconds of CLOCK_MONOTONIC, as now_seconds
 * gives them, read through the CPU's time-stamp counter (about 9 ns against
 * 20 for clock_gettime) where the kernel itself keeps CLOCK_MONOTONIC on it
 * (clock source "tsc": a counter that runs at one rate on every CPU). The
 * counter is converted from an anchor (a counter reading paired with
 * clock_gettime) taken again each millisecond, at the rate measured from
 * the first anchor to the newest, so the conversion's error stays below a
 * microsecond at first and shrinks as the run goes on. Elsewhere it is
 * clock_gettime itself. Called with the GIL held (the anchor is shared). */
#if defined(__x86_64__)
#include <x86intrin.h>
static struct {
    int on;
    uint64_t first_tick, tick, period;  /* first anchor, newest one, ticks between anchors */
    double first_s, s, s_per_tick;
} rclock;

/* A counter reading and clock_gettime taken together (the counter read on
 * both sides; retried where something came between them). */
static int anchor_now(uint64_t *tick, double *s) {
    for (int i = 0; i < 16; i++) {
        uint64_t a = __rdtsc();
        double t = now_seconds();
        uint64_t b = __rdtsc();
        if (b - a < 2000) {
            *tick = a + (b - a) / 2;
            *s = t;
            return 1;
        }
    }
    return 0;
}

static void recorder_clock_init(void) {
    char src[32] = {0};
    FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (!f) return;
    int ok = fgets(src, sizeof src, f) != NULL;
    fclose(f);
    if (!ok || strncmp(src, "tsc", 3) != 0 || (src[3] != '\n' && src[3] != 0)) return;
    uint64_t t1;
    double s1;
    if (!anchor_now(&rclock.first_tick, &rclock.first_s)) return;
    do {
        if (!anchor_now(&t1, &s1)) return;
    } while (s1 - rclock.first_s < 200e-6);  /* a first rate, over 0.2 ms */
    if (t1 <= rclock.first_tick) return;
    rclock.s_per_tick = (s1 - rclock.first_s) / (double)(t1 - rclock.first_tick);
    rclock.tick = t1;
    rclock.s = s1;
    rclock.period = (uint64_t)(1e-3 / rclock.s_per_tick);
    rclock.on = 1;
}

static inline double recorder_seconds(void) {
    if (!rclock.on) return now_seconds();
    uint64_t d = __rdtsc() - rclock.tick;
    if (d < rclock.period) return rclock.s + (double)d * rclock.s_per_tick;
    uint64_t t;
    double s;
    if (!anchor_now(&t, &s)) return now_seconds();
    if (t > rclock.first_tick) {
        rclock.s_per_tick = (s - rclock.first_s) / (double)(t - rclock.first_tick);
        rclock.period = (uint64_t)(1e-3 / rclock.s_per_tick);
    }
    rclock.tick = t;
    rclock.s = s;
    return s;
}
#else
static void recorder_clock_init(void) {}
static inline double recorder_seconds(void) { return now_seconds(); }
#endif

/* rank r's signature record of call seq: three words after its post counter */
static inline uint64_t *record(WindowObject *w, int r, uint64_t seq) {
    return w->counters[K_POST][r] + 1 + 3 * (seq & 1);
}

/* A record is written with word 0 set to REC_WRITING first and to its
 * value last, so that a reader that sees the same word 0 before and after
 * reading the other two read one record whole (see read_record). Word 0 of
 * a real record is never 0 (never written) nor REC_WRITING: its
 * collective's code is at least 1. */
#define REC_WRITING 1ULL

static inline void write_record(WindowObject *w, uint64_t seq, uint64_t w0, uint64_t w1, uint64_t w2) {
    if (!w->checks) return;
    uint64_t *rec = record(w, w->rank, seq);
    __atomic_store_n(&rec[0], REC_WRITING, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&rec[1], w1, __ATOMIC_RELAXED);
    __atomic_store_n(&rec[2], w2, __ATOMIC_RELAXED);
    __atomic_store_n(&rec[0], (w0 & ~(SIG_SEQ_MASK << SIG_SEQ_SHIFT)) | ((seq & SIG_SEQ_MASK) << SIG_SEQ_SHIFT),
                     __ATOMIC_RELEASE);
}

/* rank r's record in the slot of call seq into out; 0 when it was being
 * rewritten meanwhile (the rank has moved on to a later call). A slot never
 * written reads as word 0 = 0: a record of no call, behind every call. */
static inline int read_record(WindowObject *w, int r, uint64_t seq, uint64_t *out) {
    const uint64_t *rec = record(w, r, seq);
    uint64_t a = __atomic_load_n(&rec[0], __ATOMIC_ACQUIRE);
    out[1] = __atomic_load_n(&rec[1], __ATOMIC_ACQUIRE);
    out[2] = __atomic_load_n(&rec[2], __ATOMIC_ACQUIRE);
    uint64_t b = __atomic_load_n(&rec[0], __ATOMIC_ACQUIRE);
    out[0] = a;
    return a != REC_WRITING && a == b;
}

/* -1 when every peer's record of call seq equals this rank's (a peer whose
 * record is of a later call has passed this one, which it verified), else
 * the first peer whose record differs or is of an earlier call, or this
 * rank or a peer when one refused. Call after every peer posted. */
static int verify(WindowObject *w, uint64_t seq) {
    if (!w->checks) return -1;
    const uint64_t *mine = record(w, w->rank, seq);
    uint64_t m0 = mine[0], m1 = mine[1], m2 = mine[2];
    uint64_t s = seq & SIG_SEQ_MASK, rec[3];
    if (m0 & SIG_REFUSED) return w->rank;
    for (int r = 0; r < w->size; r++) {
        if (r == w->rank) continue;
        if (!read_record(w, r, seq, rec)) continue;  /* rewritten: it has moved on, past this call */
        if (!rec[0]) return r;                       /* it never posted a record in this slot */
        uint64_t rs = (rec[0] >> SIG_SEQ_SHIFT) & SIG_SEQ_MASK;
        if (rs == s) {
            if (rec[0] != m0 || rec[1] != m1 || rec[2] != m2) return r;
        } else if (((rs - s) & SIG_SEQ_MASK) >= (1ULL << 22)) {
            return r;  /* an earlier call: it never posted this one's record */
        }
    }
    return -1;
}

/* rank + 1 of a peer that aborted this rank's communicator without
 * completing call seq, or 0. The inbox holds (first call the peer did not
 * complete) << 32 | (its rank + 1). */
static inline int aborted_by(WindowObject *w, uint64_t seq) {
    uint64_t a = w->inbox ? __atomic_load_n(w->inbox, __ATOMIC_ACQUIRE) : 0;
    if (!a) return 0;
    uint64_t first = (a >> 32) & SIG_SEQ_MASK, ahead = (first - (seq & SIG_SEQ_MASK)) & SIG_SEQ_MASK;
    if (ahead != 0 && ahead < (1ULL << 22)) return 0;  /* it completed this call */
    return (int)(a & 0xFFFFFFFF);
}

static void wake(WindowObject *w, int r) {
    __atomic_store_n(w->sleeps[r], 0, __ATOMIC_RELEASE);
    syscall(SYS_futex, (uint32_t *)w->sleeps[r], FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Set this rank's counter of ``kind`` to ``v`` and wake sleeping peers that
 * may wait for it (for the epoch, only peers already at that fence). The
 * full fence orders the store before the loads of the sleep words, so a
 * peer that marked itself asleep is never missed. */
static void publish(WindowObject *w, int kind, uint64_t v) {
    __atomic_store_n(w->counters[kind][w->rank], v, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < w->size; r++) {
        if (r == w->rank || !load_acquire(w->sleeps[r])) continue;
        if (kind != K_EPOCH || load_acquire(w->counters[K_EPOCH][r]) >= v) wake(w, r);
    }
}

/* The first peer from ``start`` on (in ``mask``, if given) whose counter of
 * ``kind`` is below ``v``, or size. */
static inline int first_below(WindowObject *w, int kind, uint64_t v, const unsigned char *mask, int start) {
    uint64_t **c = w->counters[kind];
    int r = start;
    while (r < w->size && (r == w->rank || (mask && !mask[r]) || load_acquire(c[r]) >= v)) r++;
    return r;
}

/* A bounded wait: when it started, its turns, and whether it has spun its
 * spin_ns (then it yields the CPU each turn until yield_ns more are used). */
typedef struct {
    int64_t start;
    unsigned turn;
    int yielding;
} Waiting;

static inline Waiting waiting_from_now(const WindowObject *w) {
    Waiting s = {now_ns(), 0, w->spin_ns <= 0};
    return s;
}

/* One turn of a bounded wait: one pause while it spins (the clock is read
 * every 32 turns only, so that a peer's store is seen within a pause or
 * two), else a sched_yield; 0 once the spin and the yielding are used up. */
#define SPIN_TURNS_PER_CLOCK 32
static inline int keep_waiting(const WindowObject *w, Waiting *s) {
    if (!s->yielding) {
        cpu_relax();
        if (++s->turn % SPIN_TURNS_PER_CLOCK) return 1;
        if (now_ns() - s->start < w->spin_ns) return 1;
        s->yielding = 1;
    }
    if (now_ns() - s->start >= w->spin_ns + w->yield_ns) return 0;
    sched_yield();
    return 1;
}

/* Checks a wait makes, a pause apart, before it lets go of the GIL and
 * starts its clock, where each rank has a core (about 2 us): most waits of
 * small calls end within them, and letting go of the GIL and taking it
 * back costs more than the wait itself. 2 ranks, 8 B, collectives bench,
 * the two builds in turns: barrier 0.25 -> 0.23 us, bcast 0.33 -> 0.27 us,
 * allreduce 0.35 -> 0.31 us where the machine was fast; 0.65 -> 0.53-0.61,
 * 0.69-0.71 -> 0.65-0.66 and 0.74-0.76 -> 0.71-0.73 us where it was slow. */
#define HELD_SPIN_TURNS 64

/* Wait until ready(arg): HELD_SPIN_TURNS checks holding the GIL (none
 * where ranks share cores), then, the GIL let go, the bounded spin and
 * yield of keep_waiting; whether it became ready. ready only reads shared
 * memory (it runs without the GIL). */
static inline int wait_until(WindowObject *w, int (*ready)(void *), void *arg) {
    if (ready(arg)) return 1;
    for (int i = 0; w->spin_ns > 0 && i < HELD_SPIN_TURNS; i++) {
        cpu_relax();
        if (ready(arg)) return 1;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    Waiting s = waiting_from_now(w);
    while (!(ok = ready(arg)) && keep_waiting(w, &s))
        ;
    Py_END_ALLOW_THREADS
    return ok;
}

/* wait_for's condition: every peer (in mask) at v or beyond; r, the first
 * still below, moves on as they arrive. */
typedef struct {
    WindowObject *w;
    int kind;
    uint64_t v;
    const unsigned char *mask;
    int r;
} Reached;

static int all_reached(void *arg) {
    Reached *c = arg;
    c->r = first_below(c->w, c->kind, c->v, c->mask, c->r);
    return c->r == c->w->size;
}

/* Wait (spin, then yield) until every peer (in ``mask``) has its counter of
 * ``kind`` at ``v`` or beyond; size if they all have, else the first peer
 * still below when the time ran out. Releases the GIL while it waits. */
static int wait_for(WindowObject *w, int kind, uint64_t v, const unsigned char *mask) {
    Reached c = {w, kind, v, mask, 0};
    wait_until(w, all_reached, &c);
    return c.r;
}

/* Progress of a call in pieces: beside its post counter (word 7 of that
 * line, after the two records) a writer keeps how far it has filled its
 * region in the step in progress: (step & PROG_STEP_MASK) << PROG_SHIFT |
 * (bytes from the region's start written so far) / 64, rounded down. It
 * sets the count to 0 once its signature record is written, raises it after
 * each piece and posts the step when done, so a reader that sees the post
 * needs no count. Readers round what they need up to whole 64 bytes. */
#define PROG_WORD 7
#define PROG_SHIFT 20
#define PROG_UNITS ((1ULL << PROG_SHIFT) - 1)
#define PROG_STEP_MASK ((1ULL << (64 - PROG_SHIFT)) - 1)

static inline uint64_t *progress_of(WindowObject *w, int r) { return w->counters[K_POST][r] + PROG_WORD; }

static inline void set_progress(WindowObject *w, uint64_t k, uint64_t units) {
    __atomic_store_n(progress_of(w, w->rank), ((k & PROG_STEP_MASK) << PROG_SHIFT) | units, __ATOMIC_RELEASE);
}

/* Whether rank r has posted step k, or filled its region below units * 64
 * bytes in it (units 0: it has started step k: its record is written). */
static inline int has_filled(WindowObject *w, int r, uint64_t k, uint64_t units) {
    if (load_acquire(w->counters[K_POST][r]) >= k) return 1;
    uint64_t v = load_acquire(progress_of(w, r));
    return (v >> PROG_SHIFT) == (k & PROG_STEP_MASK) && (v & PROG_UNITS) >= units;
}

/* wait_filled's condition: rank r has filled its region below units * 64 bytes in step k. */
typedef struct {
    WindowObject *w;
    int r;
    uint64_t k, units;
} Filling;

static int filled(void *arg) {
    Filling *c = arg;
    return has_filled(c->w, c->r, c->k, c->units);
}

/* Wait (spin, then yield; bounded as wait_for) until rank r has filled its
 * region below units * 64 bytes in step k; 0 when the time ran out. */
static int wait_filled(WindowObject *w, int r, uint64_t k, uint64_t units) {
    Filling c = {w, r, k, units};
    return wait_until(w, filled, &c);
}

/* (rank, kind, value): what a caller must wait for before it resumes. */
static PyObject *late(int r, int kind, uint64_t v) {
    return Py_BuildValue("(iiK)", r, kind, (unsigned long long)v);
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

static PyObject *stopped(int r, int kind) {
    return Py_BuildValue("(iiK)", r, kind, 0ULL);
}

/* .record_calls(ring): write each compiled call run's start and end (seconds of
 * CLOCK_MONOTONIC, as time.monotonic()) as doubles 0 and 1, and its
 * signature record (word 0 with the call number) as words 2 to 4, of row
 * [seq & (n - 1)] of ring (n rows of 8 float64, 64 bytes each: one cache
 * line per call; n a power of two: a flight recorder's); None: stop. */
static PyObject *Window_record_calls(WindowObject *w, PyObject *ring) {
    Py_CLEAR(w->t_owner);
    w->t_calls = NULL;
    w->t_mask = 0;
    if (ring == Py_None) Py_RETURN_NONE;
    Py_buffer a;
    if (PyObject_GetBuffer(ring, &a, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = a.len / 64;
    int ok = a.len % 64 == 0 && n > 0 && (n & (n - 1)) == 0;
    double *p = a.buf;
    PyBuffer_Release(&a);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "record_calls: a power-of-two number of 64-byte rows");
        return NULL;
    }
    Py_INCREF(ring);
    w->t_owner = ring;
    w->t_calls = p;
    w->t_mask = (uint64_t)(n - 1);
    Py_RETURN_NONE;
}

static void Window_dealloc(WindowObject *w) {
    Py_CLEAR(w->t_owner);
    for (int k = 0; k < K_COUNT; k++) PyMem_Free(w->counters[k]);
    PyMem_Free(w->sleeps);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static int Window_init(WindowObject *w, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"epochs", "posts", "dones", "sleeps", "rank", "spin_ns", "yield_ns", "inbox",
                             "checks", NULL};
    PyObject *lists[K_COUNT], *sleeps, *inbox = Py_None;
    long long spin_ns, yield_ns;
    w->checks = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOiLL|Op", kwlist, &lists[K_EPOCH], &lists[K_POST],
                                     &lists[K_DONE], &sleeps, &w->rank, &spin_ns, &yield_ns, &inbox, &w->checks))
        return -1;
    w->inbox = NULL;
    if (inbox != Py_None) {
        w->inbox = (uint64_t *)PyLong_AsVoidPtr(inbox);
        if (PyErr_Occurred()) return -1;
    }
    PyObject *epochs = lists[K_EPOCH];
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
    w->t_calls = NULL;
    w->t_mask = 0;
    Py_CLEAR(w->t_owner);
    static const char *names[K_COUNT] = {"epochs", "posts", "dones"};
    for (int k = 0; k < K_COUNT; k++) {
        PyMem_Free(w->counters[k]);
        w->counters[k] = NULL;
        if (fill_addresses(lists[k], w->size, &w->counters[k], names[k]) < 0) return -1;
    }
    PyMem_Free(w->sleeps);
    w->sleeps = NULL;
    if (fill_addresses(sleeps, w->size, &w->sleeps, "sleeps") < 0) return -1;
    return 0;
}

/* .arrive(seq): post the current step with this call's record (written
 * already), wait for every rank's post of it, verify the records. */
static PyObject *Window_arrive(WindowObject *w, PyObject *arg) {
    unsigned long long seq = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    uint64_t k = w->turn;
    int a = aborted_by(w, seq);
    if (a) return stopped(a - 1, K_ABORTED);
    publish(w, K_POST, k);
    int r = wait_for(w, K_POST, k, NULL);
    if (r < w->size) return late(r, K_POST, k);
    r = verify(w, seq);
    if (r >= 0) return stopped(r, K_VERDICT);
    Py_RETURN_NONE;
}

/* .verify(seq) -> int (see verify) */
static PyObject *Window_verify(WindowObject *w, PyObject *arg) {
    unsigned long long seq = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(verify(w, seq));
}

static PyObject *Window_fence(WindowObject *w, PyObject *Py_UNUSED(ignored)) {
    uint64_t e = ++w->epoch;
    publish(w, K_EPOCH, e);
    return PyBool_FromLong(wait_for(w, K_EPOCH, e, NULL) == w->size);
}

/* .step() -> None or (rank, kind, value): take the next step through the
 * halves for an algorithm that writes its half and fences: done with every
 * earlier step; its half may be written once every peer is done with the
 * step before the last (the previous use of that half). */
static PyObject *Window_step(WindowObject *w, PyObject *Py_UNUSED(ignored)) {
    uint64_t k = ++w->turn;
    publish(w, K_DONE, k - 1);
    uint64_t v = k >= 2 ? k - 2 : 0;
    int r = wait_for(w, K_DONE, v, NULL);
    if (r < w->size) return late(r, K_DONE, v);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ compiled calls */
/* A compiled call: copies, a post, a wait for the ranks it reads from, copies and one
 * reduction; the places are in the call's buffers or in the window's halves.
 * A Loc is arrays[idx] + a0 (idx >= 0) or, in the window, the absolute
 * address a0 in half 0 and a1 in half 1 (idx < 0). */

/* A place: in the call's array idx (idx >= 0) at byte a0; in the window
 * (idx -1) at address a0 in half 0, a1 in half 1; or (idx <= -2, a direct
 * call's source only) in array PEER_ARRAY(idx) as rank a0 published it,
 * at byte a1. */
typedef struct {
    int idx;
    Py_ssize_t a0, a1;
} Loc;

#define PEER_ARRAY(idx) (-2 - (idx))

typedef struct {
    Loc src, dst;
    Py_ssize_t n;
    Loc alt;         /* a direct call with a fallback: where in the window a peer's place is (idx -1), else idx 0 */
    int rank;        /* a call in pieces: the rank whose region the copy's window side is in (-1: */
    Py_ssize_t rel;  /* none, or this rank's region read after its own fill) and its offset there */
} Copy;

#define MAX_ARRAYS 4

typedef struct {
    PyObject_HEAD
    WindowObject *window;
    int narrays;
    int stage;                    /* 0 idle, 1 to post, 2 to read, 3 to read in pieces, 4 and 5: the
                                     second step's post and read (a run waits in 1, 2, 3 and 5) */
    int half;                     /* the half of the step in progress */
    uint64_t step;                /* the step in progress */
    int writes_window;            /* some copy before the post lands in the window */
    uint64_t seq, sig[3];         /* the call in progress and its signature */
    unsigned char *sources;       /* the ranks whose regions it reads */
    Py_ssize_t need[MAX_ARRAYS];  /* bytes each array must hold; -1: unused (may be None) */
    int writes[MAX_ARRAYS];
    int nbefore, nafter, nsrc;
    Copy *before, *after;
    int two_steps;                /* a second step follows (then): */
    int wait2;                    /* whether it waits for every rank's post of it */
    int nbefore2, nafter2;        /* its copies before its post and after every rank's */
    Copy *before2, *after2;
    binop_fn f;                   /* NULL: no reduction */
    Py_ssize_t count;
    int itemsize;
    Loc rdst;
    Loc *rsrc;
    Py_ssize_t piece;             /* bytes a piece (0: the whole step at once, see progress_of) */
    int *rrank;                   /* a call in pieces: each reduction source's rank and offset as a Copy's */
    Py_ssize_t *rrel;
    int at;                       /* a run in pieces that waits while it reads: the copy, its byte, */
    Py_ssize_t at_byte, at_elem;  /* and the reduction's element it resumes at */
    int direct;                   /* a direct call (see compile's direct): */
    int fallback;                 /* with copies into its region it makes instead where its arrays */
    int ncopies_in;               /* lie in 4 KiB pages (and readers take theirs from the window): */
    Copy *copies_in;
    int copied_in;                /* the run in progress made them all (nobody reads its arrays) */
    int last_direct, last_window;  /* the last run's reads of peers' arrays, and of their copies in the window */
    int last_pooled;              /* and of peers' arrays in their shared pools (see pools) */
    int marks;                    /* it publishes how each array is read (a fallback, or pools) */
    unsigned char kind[MAX_ARRAYS];  /* then how each shared array of the run is read */
    char **pool_base;             /* reads from pools: every rank's shared pool in this process */
    uint64_t *pool_len;           /* and its bytes (NULL: none) */
    PyObject *pooler;             /* pooler(address, nbytes) -> None or (pool offset of byte 0, first, end) */
    Py_ssize_t pool_from;         /* of arrays from this many bytes on (a private buffer the pool may adopt) */
    Py_ssize_t pool_first;        /* from this many bytes on, asked before whether an array lies in huge pages */
    uintptr_t paged_at[MAX_ARRAYS];    /* each shared array's last answer of in_huge_pages: where, */
    Py_ssize_t paged_len[MAX_ARRAYS];  /* its bytes, the answer, and how many runs it still holds for */
    int paged_huge[MAX_ARRAYS], paged_left[MAX_ARRAYS];
    int *pids;                    /* every rank's process id */
    uint64_t **metas;             /* every rank's metadata block, where it publishes its arrays */
    unsigned char *readers;       /* the ranks that read this rank's arrays (waited for at the end) */
    unsigned char shared[MAX_ARRAYS];  /* the arrays this rank publishes */
    Py_ssize_t lens[MAX_ARRAYS];  /* the bytes of the run's arrays */
    char *bounce;                 /* a buffer for cross-memory reads that would run skewed */
    int dreduce;                  /* a direct reduction (see parse_direct): the reduction's peer sources */
    Loc *ralt;                    /* and, with a fallback, each one's copy in its rank's region; */
    int ncopies_out;              /* copies out of this rank's region into its output once every peer */
    Copy *copies_out;             /* is done, where that output went by the window (kind BY_WINDOW); */
    Py_ssize_t rpiece;            /* bytes a piece of the reduction, */
    Py_ssize_t huge_from;         /* arrays of fewer bytes go as if outside huge pages (a fallback's window) */
    int rone;                     /* each piece reduced into the first piece of the destination (in the window) */
    Py_ssize_t view_at, view_len; /* >= 0: array 1 is array 0's view_len bytes from byte view_at (set_view) */
    char *scratch;                /* and a piece (and a page) per source for reads across */
} CallObject;

static PyTypeObject CallType;

static inline char *where(const Loc *l, char *const *bases, int half) {
    if (l->idx >= 0) return bases[l->idx] + l->a0;
    return (char *)(half ? l->a1 : l->a0);
}

static int parse_loc(PyObject *t, Loc *l, int narrays, Py_ssize_t *need, Py_ssize_t extent) {
    if (!PyArg_ParseTuple(t, "inn", &l->idx, &l->a0, &l->a1)) return -1;
    /* (a peer's array j is checked at run time against what it published; a reduction in place publishes its
     * array as its array 1 too, see publish_arrays) */
    if (l->idx >= narrays || (l->idx <= PEER_ARRAY(0) && PEER_ARRAY(l->idx) >= MAX_ARRAYS)) {
        PyErr_SetString(PyExc_ValueError, "array index out of range");
        return -1;
    }
    if (l->idx <= PEER_ARRAY(0) && (l->a0 < 0 || l->a1 < 0 || extent < 0)) {
        PyErr_SetString(PyExc_ValueError, "negative rank, offset or length");
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
        PyObject *alt = NULL;
        c->alt.idx = 0;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOn|O", &src, &dst, &c->n, &alt) ||
            parse_loc(src, &c->src, narrays, need, c->n) < 0 || parse_loc(dst, &c->dst, narrays, need, c->n) < 0 ||
            (alt && parse_loc(alt, &c->alt, narrays, need, c->n) < 0)) {
            Py_DECREF(fast);
            return -1;
        }
        if (alt && (c->alt.idx != -1 || (c->src.idx > PEER_ARRAY(0) && c->dst.idx > PEER_ARRAY(0)))) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "a fourth place is the window's, for a copy that reads or writes a peer");
            return -1;
        }
        if (c->dst.idx >= 0) writes[c->dst.idx] = 1;
    }
    *n = (int)len;
    Py_DECREF(fast);
    return 0;
}

/* The rank whose region (spans: (start, bytes) per rank) holds window
 * place l, and its offset there; -1 when none does. */
static int region_of(const Loc *l, const Py_ssize_t *spans, int size, Py_ssize_t *rel) {
    for (int r = 0; r < size; r++) {
        if (l->a0 >= spans[2 * r] && l->a0 < spans[2 * r] + spans[2 * r + 1]) {
            *rel = l->a0 - spans[2 * r];
            return r;
        }
    }
    return -1;
}

/* Prepare a call for pieces: where each copy's window side lies (see Copy).
 * 0 when it can run in pieces: the copies before the post write only this
 * rank's region, in order of their place there without overlapping, and
 * every place is within reach of the progress count; else 1 (the caller
 * runs it whole); -1 on error (malformed spans). */
static int map_pieces(CallObject *pl, PyObject *regions) {
    WindowObject *w = pl->window;
    PyObject *fast = PySequence_Fast(regions, "regions must be a sequence of (start, bytes)");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != w->size) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "regions: one (start, bytes) per rank");
        return -1;
    }
    Py_ssize_t spans[2 * w->size];
    for (int r = 0; r < w->size; r++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, r), "nn", &spans[2 * r], &spans[2 * r + 1])) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    Py_ssize_t reach = (Py_ssize_t)(PROG_UNITS * 64), filled = 0;
    for (int i = 0; i < pl->nbefore; i++) {
        Copy *c = &pl->before[i];
        c->rank = -1;
        if (c->dst.idx >= 0) continue;
        if (region_of(&c->dst, spans, w->size, &c->rel) != w->rank || c->rel < filled || c->rel + c->n > reach) return 1;
        c->rank = w->rank;
        filled = c->rel + c->n;
    }
    for (int i = 0; i < pl->nafter; i++) {
        Copy *c = &pl->after[i];
        c->rank = -1;
        if (c->src.idx >= 0) continue;
        int r = region_of(&c->src, spans, w->size, &c->rel);
        if (r < 0 || c->rel + c->n > reach) return 1;
        c->rank = r == w->rank ? -1 : r;
    }
    if (pl->f) {
        pl->rrank = PyMem_Calloc((size_t)pl->nsrc, sizeof(int));
        pl->rrel = PyMem_Calloc((size_t)pl->nsrc, sizeof(Py_ssize_t));
        if (!pl->rrank || !pl->rrel) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = 0; i < pl->nsrc; i++) {
            pl->rrank[i] = -1;
            if (pl->rsrc[i].idx >= 0) continue;
            int r = region_of(&pl->rsrc[i], spans, w->size, &pl->rrel[i]);
            if (r < 0 || pl->rrel[i] + pl->count * pl->itemsize > reach) return 1;
            pl->rrank[i] = r == w->rank ? -1 : r;
        }
    }
    return 0;
}

/* Whether a copy list holds a peer's place (only a direct call's after
 * copies may, as their source). */
static int has_peer_place(const Copy *c, int n, int sources_too) {
    for (int i = 0; i < n; i++)
        if (c[i].dst.idx <= PEER_ARRAY(0) || (sources_too && c[i].src.idx <= PEER_ARRAY(0))) return 1;
    return 0;
}

/* Refuse peers' places anywhere but in a direct call's after copies, as
 * a source or as a destination, never both (their ranks are checked with
 * the direct part); -1 with the error set. */
static int check_places(CallObject *pl, int direct) {
    int both = 0;
    for (int i = 0; i < pl->nafter; i++)
        both |= pl->after[i].src.idx <= PEER_ARRAY(0) && pl->after[i].dst.idx <= PEER_ARRAY(0);
    int bad = has_peer_place(pl->before, pl->nbefore, 1) || (!direct && has_peer_place(pl->after, pl->nafter, 1)) ||
              both ||
              has_peer_place(pl->before2, pl->nbefore2, 1) || has_peer_place(pl->after2, pl->nafter2, 1);
    if (pl->f) {  /* a direct call's reduction may read peers' arrays */
        bad |= pl->rdst.idx <= PEER_ARRAY(0);
        for (int i = 0; i < pl->nsrc && !direct; i++) bad |= pl->rsrc[i].idx <= PEER_ARRAY(0);
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a peer's array is only a direct call's source or destination after "
                                          "the post, or its reduction's source");
        return -1;
    }
    return 0;
}

/* A sequence of exactly size ints into out; -1 on error. */
static int int_list(PyObject *seq, int size, int *out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != size) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: expected %d items", what, size);
        return -1;
    }
    for (int i = 0; i < size; i++) {
        out[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    return 0;
}

/* Mark flags[k] for every k in the sequence seq (each in [0, limit)); -1
 * with the error set (out_of_range: the message for a k outside). */
static int mark_list(PyObject *seq, int limit, unsigned char *flags, const char *what, const char *out_of_range) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        long k = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (k < 0 || k >= limit) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, out_of_range);
            Py_DECREF(fast);
            return -1;
        }
        flags[k] = 1;
    }
    Py_DECREF(fast);
    return 0;
}

/* A direct call's pools = [(address, bytes), ...]: every rank's shared
 * pool as this process maps it; pooler (None, or a callable) and
 * pool_from: see CallObject. -1 on error. */
static int parse_pools(CallObject *pl, PyObject *pools, PyObject *pooler, Py_ssize_t pool_from) {
    int size = pl->window->size;
    PyObject *fast = PySequence_Fast(pools, "pools must be a sequence of (address, bytes)");
    if (!fast) return -1;
    pl->pool_base = PyMem_Calloc((size_t)size, sizeof(char *));
    pl->pool_len = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    int bad = !pl->pool_base || !pl->pool_len;
    if (bad) PyErr_NoMemory();
    if (!bad && PySequence_Fast_GET_SIZE(fast) != size) {
        PyErr_SetString(PyExc_ValueError, "pools: one (address, bytes) per rank");
        bad = 1;
    }
    for (int r = 0; !bad && r < size; r++) {
        Py_ssize_t address, n;
        bad = !PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, r), "nn", &address, &n);
        if (!bad && (address <= 0 || n < 0)) {
            PyErr_SetString(PyExc_ValueError, "pools: a pool's address or size is wrong");
            bad = 1;
        }
        if (!bad) pl->pool_base[r] = (char *)address, pl->pool_len[r] = (uint64_t)n;
    }
    Py_DECREF(fast);
    if (bad) return -1;
    if (pooler != Py_None) {
        if (!PyCallable_Check(pooler)) {
            PyErr_SetString(PyExc_TypeError, "pooler must be callable");
            return -1;
        }
        Py_INCREF(pooler);
        pl->pooler = pooler;
    }
    pl->pool_from = pool_from;
    return 0;
}

/* A direct call's reduction (compile's reduce, with direct's ralts,
 * copies_out and piece): this rank's block, read from its own array and
 * every peer's (in the order of the sources), reduced into its own array
 * (or its region: a reduce's rank that is not the root) and written into
 * every peer's that the after copies name (each from the reduction's
 * destination, all of it). With a fallback, each peer source names its
 * copy in the peer's region (ralts: None for this rank's own), and so does
 * each write (the same place: the peer copies it out, copies_out); an
 * array of fewer than huge_from bytes in huge pages goes through the
 * window as if it were not (a read across costs more there). With one, every
 * piece is reduced into the destination's first piece (a place in the
 * window, which holds one piece: a reduce's rank that is not the root) and
 * written from there; -1 on error. */
static int parse_direct_reduction(CallObject *pl, PyObject *ralts, PyObject *copies_out, Py_ssize_t piece,
                                  Py_ssize_t huge_from, int one) {
    Py_ssize_t extent = pl->count * pl->itemsize;
    if (piece < pl->itemsize) {
        PyErr_SetString(PyExc_ValueError, "a direct reduction goes in pieces of an element or more");
        return -1;
    }
    if (one && pl->rdst.idx != -1) {
        PyErr_SetString(PyExc_ValueError, "a reduction into one piece goes into the window");
        return -1;
    }
    for (int i = 0; i < pl->nafter; i++) {
        const Copy *c = &pl->after[i];
        if (c->dst.idx > PEER_ARRAY(0) || c->src.idx != pl->rdst.idx || c->src.a0 != pl->rdst.a0 ||
            c->src.a1 != pl->rdst.a1 || c->n != extent) {
            PyErr_SetString(PyExc_ValueError, "a direct reduction's after copies write its result into peers' arrays");
            return -1;
        }
    }
    pl->rpiece = piece / pl->itemsize * pl->itemsize;
    pl->huge_from = huge_from;
    pl->rone = one;
    pl->ralt = PyMem_Calloc((size_t)pl->nsrc, sizeof(Loc));
    if (!pl->ralt) { PyErr_NoMemory(); return -1; }
    PyObject *fast = PySequence_Fast(ralts, "ralts must be a sequence");
    if (!fast) return -1;
    int bad = PySequence_Fast_GET_SIZE(fast) != pl->nsrc;
    for (int i = 0; !bad && i < pl->nsrc; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, i);
        pl->ralt[i].idx = 0;
        if (t == Py_None) continue;
        bad = parse_loc(t, &pl->ralt[i], pl->narrays, pl->need, extent) < 0 || pl->ralt[i].idx != -1 ||
              pl->rsrc[i].idx > PEER_ARRAY(0);
    }
    Py_DECREF(fast);
    if (bad) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ralts: a window place for each peer source of the reduction, else None");
        return -1;
    }
    for (int i = 0; pl->fallback && i < pl->nsrc; i++)
        bad |= pl->rsrc[i].idx <= PEER_ARRAY(0) && pl->ralt[i].idx != -1;
    for (int i = 0; pl->fallback && i < pl->nafter; i++) bad |= pl->after[i].alt.idx != -1;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a fallback's direct reduction names the window place of every peer's part");
        return -1;
    }
    if (parse_copies(copies_out, &pl->copies_out, &pl->ncopies_out, pl->narrays, pl->need, pl->writes) < 0) return -1;
    for (int i = 0; i < pl->ncopies_out; i++)
        bad |= pl->copies_out[i].src.idx != -1 || pl->copies_out[i].dst.idx < 0;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "copies out go from this rank's region into its array");
        return -1;
    }
    pl->dreduce = 1;
    return 0;
}

/* compile's direct = (pids, metas, readers, shared[, copies_in, pools,
 * pooler, pool_from, pool_first, ralts, copies_out, piece, huge_from, one]): every rank's
 * process id and metadata block (an address in this process), the ranks
 * that read (or write) this rank's arrays, the arrays this rank publishes;
 * a fallback's copies into the window; the pools (see parse_pools), and
 * from how many bytes an array's pool is asked before its pages; a
 * reduction's (parse_direct_reduction). -1 on error. */
static int parse_direct(CallObject *pl, PyObject *direct) {
    WindowObject *w = pl->window;
    PyObject *pids, *metas, *readers, *shared, *copies_in = Py_None, *pools = Py_None, *pooler = Py_None;
    PyObject *ralts = Py_None, *copies_out = Py_None;
    Py_ssize_t pool_from = 0, pool_first = PY_SSIZE_T_MAX, piece = 0, huge_from = 0;
    int one = 0;
    if (!PyArg_ParseTuple(direct, "OOOO|OOOnnOOnnp", &pids, &metas, &readers, &shared, &copies_in, &pools, &pooler,
                          &pool_from, &pool_first, &ralts, &copies_out, &piece, &huge_from, &one))
        return -1;
    if (pl->two_steps || (pl->f && (ralts == Py_None || copies_out == Py_None))) {
        PyErr_SetString(PyExc_ValueError, "a direct call has one step, and a reduction names its ralts and copies out");
        return -1;
    }
    pl->pids = PyMem_Calloc((size_t)w->size, sizeof(int));
    pl->readers = PyMem_Calloc((size_t)w->size, 1);
    if (!pl->pids || !pl->readers) { PyErr_NoMemory(); return -1; }
    if (int_list(pids, w->size, pl->pids, "pids") < 0) return -1;
    if (fill_addresses(metas, w->size, &pl->metas, "metas") < 0) return -1;
    if (mark_list(readers, w->size, pl->readers, "readers must be a sequence of ranks",
                  "a reader's rank is out of range") < 0 ||
        mark_list(shared, pl->narrays, pl->shared, "shared must be a sequence of array indices",
                  "a shared array's index is out of range") < 0)
        return -1;
    for (int j = 0; j < pl->narrays; j++)
        if (pl->shared[j] && pl->need[j] < 0) pl->need[j] = 0;  /* taken, to be published */
    for (int i = 0; i < pl->nafter; i++) {
        const Loc *l = pl->after[i].dst.idx <= PEER_ARRAY(0) ? &pl->after[i].dst : &pl->after[i].src;
        if (l->idx <= PEER_ARRAY(0) && (l->a0 >= w->size || l->a0 == w->rank)) {
            PyErr_SetString(PyExc_ValueError, "a peer's place names this rank or a rank out of range");
            return -1;
        }
    }
    pl->direct = 1;
    pl->writes_window = 1;  /* the metadata block: free once every peer is done with the step before the last */
    if (copies_in != Py_None) {  /* a fallback: every read of a peer has its place in the window */
        if (parse_copies(copies_in, &pl->copies_in, &pl->ncopies_in, pl->narrays, pl->need, pl->writes) < 0)
            return -1;
        for (int i = 0; i < pl->ncopies_in; i++)
            if (pl->copies_in[i].dst.idx != -1 || pl->copies_in[i].src.idx < 0 ||
                !pl->shared[pl->copies_in[i].src.idx]) {
                PyErr_SetString(PyExc_ValueError, "copies in go from this rank's shared arrays into the window");
                return -1;
            }
        for (int i = 0; i < pl->nafter; i++)
            if (pl->after[i].src.idx <= PEER_ARRAY(0) && pl->after[i].alt.idx != -1) {
                PyErr_SetString(PyExc_ValueError, "a read of a peer without its place in the window");
                return -1;
            }
        pl->fallback = 1;
    }
    if (pools != Py_None && parse_pools(pl, pools, pooler, pool_from) < 0) return -1;
    pl->pool_first = pool_first;
    pl->marks = pl->fallback || pl->pool_base;
    return pl->f ? parse_direct_reduction(pl, ralts, copies_out, piece, huge_from, one) : 0;
}

/* Window.compile(narrays, before, after, reduce, sources[, piece, regions]) -> Call
 *   before, after: [((idx, a0, a1), (idx, a0, a1), nbytes), ...]
 *   reduce: None or ((idx, a0, a1) dst, [(idx, a0, a1) src, ...], count, dtype, op)
 *   sources: the ranks whose window regions ``after`` and ``reduce`` read
 *   piece: bytes a piece (0: none); regions: every rank's region as (start, bytes) */
static PyObject *Window_compile(WindowObject *w, PyObject *args) {
    int narrays;
    Py_ssize_t piece = 0;
    PyObject *before, *after, *reduce, *sources, *regions = Py_None, *then = Py_None, *direct = Py_None;
    if (!PyArg_ParseTuple(args, "iOOOO|nOOO", &narrays, &before, &after, &reduce, &sources, &piece, &regions, &then,
                          &direct))
        return NULL;
    if (narrays < 0 || narrays > MAX_ARRAYS) {
        PyErr_SetString(PyExc_ValueError, "too many arrays");
        return NULL;
    }
    CallObject *pl = PyObject_New(CallObject, &CallType);
    if (!pl) return NULL;
    pl->before = pl->after = pl->before2 = pl->after2 = NULL;
    pl->two_steps = pl->nbefore2 = pl->nafter2 = 0;
    pl->wait2 = 1;
    pl->rsrc = NULL;
    pl->rrank = NULL;
    pl->rrel = NULL;
    pl->piece = 0;
    pl->at = 0;
    pl->at_byte = pl->at_elem = 0;
    pl->f = NULL;
    pl->direct = pl->fallback = pl->ncopies_in = pl->copied_in = pl->last_direct = pl->last_window = 0;
    pl->last_pooled = pl->marks = 0;
    pl->copies_in = NULL;
    pl->pool_base = NULL;
    pl->pool_len = NULL;
    pl->pooler = NULL;
    pl->pool_from = pl->pool_first = 0;
    for (int i = 0; i < MAX_ARRAYS; i++) pl->paged_left[i] = 0;
    pl->pids = NULL;
    pl->metas = NULL;
    pl->readers = NULL;
    pl->bounce = NULL;
    pl->dreduce = pl->ncopies_out = 0;
    pl->ralt = NULL;
    pl->copies_out = NULL;
    pl->rpiece = pl->huge_from = 0;
    pl->view_at = pl->view_len = -1;
    pl->scratch = NULL;
    for (int i = 0; i < MAX_ARRAYS; i++) pl->shared[i] = 0;
    pl->stage = pl->half = 0;
    pl->step = 0;
    pl->sources = PyMem_Calloc((size_t)w->size, 1);
    pl->nsrc = pl->nbefore = pl->nafter = 0;
    Py_INCREF(w);
    pl->window = w;
    pl->narrays = narrays;
    for (int i = 0; i < MAX_ARRAYS; i++) { pl->need[i] = -1; pl->writes[i] = 0; }
    if (!pl->sources) {
        Py_DECREF(pl);
        return PyErr_NoMemory();
    }
    if (parse_copies(before, &pl->before, &pl->nbefore, narrays, pl->need, pl->writes) < 0 ||
        parse_copies(after, &pl->after, &pl->nafter, narrays, pl->need, pl->writes) < 0) {
        Py_DECREF(pl);
        return NULL;
    }
    pl->writes_window = 0;
    for (int i = 0; i < pl->nbefore; i++) pl->writes_window |= pl->before[i].dst.idx < 0;
    if (then != Py_None) {
        PyObject *before2, *after2;
        if (!PyArg_ParseTuple(then, "OO|p", &before2, &after2, &pl->wait2) ||
            parse_copies(before2, &pl->before2, &pl->nbefore2, narrays, pl->need, pl->writes) < 0 ||
            parse_copies(after2, &pl->after2, &pl->nafter2, narrays, pl->need, pl->writes) < 0) {
            Py_DECREF(pl);
            return NULL;
        }
        pl->two_steps = 1;
    }
    if (mark_list(sources, w->size, pl->sources, "sources must be a sequence of ranks",
                  "a source rank is out of range") < 0) {
        Py_DECREF(pl);
        return NULL;
    }
    if (reduce != Py_None) {
        PyObject *dst, *srcs;
        int dtype, op;
        if (!PyArg_ParseTuple(reduce, "OOnii", &dst, &srcs, &pl->count, &dtype, &op)) { Py_DECREF(pl); return NULL; }
        binop_fn f = kernel(dtype, op);
        PyObject *fast = f ? PySequence_Fast(srcs, "reduce sources must be a sequence") : NULL;
        if (!f) PyErr_SetString(PyExc_ValueError, "no compiled kernel for this dtype and op");
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
    if (check_places(pl, direct != Py_None) < 0 || (direct != Py_None && parse_direct(pl, direct) < 0)) {
        Py_DECREF(pl);
        return NULL;
    }
    if (piece > 0 && regions != Py_None && !pl->two_steps && !pl->direct) {
        int whole = map_pieces(pl, regions);
        if (whole < 0) {
            Py_DECREF(pl);
            return NULL;
        }
        pl->piece = whole ? 0 : piece;
    }
    return (PyObject *)pl;
}

static void Call_dealloc(CallObject *pl) {
    PyMem_Free(pl->sources);
    PyMem_Free(pl->before);
    PyMem_Free(pl->after);
    PyMem_Free(pl->before2);
    PyMem_Free(pl->after2);
    PyMem_Free(pl->copies_in);
    PyMem_Free(pl->rsrc);
    PyMem_Free(pl->rrank);
    PyMem_Free(pl->rrel);
    PyMem_Free(pl->pids);
    PyMem_Free(pl->metas);
    PyMem_Free(pl->readers);
    PyMem_RawFree(pl->bounce);
    PyMem_Free(pl->ralt);
    PyMem_Free(pl->copies_out);
    PyMem_RawFree(pl->scratch);
    PyMem_Free(pl->pool_base);
    PyMem_Free(pl->pool_len);
    Py_XDECREF(pl->pooler);
    Py_XDECREF(pl->window);
    PyObject_Free(pl);
}

/* Take the call's buffers (a tuple of narrays objects) as bases; -1 on error. */
static int take_buffers(CallObject *pl, PyObject *arrays, Py_buffer *views, char **bases) {
    int given = PyTuple_Check(arrays) ? (int)PyTuple_GET_SIZE(arrays) : -1;
    if (given != pl->narrays && !(pl->view_at >= 0 && given == 1)) {
        PyErr_Format(PyExc_TypeError, "expected a tuple of %d arrays", pl->narrays);
        return -1;
    }
    int i;
    for (i = 0; i < pl->narrays; i++) {
        views[i].obj = NULL;
        bases[i] = NULL;
        if (i == 1 && pl->view_at >= 0) {  /* a view of array 0 (set_view) */
            if (!bases[0] || pl->view_at + pl->view_len > pl->lens[0]) {
                PyErr_SetString(PyExc_ValueError, "the compiled call's view lies outside its array 0");
                goto fail;
            }
            bases[1] = bases[0] + pl->view_at;
            pl->lens[1] = pl->view_len;
            continue;
        }
        if (pl->need[i] < 0) continue;
        int flags = PyBUF_C_CONTIGUOUS | (pl->writes[i] ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, i), &views[i], flags) < 0) goto fail;
        if (views[i].len < pl->need[i]) {
            PyErr_Format(PyExc_ValueError, "array %d holds %zd bytes, the compiled call needs %zd", i, views[i].len,
                         pl->need[i]);
            PyBuffer_Release(&views[i]);
            goto fail;
        }
        bases[i] = views[i].buf;
        pl->lens[i] = views[i].len;
    }
    return 0;
fail:
    while (--i >= 0)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    return -1;
}

static void release_buffers(CallObject *pl, Py_buffer *views) {
    for (int i = 0; i < pl->narrays; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
}

/* Bytes from which a copy between buffers that do not overlap is one
 * ``rep movsb`` where the processor says it is fast (ERMS): glibc's memmove
 * takes it too from a few KiB on, but on AMD processors stops at the size
 * of a core's L2 cache (1 MiB here) and copies with vector stores above,
 * which read every destination line first. Into a window half that other
 * ranks read two steps before, that read waits on their caches: a 4-rank
 * bcast of 1 MiB on 2 cores spent 120 us in the root's copy against 20 us
 * for 1020 KiB (docs/shared-memory.md, "Copies"). */
#define REP_MOVSB_FROM 4096
static int use_rep_movsb = 0;  /* set by set_rep_movsb (collectives.compiled, at import) */

static int has_fast_rep_movsb(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 9) & 1;  /* CPUID.(EAX=7, ECX=0):EBX bit 9: ERMS */
#else
    return 0;
#endif
}

static inline void copy_apart(char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (n >= REP_MOVSB_FROM && use_rep_movsb) {
        __asm__ __volatile__("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* memmove, but for a destination 1 to 63 bytes past the source's place in
 * a 4 KiB page: there the string-copy instruction glibc uses from a few KiB
 * on runs about ten times slower on some processors (it stalls on 4 KiB
 * aliasing), and that is where malloc puts two arrays of the same size
 * allocated one after the other. A loop of fixed 64-byte copies (vector
 * moves, no string instruction) copies those at full speed. */
static void copy_bytes(char *dst, const char *src, size_t n) {
    size_t ahead = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095;
    if (dst < src + n && src < dst + n) {
        memmove(dst, src, n);
        return;
    }
    if (n < 1024 || ahead == 0 || ahead >= 64) {
        copy_apart(dst, src, n);
        return;
    }
    size_t i = 0;
    for (; i + 64 <= n; i += 64) memcpy(dst + i, src + i, 64);
    memcpy(dst + i, src + i, n - i);
}

static void do_copies(const Copy *c, int n, char *const *bases, int half) {
    for (int i = 0; i < n; i++) copy_bytes(where(&c[i].dst, bases, half), where(&c[i].src, bases, half), (size_t)c[i].n);
}

static void do_after(CallObject *pl, char *const *bases, int half) {
    do_copies(pl->after, pl->nafter, bases, half);
    if (pl->f) {
        char *srcs[pl->nsrc];
        for (int i = 0; i < pl->nsrc; i++) srcs[i] = where(&pl->rsrc[i], bases, half);
        reduce_all(pl->f, where(&pl->rdst, bases, half), srcs, pl->nsrc, pl->count, pl->itemsize, NULL, 0);
    }
}
/* A call in pieces, stage 1: the copies before the post, raising this
 * rank's progress after each piece of those into its region (in order of
 * their place there, see map_pieces). */
static void fill_in_pieces(CallObject *pl, char *const *bases, uint64_t k) {
    WindowObject *w = pl->window;
    for (int i = 0; i < pl->nbefore; i++) {
        const Copy *c = &pl->before[i];
        char *dst = where(&c->dst, bases, pl->half), *src = where(&c->src, bases, pl->half);
        if (c->rank < 0) {
            copy_bytes(dst, src, (size_t)c->n);
            continue;
        }
        for (Py_ssize_t a = 0; a < c->n; a += pl->piece) {
            Py_ssize_t n = c->n - a < pl->piece ? c->n - a : pl->piece;
            copy_bytes(dst + a, src + a, (size_t)n);
            set_progress(w, k, (uint64_t)(c->rel + a + n) / 64);
        }
    }
}

/* A call in pieces, stage 3: the copies and the reduction after the post,
 * each piece once its source has filled it; NULL when done, else what to
 * wait for (the source's post), the place to resume at kept. */
static PyObject *read_in_pieces(CallObject *pl, char *const *bases, uint64_t k) {
    WindowObject *w = pl->window;
    for (; pl->at < pl->nafter; pl->at++, pl->at_byte = 0) {
        const Copy *c = &pl->after[pl->at];
        char *dst = where(&c->dst, bases, pl->half), *src = where(&c->src, bases, pl->half);
        while (pl->at_byte < c->n) {
            Py_ssize_t a = pl->at_byte, n = c->n - a < pl->piece ? c->n - a : pl->piece;
            if (c->rank >= 0 && !wait_filled(w, c->rank, k, (uint64_t)(c->rel + a + n + 63) / 64))
                return late(c->rank, K_POST, k);
            copy_bytes(dst + a, src + a, (size_t)n);
            pl->at_byte = a + n;
        }
    }
    if (!pl->f) return NULL;
    Py_ssize_t step = pl->piece / pl->itemsize > 0 ? pl->piece / pl->itemsize : 1;
    char *out = where(&pl->rdst, bases, pl->half), *srcs[pl->nsrc];
    while (pl->at_elem < pl->count) {
        Py_ssize_t lo = pl->at_elem, n = pl->count - lo < step ? pl->count - lo : step;
        Py_ssize_t off = lo * pl->itemsize, end = off + n * pl->itemsize;
        for (int i = 0; i < pl->nsrc; i++) {
            if (pl->rrank[i] >= 0 && !wait_filled(w, pl->rrank[i], k, (uint64_t)(pl->rrel[i] + end + 63) / 64))
                return late(pl->rrank[i], K_POST, k);
            srcs[i] = where(&pl->rsrc[i], bases, pl->half) + off;
        }
        reduce_all(pl->f, out + off, srcs, pl->nsrc, n, pl->itemsize, NULL, 0);
        pl->at_elem = lo + n;
    }
    return NULL;
}

/* A direct call's published words: per half of the metadata block, per
 * array, its address and its bytes (64 bytes: MAX_ARRAYS pairs). */
#define DIRECT_WORDS (2 * MAX_ARRAYS)

static inline uint64_t *published(const CallObject *pl, int r) {
    return pl->metas[r] + pl->half * DIRECT_WORDS;
}

/* The top bit of an array's published bytes: it lies in huge pages (a
 * call with a fallback or pools only); the next: bytes of it lie in its
 * rank's shared pool, where the pool words say (and peers move them there). */
#define IN_HUGE_PAGES (1ULL << 63)
#define IN_POOL (1ULL << 62)
#define PUBLISHED_FLAGS (IN_HUGE_PAGES | IN_POOL)

/* The pool words (a call with pools): per half, per array, the pool
 * offset of the array's byte 0 (as int64: that byte may lie before the
 * pool's part), and the first and end byte of the part in the pool; from
 * byte 1024 of the metadata block. */
#define POOL_WORDS_AT 128
#define POOL_WORDS (3 * MAX_ARRAYS)

static inline uint64_t *pool_words(const CallObject *pl, int r) {
    return pl->metas[r] + POOL_WORDS_AT + pl->half * POOL_WORDS;
}

/* How a direct call's peers take a shared array (CallObject.kind). */
enum { BY_WINDOW = 0, BY_READ = 1, BY_POOL = 2 };

/* struct pm_scan_arg and struct page_region of <linux/fs.h> (Linux 6.7 on),
 * for kernels' headers without them. */
typedef struct {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
        category_anyof_mask, return_mask;
} PmScanArg;
typedef struct {
    uint64_t start, end, categories;
} PageRegion;
#define PAGEMAP_SCAN_IOCTL _IOWR('f', 16, PmScanArg)
#define PAGE_IS_HUGE_CATEGORY (1ULL << 6)

static int pagemap_fd = -1;
static pid_t pagemap_pid = 0;

/* Whether every whole 4 KiB page of the n bytes at a is part of a huge
 * page (cross-memory reads pin every page they touch, one at a time on 4
 * KiB pages: several times slower there, see transports/shm/copy_race.py):
 * one PAGEMAP_SCAN query of /proc/self/pagemap (opened once per process),
 * stopping at the first page that is not; 0 where the kernel cannot tell. */
static int in_huge_pages(uintptr_t a, size_t n) {
    uintptr_t lo = (a + 4095) & ~(uintptr_t)4095, hi = (a + n) & ~(uintptr_t)4095;
    if (hi <= lo) return 1;  /* no whole page: a read of less than two pages */
    pid_t pid = getpid();
    if (pagemap_pid != pid) {  /* a forked child reopens its own */
        if (pagemap_fd >= 0) close(pagemap_fd);
        pagemap_fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        pagemap_pid = pid;
    }
    if (pagemap_fd < 0) return 0;
    PageRegion found;
    PmScanArg arg = {sizeof(PmScanArg), 0, lo, hi, 0, (uint64_t)(uintptr_t)&found, 1, 1,
                     PAGE_IS_HUGE_CATEGORY, PAGE_IS_HUGE_CATEGORY, 0, PAGE_IS_HUGE_CATEGORY};
    return ioctl(pagemap_fd, PAGEMAP_SCAN_IOCTL, &arg) == 0;  /* no page found that lacks it */
}

/* Whether shared array j of this run lies in huge pages: in_huge_pages,
 * asked again after PAGED_RUNS runs on the same array (the answer only
 * picks the faster path: the pages may change between, the result not). */
#define PAGED_RUNS 64

static int array_in_huge_pages(CallObject *pl, int j, char *base) {
    if (pl->paged_left[j] > 0 && pl->paged_at[j] == (uintptr_t)base && pl->paged_len[j] == pl->lens[j]) {
        pl->paged_left[j]--;
        return pl->paged_huge[j];
    }
    pl->paged_at[j] = (uintptr_t)base;
    pl->paged_len[j] = pl->lens[j];
    pl->paged_left[j] = PAGED_RUNS;
    return pl->paged_huge[j] = in_huge_pages((uintptr_t)base, (size_t)pl->lens[j]);
}

/* Where shared array j (n bytes at base) of a direct call lies in this
 * rank's shared pool: wholly, when it is inside the pool's mapping (from
 * the transport's alloc); else the pooler's answer (a private buffer the
 * pool adopted, all but its partial first and last pages), asked only from
 * pool_from bytes on. 1 with *off, *first, *end set; 0: not there; -1: the
 * pooler raised. */
static int pool_part(CallObject *pl, char *base, Py_ssize_t n, int64_t *off, uint64_t *first, uint64_t *end) {
    int me = pl->window->rank;
    if (!pl->pool_base) return 0;
    if (base >= pl->pool_base[me] && (uint64_t)(base - pl->pool_base[me]) + (uint64_t)n <= pl->pool_len[me]) {
        *off = (int64_t)(base - pl->pool_base[me]), *first = 0, *end = (uint64_t)n;
        return 1;
    }
    if (!pl->pooler || n < pl->pool_from) return 0;
    PyObject *got = PyObject_CallFunction(pl->pooler, "nn", (Py_ssize_t)(uintptr_t)base, n);
    if (!got) return -1;
    long long o = 0;
    unsigned long long a = 0, b = 0;
    int ok = got != Py_None && PyArg_ParseTuple(got, "LKK", &o, &a, &b);
    Py_DECREF(got);
    if (got != Py_None && !ok) return -1;
    if (!ok || a >= b || b > (uint64_t)n) return 0;
    *off = (int64_t)o, *first = a, *end = b;
    return 1;
}

/* Publish where this rank's shared arrays are (before the post); a call
 * with a fallback or pools also how its readers take each (kind): straight
 * where it lies in huge pages (IN_HUGE_PAGES), from its part in this
 * rank's shared pool (IN_POOL), else from the copy in the window this rank
 * makes (see copies_in), or straight without a fallback. 1 when every one
 * goes through the window (nobody reads this rank's arrays), 0 when not,
 * -1 when the pooler raised. */
static int publish_arrays(CallObject *pl, char *const *bases) {
    uint64_t *words = published(pl, pl->window->rank);
    int all_window = 1;
    for (int j = 0; j < MAX_ARRAYS; j++) {
        int on = j < pl->narrays && pl->shared[j] && bases[j];
        uint64_t flag = 0;
        pl->kind[j] = BY_WINDOW;
        if (on && pl->marks) {
            int64_t off = 0;
            uint64_t first = 0, end = 0;
            int first_pool = pl->lens[j] >= pl->pool_first, pooled = 0;
            if (first_pool && (pooled = pool_part(pl, bases[j], pl->lens[j], &off, &first, &end)) < 0) return -1;
            if (!pooled && pl->lens[j] >= pl->huge_from && array_in_huge_pages(pl, j, bases[j])) {
                flag = IN_HUGE_PAGES, pl->kind[j] = BY_READ;
            } else if (!first_pool && (pooled = pool_part(pl, bases[j], pl->lens[j], &off, &first, &end)) < 0) {
                return -1;
            } else if (pooled) {
                uint64_t *pw = pool_words(pl, pl->window->rank) + 3 * j;
                pw[0] = (uint64_t)off, pw[1] = first, pw[2] = end;
                flag = IN_POOL, pl->kind[j] = BY_POOL;
            } else {
                pl->kind[j] = pl->fallback ? BY_WINDOW : BY_READ;
            }
            all_window &= pl->kind[j] == BY_WINDOW;
        }
        words[2 * j] = on ? (uint64_t)(uintptr_t)bases[j] : 0;
        words[2 * j + 1] = on ? (uint64_t)pl->lens[j] | flag : 0;
    }
    if (pl->dreduce && pl->narrays == 1) {  /* in place: its input, which peers read as array 1, is array 0 */
        uint64_t *pw = pool_words(pl, pl->window->rank);
        words[2] = words[0], words[3] = words[1];
        pw[3] = pw[0], pw[4] = pw[1], pw[5] = pw[2];
    }
    return pl->fallback && all_window;
}

/* The copies in of the arrays a fallback call's readers take from the window (kind BY_WINDOW). */
static void copy_in_window_arrays(CallObject *pl, char *const *bases) {
    for (int i = 0; i < pl->ncopies_in; i++)
        if (pl->kind[pl->copies_in[i].src.idx] == BY_WINDOW) do_copies(&pl->copies_in[i], 1, bases, pl->half);
}

/* The kernel's cross-memory copy runs several times slower when the
 * destination starts 1 to 31 bytes past the source's place in a 4 KiB page
 * (see transports/shm/cma.py); such reads go through a bounce buffer
 * placed like the source, BOUNCE_BYTES at a time. */
#define SKEW_SLOW_BYTES 32
#define BOUNCE_BYTES (256 << 10)

/* Move n bytes between ``local`` and ``remote`` in process pid (write:
 * process_vm_writev, out of local; else process_vm_readv, into it), in as
 * many calls as the kernel needs; 0, or the errno of the first that moved
 * nothing. */
static int vm_move_bytes(int pid, uintptr_t remote, char *local, size_t n, int write) {
    size_t done = 0;
    while (done < n) {
        struct iovec mine = {local + done, n - done};
        struct iovec theirs = {(void *)(remote + done), n - done};
        ssize_t got = write ? process_vm_writev(pid, &mine, 1, &theirs, 1, 0)
                            : process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
        if (got <= 0) return got < 0 ? errno : EIO;
        done += (size_t)got;
    }
    return 0;
}

/* A cross-memory read of n bytes at remote into local, or (write) a
 * write of local to remote (vm_move_bytes), through the call's bounce
 * buffer (placed like the remote side) where the copy would run skewed; 0
 * or an errno (ENOMEM: no bounce buffer). */
static int direct_move(CallObject *pl, int pid, uintptr_t remote, char *local, size_t n, int write) {
    size_t skew = (write ? remote - (uintptr_t)local : (uintptr_t)local - remote) & 4095;
    if (skew == 0 || skew >= SKEW_SLOW_BYTES) return vm_move_bytes(pid, remote, local, n, write);
    if (!pl->bounce && !(pl->bounce = PyMem_RawMalloc(BOUNCE_BYTES + 4096))) return ENOMEM;
    char *place = pl->bounce + ((remote - (uintptr_t)pl->bounce) & 4095);
    for (size_t a = 0; a < n; a += BOUNCE_BYTES) {
        size_t m = n - a < BOUNCE_BYTES ? n - a : BOUNCE_BYTES;
        if (write) memcpy(place, local + a, m);
        int err = vm_move_bytes(pid, remote + a, place, m, write);
        if (err) return err;
        if (!write) memcpy(local + a, place, m);
    }
    return 0;
}

static inline int direct_read(CallObject *pl, int pid, uintptr_t from, char *to, size_t n) {
    return direct_move(pl, pid, from, to, n, 0);
}

/* Read n bytes at byte at of rank r's array j (published at address,
 * nbytes long, with IN_POOL) into local, or (write) write local there:
 * the part in r's shared pool (as its pool words say) by a copy out of or
 * into this process's mapping of that pool, the rest (the array's partial
 * first and last pages) by cross-memory attach. 0, an errno, or -1 when
 * the pool words leave the array or the pool. */
static int pool_move(CallObject *pl, int r, int j, uintptr_t address, uint64_t nbytes, uint64_t at, char *local,
                     size_t n, int write) {
    const uint64_t *pw = pool_words(pl, r) + 3 * j;
    int64_t off = (int64_t)load_acquire(&pw[0]);
    uint64_t first = load_acquire(&pw[1]), end = load_acquire(&pw[2]);
    if (!pl->pool_base || first >= end || end > nbytes || off < -(int64_t)nbytes ||
        off > (int64_t)pl->pool_len[r] || off + (int64_t)first < 0 || (uint64_t)(off + (int64_t)end) > pl->pool_len[r])
        return -1;  /* (off bounded first: the sums cannot overflow) */
    uint64_t stop = at + n, lo = first > at ? (first < stop ? first : stop) : at;
    uint64_t hi = end < stop ? (end > lo ? end : lo) : stop;
    int err = 0;
    char *pooled = pl->pool_base[r] + off + (int64_t)lo;
    if (lo > at) err = direct_move(pl, pl->pids[r], address + at, local, (size_t)(lo - at), write);
    if (!err && hi > lo) {
        if (write) copy_bytes(pooled, local + (lo - at), (size_t)(hi - lo));
        else copy_bytes(local + (lo - at), pooled, (size_t)(hi - lo));
    }
    if (!err && stop > hi) err = direct_move(pl, pl->pids[r], address + hi, local + (hi - at), (size_t)(stop - hi), write);
    return err;
}

/* A direct call writes a peer's array this many bytes at a time, and looks
 * at its abort inbox before each: a peer that gave up on the call (a
 * timeout) has returned to its caller, who may use the buffer again. */
#define WRITE_BYTES (1 << 20)

/* Write copy c, whose destination is a peer's published array, as
 * direct_reads reads: inside the array as published (else
 * K_WRITE_OUTSIDE), into the pool where it lies there, else across. 0 with
 * *pooled or *direct counted, else -1 with *bad, *kind, *value set. */
static int direct_write(CallObject *pl, const Copy *c, char *const *bases, int *pooled, int *direct, int *bad,
                        int *kind, uint64_t *value) {
    int r = (int)c->dst.a0, j = PEER_ARRAY(c->dst.idx);
    const uint64_t *words = published(pl, r);
    uint64_t address = load_acquire(&words[2 * j]), word = load_acquire(&words[2 * j + 1]);
    uint64_t nbytes = word & ~PUBLISHED_FLAGS, at = (uint64_t)c->dst.a1, n = (uint64_t)c->n;
    int in_pool = pl->marks && (word & IN_POOL) && !(word & IN_HUGE_PAGES);
    char *src = where(&c->src, bases, pl->half);
    if (!address || at + n > nbytes) {
        *bad = r, *kind = K_WRITE_OUTSIDE, *value = nbytes;
        return -1;
    }
    for (uint64_t a = 0; a < n; a += WRITE_BYTES) {
        uint64_t m = n - a < WRITE_BYTES ? n - a : WRITE_BYTES;
        int gone = aborted_by(pl->window, pl->seq), err;
        if (gone) {
            *bad = gone - 1, *kind = K_ABORTED, *value = 0;
            return -1;
        }
        err = in_pool ? pool_move(pl, r, j, (uintptr_t)address, nbytes, at + a, src + a, (size_t)m, 1)
                      : direct_move(pl, pl->pids[r], (uintptr_t)address + at + a, src + a, (size_t)m, 1);
        if (err) {
            *bad = r, *kind = err < 0 ? K_WRITE_OUTSIDE : K_LOST, *value = err < 0 ? nbytes : (uint64_t)err;
            return -1;
        }
    }
    if (in_pool) (*pooled)++;
    else (*direct)++;
    return 0;
}

/* A direct call's copies after every rank posted: from peers' published
 * arrays by cross-memory attach, each only inside the array as its rank
 * published it; the rest as any call's. NULL when done, else why the run
 * stopped: (rank, K_OUTSIDE, the bytes it published) or (rank, K_LOST, errno). */
static PyObject *direct_reads(CallObject *pl, char *const *bases) {
    int err = 0, bad = -1, kind = 0, direct = 0, window = 0, pooled = 0;
    uint64_t value = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < pl->nafter && bad < 0; i++) {
        const Copy *c = &pl->after[i];
        if (c->dst.idx <= PEER_ARRAY(0)) {  /* a write into a peer's array */
            direct_write(pl, c, bases, &pooled, &direct, &bad, &kind, &value);
            continue;
        }
        char *dst = where(&c->dst, bases, pl->half);
        if (c->src.idx > PEER_ARRAY(0)) {
            copy_bytes(dst, where(&c->src, bases, pl->half), (size_t)c->n);
            continue;
        }
        int r = (int)c->src.a0, j = PEER_ARRAY(c->src.idx);
        const uint64_t *words = published(pl, r);
        uint64_t address = load_acquire(&words[2 * j]), word = load_acquire(&words[2 * j + 1]);
        uint64_t nbytes = word & ~PUBLISHED_FLAGS;
        if (!address || (uint64_t)c->src.a1 + (uint64_t)c->n > nbytes) {
            bad = r, kind = K_OUTSIDE, value = nbytes;
        } else if (pl->marks && (word & IN_POOL) && !(word & IN_HUGE_PAGES)) {
            if ((err = pool_move(pl, r, j, (uintptr_t)address, nbytes, (uint64_t)c->src.a1, dst, (size_t)c->n, 0)) < 0)
                bad = r, kind = K_OUTSIDE, value = nbytes;
            else if (err)
                bad = r, kind = K_LOST, value = (uint64_t)err;
            else
                pooled++;
        } else if (pl->fallback && !(word & IN_HUGE_PAGES)) {  /* it copied this into its region, see copies_in */
            copy_bytes(dst, where(&c->alt, bases, pl->half), (size_t)c->n);
            window++;
        } else if (c->n && (err = direct_read(pl, pl->pids[r], (uintptr_t)address + (uintptr_t)c->src.a1, dst,
                                              (size_t)c->n))) {
            bad = r, kind = K_LOST, value = (uint64_t)err;
        } else {
            direct++;
        }
    }
    Py_END_ALLOW_THREADS
    pl->last_direct = direct, pl->last_window = window, pl->last_pooled = pooled;
    return bad < 0 ? NULL : Py_BuildValue("(iiK)", bad, kind, (unsigned long long)value);
}

/* direct_reads, then the abort inbox again: a peer that gave up on this
 * call (a timeout) while this rank read from it has returned, and its
 * caller may have changed the buffer under the read; its abort is written
 * before that, so the run stops with K_ABORTED rather than completing with
 * what it read. */
static PyObject *direct_after(CallObject *pl, char *const *bases) {
    PyObject *failed = direct_reads(pl, bases);
    if (failed) return failed;
    int a = aborted_by(pl->window, pl->seq);
    return a ? stopped(a - 1, K_ABORTED) : NULL;
}

/* Where bytes [at, at + n) of rank r's array j (nbytes as published,
 * with IN_POOL) lie in this process's mapping of r's pool, when they all
 * lie in its part there and its pool words stay inside the array and the
 * pool; else NULL (pool_move then moves them, or refuses). */
static char *in_pool_place(const CallObject *pl, int r, int j, uint64_t nbytes, uint64_t at, uint64_t n) {
    const uint64_t *pw = pool_words(pl, r) + 3 * j;
    int64_t off = (int64_t)load_acquire(&pw[0]);
    uint64_t first = load_acquire(&pw[1]), end = load_acquire(&pw[2]);
    if (!pl->pool_base || first >= end || end > nbytes || off < -(int64_t)nbytes || off > (int64_t)pl->pool_len[r] ||
        off + (int64_t)first < 0 || (uint64_t)(off + (int64_t)end) > pl->pool_len[r] || at < first || at + n > end)
        return NULL;  /* (off bounded first: the sums cannot overflow) */
    return pl->pool_base[r] + off + (int64_t)at;
}

/* How a direct call takes rank r's published array j: BY_POOL (its part
 * in r's shared pool), BY_WINDOW (its copy in r's region: a fallback, the
 * array in 4 KiB pages outside the pool) or BY_READ (across). */
static inline int taken_by(const CallObject *pl, uint64_t word) {
    if (pl->marks && (word & IN_POOL) && !(word & IN_HUGE_PAGES)) return BY_POOL;
    return pl->fallback && !(word & IN_HUGE_PAGES) ? BY_WINDOW : BY_READ;
}

/* Whether every peer's place of a direct reduction (its sources and the
 * after copies' destinations) lies inside the array its rank published;
 * -1 when so, else the first rank whose does not, with *kind and *value
 * (K_OUTSIDE or K_WRITE_OUTSIDE, and the bytes it published). */
static int reduction_outside(const CallObject *pl, int *kind, uint64_t *value) {
    uint64_t extent = (uint64_t)(pl->count * pl->itemsize);
    for (int i = 0; i < pl->nsrc + pl->nafter; i++) {
        int writes = i >= pl->nsrc;
        const Loc *l = writes ? &pl->after[i - pl->nsrc].dst : &pl->rsrc[i];
        if (l->idx > PEER_ARRAY(0)) continue;
        const uint64_t *words = published(pl, (int)l->a0);
        int j = PEER_ARRAY(l->idx);
        uint64_t address = load_acquire(&words[2 * j]), nbytes = load_acquire(&words[2 * j + 1]) & ~PUBLISHED_FLAGS;
        if (!address || (uint64_t)l->a1 + extent > nbytes) {
            *kind = writes ? K_WRITE_OUTSIDE : K_OUTSIDE, *value = nbytes;
            return (int)l->a0;
        }
    }
    return -1;
}

/* A direct call's reduction (see parse_direct_reduction), piece by piece,
 * once every place was found inside its array: each peer's piece is read
 * where it lies (in its pool, in place; in its region, a fallback's copy;
 * else across into scratch placed like it in a page); the reduction, in
 * rank order, goes into this rank's array and is streamed from there into
 * every peer's pool or region that takes it; the rest is written across.
 * Before each piece's writes, the abort inbox: a peer that gave up may use
 * its buffer again. NULL when done, else why the run stopped. */
static PyObject *direct_reduce(CallObject *pl, char *const *bases) {
    WindowObject *w = pl->window;
    int p = pl->nsrc, bad = -1, kind = 0, direct = 0, window = 0, pooled = 0;
    uint64_t value = 0;
    if ((bad = reduction_outside(pl, &kind, &value)) >= 0)
        return Py_BuildValue("(iiK)", bad, kind, (unsigned long long)value);
    uint64_t extent = (uint64_t)(pl->count * pl->itemsize), piece = (uint64_t)pl->rpiece;
    size_t stride = (size_t)piece + 4096;
    char *out = where(&pl->rdst, bases, pl->half), *srcs[p], *copies[pl->nafter + 1];
    int across[pl->nafter + 1];
    Py_BEGIN_ALLOW_THREADS
    if (!pl->scratch) pl->scratch = PyMem_RawMalloc(stride * (size_t)p);
    if (!pl->scratch) bad = w->rank, kind = K_LOST, value = ENOMEM;
    for (uint64_t lo = 0; lo < extent && bad < 0; lo += piece) {
        uint64_t n = extent - lo < piece ? extent - lo : piece;
        for (int i = 0; i < p && bad < 0; i++) {
            const Loc *l = &pl->rsrc[i];
            if (l->idx > PEER_ARRAY(0)) {
                srcs[i] = where(l, bases, pl->half) + lo;
                continue;
            }
            int r = (int)l->a0, j = PEER_ARRAY(l->idx), err = 0;
            const uint64_t *words = published(pl, r);
            uint64_t address = load_acquire(&words[2 * j]), word = load_acquire(&words[2 * j + 1]);
            uint64_t nbytes = word & ~PUBLISHED_FLAGS, at = (uint64_t)l->a1 + lo;
            char *scratch = pl->scratch + stride * (size_t)i;
            scratch += ((uintptr_t)address + at - (uintptr_t)scratch) & 4095;
            int by = taken_by(pl, word);
            if (by == BY_WINDOW) {
                srcs[i] = where(&pl->ralt[i], bases, pl->half) + lo;
                window++;
            } else if (by == BY_POOL) {
                srcs[i] = in_pool_place(pl, r, j, nbytes, at, n);
                if (!srcs[i])  /* partly outside its part in the pool (an adopted buffer's first or last page) */
                    err = pool_move(pl, r, j, (uintptr_t)address, nbytes, at, srcs[i] = scratch, (size_t)n, 0);
                pooled++;
            } else {
                err = direct_read(pl, pl->pids[r], (uintptr_t)address + at, srcs[i] = scratch, (size_t)n);
                direct++;
            }
            if (err) bad = r, kind = err < 0 ? K_OUTSIDE : K_LOST, value = err < 0 ? nbytes : (uint64_t)err;
        }
        int gone = bad < 0 ? aborted_by(w, pl->seq) : 0, ncopies = 0;
        if (gone) bad = gone - 1, kind = K_ABORTED, value = 0;
        if (bad >= 0) break;
        for (int i = 0; i < pl->nafter; i++) {  /* where each write goes: streamed from the reduction, or across */
            const Copy *c = &pl->after[i];
            int r = (int)c->dst.a0, j = PEER_ARRAY(c->dst.idx);
            uint64_t word = load_acquire(&published(pl, r)[2 * j + 1]), at = (uint64_t)c->dst.a1 + lo;
            int by = taken_by(pl, word);
            char *to = by == BY_WINDOW ? where(&c->alt, bases, pl->half) + lo
                     : by == BY_POOL ? in_pool_place(pl, r, j, word & ~PUBLISHED_FLAGS, at, n) : NULL;
            across[i] = !to;
            if (to) copies[ncopies++] = to;
        }
        char *into = pl->rone ? out : out + lo;  /* the result's piece */
        reduce_all(pl->f, into, srcs, p, (Py_ssize_t)(n / (uint64_t)pl->itemsize), pl->itemsize, copies, ncopies);
        for (int i = 0; i < pl->nafter && bad < 0; i++) {
            if (!across[i]) continue;
            const Copy *c = &pl->after[i];
            int r = (int)c->dst.a0, j = PEER_ARRAY(c->dst.idx), err;
            const uint64_t *words = published(pl, r);
            uint64_t address = load_acquire(&words[2 * j]), word = load_acquire(&words[2 * j + 1]);
            uint64_t nbytes = word & ~PUBLISHED_FLAGS, at = (uint64_t)c->dst.a1 + lo;
            if (taken_by(pl, word) == BY_POOL)
                err = pool_move(pl, r, j, (uintptr_t)address, nbytes, at, into, (size_t)n, 1);
            else
                err = direct_move(pl, pl->pids[r], (uintptr_t)address + at, into, (size_t)n, 1);
            if (err) bad = r, kind = err < 0 ? K_WRITE_OUTSIDE : K_LOST, value = err < 0 ? nbytes : (uint64_t)err;
        }
    }
    Py_END_ALLOW_THREADS
    pl->last_direct = direct, pl->last_window = window, pl->last_pooled = pooled;
    if (bad >= 0) return Py_BuildValue("(iiK)", bad, kind, (unsigned long long)value);
    int a = aborted_by(w, pl->seq);
    return a ? stopped(a - 1, K_ABORTED) : NULL;
}

/* The call from its stage on: 1, wait until the half is free (when it
 * writes into the window), copy before, post with this call's signature
 * record; 2, wait for every rank's post, verify every record, copy after
 * and reduce, done. Returns None when complete, else what to wait for
 * before resuming (the stage is kept), or why it stopped for good (a
 * disagreement or an abort: the run is over, nothing read from a peer).
 * A call in pieces (piece > 0) writes its record first and publishes its
 * progress as it copies; in stage 2 it waits only for every rank's record,
 * and in stage 3 reads each piece once its source has filled it. */
static PyObject *advance(CallObject *pl, char *const *bases) {
    WindowObject *w = pl->window;
    uint64_t k = pl->step;
    int r;
    if (pl->stage == 1) {
        if (pl->writes_window) {
            uint64_t v = k >= 2 ? k - 2 : 0;
            r = wait_for(w, K_DONE, v, NULL);
            if (r < w->size) return late(r, K_DONE, v);
        }
        if (pl->piece) {
            write_record(w, pl->seq, pl->sig[0], pl->sig[1], pl->sig[2]);
            set_progress(w, k, 0);
            fill_in_pieces(pl, bases, k);
        } else {
            do_copies(pl->before, pl->nbefore, bases, pl->half);
            if (pl->direct) {  /* arrays in 4 KiB pages, outside the pool: readers take their copies in the window */
                int copied = publish_arrays(pl, bases);
                if (copied < 0) {
                    pl->stage = 0;  /* nothing posted: the run never started */
                    return NULL;
                }
                pl->copied_in = copied;
                if (pl->fallback) copy_in_window_arrays(pl, bases);  /* (those of kind BY_WINDOW) */
            }
            write_record(w, pl->seq, pl->sig[0], pl->sig[1], pl->sig[2]);
        }
        publish(w, K_POST, k);
        pl->stage = 2;
    }
    if (pl->stage == 2) {
        if (pl->piece) {
            for (r = 0; r < w->size; r++)
                if (r != w->rank && !wait_filled(w, r, k, 0)) return late(r, K_POST, k);
        } else {
            r = wait_for(w, K_POST, k, NULL);
            if (r < w->size) return late(r, K_POST, k);
        }
        pl->stage = 0;
        r = verify(w, pl->seq);
        if (r >= 0) return stopped(r, K_VERDICT);
        int a = aborted_by(w, pl->seq);
        if (a) return stopped(a - 1, K_ABORTED);
        if (pl->piece) {
            pl->stage = 3;
            pl->at = 0;
            pl->at_byte = pl->at_elem = 0;
        } else if (pl->direct) {
            PyObject *failed = pl->dreduce ? direct_reduce(pl, bases) : direct_after(pl, bases);
            if (failed) return failed;
        } else {
            do_after(pl, bases, pl->half);
        }
    }
    if (pl->stage == 3) {
        PyObject *wait = read_in_pieces(pl, bases, k);
        if (wait) return wait;
        pl->stage = 0;
    }
    if (pl->stage == 0) {  /* the first step is done */
        publish(w, K_DONE, k);
        if (pl->direct && (!pl->copied_in || pl->dreduce)) pl->stage = 6;  /* (a reduction's peers write too) */
        if (pl->two_steps) {
            k = pl->step = ++w->turn;
            pl->half = (int)((k - 1) & 1);
            pl->stage = 4;
        }
    }
    if (pl->stage == 4) {  /* the second step's half was free once every rank posted the first */
        do_copies(pl->before2, pl->nbefore2, bases, pl->half);
        publish(w, K_POST, k);
        pl->stage = 5;
    }
    if (pl->stage == 5) {
        if (pl->wait2) {
            r = wait_for(w, K_POST, k, NULL);
            if (r < w->size) return late(r, K_POST, k);
        }
        pl->stage = 0;
        int a = aborted_by(w, pl->seq);
        if (a) return stopped(a - 1, K_ABORTED);
        do_copies(pl->after2, pl->nafter2, bases, pl->half);
        publish(w, K_DONE, k);
    }
    if (pl->stage == 6) {  /* a direct call: its arrays stay as they are until every reader is done */
        r = wait_for(w, K_DONE, k, pl->readers);
        if (r < w->size) return late(r, K_DONE, k);
        pl->stage = 0;
        if (pl->dreduce && pl->fallback && pl->ncopies_out && pl->kind[pl->copies_out[0].dst.idx] == BY_WINDOW)
            do_copies(pl->copies_out, pl->ncopies_out, bases, pl->half);  /* peers wrote into its region */
    }
    if (w->t_calls) {  /* its end, never before its start (the clock's anchor may move between) */
        double *row = w->t_calls + 8 * (pl->seq & w->t_mask), end = recorder_seconds();
        row[1] = end >= row[0] ? end : row[0];
    }
    Py_RETURN_NONE;
}

/* The start of a run of call seq with signature sig: the flight recorder's
 * row; NULL when it may go on, else why it stops (a peer aborted). */
static PyObject *begin_run(CallObject *pl, uint64_t seq, const uint64_t *sig) {
    WindowObject *w = pl->window;
    pl->seq = seq;
    for (int i = 0; i < 3; i++) pl->sig[i] = sig[i];
    if (w->t_calls) {  /* the flight recorder's: this call, and when it started */
        double *row = w->t_calls + 8 * (seq & w->t_mask);
        uint64_t *words = (uint64_t *)row;
        row[0] = recorder_seconds();
        words[2] = (sig[0] & ~(SIG_SEQ_MASK << SIG_SEQ_SHIFT)) | ((seq & SIG_SEQ_MASK) << SIG_SEQ_SHIFT);
        words[3] = sig[1];
        words[4] = sig[2];
    }
    int a = aborted_by(w, seq);
    return a ? stopped(a - 1, K_ABORTED) : NULL;
}

/* The run's step through the window, as far as it goes (see advance). */
static PyObject *first_step(CallObject *pl, char *const *bases) {
    WindowObject *w = pl->window;
    uint64_t k = pl->step = ++w->turn;
    pl->half = (int)((k - 1) & 1);
    publish(w, K_DONE, k - 1);
    pl->stage = 1;
    return advance(pl, bases);
}

/* .run(arrays, seq, sig) -> None or (rank, kind, value): take the next step
 * of call seq (signature sig: three words); this rank is done with every
 * earlier one; then as far as it can go (see advance). When it returns what
 * to wait for, wait, then .resume(arrays). */
static PyObject *Call_run(CallObject *pl, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer views[MAX_ARRAYS];
    char *bases[MAX_ARRAYS];
    uint64_t sig[3];
    if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 3) {
        PyErr_SetString(PyExc_TypeError, "run(arrays, seq, sig): sig is a tuple of three ints");
        return NULL;
    }
    if (pl->stage != 0) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled call's previous run is not finished");
        return NULL;
    }
    uint64_t seq = PyLong_AsUnsignedLongLongMask(args[1]);
    for (int i = 0; i < 3; i++) sig[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(args[2], i));
    if (PyErr_Occurred()) return NULL;
    PyObject *out = begin_run(pl, seq, sig);
    if (out) return out;
    if (take_buffers(pl, args[0], views, bases) < 0) return NULL;
    out = first_step(pl, bases);
    release_buffers(pl, views);
    return out;
}

/* .resume(arrays): go on after a wait (see run) */
static PyObject *Call_resume(CallObject *pl, PyObject *arrays) {
    Py_buffer views[MAX_ARRAYS];
    char *bases[MAX_ARRAYS];
    if (pl->stage == 0) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled call has no run to resume");
        return NULL;
    }
    if (take_buffers(pl, arrays, views, bases) < 0) return NULL;
    PyObject *out = advance(pl, bases);
    release_buffers(pl, views);
    return out;
}

/* .set_view(at, nbytes): from now on array 1 is array 0's nbytes from byte at (runs take array 0 alone) */
static PyObject *Call_set_view(CallObject *pl, PyObject *args) {
    Py_ssize_t at, n;
    if (!PyArg_ParseTuple(args, "nn", &at, &n)) return NULL;
    if (pl->narrays != 2 || at < 0 || n < 0 || pl->stage != 0) {
        PyErr_SetString(PyExc_ValueError, "set_view: a call of two arrays, not running, at and nbytes >= 0");
        return NULL;
    }
    pl->view_at = at, pl->view_len = n;
    Py_RETURN_NONE;
}

/* .abandon(): forget a run that failed while it waited (a timeout, a lost peer) */
static PyObject *Call_abandon(CallObject *pl, PyObject *Py_UNUSED(ignored)) {
    pl->stage = 0;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------ prepared calls from C */
/* FastCalls(ndarray, queue, wait): the communicator's prepared calls that
 * are compiled calls, run straight from its public methods. Each is kept
 * under what a call passes (the collective, the algorithm, the root and
 * the op, compared by identity: the objects the first call passed, held;
 * and each array's dtype, also by identity, and size) with what a call
 * checks before it runs (contiguous arrays, writable where written, apart
 * where it must be). Identity keeps the comparison to a few words; an
 * equal object that is not the same one only misses, and the call takes
 * the Python path, which checks it as every call.
 *   .seq: the communicator's call number (the Python path's too).
 *   .open: 0 turns every lookup into a miss (an aborted or closed communicator).
 *   .generation: how many times every entry was dropped (a full table, clear()).
 *   .hits: calls run from here.
 *   .add(collective, algorithm, root, op, arrays, call, sig, writes, apart, info[, copy_in[, own_at]])
 *   .run(collective, algorithm, root, op, a, b, timeout) -> bool: False, nothing done,
 *       where no entry fits (or a timeout is given, or the queue of
 *       nonblocking calls is busy); else the call has run, or has failed:
 *       a run that must wait goes on in wait(info, arrays, late, seq). */

#define FAST_SLOTS 64
#define TAG_SPACE (1ULL << 27)

typedef struct {
    CallObject *call;                    /* held; NULL: a free slot */
    PyObject *name, *algorithm, *op;     /* held (op may be Py_None) */
    long root;                           /* -1: None */
    int narr;                            /* arrays the call passes (<= 2) */
    PyObject *descr[2];                  /* held; NULL: the array is None */
    Py_ssize_t size[2], nbytes[2];
    int writes[2], apart;
    Py_ssize_t copy_in;                  /* >= 0: copy array 1 into array 0 there first, run on array 0 */
    Py_ssize_t own_at;                   /* >= 0 (with apart): array 1 may also be array 0 from this byte */
    uint64_t sig[3];
    PyObject *info;                      /* held: handed to wait() */
} FastEntry;

typedef struct {
    PyObject_HEAD
    PyTypeObject *ndarray;
    PyObject *queue, *wait;
    unsigned long long seq, generation, hits;
    int open;
    FastEntry slots[FAST_SLOTS];
} FastObject;

static PyObject *str_busy;

static void fast_clear_entry(FastEntry *e) {
    Py_CLEAR(e->call);
    Py_CLEAR(e->name);
    Py_CLEAR(e->algorithm);
    Py_CLEAR(e->op);
    Py_CLEAR(e->descr[0]);
    Py_CLEAR(e->descr[1]);
    Py_CLEAR(e->info);
}

static void Fast_dealloc(FastObject *f) {
    for (int i = 0; i < FAST_SLOTS; i++) fast_clear_entry(&f->slots[i]);
    Py_CLEAR(f->ndarray);
    Py_CLEAR(f->queue);
    Py_CLEAR(f->wait);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static int Fast_init(FastObject *f, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *ndarray, *queue, *wait;
    if (!PyArg_ParseTuple(args, "O!OO", &PyType_Type, &ndarray, &queue, &wait)) return -1;
    for (int i = 0; i < FAST_SLOTS; i++) fast_clear_entry(&f->slots[i]);
    Py_INCREF(ndarray);
    Py_INCREF(queue);
    Py_INCREF(wait);
    Py_XSETREF(f->ndarray, (PyTypeObject *)ndarray);
    Py_XSETREF(f->queue, queue);
    Py_XSETREF(f->wait, wait);
    f->seq = f->generation = f->hits = 0;
    f->open = 1;
    return 0;
}

/* 1 and the root as a long (-1 for None), or 0 where a root cannot be kept */
static int root_of(PyObject *o, long *root) {
    if (o == Py_None) { *root = -1; return 1; }
    if (!PyLong_CheckExact(o)) return 0;
    int overflow;
    *root = PyLong_AsLongAndOverflow(o, &overflow);
    return !overflow && *root >= 0;
}

static inline size_t fast_hash(PyObject *name, PyObject *algorithm, long root, PyObject *op, PyObject *d0,
                               Py_ssize_t n0) {
    uintptr_t h = (uintptr_t)name ^ ((uintptr_t)algorithm << 1) ^ ((uintptr_t)op << 2) ^ ((uintptr_t)d0 << 3);
    h ^= (uintptr_t)(root + 1) * 0x9E3779B97F4A7C15ULL ^ (uintptr_t)n0 * 0xC2B2AE3D27D4EB4FULL;
    h ^= h >> 29;
    return (size_t)(h ^ (h >> 13)) & (FAST_SLOTS - 1);
}

/* An array of the call: NULL and 1 for None, the array and 1 for an exact
 * numpy array of one dimension, else 0 (not kept: the Python path). */
static inline int array_of(FastObject *f, PyObject *o, ArrayHead **out) {
    if (o == Py_None) { *out = NULL; return 1; }
    if (Py_TYPE(o) != f->ndarray) return 0;
    *out = (ArrayHead *)o;
    return (*out)->nd == 1;
}

/* .add(collective, algorithm, root, op, arrays, call, sig, writes, apart, info[, copy_in[, own_at]]) */
static PyObject *Fast_add(FastObject *f, PyObject *args) {
    PyObject *name, *algorithm, *rooto, *op, *arrays, *call, *sigt, *writes, *info;
    int apart;
    Py_ssize_t copy_in = -1, own_at = -1;
    if (!PyArg_ParseTuple(args, "OOOOO!O!O!O!pO|nn", &name, &algorithm, &rooto, &op, &PyTuple_Type, &arrays,
                          &CallType, &call, &PyTuple_Type, &sigt, &PyTuple_Type, &writes, &apart, &info, &copy_in,
                          &own_at))
        return NULL;
    long root;
    Py_ssize_t narr = PyTuple_GET_SIZE(arrays);
    ArrayHead *a[2] = {NULL, NULL};
    if (!root_of(rooto, &root) || narr > 2 || PyTuple_GET_SIZE(sigt) != 3 || PyTuple_GET_SIZE(writes) != narr)
        Py_RETURN_FALSE;
    for (int i = 0; i < narr; i++)
        if (!array_of(f, PyTuple_GET_ITEM(arrays, i), &a[i])) Py_RETURN_FALSE;
    if (copy_in >= 0 && (narr != 2 || !a[0] || ((CallObject *)call)->narrays != 1)) Py_RETURN_FALSE;
    Py_ssize_t view_at = ((CallObject *)call)->view_at;
    if (view_at >= 0 && (copy_in >= 0 || narr != 1 || !a[0])) Py_RETURN_FALSE;
    FastEntry fresh;
    memset(&fresh, 0, sizeof fresh);
    for (int i = 0; i < 3; i++) fresh.sig[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(sigt, i));
    for (int i = 0; i < narr; i++) fresh.writes[i] = PyObject_IsTrue(PyTuple_GET_ITEM(writes, i));
    if (PyErr_Occurred()) return NULL;
    for (int i = 0; i < narr; i++) {
        if (!a[i]) continue;
        PyObject *nb = PyObject_GetAttrString((PyObject *)a[i], "nbytes");
        if (!nb) return NULL;
        fresh.nbytes[i] = PyLong_AsSsize_t(nb);
        Py_DECREF(nb);
        if (PyErr_Occurred()) return NULL;
        fresh.size[i] = a[i]->dimensions[0];
        fresh.descr[i] = a[i]->descr;
    }
    if (copy_in >= 0 && a[1] && copy_in + fresh.nbytes[1] > fresh.nbytes[0]) Py_RETURN_FALSE;
    if (view_at >= 0 && view_at + ((CallObject *)call)->view_len > fresh.nbytes[0]) Py_RETURN_FALSE;
    fresh.copy_in = copy_in;
    fresh.own_at = apart && a[1] && own_at >= 0 && own_at + fresh.nbytes[1] <= fresh.nbytes[0] ? own_at : -1;
    size_t h = fast_hash(name, algorithm, root, op, fresh.descr[0], fresh.size[0]), at = h;
    for (int probe = 0; probe < FAST_SLOTS; probe++, at = (at + 1) & (FAST_SLOTS - 1))
        if (!f->slots[at].call) break;
    if (f->slots[at].call) {  /* full: start over (the Python path adds them again) */
        for (int i = 0; i < FAST_SLOTS; i++) fast_clear_entry(&f->slots[i]);
        f->generation++;
        at = h;
    }
    FastEntry *e = &f->slots[at];
    *e = fresh;
    e->root = root;
    e->narr = (int)narr;
    e->apart = apart;
    Py_INCREF(call); e->call = (CallObject *)call;
    Py_INCREF(name); e->name = name;
    Py_INCREF(algorithm); e->algorithm = algorithm;
    Py_INCREF(op); e->op = op;
    Py_XINCREF(e->descr[0]);
    Py_XINCREF(e->descr[1]);
    Py_INCREF(info); e->info = info;
    Py_RETURN_TRUE;
}

static inline int same_array(const FastEntry *e, int i, const ArrayHead *a) {
    if (!a) return e->descr[i] == NULL;
    return e->descr[i] == a->descr && e->size[i] == a->dimensions[0];
}

/* .run(collective, algorithm, root, op, a, b, timeout) -> bool (see above) */
static PyObject *Fast_run(FastObject *f, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "run(collective, algorithm, root, op, a, b, timeout)");
        return NULL;
    }
    long root;
    ArrayHead *a[2];
    if (!f->open || args[6] != Py_None || !root_of(args[2], &root) || !array_of(f, args[4], &a[0]) ||
        !array_of(f, args[5], &a[1]))
        Py_RETURN_FALSE;
    PyObject *name = args[0], *algorithm = args[1], *op = args[3];
    size_t at = fast_hash(name, algorithm, root, op, a[0] ? a[0]->descr : NULL, a[0] ? a[0]->dimensions[0] : 0);
    FastEntry *e = NULL;
    for (int probe = 0; probe < FAST_SLOTS; probe++, at = (at + 1) & (FAST_SLOTS - 1)) {
        FastEntry *c = &f->slots[at];
        if (!c->call) break;
        if (c->name == name && c->algorithm == algorithm && c->root == root && c->op == op &&
            same_array(c, 0, a[0]) && (c->narr < 2 ? a[1] == NULL : same_array(c, 1, a[1]))) {
            e = c;
            break;
        }
    }
    if (!e || e->call->stage != 0) Py_RETURN_FALSE;
    char *bases[MAX_ARRAYS] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < e->narr; i++) {
        if (!a[i]) continue;
        int fl = a[i]->flags;
        if (!(fl & ARR_C_CONTIGUOUS) || (e->writes[i] && !(fl & ARR_WRITEABLE))) Py_RETURN_FALSE;
        bases[i] = a[i]->data;
    }
    if (e->apart && a[0] && a[1] && bases[0] < bases[1] + e->nbytes[1] && bases[1] < bases[0] + e->nbytes[0] &&
        !(e->own_at >= 0 && bases[1] == bases[0] + e->own_at))
        Py_RETURN_FALSE;
    PyObject *busy = PyObject_GetAttr(f->queue, str_busy);
    if (!busy) return NULL;
    int idle = busy == Py_False || (PyLong_Check(busy) && PyLong_AsLong(busy) == 0);
    Py_DECREF(busy);
    if (!idle) Py_RETURN_FALSE;
    int runs_on = e->narr;  /* the call's arrays: as given, or the first alone after copying the second in */
    if (e->call->view_at >= 0) bases[1] = bases[0] + e->call->view_at;  /* (checked against array 0 by add) */
    if (e->copy_in >= 0) {
        if (bases[1] && e->nbytes[1]) copy_bytes(bases[0] + e->copy_in, bases[1], (size_t)e->nbytes[1]);
        bases[1] = NULL;
        runs_on = 1;
    }
    uint64_t seq = f->seq = (f->seq + 1) % TAG_SPACE;
    f->hits++;
    /* held for the run: another thread may empty the table while a wait lets go of the GIL */
    CallObject *pl = e->call;
    PyObject *info = e->info;
    Py_INCREF(pl);
    Py_INCREF(info);
    PyObject *late = begin_run(pl, seq, e->sig);
    if (!late) late = first_step(pl, bases);
    if (late && late != Py_None) {  /* wait (or raise why it stopped) in Python */
        PyObject *arrays = PyTuple_New(pl->narrays);
        for (int i = 0; arrays && i < pl->narrays; i++) {
            PyObject *o = i < runs_on && a[i] ? (PyObject *)a[i] : Py_None;
            Py_INCREF(o);
            PyTuple_SET_ITEM(arrays, i, o);
        }
        PyObject *done = arrays ? PyObject_CallFunction(f->wait, "OOOK", info, arrays, late,
                                                        (unsigned long long)seq) : NULL;
        Py_XDECREF(arrays);
        Py_DECREF(late);
        late = done;
    }
    Py_DECREF(info);
    Py_DECREF(pl);
    if (!late) return NULL;
    Py_DECREF(late);
    Py_RETURN_TRUE;
}

/* .head(array) -> (data, nd, size, dtype, flags): what run reads of an array, to check against numpy */
static PyObject *Fast_head(FastObject *f, PyObject *o) {
    ArrayHead *a;
    if (Py_TYPE(o) != f->ndarray || !array_of(f, o, &a)) {
        PyErr_SetString(PyExc_TypeError, "head(array): a numpy array of one dimension");
        return NULL;
    }
    return array_head_tuple(a);
}

/* .clear(): forget every entry */
static PyObject *Fast_clear(FastObject *f, PyObject *Py_UNUSED(ignored)) {
    for (int i = 0; i < FAST_SLOTS; i++) fast_clear_entry(&f->slots[i]);
    f->generation++;
    Py_RETURN_NONE;
}

static PyMethodDef Fast_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Fast_run, METH_FASTCALL,
     "run(collective, algorithm, root, op, a, b, timeout) -> bool: run the kept call that fits, if any."},
    {"add", (PyCFunction)Fast_add, METH_VARARGS,
     "add(collective, algorithm, root, op, arrays, call, sig, writes, apart, info[, copy_in[, own_at]]) -> bool: "
     "keep a call (copy_in >= 0: copy array 1 into array 0 at that byte first, then run on array 0 alone; "
     "own_at >= 0: with apart, array 1 may also be array 0 from that byte)."},
    {"head", (PyCFunction)Fast_head, METH_O,
     "head(array) -> (data, nd, size, dtype, flags) as run reads them (flags: C-contiguous 1, writable 0x400)."},
    {"clear", (PyCFunction)Fast_clear, METH_NOARGS, "clear(): forget every call."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Fast_members[] = {
    {"seq", T_ULONGLONG, offsetof(FastObject, seq), 0, "the communicator's call number"},
    {"open", T_INT, offsetof(FastObject, open), 0, "0: every lookup misses"},
    {"generation", T_ULONGLONG, offsetof(FastObject, generation), READONLY, "times every entry was dropped"},
    {"hits", T_ULONGLONG, offsetof(FastObject, hits), READONLY, "calls run from here"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._compiled.FastCalls",
    .tp_basicsize = sizeof(FastObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FastCalls(ndarray, queue, wait): a communicator's compiled prepared calls, run from C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Fast_init,
    .tp_dealloc = (destructor)Fast_dealloc,
    .tp_methods = Fast_methods,
    .tp_members = Fast_members,
};

/* ---------------------------------------------------------- module level */

/* reduce_into(out, srcs, dtype, op[, copies]): out = srcs[0] op srcs[1] op
 * ..., and the result also into every buffer of ``copies`` (stream_bytes);
 * every one a C-contiguous buffer of out's length, out and the copies
 * writable (out may be srcs[0], no other; no copy overlaps anything). */
static PyObject *native_reduce_into(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *out_obj, *srcs, *copies = NULL;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOii|O", &out_obj, &srcs, &dtype, &op, &copies)) return NULL;
    binop_fn f = kernel(dtype, op);
    if (!f) {
        PyErr_SetString(PyExc_ValueError, "no compiled kernel for this dtype and op");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(srcs, "srcs must be a sequence");
    PyObject *fast_copies = copies ? PySequence_Fast(copies, "copies must be a sequence") : PyTuple_New(0);
    Py_buffer out = {0};
    Py_buffer *views = NULL;
    char **bases = NULL;
    Py_ssize_t p = 0, nc = 0, got = 0;
    if (!fast || !fast_copies) goto done;
    p = PySequence_Fast_GET_SIZE(fast);
    nc = PySequence_Fast_GET_SIZE(fast_copies);
    if (p < 2 || p > 4096 || nc > 4096) {
        PyErr_SetString(PyExc_ValueError, "srcs: 2 to 4096 buffers; copies: up to 4096");
        goto done;
    }
    views = PyMem_Calloc((size_t)(p + nc), sizeof(Py_buffer));
    bases = PyMem_Calloc((size_t)(p + nc), sizeof(char *));
    if (!views || !bases) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    for (; got < p + nc; got++) {
        PyObject *item = got < p ? PySequence_Fast_GET_ITEM(fast, got) : PySequence_Fast_GET_ITEM(fast_copies, got - p);
        int flags = got < p ? PyBUF_C_CONTIGUOUS : PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(item, &views[got], flags) < 0) break;
        bases[got] = views[got].buf;
        if (views[got].len != out.len) {
            PyErr_SetString(PyExc_ValueError, "every source and copy must have the output's length");
            got++;
            break;
        }
    }
    if (!PyErr_Occurred() && out.len % ITEMSIZE[dtype])
        PyErr_SetString(PyExc_ValueError, "the length is not a whole number of items");
    if (!PyErr_Occurred()) {
        Py_BEGIN_ALLOW_THREADS
        reduce_all(f, out.buf, bases, (int)p, out.len / ITEMSIZE[dtype], ITEMSIZE[dtype], bases + p, (int)nc);
        Py_END_ALLOW_THREADS
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    if (out.obj) PyBuffer_Release(&out);
    PyMem_Free(views);
    PyMem_Free(bases);
    Py_XDECREF(fast);
    Py_XDECREF(fast_copies);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Window_methods[] = {
    {"fence", (PyCFunction)Window_fence, METH_NOARGS,
     "fence() -> bool: publish the next epoch, wake sleeping peers, wait (bounded) for all."},
    {"step", (PyCFunction)Window_step, METH_NOARGS,
     "step() -> None or (rank, kind, value): the next step through the halves, once its half is free."},
    {"arrive", (PyCFunction)Window_arrive, METH_O,
     "arrive(seq) -> None or (rank, kind, value): post the current step, wait for all, verify records."},
    {"record_calls", (PyCFunction)Window_record_calls, METH_O,
     "record_calls(ring): write each compiled call run's times and signature in row seq & (n - 1); None: stop."},
    {"verify", (PyCFunction)Window_verify, METH_O,
     "verify(seq) -> int: -1 when every rank's signature record of call seq agrees, else a rank."},
    {"compile", (PyCFunction)Window_compile, METH_VARARGS,
     "compile(narrays, before, after, reduce, sources[, piece, regions, then, direct]) -> Call: copies, post, "
     "wait, copies, a reduction; in pieces of piece bytes (regions: every rank's (start, bytes)); direct: "
     "(pids, metas, readers, shared), reading peers' published arrays."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Window_members[] = {
    {"epoch", T_ULONGLONG, offsetof(WindowObject, epoch), 0, "fences this rank has passed"},
    {"turn", T_ULONGLONG, offsetof(WindowObject, turn), 0, "steps taken through the halves"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._compiled.Window",
    .tp_basicsize = sizeof(WindowObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Window(epochs, posts, dones, sleeps, rank, spin_ns, yield_ns): counters in shared memory.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Window_init,
    .tp_dealloc = (destructor)Window_dealloc,
    .tp_methods = Window_methods,
    .tp_members = Window_members,
};

static PyMethodDef Call_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Call_run, METH_FASTCALL,
     "run(arrays, seq, sig) -> None or (rank, kind, value): the next step; what to wait for before resume."},
    {"resume", (PyCFunction)Call_resume, METH_O, "resume(arrays): go on after the wait run asked for."},
    {"abandon", (PyCFunction)Call_abandon, METH_NOARGS, "abandon(): forget a run that failed while it waited."},
    {"set_view", (PyCFunction)Call_set_view, METH_VARARGS,
     "set_view(at, nbytes): array 1 is array 0's nbytes from byte at; runs take (array 0,) alone."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Call_members[] = {
    {"two_steps", T_INT, offsetof(CallObject, two_steps), READONLY, "1 when a second step follows the first"},
    {"piece", T_PYSSIZET, offsetof(CallObject, piece), READONLY, "bytes a piece (0: the call runs whole)"},
    {"direct", T_INT, offsetof(CallObject, direct), READONLY, "1 when it reads peers' arrays straight from their memory"},
    {"fallback", T_INT, offsetof(CallObject, fallback), READONLY,
     "1 when a rank whose arrays do not lie in huge pages copies them into the window for its readers"},
    {"reduces", T_INT, offsetof(CallObject, dreduce), READONLY,
     "1 when a direct call reduces its block from peers' arrays and writes it into theirs"},
    {"last_direct", T_INT, offsetof(CallObject, last_direct), READONLY,
     "how many copies its last run read straight from peers' arrays (a reduction: pieces of a peer read)"},
    {"last_window", T_INT, offsetof(CallObject, last_window), READONLY,
     "how many copies its last run took from peers' copies in the window (see fallback)"},
    {"last_pooled", T_INT, offsetof(CallObject, last_pooled), READONLY,
     "how many copies its last run took from peers' arrays in their shared pools (see fallback)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "collectives._compiled.Call",
    .tp_basicsize = sizeof(CallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A collective's small case: copies, post, wait for the sources, copies, a reduction.",
    .tp_dealloc = (destructor)Call_dealloc,
    .tp_methods = Call_methods,
    .tp_members = Call_members,
};

static PyObject *ext_copy(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: %zd bytes into %zd", src.len, dst.len);
    } else if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "copy: buffers must be C-contiguous");
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_bytes(dst.buf, src.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* vm_move(pid, address, buffer, write) -> 0, or the errno of the first
 * call that moved nothing: the whole buffer read from address in process
 * pid (write false: process_vm_readv, the buffer writable) or written
 * there (process_vm_writev), in as many calls as the kernel needs. */
static PyObject *ext_vm_move(PyObject *Py_UNUSED(module), PyObject *args) {
    int pid, write;
    unsigned long long address;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iKOp", &pid, &address, &obj, &write)) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, write ? PyBUF_C_CONTIGUOUS : (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) < 0)
        return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = vm_move_bytes(pid, (uintptr_t)address, b.buf, (size_t)b.len, write);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromLong(err);
}

/* set_rep_movsb(on) -> bool: copies from REP_MOVSB_FROM bytes on are one
 * rep movsb when on and the processor has ERMS; whether they now are */
static PyObject *ext_set_rep_movsb(PyObject *Py_UNUSED(module), PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    use_rep_movsb = on && has_fast_rep_movsb();
    return PyBool_FromLong(use_rep_movsb);
}

/* recorder_time() -> (seconds, through the counter): the flight recorder's clock */
static PyObject *ext_recorder_time(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    double t = recorder_seconds();
#if defined(__x86_64__)
    return Py_BuildValue("(dO)", t, rclock.on ? Py_True : Py_False);
#else
    return Py_BuildValue("(dO)", t, Py_False);
#endif
}

static PyMethodDef module_methods[] = {
    {"recorder_time", ext_recorder_time, METH_NOARGS,
     "recorder_time() -> (seconds, tsc): the flight recorder's clock (CLOCK_MONOTONIC's seconds) and whether it "
     "reads them through the time-stamp counter."},
    {"copy", ext_copy, METH_VARARGS, "copy(dst, src): dst = src (C-contiguous buffers of one length)."},
    {"set_rep_movsb", ext_set_rep_movsb, METH_O,
     "set_rep_movsb(on) -> bool: large copies by one rep movsb where the processor has ERMS (x86-64); "
     "whether they now are."},
    {"vm_move", ext_vm_move, METH_VARARGS,
     "vm_move(pid, address, buffer, write) -> 0 or an errno: buffer read from address in process pid (write "
     "false) or written there (cross-memory attach)."},
    {"reduce_into", native_reduce_into, METH_VARARGS,
     "reduce_into(out, srcs, dtype, op[, copies]): out = srcs[0] op srcs[1] op ..., also into each of copies."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "collectives._compiled",
    "Compiled fast path of the shared-memory window (fences, compiled calls of small collectives, reductions).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__compiled(void) {
    if (PyType_Ready(&WindowType) < 0 || PyType_Ready(&CallType) < 0 || PyType_Ready(&FastType) < 0) return NULL;
    recorder_clock_init();
    str_busy = PyUnicode_InternFromString("busy");
    if (!str_busy) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&FastType);
    if (PyModule_AddObject(m, "FastCalls", (PyObject *)&FastType) < 0) {
        Py_DECREF(&FastType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CallType);
    PyModule_AddObject(m, "Call", (PyObject *)&CallType);
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
    PyModule_AddIntConstant(m, "K_EPOCH", K_EPOCH);
    PyModule_AddIntConstant(m, "K_POST", K_POST);
    PyModule_AddIntConstant(m, "K_DONE", K_DONE);
    PyModule_AddIntConstant(m, "K_VERDICT", K_VERDICT);
    PyModule_AddIntConstant(m, "K_ABORTED", K_ABORTED);
    PyModule_AddIntConstant(m, "K_OUTSIDE", K_OUTSIDE);
    PyModule_AddIntConstant(m, "K_WRITE_OUTSIDE", K_WRITE_OUTSIDE);
    PyModule_AddIntConstant(m, "K_LOST", K_LOST);
    return m;
}
