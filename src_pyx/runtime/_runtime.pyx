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

    /* CPU features that no x86-64 level implies, as bits of the result:
     * 1 AVX512_VNNI, 2 AVX512_BF16, 4 AVX_VNNI, 8 AMX_TILE, 16 AMX_INT8,
     * 32 AMX_BF16, 64 the OS saves AMX tile state (XCR0 bits 17-18) and
     * grants it to this process (Linux arch_prctl ARCH_REQ_XCOMP_PERM). */
    #if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
    #include <cpuid.h>
    #ifdef __linux__
    #include <unistd.h>
    #include <sys/syscall.h>
    #endif
    static int cyf_cpu_features(void) {
        unsigned a, b, c, d, a1 = 0, b1, c1, d1;
        int f = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
            return 0;
        if (a >= 1)
            __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
        if (c & (1u << 11)) f |= 1;
        if (a1 & (1u << 5)) f |= 2;
        if (a1 & (1u << 4)) f |= 4;
        if (d & (1u << 24)) f |= 8;
        if (d & (1u << 25)) f |= 16;
        if (d & (1u << 22)) f |= 32;
        if (f & 8) {
            unsigned lo, hi, ecx1, eax1, ebx1, edx1;
            __get_cpuid(1, &eax1, &ebx1, &ecx1, &edx1);
            if (ecx1 & (1u << 27)) {  /* OSXSAVE: XGETBV may be used */
                __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
                int ok = (lo & (3u << 17)) == (3u << 17);
    #ifdef __linux__
                /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 */
                ok = ok && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    #endif
                if (ok) f |= 64;
            }
        }
        return f;
    }
    #else
    static int cyf_cpu_features(void) { return 0; }
    #endif
    """
    int cyf_openmp() nogil
    int cyf_cpu_features() nogil
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


_FEATURES = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "amx_os")


def cpu_features():
    """{feature: bool} for the CPU features the kernels pick by, beyond the
    x86-64 level: avx512_vnni, avx512_bf16, avx_vnni, amx_tile, amx_int8,
    amx_bf16 (CPUID), and amx_os: the OS saves the AMX tile state and lets
    this process use it.  All False on other architectures."""
    bits = cyf_cpu_features()
    return {name: bool(bits >> i & 1) for i, name in enumerate(_FEATURES)}


def x86_level():
    """Highest x86-64 level (1-4) the CPU supports, 0 on other architectures."""
    return cyf_x86_level()
