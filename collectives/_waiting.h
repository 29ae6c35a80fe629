/* What the C extensions' bounded waits are made of: an acquire load of a
 * counter in shared memory, the monotonic clock in nanoseconds, and the
 * processor's pause between two checks. */
#ifndef COLLECTIVES_WAITING_H
#define COLLECTIVES_WAITING_H

#include <stdint.h>
#include <time.h>

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

#endif
