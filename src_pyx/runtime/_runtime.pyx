# cython: language_level=3
"""Process-level facts the kernels depend on: OpenMP and the CPU's x86-64 level.

Compiled once with baseline flags (never per level) so that it can be
imported on any CPU to decide which kernel level is safe to load.
"""

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int cyf_openmp(void) { return 1; }
    static int cyf_omp_max_threads(void) { return omp_get_max_threads(); }
    /* Ends this thread's OpenMP worker threads (they are started again by
     * the next parallel region).  Called before fork(): libgomp has no fork
     * handler, so a child that inherits a team of threads that no longer
     * exist waits for them forever at its first parallel region.  Weak, so
     * that a libgomp older than OpenMP 5.0's pause (GCC 9) still loads:
     * -1 then, and the child runs its kernels on one thread instead. */
    #pragma weak omp_pause_resource_all
    static int cyf_release_threads(void) {
        if (!omp_pause_resource_all)
            return -1;
        return omp_pause_resource_all(omp_pause_soft);
    }
    #else
    static int cyf_openmp(void) { return 0; }
    static int cyf_omp_max_threads(void) { return 1; }
    static int cyf_release_threads(void) { return 0; }
    #endif

    /* Highest x86-64 micro-architecture level this CPU and OS support
     * (0 when not x86-64).  __builtin_cpu_supports checks OS support of the
     * wide registers (XGETBV) as well as the CPUID bits. */
    static int cyf_x86_level(void) {
    #if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        if (!(__builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt")
              && __builtin_cpu_supports("ssse3")))
            return 1;
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
              && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2")
              && __builtin_cpu_supports("avx")))
            return 2;
        if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
              && __builtin_cpu_supports("avx512vl")))
            return 3;
        return 4;
    #else
        return 0;
    #endif
    }
    """
    int cyf_openmp() nogil
    int cyf_omp_max_threads() nogil
    int cyf_x86_level() nogil
    int cyf_release_threads() nogil


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(cyf_openmp())


def omp_max_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return cyf_omp_max_threads()


def release_threads():
    """End the OpenMP worker threads of the calling thread's team; 0 on
    success.  Safe to call at any time outside a parallel region."""
    return cyf_release_threads()


def x86_level():
    """Highest x86-64 level (1-4) the CPU supports, 0 on other architectures."""
    return cyf_x86_level()
