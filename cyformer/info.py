"""What was compiled and what is in use: cyformer.build_info()."""

import platform

from . import _checks, _cores, _runtime, formats, kernels


def build_info():
    """A dict describing the compiled kernels and the runtime.

    openmp: compiled with OpenMP; compile_flags: common flags; isa: the kernel
    level loaded for this CPU and its flags; cython: Cython version used to
    build; threads: the default thread count (OMP_NUM_THREADS, else the cores
    in this process's affinity mask); adaptive_threads: whether calls use
    fewer while other processes keep cores busy (cyformer._cores);
    cpu_features: the CPU features kernels are chosen by beyond the level
    (AVX512-VNNI, AVX512-BF16, AVX-VNNI, AMX and whether the OS grants AMX);
    formats: per weight format (cyformer.formats), its bytes per weight and
    the kernels that compute with it here.
    """
    b = kernels.BUILD
    return {
        "version": __import__("cyformer").__version__,
        "openmp": bool(b.get("openmp")) and _runtime.openmp_enabled(),
        "compile_flags": list(b.get("compile_flags", [])) + list(b.get("openmp_flags", [])),
        "isa": kernels.LEVEL,
        "isa_flags": list(b.get("levels", {}).get(kernels.LEVEL, [])),
        "isa_levels_built": list(b.get("levels", {})),
        "cpu_x86_level": _runtime.x86_level(),
        "cpu_features": _runtime.cpu_features(),
        "cython": b.get("cython"),
        "compiler": b.get("compiler"),
        "debug": bool(b.get("debug")),
        "threads": _checks.default_threads(),
        "omp_max_threads": _runtime.omp_max_threads(),
        "adaptive_threads": _cores.enabled(),
        "machine": platform.machine(),
        "formats": {name: {"bytes_per_weight": f.bytes_per_weight, "kernels": kernels.linalg.format_kernels()[name]}
                    for name, f in formats.TABLE.items()},
    }
