"""Interchangeable implementations of the forward pass.

"cython"  the compiled kernels (the default, the fast path)
"numpy"   a vectorised NumPy reference in einsum style
"naive"   pure-Python loops over a residual-stream State: teaching code, slow

Every backend is a ``Backend`` (the protocol below): the methods every
caller may use, and its optional capabilities as declared values, so that
callers read them instead of probing for attributes.
"""

import importlib
from typing import Optional, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    """What the Model, the generation loop and the engine use of a backend.

    Capabilities (declared by every backend, read by callers):
    supports_hooks: ``run`` also takes ``hooks=HookPoints`` (cyformer.hooks)
    and then goes through the hook points.
    exact_chunk: runs of at least this many positions give logits that do not
    depend on how the positions are split, so a prefill cut into such pieces
    is bitwise one prefill (the engine chunks prompts and reuses cached keys
    only then); None: no such guarantee, prefill whole.
    """

    name: str
    supports_hooks: bool
    exact_chunk: Optional[int]

    def new_cache(self, capacity, reuse=False):
        """A cache for ``capacity`` positions with a ``length`` attribute
        (reuse=True: the caller drops it after one ``run``, so the backend may
        hand out the same memory again)."""

    def run(self, ids, cache, last_only=False):
        """float32 logits [T, V] (or [1, V] with last_only) for ids [T]
        placed after ``cache.length`` earlier positions; advances the cache."""

    def step_batch(self, tokens, caches):
        """Logits [B, V] for one new token (tokens [B]) in each of B caches,
        each advanced by one: the engine's decode step."""

    def forward_batch(self, batch):
        """Logits [B, T, V] of B fresh sequences (ids [B, T], validated),
        each bitwise the logits of running it alone."""


def forward_each(backend, batch):
    """forward_batch by running each sequence alone (one [T, V] array at a time)."""
    logits = np.empty((*batch.shape, backend.config.vocab_size), dtype=np.float32)
    for b, seq in enumerate(batch):  # each run's array is dropped before the next one
        logits[b] = backend.run(seq, backend.new_cache(len(seq), reuse=True))
    return logits

_MODULES = {"cython": ("cython", "CythonBackend"), "numpy": ("numpy_ref", "NumpyBackend"),
            "naive": ("naive", "NaiveBackend")}
BACKENDS = tuple(_MODULES)


def make_backend(name, cfg, weights, threads):
    if not isinstance(name, str) or name not in _MODULES:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    module, cls = _MODULES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(cfg, weights, threads)
