"""Interchangeable implementations of the forward pass.

"cython"  the compiled kernels (the default, the fast path)
"numpy"   a vectorised NumPy reference in einsum style
"naive"   pure-Python loops over a residual-stream State: teaching code, slow

Each backend has ``name``, ``new_cache(capacity, reuse=False)`` returning a
cache with a ``length`` attribute (reuse=True: the caller drops it after one
``run``, so a backend may hand out the same memory again), and ``run(ids, cache, last_only=False)`` returning
float32 logits [T, V] (or [1, V]) for ids [T] placed after ``cache.length``
earlier positions, and ``step_batch(tokens, caches)`` returning logits
[B, V] for one new token in each of B caches (the engine's decode step).
"""

import importlib

_MODULES = {"cython": ("cython", "CythonBackend"), "numpy": ("numpy_ref", "NumpyBackend"),
            "naive": ("naive", "NaiveBackend")}
BACKENDS = tuple(_MODULES)


def make_backend(name, cfg, weights, threads):
    if not isinstance(name, str) or name not in _MODULES:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    module, cls = _MODULES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(cfg, weights, threads)
