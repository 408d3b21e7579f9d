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
static inline void cyf_barrier(void)
{
#pragma omp barrier
}
#else
static inline int cyf_team_size(void) { return 1; }
static inline void cyf_barrier(void) { }
#endif

#endif
