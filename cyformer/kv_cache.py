"""Per-sequence key/value cache: what attention needs of earlier positions."""

import numpy as np

from .config import Config

PAD = 16  # floats of padding per key row (one cache line)


class KVCache:
    """Keys and values of every layer for one sequence, allocated once.

    k [L, G, D, capacity + PAD]  keys, transposed so a query's scores vectorise over positions
    v [L, G, capacity + PAD, D]  values (positions past capacity are never used)
    G = n_kv_head: with grouped-query attention the cache holds the key/value
    heads only, never one copy per query head.
    ``length`` positions are filled; the next token goes to position ``length``.
    A cache belongs to one sequence: two generations never share one.
    """

    def __init__(self, cfg: Config, capacity=None, alloc=None):
        """alloc(name, shape): where the arrays come from (default: new
        zeroed arrays).  Attention uses no position before writing it, so
        reused memory needs no clearing."""
        cap = cfg.n_positions if capacity is None else int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"KVCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        L, G, D = cfg.n_layer, cfg.n_kv_head, cfg.d_head
        self.capacity = cap
        # Rows of k are `cap` floats apart; at a multiple of 1 KB (256, 512,
        # 1024 positions) the D rows a score strip reads fall into the same
        # few L1 sets and evict each other.  One cache line of padding per row
        # spreads them; the kernels see a cache of cap + PAD positions.
        make = alloc or (lambda name, shape: np.zeros(shape, dtype=np.float32))
        self.k = make("k_cache", (L, G, D, cap + PAD))
        self.v = make("v_cache", (L, G, cap + PAD, D))
        self.length = 0

    def layer(self, i):
        """(k_cache, v_cache) views of layer i, as the attention kernel takes them."""
        return self.k[i], self.v[i]

    @property
    def free(self):
        return self.capacity - self.length

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes
