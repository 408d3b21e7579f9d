"""Load the compiled kernels built for the best instruction-set level this CPU has.

setup.py compiles src_pyx/ once per x86-64 level (v2: SSE4.2, v3: AVX2+FMA,
v4: AVX-512) into cyformer._kernels_<level>.  Importing a level the CPU
lacks would die with SIGILL, so the choice is made here from CPUID (via the
baseline-compiled cyformer._runtime) before anything is imported.

CYFORMER_ISA=v2|v3|v4 forces a level (for testing the fallbacks); asking for
one the CPU cannot run is an error, not a crash.
"""

import importlib
import os

from . import _runtime
from .errors import CyformerError

try:
    from ._build_info import BUILD
except ImportError:  # pragma: no cover - only in a broken source checkout
    BUILD = {"levels": {}, "openmp": _runtime.openmp_enabled()}

_X86_RANK = {"v2": 2, "v3": 3, "v4": 4}


def _choose_level():
    built = list(BUILD.get("levels", {}))
    forced = os.environ.get("CYFORMER_ISA", "").strip()
    cpu = _runtime.x86_level()
    if forced:
        if forced not in built:
            raise CyformerError(f"CYFORMER_ISA={forced!r} was not built; built levels: {built}")
        if forced in _X86_RANK and _X86_RANK[forced] > cpu:
            raise CyformerError(f"CYFORMER_ISA={forced!r} needs x86-64-{forced}, this CPU has level {cpu}")
        return forced
    for name in ("native", "generic"):
        if name in built:
            return name
    usable = [lv for lv in built if _X86_RANK.get(lv, 99) <= cpu]
    if not usable:
        raise CyformerError(f"this CPU (x86-64 level {cpu}) supports none of the built kernel levels {built}")
    return max(usable, key=_X86_RANK.get)


LEVEL = _choose_level()
_pkg = f"cyformer._kernels_{LEVEL}"
linalg = importlib.import_module(f"{_pkg}.linalg")
norm = importlib.import_module(f"{_pkg}.norm")
activations = importlib.import_module(f"{_pkg}.activations")
attention = importlib.import_module(f"{_pkg}.attention")
mlp = importlib.import_module(f"{_pkg}.mlp")
decode = importlib.import_module(f"{_pkg}.decode")
