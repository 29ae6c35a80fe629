/* The host's floors for moving bytes between two processes: what no
 * shared-memory collective of two ranks can beat. Built and run by
 * ``python -m collectives.bench.copy_floors``; prints one line per
 * (size, way): "FLOOR <way> <bytes> <microseconds per move>", each the
 * median of its rounds' means.
 *
 * Every copy is the library's (collectives/_compiled.c, copy_bytes): one
 * rep movsb from 4 KiB on where the processor has ERMS, unless the
 * environment says COLLECTIVES_COPY_REP_MOVSB=0 (then memcpy).
 *
 * Ways (two processes, A and B, on a shared-memory barrier; buffers
 * written once before the rounds, as a benchmark's are):
 *   memcpy        A copies within its own memory (no second process involved)
 *   cma_read      B reads A's buffer by process_vm_readv (one copy, the kernel's)
 *   cma_both      A and B each read the other's buffer at once (alltoall's pattern at 2 ranks)
 *   two_copies    A copies into shared memory, then B copies out (a window's bcast, whole)
 *   pipelined     the same in 64 KiB pieces, B copying each as soon as A has written it
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PIECE (64 << 10)

static int rep_movsb;

static int use_rep_movsb(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    const char *off = getenv("COLLECTIVES_COPY_REP_MOVSB");
    if (off && (!strcmp(off, "0") || !strcasecmp(off, "false") || !strcasecmp(off, "no") || !strcasecmp(off, "off")))
        return 0;
    unsigned a, b, c, d;
    __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0));
    if (a < 7) return 0;
    __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return (b >> 9) & 1;
#else
    return 0;
#endif
}

static void copy(char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (rep_movsb && n >= 4096) {
        __asm__ __volatile__("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
        return;
    }
#endif
    memcpy(dst, src, n);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    volatile long arrive[2][8], leave[2][8], progress[8];
    double took[2];
} Shared;

static void meet(volatile long (*slot)[8], int me, long i) {
    __atomic_store_n(&slot[me][0], i, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&slot[1 - me][0], __ATOMIC_ACQUIRE) < i) {}
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: copy_floors BYTES ITERS ROUNDS\n");
        return 2;
    }
    size_t n = (size_t)atol(argv[1]);
    rep_movsb = use_rep_movsb();
    int iters = atoi(argv[2]), rounds = atoi(argv[3]);
    Shared *sh = mmap(0, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *win = mmap(0, 2 * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *mine = aligned_alloc(4096, n), *into = aligned_alloc(4096, n);
    if (sh == MAP_FAILED || win == MAP_FAILED || !mine || !into) return 1;
    memset(sh, 0, sizeof(Shared));
    memset(win, 0, 2 * n);
    memset(mine, 1, n);
    memset(into, 2, n);
    pid_t pids[2];
    pids[0] = getpid();
    pid_t child = fork();
    if (child < 0) return 1;
    int me = child == 0;
    pids[1] = me ? getpid() : child;
    if (me) pids[0] = getppid();
    const char *ways[] = {"memcpy", "cma_read", "cma_both", "two_copies", "pipelined"};
    long step = 0;
    for (int w = 0; w < 5; w++) {
        double means[64];
        int nr = rounds < 64 ? rounds : 64;
        for (int r = 0; r < nr; r++) {
            double total = 0;
            for (int i = 0; i < iters; i++) {
                step++;
                char *half = win + (step & 1) * n;
                meet(sh->arrive, me, step);
                double t0 = now();
                if (w == 0 && me == 0) {
                    copy(into, mine, n);
                } else if ((w == 1 && me == 1) || w == 2) {
                    struct iovec l = {into, n}, rem = {mine, n};  /* the peer's buffer is at the same address */
                    if (process_vm_readv(pids[1 - me], &l, 1, &rem, 1, 0) != (ssize_t)n) {
                        perror("process_vm_readv");
                        return 1;
                    }
                } else if (w == 3) {
                    if (me == 0) {
                        copy(half, mine, n);
                        __atomic_store_n(&sh->progress[0], step * (long)(n + 1), __ATOMIC_RELEASE);
                    } else {
                        while (__atomic_load_n(&sh->progress[0], __ATOMIC_ACQUIRE) < step * (long)(n + 1)) {}
                        copy(into, half, n);
                    }
                } else if (w == 4) {
                    for (size_t a = 0; a < n; a += PIECE) {
                        size_t k = n - a < PIECE ? n - a : PIECE;
                        long mark = step * (long)(n + 1) + (long)(a + k);
                        if (me == 0) {
                            copy(half + a, mine + a, k);
                            __atomic_store_n(&sh->progress[0], mark, __ATOMIC_RELEASE);
                        } else {
                            while (__atomic_load_n(&sh->progress[0], __ATOMIC_ACQUIRE) < mark) {}
                            copy(into + a, half + a, k);
                        }
                    }
                }
                meet(sh->leave, me, step);
                total += now() - t0;
            }
            means[r] = total / iters * 1e6;
        }
        qsort(means, (size_t)nr, sizeof(double), cmp);
        if (me == 0) printf("FLOOR %s %zu %.2f\n", ways[w], n, means[nr / 2]);
    }
    if (me == 0) waitpid(child, NULL, 0);
    return 0;
}
