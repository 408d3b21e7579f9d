"""Build the Cython kernels.

The kernels in ``src_pyx/`` are compiled once per x86-64 micro-architecture
level into sibling packages ``cyformer._kernels_v2``, ``_kernels_v3`` and
``_kernels_v4`` (SSE4.2, AVX2+FMA, AVX-512).  ``cyformer.kernels`` picks the
best one the running CPU supports at import time, so the default wheel runs on
any x86-64-v2 CPU and still uses wide vectors where they exist.  On other
architectures a single ``_kernels_generic`` package is built.

Environment switches read at build time:

``CYFORMER_NATIVE=1``  build only ``_kernels_native`` with ``-march=native``.
``CYFORMER_DEBUG=1``   bounds and wraparound checks on, ``-O1 -g``.
``CYFORMER_ISA=v2,v3`` restrict the levels that are built (faster dev builds).
``CYFORMER_CCACHE=0``  do not compile through ccache (used when it is on PATH).

Repeated builds from one checkout are incremental: the generated C files in
build/c are reused while a fingerprint of the kernel sources, Cython, NumPy
and the build switches is unchanged (Cython's own check goes by file times,
and every isolated pip build installs a fresh Cython whose include files are
newer than any C file), and setuptools then skips every module whose
compiled file in build/ is newer than its C file.  Each module's compile is
announced on standard error (shown by ``pip install -v``).

Floating point stays IEEE: no ``-ffast-math`` (it breaks tanh/exp edge cases
and lets the compiler reorder sums, which would make results depend on the
vector width).
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import warnings

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# Sources are named relative to the checkout: cythonize puts an absolute
# source under build_dir by its whole path (build/c/<checkout>/build/...).
os.chdir(HERE)
SRC = os.path.join(HERE, "src_pyx")
# Per-level copies of src_pyx/ live here so that each level is a real package
# and relative cimports between kernel modules resolve inside that level.
GEN = os.path.join(HERE, "build", "cython")

KERNEL_MODULES = ["linalg", "norm", "activations", "attention", "mlp", "decode"]
X86_LEVELS = {
    "v2": ["-march=x86-64-v2", "-mtune=generic"],
    "v3": ["-march=x86-64-v3", "-mtune=generic"],
    "v4": ["-march=x86-64-v4", "-mtune=generic"],
}

DEBUG = os.environ.get("CYFORMER_DEBUG", "") not in ("", "0")
NATIVE = os.environ.get("CYFORMER_NATIVE", "") not in ("", "0")


def _cc():
    return (sysconfig.get_config_var("CC") or "cc").split()


def _compiles(flags, code="int main(void){return 0;}\n", link_flags=()):
    """True when the C compiler accepts ``flags`` on a tiny program."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(code)
        cmd = _cc() + list(flags) + [src, "-o", os.path.join(tmp, "probe")] + list(link_flags)
        try:
            return subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            return False


def openmp_flags():
    """Compile and link flags that enable OpenMP, or None when unavailable."""
    probe = textwrap.dedent("""
        #include <omp.h>
        int main(void) { int n = 0;
        #pragma omp parallel reduction(+:n)
          n += 1;
          return omp_get_max_threads() > 0 ? 0 : 1; }
    """)
    candidates = [(["-fopenmp"], ["-fopenmp"])]  # gcc, clang with libomp
    if sys.platform == "darwin":  # Apple clang needs libomp spelled out
        candidates.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
    for cflags, lflags in candidates:
        if _compiles(cflags, probe, lflags):
            return cflags, lflags
    return None


def isa_levels():
    if NATIVE:
        return {"native": ["-march=native"]}
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {"generic": []}
    wanted = os.environ.get("CYFORMER_ISA")
    levels = {}
    for name, flags in X86_LEVELS.items():
        if wanted and name not in wanted.split(","):
            continue
        if _compiles(flags):
            levels[name] = flags
        else:
            warnings.warn(f"compiler does not accept {flags}; skipping kernel level {name}")
    if not levels:
        raise RuntimeError("no x86-64 kernel level could be compiled (need gcc >= 11 or clang >= 12)")
    return levels


def generate_level_sources(level):
    """Copy src_pyx/ into build/cython/cyformer/_kernels_<level>/ and return that dir."""
    pkg = os.path.join(GEN, "cyformer", f"_kernels_{level}")
    os.makedirs(pkg, exist_ok=True)
    open(os.path.join(GEN, "cyformer", "__init__.py"), "a").close()
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(f'"""cyformer kernels compiled for the {level} instruction set level (generated)."""\n')
    for name in os.listdir(SRC):
        if name.endswith((".pyx", ".pxd", ".h")):
            src, dst = os.path.join(SRC, name), os.path.join(pkg, name)
            # Copy only when changed so incremental builds stay incremental.
            if not os.path.exists(dst) or open(src, "rb").read() != open(dst, "rb").read():
                shutil.copyfile(src, dst)
    return pkg


def extensions(levels, omp):
    """The extension modules: the runtime helper plus every kernel module per level."""
    import numpy  # a build requirement: its headers serve the kernels' NumPy C-API checks

    omp_c, omp_l = omp if omp else ([], [])
    base = ["-O1", "-g"] if DEBUG else ["-O3"]
    # -fno-math-errno lets gcc inline sqrtf; it changes no result.
    base += ["-fno-math-errno", "-Wno-unused-function", "-Wno-unreachable-code", "-Wno-psabi"]
    # Cython copies a variable assigned inside a `with parallel()` block into
    # each thread with firstprivate(), so gcc sees an uninitialised value
    # copied in (about 20 warnings per level).  Every such variable (per-thread
    # scratch pointers, loop state) is assigned in the block before it is read:
    # false positives.  Only gcc has -Wmaybe-uninitialized, hence the probe.
    for flag in ("-Wno-uninitialized", "-Wno-maybe-uninitialized"):
        if _compiles(["-Werror", flag]):
            base.append(flag)
    exts = [
        Extension(
            "cyformer._runtime",
            [os.path.relpath(os.path.join(SRC, "runtime", "_runtime.pyx"), HERE)],
            extra_compile_args=base + omp_c,
            extra_link_args=omp_l,
        )
    ]
    for level, flags in levels.items():
        pkg = os.path.join(GEN, "cyformer", f"_kernels_{level}")
        for mod in KERNEL_MODULES:
            exts.append(
                Extension(
                    f"cyformer._kernels_{level}.{mod}",
                    [os.path.relpath(os.path.join(pkg, f"{mod}.pyx"), HERE)],
                    include_dirs=[pkg, numpy.get_include()],
                    # a header included by another header is no dependency
                    # Cython knows of: without these a change there kept the old .so
                    depends=sorted(os.path.join(pkg, n) for n in os.listdir(SRC) if n.endswith(".h")),
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                    extra_compile_args=base + flags + omp_c,
                    extra_link_args=omp_l,
                )
            )
    return exts, base


def _fingerprint(directives):
    """What the generated C files depend on: every kernel source, the Cython
    and NumPy versions, the directives and the build switches, and the levels
    generated (a build of fewer levels leaves the others' C files behind)."""
    import Cython
    import numpy

    h = hashlib.sha256(json.dumps([Cython.__version__, numpy.__version__, directives, DEBUG, NATIVE,
                                   sorted(LEVELS)], sort_keys=True).encode())
    for root, _, files in sorted(os.walk(SRC)):
        for name in sorted(files):
            if name.endswith((".pyx", ".pxd", ".h")):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, SRC).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


C_DIR = os.path.join(HERE, "build", "c")
C_STAMP = os.path.join(C_DIR, "fingerprint.txt")


def _c_file(ext):
    """Where cythonize(build_dir=build/c) writes the C file of a one-.pyx extension."""
    return os.path.join(C_DIR, os.path.splitext(ext.sources[0])[0] + ".c")


class BuildExt(build_ext):
    """Cythonize lazily (so metadata queries need no Cython), reuse the C files
    of an unchanged tree, announce each module, and record build info."""

    def finalize_options(self):
        import Cython
        from Cython.Build import cythonize

        omp = openmp_flags()
        if omp is None:
            warnings.warn(
                "\n" + "!" * 72 + "\n"
                "cyformer: the C compiler has no OpenMP support. Building SERIAL kernels:\n"
                "everything works, but only one core is used. Install libgomp/libomp\n"
                "and rebuild for multi-threaded inference.\n" + "!" * 72,
                stacklevel=1,
            )
        exts, base = extensions(LEVELS, omp)
        directives = {
            "language_level": 3,
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
            "cdivision": not DEBUG,
            "embedsignature": True,
        }
        stamp = _fingerprint(directives)
        reuse = (os.path.exists(C_STAMP) and open(C_STAMP).read() == stamp
                 and all(os.path.exists(_c_file(e)) for e in exts))
        if reuse:
            for e in exts:
                e.sources = [os.path.relpath(_c_file(e), HERE)]
            self.distribution.ext_modules = exts
            print(f"[cyformer build] kernel sources unchanged: reusing the C files in {C_DIR}",
                  file=sys.stderr, flush=True)
        else:
            print(f"[cyformer build] generating C for {len(exts)} modules (Cython {Cython.__version__})",
                  file=sys.stderr, flush=True)
            self.distribution.ext_modules = cythonize(
                exts,
                compiler_directives=directives,
                include_path=[GEN],
                build_dir=C_DIR,
                nthreads=os.cpu_count() or 1,
                quiet=True,
            )
            with open(C_STAMP, "w") as f:
                f.write(stamp)
        self._info = {
            "openmp": omp is not None,
            "openmp_flags": omp[0] if omp else [],
            "compile_flags": base,
            "levels": LEVELS,
            "debug": DEBUG,
            "native": NATIVE,
            "cython": Cython.__version__,
            "compiler": " ".join(_cc()),
        }
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        super().finalize_options()

    def build_extensions(self):
        if (os.environ.get("CYFORMER_CCACHE", "1") != "0" and shutil.which("ccache")
                and self.compiler.compiler_type == "unix"):
            for attr in ("compiler_so", "compiler"):
                cmd = getattr(self.compiler, attr, None)
                if cmd and os.path.basename(cmd[0]) != "ccache":
                    setattr(self.compiler, attr, ["ccache", *cmd])
            print("[cyformer build] compiling through ccache", file=sys.stderr, flush=True)
        self._total, self._done = len(self.extensions), 0
        super().build_extensions()

    def build_extension(self, ext):
        try:
            from setuptools.modified import newer_group
        except ImportError:  # setuptools < 69
            from distutils.dep_util import newer_group

        target = self.get_ext_fullpath(ext.name)
        stale = self.force or newer_group(list(ext.sources) + list(ext.depends or []), target, "newer")
        print(f"[cyformer build] {'compiling' if stale else 'up to date:'} {ext.name}",
              file=sys.stderr, flush=True)
        super().build_extension(ext)

    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "cyformer", "_build_info.py")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            f.write("# Generated by setup.py at build time.\n")
            f.write(f"BUILD = {self._info!r}\n")
        if self.inplace:
            shutil.copyfile(out, os.path.join(HERE, "cyformer", "_build_info.py"))


LEVELS = isa_levels()
level_pkgs = {f"cyformer._kernels_{lv}": generate_level_sources(lv) for lv in LEVELS}
setup(
    packages=[*find_packages(include=["cyformer", "cyformer.*"]), *level_pkgs],
    package_dir={**{k: os.path.relpath(v, HERE) for k, v in level_pkgs.items()}},
    package_data={
        "cyformer": ["data/*/*.json", "data/*/*.safetensors", "data/*/*.md", "data/*/*.png", "py.typed"],
        **{k: ["*.pxd", "*.h"] for k in level_pkgs},
    },
    ext_modules=[Extension("cyformer._runtime", [])],  # replaced in BuildExt
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
