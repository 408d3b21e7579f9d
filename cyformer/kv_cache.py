"""Per-sequence key/value cache: what attention needs of earlier positions."""

import numpy as np

from .config import Config


class KVCache:
    """Keys and values of every layer for one sequence, allocated once.

    k [L, H, D, capacity]  keys, transposed so a query's scores vectorise over positions
    v [L, H, capacity, D]  values
    ``length`` positions are filled; the next token goes to position ``length``.
    A cache belongs to one sequence: two generations never share one.
    """

    def __init__(self, cfg: Config, capacity=None):
        cap = cfg.n_positions if capacity is None else int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"KVCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        L, H, D = cfg.n_layer, cfg.n_head, cfg.d_head
        self.capacity = cap
        self.k = np.zeros((L, H, D, cap), dtype=np.float32)
        self.v = np.zeros((L, H, cap, D), dtype=np.float32)
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
