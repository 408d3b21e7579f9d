"""Per-sequence key/value cache: what attention needs of earlier positions.

The cache grows with the sequence.  It starts with room for the positions
asked for first and, when a run needs more, moves to arrays with room for
half as many again (at least GROW_MIN more positions), copying the filled
rows: a cache of n positions has cost O(n) copying in all and holds at most
about n / 2 unused positions, instead of the whole context reserved up front
(8.6 GB a sequence for a 128K-context Llama).  Each layer's keys stay one
strided array, so the attention and decode kernels read it as before, and a
cache's capacity changes no result (it is only a row stride).  Paged blocks
would let sequences share prefix blocks without copies, but every kernel
would have to gather keys through a block table; see ARCHITECTURE.md.
"""

import numpy as np

from .config import Config

PAD = 16        # floats of padding per key row (one cache line)
GROW_MIN = 256  # positions added at least when a cache grows
ROUND = 64      # capacities are multiples of this (or the limit)


def position_bytes(cfg: Config):
    """Bytes one position takes in a KVCache: its key and value in every layer."""
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.d_head * 4


class KVCache:
    """Keys and values of every layer for one sequence, grown as it fills.

    k [L, G, D, capacity + PAD]  keys, transposed so a query's scores vectorise over positions
    v [L, G, capacity + PAD, D]  values (positions past capacity are never used)
    G = n_kv_head: with grouped-query attention the cache holds the key/value
    heads only, never one copy per query head.
    ``length`` positions are filled; the next token goes to position ``length``.
    ``limit``: the most positions it may ever hold; ``capacity``: the
    positions its arrays hold now (``reserve`` grows them).
    A cache belongs to one sequence: two generations never share one.
    """

    def __init__(self, cfg: Config, limit=None, alloc=None, capacity=0):
        """limit: most positions (default n_positions); capacity: positions
        allocated now (default none: the first ``reserve`` or run sizes it).
        alloc(name, shape): where the arrays come from (default: new zeroed
        arrays); a cache from ``alloc`` is allocated whole and never grows.
        Attention uses no position before writing it, so reused memory needs
        no clearing."""
        lim = cfg.n_positions if limit is None else int(limit)
        if not 1 <= lim <= cfg.n_positions:
            raise ValueError(f"KVCache: capacity must be in [1, {cfg.n_positions}], got {limit}")
        self.limit = lim
        self.shape = (cfg.n_layer, cfg.n_kv_head, cfg.d_head)
        self.position_bytes = position_bytes(cfg)
        self._alloc = alloc
        self.length = 0
        self._allocate(lim if alloc is not None else min(lim, max(0, int(capacity))))

    def _allocate(self, cap):
        L, G, D = self.shape
        # Rows of k are `cap` floats apart; at a multiple of 1 KB (256, 512,
        # 1024 positions) the D rows a score strip reads fall into the same
        # few L1 sets and evict each other.  One cache line of padding per row
        # spreads them; the kernels see a cache of cap + PAD positions.
        make = self._alloc or (lambda name, shape: np.zeros(shape, dtype=np.float32))
        self.k = make("k_cache", (L, G, D, cap + PAD))
        self.v = make("v_cache", (L, G, cap + PAD, D))
        self.capacity = cap

    def layer(self, i):
        """(k_cache, v_cache) views of layer i, as the attention kernel takes them."""
        return self.k[i], self.v[i]

    def grown(self, n):
        """The capacity ``reserve(n)`` moves to: n rounded up, and at least
        half as much again as now (GROW_MIN positions at least), within the limit."""
        if n <= self.capacity:
            return self.capacity
        target = max(n, self.capacity + max(GROW_MIN, self.capacity // 2))
        return min(self.limit, -(-target // ROUND) * ROUND)

    def bytes_at(self, capacity):
        """The bytes the arrays take at ``capacity`` positions."""
        return (capacity + PAD) * self.position_bytes

    def reserve(self, n, capacity=None):
        """Make room for n positions, moving the filled ones into larger
        arrays when needed (to ``capacity``, default ``grown(n)``)."""
        if n <= self.capacity:
            return
        if n > self.limit:
            raise ValueError(f"KVCache: {n} positions exceed the cache's capacity of {self.limit}")
        if self._alloc is not None:
            raise ValueError(f"KVCache: a workspace cache of {self.capacity} positions cannot grow to {n}")
        cap = self.grown(n) if capacity is None else max(n, min(self.limit, int(capacity)))
        k, v, n0 = self.k, self.v, self.length
        self._allocate(cap)
        self.k[..., :n0] = k[..., :n0]
        self.v[:, :, :n0] = v[:, :, :n0]

    def release(self):
        """Drop the arrays (the cache holds nothing afterwards)."""
        self.k = self.v = None
        self.capacity = self.length = 0

    @property
    def free(self):
        return self.limit - self.length

    @property
    def nbytes(self):
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes
