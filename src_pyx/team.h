/* The OpenMP team of the enclosing parallel region, for kernels that split
 * work between threads by hand and meet at barriers (Cython's parallel
 * blocks have no barrier).  Without OpenMP the team is the calling thread. */
#ifndef CYFORMER_TEAM_H
#define CYFORMER_TEAM_H

#include <stddef.h>

/* The next work item from a counter shared by the team (zero at the start). */
static inline ptrdiff_t cyf_next_item(ptrdiff_t *counter)
{
    return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

#ifdef _OPENMP
#include <omp.h>
static inline int cyf_team_size(void) { return omp_get_num_threads(); }
/* omp_get_num_procs asks the OS for the affinity mask on every call: once */
static inline int cyf_cpus(void)
{
    static int cpus;
    int n = __atomic_load_n(&cpus, __ATOMIC_RELAXED);
    if (!n) {
        n = omp_get_num_procs();
        __atomic_store_n(&cpus, n, __ATOMIC_RELAXED);
    }
    return n;
}
static inline void cyf_barrier(void)
{
#pragma omp barrier
}
#else
static inline int cyf_team_size(void) { return 1; }
static inline int cyf_cpus(void) { return 1; }
static inline void cyf_barrier(void) { }
#endif

/* The barrier of a team that meets often (the fused decode step: about
 * eight times per layer).  libgomp's barrier spins only ~100 times before
 * it sleeps once the process holds more of its threads than there are
 * CPUs, and the idle team another Python thread left behind counts (a
 * generate() before an Engine): then nearly every wait became a sleep and a
 * wake-up, and the batched step a fifth slower.  This one spins up to
 * CYF_BAR_SPINS pauses whatever other teams exist (a few when its own team
 * outnumbers the CPUs), then sleeps on a futex.  Zeroed before the region;
 * shared by the team. */
typedef struct {
    unsigned gen;       /* bumped by the last thread to arrive */
    int arrived;
    int sleepers;
} cyf_bar;

#define CYF_BAR_SPINS (1L << 15)

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static inline void cyf_futex_wait(unsigned *addr, unsigned val)
{
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static inline void cyf_futex_wake(unsigned *addr) { syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
#else
#include <sched.h>
static inline void cyf_futex_wait(unsigned *addr, unsigned val) { (void)addr; (void)val; sched_yield(); }
static inline void cyf_futex_wake(unsigned *addr) { (void)addr; }
#endif

static inline void cyf_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Every thread of the team (n of them) calls it; returns once all have.
 * The last to arrive publishes gen with release order, the others read it
 * with acquire: what any thread wrote before the barrier is visible after. */
static inline void cyf_bar_wait(cyf_bar *b, int n)
{
    if (n <= 1)
        return;
    const unsigned gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == n) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, gen + 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST))
            cyf_futex_wake(&b->gen);
        return;
    }
    const long spins = n > cyf_cpus() ? 64 : CYF_BAR_SPINS;
    for (long i = 0; i < spins; i++) {
        if (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != gen)
            return;
        cyf_pause();
    }
    /* seq_cst on both sides: either the waker sees a sleeper, or the
     * sleeper sees the new gen (and the futex refuses to sleep on a stale one) */
    __atomic_add_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&b->gen, __ATOMIC_SEQ_CST) == gen)
        cyf_futex_wait(&b->gen, gen);
    __atomic_sub_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
}

#endif
