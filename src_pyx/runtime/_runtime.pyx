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
    #else
    static int cyf_openmp(void) { return 0; }
    static int cyf_omp_max_threads(void) { return 1; }
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


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(cyf_openmp())


def omp_max_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return cyf_omp_max_threads()


def x86_level():
    """Highest x86-64 level (1-4) the CPU supports, 0 on other architectures."""
    return cyf_x86_level()
